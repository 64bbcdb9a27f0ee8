"""A toy block hook in every denoiser transformer, through `md_core.block_hook` alone.

Each tiny random model is traced once (one jit) with four runs of its forward: no hook, a pass-through
hook (`run(c, 0, n)`), a split one (`run(run(c, 0, 1), 1, n)`) and one that runs only the first block.
The hook records, at trace time, which stacks it took over and how many blocks it ran.
"""

import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import md_core
import md_flux
import md_ltx
import md_wan


def _normal(i: int, shape) -> jax.Array:
  return jax.random.normal(jax.random.key(i), shape, jnp.float32)


def _flux1():
  cfg = md_flux.FLUX_VARIANTS["tiny"]
  model = md_flux.FluxTransformer(cfg, rngs=nnx.Rngs(0))
  img_ids, txt_ids = md_flux.image_ids(2, 4), jnp.zeros((3, 3))

  def forward(m):
    return m(
      _normal(1, (1, 8, cfg.in_channels)),
      _normal(2, (1, 3, cfg.joint_attention_dim)),
      _normal(3, (1, cfg.pooled_projection_dim)),
      jnp.full((1,), 0.7),
      img_ids,
      txt_ids,
      guidance=jnp.full((1,), 3.5),
    )

  return model, forward, (cfg.num_layers, cfg.num_single_layers)


def _flux2(kv: bool):
  cfg = dataclasses.replace(md_flux.FLUX2_VARIANTS["tiny"], guidance_embeds=False)  # as Klein
  model = md_flux.Flux2Transformer(cfg, rngs=nnx.Rngs(0))
  txt, txt_ids = _normal(2, (1, 3, cfg.joint_attention_dim)), md_flux.text_ids(3)
  latents, img_ids = _normal(1, (1, 8, cfg.in_channels)), md_flux.image_ids(2, 4, axes=4)
  ref, ref_ids = _normal(4, (1, 4, cfg.in_channels)), md_flux.image_ids(2, 2, time=10.0, axes=4)
  t = jnp.full((1,), 0.7)

  def forward(m):
    if not kv:
      return m(latents, txt, t, img_ids, txt_ids)
    # The extract step returns per-block keys and values: no hook takes it over (the index counts
    # only the cached call's two stacks).
    _, cache = m(
      jnp.concatenate([ref, latents], 1), txt, t, jnp.concatenate([ref_ids, img_ids]), txt_ids,
      num_ref_tokens=ref.shape[1],
    )  # fmt: skip
    return m(latents, txt, t, img_ids, txt_ids, kv_cache=cache)

  return model, forward, (cfg.num_layers, cfg.num_single_layers)


def _wan():
  cfg = md_wan.VARIANTS["tiny"]
  model = md_wan.WanTransformer(cfg, rngs=nnx.Rngs(0))

  def forward(m):
    x = _normal(1, (1, cfg.in_channels, 2, 4, 4))
    return m(x, jnp.full((1,), 700.0), _normal(2, (1, 5, cfg.text_dim)))

  return model, forward, (cfg.num_layers,)


def _ltx():
  cfg = md_ltx.VARIANTS["tiny"]
  model = md_ltx.LTXTransformer(cfg, rngs=nnx.Rngs(0))

  def forward(m):
    x, text = _normal(1, (1, 12, cfg.in_channels)), _normal(2, (1, 5, cfg.caption_channels))
    return m(x, text, jnp.full((1,), 700.0), num_frames=2, height=2, width=3)

  return model, forward, (cfg.num_layers,)


def _ltx2():
  cfg = md_ltx.LTX2_VARIANTS["tiny"]
  model = md_ltx.LTX2Transformer(cfg, rngs=nnx.Rngs(0))

  def forward(m):
    return m(
      _normal(1, (1, 12, cfg.in_channels)),
      _normal(2, (1, 4, cfg.audio_in_channels)),
      _normal(3, (1, 5, cfg.caption_channels)),
      _normal(4, (1, 5, cfg.caption_channels)),
      jnp.full((1,), 700.0),
      num_frames=2,
      height=2,
      width=3,
      audio_num_frames=4,
    )

  return model, forward, (cfg.num_layers,)


MODELS = {
  "flux1": _flux1,
  "flux2": lambda: _flux2(kv=False),
  "flux2-kv": lambda: _flux2(kv=True),
  "wan": _wan,
  "ltx": _ltx,
  "ltx2": _ltx2,
}


def _recording(split):
  """A hook running `split(run, carry, n)`; its `calls` get `(index, num_layers, blocks run)`."""
  calls = []

  def hook(run, carry, *, num_layers, index):
    ran = []

    def counted(c, start, stop):
      ran.append(stop - start)
      return run(c, start, stop)

    out = split(counted, carry, num_layers)
    calls.append((index, num_layers, sum(ran)))
    return out

  hook.calls = calls
  return hook


HOOKS = {
  "pass": lambda run, c, n: run(c, 0, n),
  "split": lambda run, c, n: run(run(c, 0, 1), 1, n),
  "first": lambda run, c, n: run(c, 0, 1),
}


# LTX-2's row is in the slow suite; FirstBlockCache and TeaCache on LTX-2 (tests/test_cache_families.py)
# run its block hook in the default one.
@pytest.mark.parametrize(
  "name", [pytest.param(m, marks=[pytest.mark.slow] if m == "ltx2" else []) for m in MODELS]
)
def test_block_hook(name):
  model, forward, stacks = MODELS[name]()
  graphdef, state = nnx.split(model)
  hooks = {k: _recording(split) for k, split in HOOKS.items()}

  @jax.jit
  def run_all(state):
    m = nnx.merge(graphdef, state)
    outs = {"plain": forward(m)}
    for k, hook in hooks.items():
      with md_core.block_hook(hook):
        outs[k] = forward(m)
    return outs

  outs = run_all(state)
  chex.assert_tree_all_finite(outs["plain"])
  chex.assert_trees_all_equal(outs["pass"], outs["plain"])
  chex.assert_trees_all_close(outs["split"], outs["plain"], atol=1e-6, rtol=0)
  gap = max(
    float(jnp.max(jnp.abs(a - b)))
    for a, b in zip(jax.tree.leaves(outs["first"]), jax.tree.leaves(outs["plain"]), strict=True)
  )
  assert gap > 1e-3, f"{name}: running only the first block changed the output by {gap}"
  # Every hookable stack went through the hook once, in order, and ran the blocks asked for.
  for k, want_blocks in (("pass", stacks), ("split", stacks), ("first", (1,) * len(stacks))):
    want = [(i, n, b) for i, (n, b) in enumerate(zip(stacks, want_blocks, strict=True))]
    assert hooks[k].calls == want, (k, hooks[k].calls)
  assert np.all([n > 1 for n in stacks])  # so that "first" leaves blocks out
