"""Run-time LoRA slots (md_core.add_lora_slots / set_lora, Pipeline.add_lora_slots / set_lora): an
adapter in the slots gives the output of the weights merged by hand (W + s·A·B), several adapters add up,
and swapping adapters of other ranks, scales or none at all reuses the compiled denoising loop."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import md_core
import md_wan
from md_core import testing

TARGETS = ("attn1.to_q", "attn1.to_v", "attn2.to_k", "ffn.net.0.proj")


@pytest.fixture(scope="module")
def pipe():
  p = md_wan.load_pipeline(testing.fixture_path("wan_pipeline") / "t2v")
  paths = p.add_lora_slots(8, targets=TARGETS)
  assert paths and all(any(path.endswith(t) for t in TARGETS) for path in paths)
  return p, paths


KW = dict(
  prompt="a cat", height=32, width=32, num_frames=5, num_inference_steps=3, guidance_scale=5.0,
  seed=0, progress=False, output_type="latent",
)  # fmt: skip


def _adapter(paths, rank, seed, scale=1.0, layer=None):
  rng = np.random.default_rng(seed)
  out = {}
  layers = md_core.dense_layers(_PIPE[0].transformer)
  for path in paths:
    *lead, n_in, n_out = layers[path].kernel.get_value().shape
    shape_lead = [] if layer is not None else lead
    a = rng.standard_normal((*shape_lead, n_in, rank)).astype(np.float32) * 0.2
    b = rng.standard_normal((*shape_lead, rank, n_out)).astype(np.float32) * 0.2
    out[path] = md_core.LoRASlotWeight(a, b, scale, layer)
  return out


_PIPE = []


def _merged_state(state, adapters):
  """The split state with every adapter merged into its kernel by hand."""
  out = jax.tree.map(lambda x: x, state)
  flat = dict(nnx.to_flat_state(out))
  for adapter in adapters:
    for path, w in adapter.items():
      key = tuple(int(p) if p.isdigit() else p for p in path.split(".")) + ("kernel",)
      kernel = flat[key].get_value()
      delta = w.scale * np.matmul(w.a, w.b)
      if w.layer is not None:  # only that layer of the stack
        delta = np.zeros(kernel.shape, np.float32) + (
          np.eye(kernel.shape[0], dtype=np.float32)[w.layer][:, None, None] * delta[None]
        )
      flat[key].set_value(kernel + delta)
  return out


def _loop_programs(p):
  return sum(fn._cache_size() for fn in p._memo._fns.values() if hasattr(fn, "_cache_size"))


def test_slots_equal_merged_weights_and_swaps_never_recompile(pipe):
  p, paths = pipe
  _PIPE[:] = [p]
  base = np.asarray(p(**KW))
  programs = _loop_programs(p)
  assert programs >= 1

  one = _adapter(paths[:2], 4, seed=1, scale=0.7)
  stacked = _adapter(paths[2:3], 2, seed=2, scale=1.5, layer=1)  # only block 1 of the scanned stack
  p.set_lora([one, stacked])
  with_lora = np.asarray(p(**KW))
  assert float(np.abs(with_lora - base).max()) > 1e-3

  # The same adapters merged into the kernels, slots cleared: the same output.
  split = p._t1
  slots = split.state
  split.state = _merged_state(md_core.clear_lora(slots), [one, stacked])
  merged = np.asarray(p(**KW))
  split.state = slots
  np.testing.assert_allclose(with_lora, merged, atol=1e-4, rtol=1e-4)

  # Five adapters of other ranks, other scales, and none: no new program.
  for i, rank in enumerate((1, 2, 3, 6, 8)):
    p.set_lora(_adapter(paths, rank, seed=10 + i, scale=0.1 * (i + 1)))
    p(**KW)
  p.set_lora([])
  np.testing.assert_allclose(np.asarray(p(**KW)), base, atol=1e-6, rtol=0)
  assert _loop_programs(p) == programs


def test_set_lora_errors(pipe):
  p, paths = pipe
  _PIPE[:] = [p]
  with pytest.raises(ValueError, match="has no LoRA slot; slots nearest by name"):
    p.set_lora(
      {"blocks.attn1.to_nothing": md_core.LoRASlotWeight(np.zeros((4, 1)), np.zeros((1, 4)))}
    )
  too_big = _adapter(paths[:1], 6, seed=0)
  with pytest.raises(ValueError, match="needs rank 12 .* its slot holds 8"):
    p.set_lora([too_big, too_big])
  w = too_big[paths[0]]
  with pytest.raises(ValueError, match="takes a"):
    p.set_lora({paths[0]: md_core.LoRASlotWeight(w.a[..., :3, :], w.b)})
  with pytest.raises(ValueError, match="match no Dense layer"):
    md_core.add_lora_slots(p.transformer, 4, targets=("no_such_layer",))
  with pytest.raises(ValueError, match="has no model component 'unet'"):
    p.set_lora({}, component="unet")


def test_dense_slot_closed_form():
  d = md_core.nn.Dense(3, 5, rngs=nnx.Rngs(0))
  x = jnp.linspace(-1, 1, 6).reshape(2, 3)
  y0 = d(x)
  md_core.add_lora_slots(d, 4)
  np.testing.assert_array_equal(np.asarray(d(x)), np.asarray(y0))  # zero slots: the same layer
  a = np.arange(6, dtype=np.float32).reshape(3, 2) / 10
  b = np.ones((2, 5), np.float32)
  paths = md_core.lora_paths(d)
  assert paths == [""] and md_core.lora_rank(d) == 4
  new = md_core.set_lora(nnx.state(d), {"": md_core.LoRASlotWeight(a, b, 0.5)})
  nnx.update(d, new)
  want = np.asarray(y0) + 0.5 * np.asarray(x) @ a @ b
  np.testing.assert_allclose(np.asarray(d(x)), want, atol=1e-6)
