"""LTX-Video transformer against diffusers' outputs (tests/fixtures/ltx_transformer), the original single
file, rotary tables and input errors."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import md_ltx
from md_core.testing import fixture_path, load_arrays

CASES = ("t2v", "per_token")
TOL = 1e-4


@jax.jit(static_argnames=("grid", "scale"))
def _apply(graphdef, state, x, text, t, mask, grid, scale):
  f, h, w = grid
  return nnx.merge(graphdef, state)(
    x, text, t, mask, num_frames=f, height=h, width=w, rope_interpolation_scale=scale
  )


def run(model, ref):
  graphdef, state = nnx.split(model)
  scale = ref.get("rope_interpolation_scale")
  scale = None if scale is None else tuple(float(s) for s in scale)
  return _apply(
    graphdef, state, jnp.asarray(ref["hidden_states"]), jnp.asarray(ref["encoder_hidden_states"]),
    jnp.asarray(ref["timestep"]), jnp.asarray(ref["encoder_attention_mask"]),
    tuple(int(n) for n in ref["grid"]), scale,
  )  # fmt: skip


@pytest.fixture(scope="module")
def model():
  return md_ltx.load_transformer(fixture_path("ltx_transformer"))


@pytest.mark.parametrize("case", CASES)
def test_matches_diffusers(model, case):
  ref = load_arrays(fixture_path("ltx_transformer") / f"{case}.npz")
  out = run(model, ref)
  chex.assert_shape(out, ref["sample"].shape)
  chex.assert_trees_all_close(out, ref["sample"], atol=TOL, rtol=0)


def test_original_single_file_gives_the_same_outputs(model):
  single = md_ltx.load_transformer(
    fixture_path("ltx_transformer") / "ltxv-tiny.safetensors", num_attention_heads=2
  )
  assert single.cfg == model.cfg
  ref = load_arrays(fixture_path("ltx_transformer") / "t2v.npz")
  chex.assert_trees_all_close(run(single, ref), ref["sample"], atol=TOL, rtol=0)


def test_config_read_from_the_fixture(model):
  assert model.cfg == md_ltx.VARIANTS["tiny"]
  assert model.blocks.attn1.to_q.kernel[...].shape == (2, 32, 32)
  assert model.blocks.norm1.scale is None  # norm_elementwise_affine=False


def test_bf16_keeps_modulation_tables_f32():
  model = md_ltx.load_transformer(fixture_path("ltx_transformer"), dtype=jnp.bfloat16)
  assert model.blocks.attn1.to_q.kernel[...].dtype == jnp.bfloat16
  assert model.scale_shift_table[...].dtype == jnp.float32
  assert model.blocks.scale_shift_table[...].dtype == jnp.float32
  ref = load_arrays(fixture_path("ltx_transformer") / "t2v.npz")
  out = run(
    model, {k: v.astype(jnp.bfloat16) if k == "hidden_states" else v for k, v in ref.items()}
  )
  assert out.dtype == jnp.bfloat16
  err = float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref["sample"])))
  assert err < 0.1 * float(np.max(np.abs(ref["sample"]))), err


def test_rope_tables_layout():
  cfg = md_ltx.VARIANTS["tiny"]  # width 32: 5 frequencies per axis, 2 unrotated features in front
  cos, sin = md_ltx.rope_tables(cfg, 2, 3, 4, (0.5, 32.0, 32.0))
  chex.assert_shape((cos, sin), (24, 32))
  cos, sin = np.asarray(cos).reshape(2, 3, 4, 32), np.asarray(sin).reshape(2, 3, 4, 32)
  np.testing.assert_array_equal(cos[..., :2], 1.0)
  np.testing.assert_array_equal(sin[..., :2], 0.0)
  # Feature 2 + 2 * (3k + a) + j holds frequency k of axis a: pairs share an angle.
  np.testing.assert_array_equal(cos[..., 2::2], cos[..., 3::2])
  freqs = 10000.0 ** np.linspace(0, 1, 5) * np.pi / 2
  f, h, w = 1, 2, 3
  pos = (f * 0.5 / 20, h * 32.0 / 2048, w * 32.0 / 2048)
  for k in range(5):
    for a in range(3):
      want = np.cos(freqs[k] * (2 * pos[a] - 1))
      np.testing.assert_allclose(cos[f, h, w, 2 + 2 * (3 * k + a)], want, atol=2e-3)


def _abstract(cfg):
  return nnx.eval_shape(lambda: md_ltx.LTXTransformer(cfg, rngs=nnx.Rngs(0)))


def _trace(model, x, text, t, mask=None, **kwargs):
  graphdef, state = nnx.split(model)
  args = [
    None if a is None else jax.ShapeDtypeStruct(np.shape(a), jnp.float32)
    for a in (x, text, t, mask)
  ]
  return jax.eval_shape(lambda st, *a: nnx.merge(graphdef, st)(*a, **kwargs), state, *args)


def test_input_errors():
  model = _abstract(md_ltx.VARIANTS["tiny"])
  x, text, t = np.zeros((1, 24, 8)), np.zeros((1, 5, 24)), np.zeros((1,))
  grid = dict(num_frames=2, height=3, width=4)
  assert _trace(model, x, text, t, **grid).shape == (1, 24, 8)
  with pytest.raises(
    ValueError, match=r"has 24 tokens but num_frames x height x width = 2 x 3 x 5 = 30"
  ):
    _trace(model, x, text, t, num_frames=2, height=3, width=5)
  with pytest.raises(ValueError, match=r"caption_channels=24\] \(T5 states\), got \(1, 5, 4096\)"):
    _trace(model, x, np.zeros((1, 5, 4096)), t, **grid)
  with pytest.raises(ValueError, match=r"\[B, S, in_channels=8\], got \(1, 24, 128\)"):
    _trace(model, np.zeros((1, 24, 128)), text, t, **grid)
  with pytest.raises(
    ValueError, match=r"timestep must be \[B\]=\(1,\) or per token \[B, S\]=\(1, 24\)"
  ):
    _trace(model, x, text, np.zeros((1, 5)), **grid)
  with pytest.raises(ValueError, match=r"encoder_attention_mask must be \[B, S_text\]=\(1, 5\)"):
    _trace(model, x, text, t, np.zeros((1, 6)), **grid)
  with pytest.raises(ValueError, match="must be three numbers"):
    _trace(model, x, text, t, rope_interpolation_scale=(1.0, 2.0), **grid)


def test_config_errors():
  with pytest.raises(ValueError, match=r"keys \['use_rope'\] are not supported"):
    md_ltx.LTXConfig.from_dict({"use_rope": True})
  with pytest.raises(ValueError, match="LTX2VideoTransformer3DModel"):
    md_ltx.LTXConfig.from_dict({"_class_name": "LTX2VideoTransformer3DModel"})
  with pytest.raises(ValueError, match="cross_attention_dim=4096 must equal the model width"):
    md_ltx.LTXConfig(cross_attention_dim=4096)
  with pytest.raises(ValueError, match="qk_norm='rms_norm'"):
    md_ltx.LTXConfig(qk_norm="rms_norm")


def test_sharded_load_and_forward(model):
  """Loaded onto a (fsdp=4, tensor=2) mesh: weights sharded by their logical axes with the stacked layer
  axis whole; the forward pass under the mesh gives the single-device result."""
  import md_sharding as mds

  ref = load_arrays(fixture_path("ltx_transformer") / "t2v.npz")
  want = run(model, ref)
  mesh = mds.make_mesh(mds.MeshConfig(ici_fsdp_parallelism=4, ici_tensor_parallelism=2))
  sharded = md_ltx.load_transformer(fixture_path("ltx_transformer"), mesh=mesh)
  assert tuple(sharded.blocks.attn1.to_q.kernel[...].sharding.spec) == (None, "fsdp", "tensor")
  assert tuple(sharded.blocks.ff.proj_out.kernel[...].sharding.spec) == (None, "tensor", "fsdp")
  with jax.set_mesh(mesh):
    got = run(sharded, ref)
  chex.assert_trees_all_close(got, want, atol=1e-5, rtol=0)


@pytest.mark.slow
def test_ring_attention_matches_single_device(model):
  """Tokens split 4 ways over `context` with ring attention (masked cross-attention included)."""
  import md_sharding as mds

  ref = load_arrays(fixture_path("ltx_transformer") / "t2v.npz")
  ring = md_ltx.load_transformer(fixture_path("ltx_transformer"), attention="ring")
  mesh = mds.make_mesh(mds.MeshConfig(ici_fsdp_parallelism=2, ici_context_parallelism=4))
  with jax.set_mesh(mesh):
    got = run(ring, ref)
  chex.assert_trees_all_close(got, ref["sample"], atol=TOL, rtol=0)


def test_video_coords_reproduce_the_scaled_grid(model):
  """Explicit coordinates `grid * scale` (as LTXConditionPipeline builds them) give the scaled grid's
  rotary tables and outputs (the diffusers-checked path); host (NumPy) and device tables agree."""
  ref = load_arrays(fixture_path("ltx_transformer") / "t2v.npz")
  f, h, w = (int(n) for n in ref["grid"])
  scale = tuple(float(s) for s in ref["rope_interpolation_scale"])
  grid = np.stack(np.meshgrid(np.arange(f), np.arange(h), np.arange(w), indexing="ij"))
  coords = (grid.reshape(3, -1).astype(np.float32) * np.float32(scale).reshape(3, 1))[None]
  cos, sin = md_ltx.rope_tables(model.cfg, f, h, w, scale)
  cos_c, sin_c = md_ltx.rope_tables_from_coords(model.cfg, coords)
  np.testing.assert_array_equal(np.asarray(cos_c[0]), np.asarray(cos))
  np.testing.assert_array_equal(np.asarray(sin_c[0]), np.asarray(sin))
  cos_d, _ = md_ltx.rope_tables_from_coords(model.cfg, jnp.asarray(coords))
  np.testing.assert_allclose(np.asarray(cos_d), np.asarray(cos_c), atol=1e-5, rtol=0)
  args = [jnp.asarray(ref[k]) for k in ("hidden_states", "encoder_hidden_states", "timestep")]
  out = model(*args, jnp.asarray(ref["encoder_attention_mask"]), video_coords=coords)
  chex.assert_trees_all_close(out, ref["sample"], atol=TOL, rtol=0)
  # A skip mask of ones (no block skipped) changes nothing; a skipped block does.
  b = args[0].shape[0]
  keep = model(*args, jnp.asarray(ref["encoder_attention_mask"]), video_coords=coords,
               skip_layer_mask=jnp.ones((2, b)))  # fmt: skip
  chex.assert_trees_all_close(keep, out, atol=1e-6, rtol=0)
  skipped = model(*args, jnp.asarray(ref["encoder_attention_mask"]), video_coords=coords,
                  skip_layer_mask=jnp.zeros((2, b)))  # fmt: skip
  assert float(jnp.abs(skipped - out).max()) > 1e-3
  with pytest.raises(ValueError, match=r"video_coords must be \[B=2 or 1, 3, S=\d+\]"):
    model(*args, video_coords=coords[:, :, :-1])
  with pytest.raises(ValueError, match=r"skip_layer_mask must be \[num_layers, B\]"):
    model(*args, video_coords=coords, skip_layer_mask=jnp.ones((3, b)))
