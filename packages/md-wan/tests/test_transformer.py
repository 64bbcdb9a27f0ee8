"""Wan transformer against diffusers' outputs (tests/fixtures/wan_transformer), layouts, errors, and context
parallelism on 8 virtual devices."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import md_sharding as mds
import md_wan
from md_core.testing import fixture_path, load_arrays

CASES = ("t2v", "i2v", "flf2v", "ti2v")
TOL = 1e-5  # measured max errors are ~6e-7 (f32)


@jax.jit(static_argnames=("layout",))
def _apply(graphdef, state, x, t, text, image, layout="BCFHW"):
  return nnx.merge(graphdef, state)(x, t, text, image, layout=layout)


def run(model, ref, layout="BCFHW"):
  graphdef, state = nnx.split(model)
  image = ref.get("encoder_hidden_states_image")
  x = jnp.asarray(ref["hidden_states"])
  if layout == "BFHWC":
    x = x.transpose(0, 2, 3, 4, 1)
  return _apply(
    graphdef, state, x, jnp.asarray(ref["timestep"]), jnp.asarray(ref["encoder_hidden_states"]),
    None if image is None else jnp.asarray(image), layout=layout,
  )  # fmt: skip


@pytest.fixture(scope="module")
def models():
  return {case: md_wan.load_transformer(fixture_path("wan_transformer") / case) for case in CASES}


@pytest.mark.parametrize("case", CASES)
def test_matches_diffusers(models, case):
  ref = load_arrays(fixture_path("wan_transformer") / f"{case}.npz")
  out = run(models[case], ref)
  chex.assert_shape(out, ref["sample"].shape)
  chex.assert_trees_all_close(out, ref["sample"], atol=TOL, rtol=0)


@pytest.mark.parametrize("case", ["t2v", "i2v"])
def test_bf16_follows_diffusers(case):
  """Loaded in bf16 (float32 kept where diffusers keeps it) on bf16 inputs: within bf16 noise of diffusers'
  bf16 run (measured max 0.016 / 0.010 at output scale ~2, about the bf16-vs-f32 gap of the reference)."""
  ref = load_arrays(fixture_path("wan_transformer") / f"{case}.npz")
  model = md_wan.load_transformer(fixture_path("wan_transformer") / case, dtype=jnp.bfloat16)
  assert model.blocks.attn1.to_q.kernel[...].dtype == jnp.bfloat16
  for param in (model.scale_shift_table, model.blocks.scale_shift_table, model.blocks.norm2.scale):
    assert param[...].dtype == jnp.float32
  half = {k: v.astype(jnp.bfloat16) if k != "timestep" else v for k, v in ref.items()}
  out = run(model, half)
  assert out.dtype == jnp.bfloat16
  err = float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref["sample_bf16"])))
  assert err < 0.03, err


def test_channels_last_layout(models):
  ref = load_arrays(fixture_path("wan_transformer") / "t2v.npz")
  out = run(models["t2v"], ref, layout="BFHWC")
  chex.assert_trees_all_close(out.transpose(0, 4, 1, 2, 3), ref["sample"], atol=TOL, rtol=0)


def test_configs_read_from_the_fixture(models):
  assert models["i2v"].cfg.added_kv_proj_dim == 48 and models["i2v"].image_embedder is not None
  assert models["ti2v"].cfg.cross_attn_norm is False and models["ti2v"].blocks.norm2 is None
  assert models["flf2v"].cfg.pos_embed_seq_len == 10
  assert models["t2v"].blocks.attn1.to_q.kernel[...].shape == (2, 48, 48)


def test_rope_tables_split_the_head_dim():
  cfg = md_wan.VARIANTS["2.1-t2v-14b"]
  assert cfg.rope_dims == (44, 42, 42)
  cos, sin = md_wan.rope_tables(md_wan.VARIANTS["tiny"], 2, 3, 4)  # head dim 12 → (4, 4, 4)
  chex.assert_shape(cos, (24, 12))
  cos = np.asarray(cos).reshape(2, 3, 4, 12)
  # Frame part depends on the frame only, row part on the row, column part on the column.
  np.testing.assert_allclose(cos[1, 0, 0, :4], cos[1, 2, 3, :4])
  np.testing.assert_allclose(cos[0, 2, 0, 4:8], cos[1, 2, 3, 4:8])
  np.testing.assert_allclose(cos[0, 0, 3, 8:], cos[1, 2, 3, 8:])
  # Angle of pair i at position p is p / 10000**(2i/d): pair 1 of the column part (d=4) at column 3.
  np.testing.assert_allclose(cos[0, 0, 3, 10], np.cos(3 / 100.0), rtol=1e-6)
  np.testing.assert_allclose(
    np.asarray(sin).reshape(2, 3, 4, 12)[1, 0, 0, 0], np.sin(1.0), rtol=1e-6
  )


def _tiny_inputs(cfg, f=2, h=4, w=4, text=16, batch=1):
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.standard_normal((batch, cfg.in_channels, f, h, w)), jnp.float32)
  t = jnp.full((batch,), 500.0)
  ctx = jnp.asarray(rng.standard_normal((batch, 7, text)), jnp.float32)
  return x, t, ctx


def _abstract(cfg):
  return nnx.eval_shape(lambda: md_wan.WanTransformer(cfg, rngs=nnx.Rngs(0)))


def _trace(model, *args, **kwargs):
  """Runs the model's checks by tracing it with abstract parameters and inputs (no compute)."""
  graphdef, state = nnx.split(model)
  args = [None if a is None else jax.ShapeDtypeStruct(a.shape, a.dtype) for a in args]
  return jax.eval_shape(lambda st, *a: nnx.merge(graphdef, st)(*a, **kwargs), state, *args)


def _tiny_dict(**overrides):
  cfg = md_wan.VARIANTS["tiny"]
  return dict(
    num_attention_heads=cfg.num_attention_heads, attention_head_dim=cfg.attention_head_dim,
    in_channels=4, out_channels=4, text_dim=16, freq_dim=16, ffn_dim=32, num_layers=2,
  ) | overrides  # fmt: skip


def test_input_errors(models):
  model = models["t2v"]
  x, t, ctx = _tiny_inputs(model.cfg)
  assert _trace(model, x, t, ctx).shape == x.shape
  with pytest.raises(
    ValueError, match=r"frames/height/width \(2, 5, 4\) must be multiples of .*H=5 % 2"
  ):
    _trace(model, np.zeros((1, 4, 2, 5, 4)), t, ctx)
  with pytest.raises(
    ValueError, match=r"\[B=1, S, text_dim=16\] \(UMT5 states\), got \(1, 7, 32\)"
  ):
    _trace(model, x, t, np.zeros((1, 7, 32)))
  with pytest.raises(ValueError, match="has 3 channels; the config has in_channels=4"):
    _trace(model, x[:, :3], t, ctx)
  with pytest.raises(
    ValueError,
    match=r"timestep must be \[B\]=\(1,\), per token \[B, tokens\]=\(1, 8\) or per latent frame "
    r"\[B, frames\]=\(1, 2\), got \(1, 5\)",
  ):
    _trace(model, x, np.zeros((1, 5)), ctx)
  with pytest.raises(ValueError, match="no image branch"):
    _trace(model, x, t, ctx, np.zeros((1, 5, 20)))
  with pytest.raises(ValueError, match="layout='NCHW'"):
    _trace(model, x, t, ctx, layout="NCHW")
  i2v = models["i2v"]
  x8 = np.zeros((1, 8, 2, 4, 4))
  with pytest.raises(ValueError, match="pass encoder_hidden_states_image"):
    _trace(i2v, x8, t, ctx)
  with pytest.raises(ValueError, match=r"\[B, tokens, image_dim=20\], got \(1, 5, 21\)"):
    _trace(i2v, x8, t, ctx, np.zeros((1, 5, 21)))
  with pytest.raises(
    ValueError, match="with pos_embed_seq_len=10 the model takes 2 images per video"
  ):
    _trace(models["flf2v"], x8, t, ctx, np.zeros((1, 5, 20)))
  long = _abstract(md_wan.WanConfig(**_tiny_dict(rope_max_seq_len=2)))
  with pytest.raises(ValueError, match="3 latent frames after patching exceed rope_max_seq_len=2"):
    _trace(long, np.zeros((1, 4, 3, 2, 2)), t, ctx)


def test_heads_not_divisible_by_tensor_or_ulysses_degree():
  six = _tiny_dict(num_attention_heads=6, attention_head_dim=8)
  model = _abstract(md_wan.WanConfig(**six))
  x, t, ctx = _tiny_inputs(model.cfg)
  mesh = mds.make_mesh(mds.MeshConfig(ici_fsdp_parallelism=2, ici_tensor_parallelism=4))
  with jax.set_mesh(mesh):
    with pytest.raises(
      ValueError,
      match=r"num_attention_heads=6 .* tensor parallelism 4; tensor degrees that work: \[1, 2, 3, 6\]",
    ):
      _trace(model, x, t, ctx)
  uly = _abstract(md_wan.WanConfig(**six, attention="ulysses"))
  mesh = mds.make_mesh(mds.MeshConfig(ici_fsdp_parallelism=2, ici_context_parallelism=4))
  with jax.set_mesh(mesh):
    with pytest.raises(
      ValueError, match=r"context axis of size 4.*Ulysses degrees that work: \[1, 2, 3, 6\]"
    ):
      _trace(uly, x, t, ctx)


@pytest.mark.parametrize(
  "implementation, case", [("ulysses", "t2v"), ("ring", "t2v"), ("ring", "ti2v")]
)
def test_context_parallel_matches_single_device(models, implementation, case):
  """The tiny transformers with their tokens split 4 ways over `context` (batch over fsdp) give the
  single-device dot-product result: T2V (18 tokens, not a multiple of 4) and TI2V (per-token
  timesteps, whose modulation is sharded with the tokens)."""
  ref = load_arrays(fixture_path("wan_transformer") / f"{case}.npz")
  want = run(models[case], ref)
  model = md_wan.load_transformer(fixture_path("wan_transformer") / case, attention=implementation)
  assert model.blocks.attn1.cfg.attention == implementation
  mesh = mds.make_mesh(mds.MeshConfig(ici_fsdp_parallelism=2, ici_context_parallelism=4))
  with jax.set_mesh(mesh):
    got = run(model, ref)
  chex.assert_trees_all_close(got, want, atol=1e-5, rtol=0)


def test_per_frame_timesteps_match_the_reference_per_token_ones(models):
  """TI2V's per-token timesteps are constant within each latent frame (frame 0 at 0); given once per
  frame, `[B, F / pt]`, the transformer repeats them over each frame's tokens: the reference's output
  (diffusers' per-token call), and md's per-token result to float rounding."""
  ref = load_arrays(fixture_path("wan_transformer") / "ti2v.npz")
  model = models["ti2v"]
  per_token = ref["timestep"]  # [2, 12]: 3 latent frames of 2 x 2 tokens
  per_frame = per_token[:, ::4]
  np.testing.assert_array_equal(np.repeat(per_frame, 4, axis=1), per_token)
  got = run(model, ref | {"timestep": per_frame})
  chex.assert_trees_all_close(got, ref["sample"], atol=1e-4, rtol=0)
  chex.assert_trees_all_close(got, run(model, ref), atol=1e-6, rtol=0)


def test_sharded_load_and_forward(models):
  """Loaded onto a (fsdp=2, tensor=4) mesh: weights sharded by their logical axes, the stacked layer
  axis whole; the forward pass under the mesh gives the single-device result, tokens stay sharded."""
  ref = load_arrays(fixture_path("wan_transformer") / "i2v.npz")
  want = run(models["i2v"], ref)
  mesh = mds.make_mesh(mds.MeshConfig(ici_fsdp_parallelism=2, ici_tensor_parallelism=4))
  model = md_wan.load_transformer(fixture_path("wan_transformer") / "i2v", mesh=mesh)
  assert tuple(model.blocks.attn1.to_q.kernel[...].sharding.spec) == (None, "fsdp", "tensor")
  assert tuple(model.blocks.attn2.to_out.kernel[...].sharding.spec) == (None, "tensor", "fsdp")
  assert tuple(model.blocks.ffn.proj_in.kernel[...].sharding.spec) == (None, "fsdp", "tensor")
  assert tuple(model.blocks.scale_shift_table[...].sharding.spec) == (None, None, None, "fsdp")
  with jax.set_mesh(mesh):
    got = run(model, ref)
  chex.assert_trees_all_close(got, want, atol=1e-5, rtol=0)
