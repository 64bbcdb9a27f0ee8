"""md_core.nn blocks against diffusers / torch outputs saved by tools/fixtures/core.py."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import md_core
from md_core import nn
from md_core.testing import fixture_path, load_arrays

ATOL = 1e-5


@pytest.fixture(scope="module")
def ref():
  return load_arrays(fixture_path("core") / "blocks.npz")


@pytest.fixture(scope="module")
def weights():
  return md_core.open_checkpoint(fixture_path("core") / "blocks.safetensors")


def _load(factory, weights, prefix, rules):
  sub = {k: weights[k] for k in weights if k.startswith(prefix + ".")}
  rules = [(rf"{prefix}\.{torch}" if torch else prefix, md, kind) for torch, md, kind in rules]
  return md_core.load_weights(factory, sub, md_core.torch_module_keymap(rules), progress=False)


@pytest.mark.parametrize(
  "name,dim,flip,shift,scale,period",
  [
    ("sd", 32, True, 0.0, 1.0, 10000),
    ("odd", 33, False, 1.0, 1.0, 10000),
    ("scaled", 64, True, 1.0, 1000.0, 10000),
    ("period", 16, False, 0.5, 1.0, 100),
  ],
)
def test_timestep_embedding(ref, name, dim, flip, shift, scale, period):
  got = jax.jit(
    lambda t: nn.timestep_embedding(
      t, dim, flip_sin_to_cos=flip, downscale_freq_shift=shift, scale=scale, max_period=period
    )
  )(jnp.asarray(ref["t"]))
  chex.assert_shape(got, (5, dim))
  # f32 sin/cos of an argument x is only defined to about one ulp of x (x up to 1e3, or 1e6 with scale=1000),
  # and torch and XLA round exp() differently by an ulp; so the bound grows with the largest argument.
  t = ref["t"]
  for row in range(len(t)):
    atol = max(ATOL, 2 * np.spacing(np.float32(t[row] * scale)))
    chex.assert_trees_all_close(got[row], ref[f"temb_{name}"][row], atol=atol, rtol=0)


def test_timestep_embedding_rejects_2d():
  with pytest.raises(ValueError, match=r"timesteps must be 1-d"):
    nn.timestep_embedding(jnp.zeros((2, 3)), 8)


def test_timestep_mlp(ref, weights):
  mlp = _load(
    lambda: nn.TimestepEmbedding(32, 64, rngs=nnx.Rngs(0)),
    weights,
    "temb_mlp",
    [(r"linear_1", "linear_1", "linear"), (r"linear_2", "linear_2", "linear")],
  )
  chex.assert_trees_all_close(mlp(jnp.asarray(ref["temb_mlp_in"])), ref["temb_mlp_out"], atol=ATOL)


@pytest.mark.parametrize(
  "act", ["gelu", "gelu-approximate", "geglu", "geglu-approximate", "swiglu", "linear-silu"]
)
def test_feed_forward(ref, weights, act):
  ff = _load(
    lambda: nn.FeedForward(16, dim_out=12, mult=2, activation=act, rngs=nnx.Rngs(0)),
    weights,
    f"ff_{act}",
    [(r"net\.0\.proj", "proj_in", "linear"), (r"net\.2", "proj_out", "linear")],
  )
  chex.assert_trees_all_close(ff(jnp.asarray(ref["ff_in"])), ref[f"ff_{act}"], atol=ATOL)


def test_norms(ref, weights):
  x = jnp.asarray(ref["ff_in"])
  rms = _load(
    lambda: nn.RMSNorm(16, eps=1e-6, rngs=nnx.Rngs(0)), weights, "rms", [("", "", "norm")]
  )
  chex.assert_trees_all_close(rms(x), ref["rms"], atol=ATOL)
  ln = _load(
    lambda: nn.LayerNorm(16, eps=1e-6, rngs=nnx.Rngs(0)), weights, "ln", [("", "", "norm")]
  )
  chex.assert_trees_all_close(ln(x), ref["ln"], atol=ATOL)
  plain = nn.LayerNorm(16, eps=1e-6, elementwise_affine=False)
  chex.assert_trees_all_close(plain(x), ref["ln_plain"], atol=ATOL)
  gn = _load(lambda: nn.GroupNorm(4, 16, rngs=nnx.Rngs(0)), weights, "gn", [("", "", "norm")])
  x = jnp.asarray(ref["gn_in"]).transpose(0, 2, 3, 1)  # NCHW → NHWC
  chex.assert_trees_all_close(gn(x).transpose(0, 3, 1, 2), ref["gn"], atol=ATOL)


def test_norms_keep_input_dtype_and_compute_in_f32():
  x = jnp.asarray(np.random.default_rng(0).normal(size=(2, 5, 16)) * 100, jnp.bfloat16)
  for norm in (nn.RMSNorm(16), nn.LayerNorm(16), nn.GroupNorm(4, 16)):
    y = norm(x)
    assert y.dtype == jnp.bfloat16
    chex.assert_trees_all_close(y.astype(jnp.float32), norm(x.astype(jnp.float32)), atol=2e-2)


def test_gelu(ref):
  x = jnp.asarray(ref["ff_in"])
  chex.assert_trees_all_close(nn.gelu(x), ref["gelu"], atol=ATOL)
  chex.assert_trees_all_close(nn.gelu(x, approximate=True), ref["gelu_tanh"], atol=ATOL)


def test_rope_1d_and_apply(ref):
  cos, sin = nn.rope_1d(16, jnp.asarray(ref["rope_pos"]))
  chex.assert_trees_all_close((cos, sin), (ref["rope_cos"], ref["rope_sin"]), atol=ATOL)
  out = jax.jit(nn.apply_rope)(jnp.asarray(ref["rope_x"]), cos, sin)
  chex.assert_trees_all_close(out, ref["rope_out"], atol=ATOL)
  half = nn.apply_rope(
    jnp.asarray(ref["rope_x"]),
    jnp.asarray(ref["rope_half_cos"]),
    jnp.asarray(ref["rope_half_sin"]),
    interleaved=False,
  )
  chex.assert_trees_all_close(half, ref["rope_half_out"], atol=ATOL)


def test_rope_nd(ref):
  cos, sin = nn.rope_nd(jnp.asarray(ref["rope_ids"]), (4, 6, 6))
  chex.assert_trees_all_close((cos, sin), (ref["rope_nd_cos"], ref["rope_nd_sin"]), atol=ATOL)
  with pytest.raises(ValueError, match="3 position axes but axes_dims"):
    nn.rope_nd(jnp.asarray(ref["rope_ids"]), (8, 8))


def test_rope_rejects_mismatched_head_dim():
  with pytest.raises(ValueError, match="rotary tables have 8 features, x has head dim 16"):
    nn.apply_rope(jnp.zeros((1, 3, 2, 16)), jnp.zeros((3, 8)), jnp.zeros((3, 8)))


def test_bad_block_settings():
  with pytest.raises(ValueError, match="num_groups=3 must divide num_channels=16"):
    nn.GroupNorm(3, 16)
  with pytest.raises(ValueError, match="unknown feed-forward activation 'tanh'"):
    nn.FeedForward(8, activation="tanh")
  with pytest.raises(ValueError, match="groups=3 must divide"):
    nn.Conv(8, 8, (3, 3), groups=3)
  with pytest.raises(ValueError, match=r"Conv2d expects \[B, 2 spatial dims, C\]"):
    nn.Conv(2, 2, (3, 3), rngs=nnx.Rngs(0))(jnp.zeros((1, 4, 2)))


def test_params_carry_logical_axes():
  dense = nn.Dense(4, 8, axes=("embed", "mlp"), rngs=nnx.Rngs(0))
  assert md_core.logical_axes(dense.kernel) == ("embed", "mlp")
  assert md_core.logical_axes(dense.bias) == ("mlp",)
  conv = nn.Conv(4, 8, (3, 3), rngs=nnx.Rngs(0))
  assert md_core.logical_axes(conv.kernel) == (None, None, "conv_in", "conv_out")


@pytest.mark.parametrize(
  "kernel, stride, padding",
  [
    ((3, 3, 3), (1, 1, 1), ((0, 0), (1, 1), (1, 1))),  # Wan's causal conv (time padded outside)
    ((3, 3, 3), (1, 2, 2), ((2, 0), (1, 1), (1, 1))),  # time padding inside, spatial stride
    ((3, 1, 1), (2, 1, 1), ((0, 0), (0, 0), (0, 0))),  # Wan's temporal downsampling
    ((1, 3, 3), (1, 1, 1), ((0, 0), (1, 1), (1, 1))),  # one time tap
    ((2, 3, 3), (1, 1, 1), ((1, 1), (0, 1), (1, 0))),  # uneven padding
  ],
)
def test_conv3d_as_2d_matches_the_3d_convolution(kernel, stride, padding):
  # The CPU path folds time into channels; XLA's own 3-d convolution is the oracle.
  kx, kk = jax.random.split(jax.random.key(0))
  x = jax.random.normal(kx, (2, 7, 10, 9, 5))
  k = jax.random.normal(kk, (*kernel, 5, 4)) * 0.3
  want = jax.lax.conv_general_dilated(
    x, k, stride, padding, dimension_numbers=("NDHWC", "DHWIO", "NDHWC")
  )
  got = nn._conv3d_folded(x, k, stride, padding)
  assert got.shape == want.shape
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=2e-5)
  conv = nn.Conv(5, 4, kernel, stride=stride, padding=padding, rngs=nnx.Rngs(0))
  conv.kernel[...] = k
  assert nn._fold_time(conv.padding, conv.dilation)  # the tests run on the CPU backend
  np.testing.assert_allclose(
    np.asarray(conv(x)), np.asarray(want) + np.asarray(conv.bias[...]), atol=2e-5, rtol=2e-5
  )


def test_conv3d_names_too_few_frames():
  conv = nn.Conv(3, 2, (3, 3, 3), padding=((0, 0), (1, 1), (1, 1)), rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="2 frames \\(padded\\) are fewer than the kernel's 3"):
    conv(jnp.zeros((1, 2, 4, 4, 3)))


@pytest.mark.parametrize("shape", [(3, 5, 64), (1, 1, 64), (64,)])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
def test_matmul_rounds_a_float32_product_once(dtype, shape):
  """`nn.matmul` (and so `Dense`): low-precision operands give the float32 product of their values
  rounded once to their dtype (NumPy in float64 as the reference); float32 stays a plain matmul."""
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.standard_normal(shape), dtype)
  w = jnp.asarray(rng.standard_normal((64, 24)) / 8, dtype)
  got = nn.matmul(x, w)
  assert got.dtype == dtype and got.shape == (*shape[:-1], 24)
  exact = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
  want = np.asarray(jnp.asarray(exact.astype(np.float32)).astype(dtype), np.float64)
  # Low precision: at most one rounding step of the output dtype away from the exactly rounded
  # product. float32: its own accumulation error over 64 terms.
  ulp = {jnp.bfloat16: 2**-7, jnp.float16: 2**-10, jnp.float32: 1e-5}[dtype]
  np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=ulp, atol=ulp)
  eqn = next(
    e for e in jax.make_jaxpr(nn.matmul)(x, w).jaxpr.eqns if e.primitive.name == "dot_general"
  )
  wide = jax.default_backend() == "cpu" and dtype != jnp.float32
  assert eqn.params["preferred_element_type"] == (jnp.float32 if wide else dtype)
  dense = nn.Dense(64, 24, axes=("embed", "mlp"), rngs=nnx.Rngs(0))
  dense.kernel[...] = w
  dense.bias[...] = jnp.zeros((24,), dtype)
  np.testing.assert_array_equal(np.asarray(dense(x), np.float64), np.asarray(got, np.float64))
