"""Flux.2 transformer: parity with diffusers (plain, guided, reference KV cache), errors, manifests."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import md_attention as mda
import md_core
import md_flux
import md_sharding as mds
from md_core.testing import fixture_path, load_arrays, load_manifest, repo_root

ATOL = 1e-4


@pytest.fixture(scope="module")
def io():
  return load_arrays(fixture_path("flux2_transformer") / "io.npz")


@pytest.fixture(scope="module")
def klein():
  return md_flux.load_flux2(fixture_path("flux2_transformer") / "klein")


@functools.partial(jax.jit, static_argnums=(0, 3))
def _apply(graphdef, state, arrays, static):
  return nnx.merge(graphdef, state)(**arrays, **dict(static))


def run(model, **kw):
  """The model under jit as a pure function of its state; static keywords stay Python values."""
  arrays = {k: v for k, v in kw.items() if isinstance(v, jax.Array | md_flux.BlockKV)}
  static = tuple(sorted((k, v) for k, v in kw.items() if k not in arrays))
  graphdef, state = nnx.split(model)
  return _apply(graphdef, state, arrays, static)


def base(io, *names):
  return {k: jnp.asarray(io[k]) for k in ("encoder_hidden_states", "txt_ids", *names)}


def test_klein_matches_diffusers(io, klein):
  assert klein.time_guidance_embed.guidance_embedder is None
  out = run(klein, **base(io, "hidden_states", "timestep", "img_ids"))
  chex.assert_trees_all_close(out, io["out_klein"], atol=ATOL, rtol=0)


def test_guided_matches_diffusers(io):
  model = md_flux.load_flux2(fixture_path("flux2_transformer") / "guided")
  out = run(model, **base(io, "hidden_states", "timestep", "img_ids", "guidance"))
  chex.assert_trees_all_close(out, io["out_guided"], atol=ATOL, rtol=0)


def test_reference_kv_cache_matches_diffusers(io, klein):
  """Flux2KleinKVPipeline's two kinds of step: extract with reference tokens, then cached."""
  r = io["ref_hidden_states"].shape[1]
  kw = base(io, "timestep")
  kw["hidden_states"] = jnp.concatenate([io["ref_hidden_states"], io["hidden_states"]], axis=1)
  kw["img_ids"] = jnp.concatenate([io["ref_ids"], io["img_ids"]], axis=0)
  out, cache = run(klein, **kw, num_ref_tokens=r)
  chex.assert_trees_all_close(out, io["out_extract"], atol=ATOL, rtol=0)
  for name in md_flux.BlockKV._fields:
    chex.assert_trees_all_close(getattr(cache, name), io[f"cache_{name}"], atol=ATOL, rtol=0)
  kw = base(io, "img_ids")
  kw.update(
    hidden_states=jnp.asarray(io["hidden_states_2"]), timestep=jnp.asarray(io["timestep_2"])
  )
  out = run(klein, **kw, kv_cache=cache)
  chex.assert_trees_all_close(out, io["out_cached"], atol=ATOL, rtol=0)


@pytest.mark.slow
@pytest.mark.parametrize("implementation", ["ulysses", "ring"])
def test_reference_kv_cache_context_parallel(io, implementation):
  mesh = mds.make_mesh(mds.MeshConfig(ici_fsdp_parallelism=2, ici_context_parallelism=4))
  model = md_flux.load_flux2(
    fixture_path("flux2_transformer") / "klein",
    mesh=mesh,
    attention=mda.AttentionConfig(implementation=implementation),
  )
  r = io["ref_hidden_states"].shape[1]
  kw = base(io, "timestep")
  kw["hidden_states"] = jnp.concatenate([io["ref_hidden_states"], io["hidden_states"]], axis=1)
  kw["img_ids"] = jnp.concatenate([io["ref_ids"], io["img_ids"]], axis=0)
  with jax.sharding.set_mesh(mesh):
    out, cache = run(model, **kw, num_ref_tokens=r)
    kw = base(io, "img_ids")
    kw.update(
      hidden_states=jnp.asarray(io["hidden_states_2"]), timestep=jnp.asarray(io["timestep_2"])
    )
    cached = run(model, **kw, kv_cache=cache)
  chex.assert_trees_all_close(out, io["out_extract"], atol=1e-5, rtol=0)
  chex.assert_trees_all_close(cached, io["out_cached"], atol=1e-5, rtol=0)


def test_return_kv_without_references(io, klein):
  out, kv = run(klein, **base(io, "hidden_states", "timestep", "img_ids"), return_kv=True)
  chex.assert_trees_all_close(out, io["out_klein"], atol=ATOL, rtol=0)
  chex.assert_shape(kv.double_k, (2, 2, 8 + 16, 4, 8))
  chex.assert_shape(kv.single_v, (2, 2, 8 + 16, 4, 8))


def test_input_errors(io, klein):
  kw = base(io, "hidden_states", "timestep", "img_ids")
  cases = [
    (dict(hidden_states=kw["hidden_states"][..., :4]), r"hidden_states must be \[B, S, 16\]"),
    (dict(img_ids=kw["img_ids"][:, :3]), r"img_ids must be \[S, 4\] or \[B, S, 4\] with S=16"),
    (dict(txt_ids=kw["txt_ids"][:5]), r"txt_ids must be .* with S=8"),
    (dict(guidance=jnp.ones(2)), r"no guidance embedder .* pass guidance=None"),
    (dict(num_ref_tokens=16), r"num_ref_tokens=16 must be in \[0, 16\)"),
  ]
  for change, match in cases:
    with pytest.raises(ValueError, match=match):
      klein(**{**kw, **change})
  bad = md_flux.BlockKV(*(jnp.zeros((2, 2, 3, 4, 7)) for _ in range(4)))
  with pytest.raises(ValueError, match=r"kv_cache.double_k must be \[2, 2, R, 4, 8\]"):
    klein(**kw, kv_cache=bad)
  good = md_flux.BlockKV(*(jnp.zeros((2, 2, 3, 4, 8)) for _ in range(4)))
  with pytest.raises(ValueError, match=r"num_ref_tokens .* or kv_cache .*, not both"):
    klein(**kw, kv_cache=good, num_ref_tokens=2)


def test_key_map():
  T = md_core.Target
  assert md_flux.convert_key_flux2("single_transformer_blocks.5.attn.to_qkv_mlp_proj.weight") == T(
    ("single_transformer_blocks", "attn", "to_qkv_mlp_proj", "kernel"), "linear", layer=5
  )
  assert md_flux.convert_key_flux2("transformer_blocks.0.attn.to_out.0.weight") == T(
    ("transformer_blocks", "attn", "to_out", "kernel"), "linear", layer=0
  )
  assert md_flux.convert_key_flux2("transformer_blocks.1.attn.norm_added_k.weight") == T(
    ("transformer_blocks", "attn", "norm_added_k", "scale"), layer=1
  )
  assert md_flux.convert_key_flux2("double_stream_modulation_txt.linear.weight") == T(
    ("double_stream_modulation_txt", "linear", "kernel"), "linear"
  )
  assert md_flux.convert_key_flux2("transformer_blocks.0.attn.to_q.bias") is None  # bias-free
  assert md_flux.convert_key_flux2("single_transformer_blocks.0.attn.add_q_proj.weight") is None


def test_config():
  cfg = md_flux.Flux2Config.from_json(fixture_path("flux2_transformer") / "klein" / "config.json")
  assert (cfg.rope_theta, cfg.axes_dims_rope, cfg.guidance_embeds) == (2000, (2, 2, 2, 2), False)
  with pytest.raises(ValueError, match=r"unsupported config keys \['pooled_projection_dim'\]"):
    md_flux.Flux2Config.from_dict({"pooled_projection_dim": 768})
  assert md_flux.FLUX2_VARIANTS["klein-9b"].inner_dim == 4096


@pytest.mark.parametrize("variant", ["klein-4b", "klein-9b"])
def test_manifest(variant):
  name = f"flux2_{variant.replace('-', '_')}_transformer"
  data = load_manifest(name)
  shapes = {k: v["shape"] for k, v in data["tensors"].items()}
  cfg = md_flux.FLUX2_VARIANTS[variant]
  assert (
    md_flux.Flux2Config.from_json(
      repo_root() / "tools" / "configs" / "flux" / f"flux2-{variant}.json"
    )
    == cfg
  )
  factory = lambda: md_flux.Flux2Transformer(cfg, rngs=nnx.Rngs(0))  # noqa: E731
  assert md_core.coverage(shapes, factory, md_flux.convert_key_flux2) == []
  # Parameter count: Klein "4B" / "9B" name the transformer plus nothing else.
  count = sum(int(np.prod(s)) for s in shapes.values())
  assert 3.5e9 < count < 4.5e9 if variant == "klein-4b" else 8.5e9 < count < 9.5e9, count
