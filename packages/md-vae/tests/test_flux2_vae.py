"""FLUX.2 VAE against diffusers' AutoencoderKLFlux2 and the Klein pipeline's latent path
(tests/fixtures/vae_flux2), key map, real-size manifest, errors."""

import json

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import md_core
import md_vae
from md_core.testing import fixture_path, load_arrays, load_manifest, repo_root


@pytest.fixture(scope="module")
def io():
  return load_arrays(fixture_path("vae_flux2") / "io.npz")


@pytest.fixture(scope="module")
def vae():
  return md_vae.load_vae_flux2(fixture_path("vae_flux2"), progress=False)


def _nhwc(x):
  return jnp.asarray(x).transpose(0, 2, 3, 1)


def _nchw(x):
  return np.asarray(x).transpose(0, 3, 1, 2)


def test_matches_diffusers(io, vae):
  """One jitted program: posterior, reconstruction, decode, and the pipeline's encode / decode paths."""
  assert vae.config.decoder_block_out_channels == (8, 12)
  graphdef, state = nnx.split(vae)

  @jax.jit
  def run(state, image, z, packed):
    m = nnx.merge(graphdef, state)
    post = m.encode(image)
    return dict(
      mean=post.mean,
      logvar=post.logvar,
      recon=m(image),
      decoded=m.decode(z),
      image_latents=m.encode_latents(image),
      packed_latents=md_vae.unpatchify_latents(m.denormalize_latents(packed)),
      packed_decoded=m.decode_latents(packed),
    )

  out = run(state, _nhwc(io["image"]), _nhwc(io["z"]), _nhwc(io["packed"]))
  chex.assert_shape(out["image_latents"], (2, 4, 6, 32))
  for name, value in out.items():
    chex.assert_trees_all_close(_nchw(value), io[name], atol=1e-4, rtol=0)


def test_tiled_matches_diffusers(io, vae):
  """Tiled encode (56x40: full and edge tiles) and decode with diffusers' tiles and blending."""
  graphdef, state = nnx.split(vae)

  @jax.jit
  def run(state, image, z):
    m = nnx.merge(graphdef, state)
    post = m.encode(image, tiled=True)
    return jnp.concatenate([post.mean, post.logvar], -1), m.decode(z, tiled=True)

  moments, decoded = run(state, _nhwc(io["big_image"]), _nhwc(io["big_z"]))
  chex.assert_trees_all_close(_nchw(moments), io["tiled_moments"], atol=1e-4, rtol=0)
  chex.assert_trees_all_close(_nchw(decoded), io["tiled_decoded"], atol=1e-4, rtol=0)


def test_patchify_roundtrip_and_order():
  x = jnp.arange(2 * 4 * 6 * 3, dtype=jnp.float32).reshape(2, 4, 6, 3)
  p = md_vae.patchify_latents(x)
  chex.assert_shape(p, (2, 2, 3, 12))
  # Channel c*4 + dy*2 + dx holds pixel (2i + dy, 2j + dx) of channel c.
  np.testing.assert_array_equal(p[1, 1, 2, 2 * 4 + 1 * 2 + 0], x[1, 3, 4, 2])
  np.testing.assert_array_equal(md_vae.unpatchify_latents(p), x)


def test_normalisation_uses_the_stored_statistics(vae):
  stats = md_core.open_checkpoint(fixture_path("vae_flux2") / "vae")
  mean, var = stats["bn.running_mean"], stats["bn.running_var"]
  assert stats["bn.num_batches_tracked"].dtype == np.int64  # in the file, ignored by the loader
  x = jnp.ones((1, 2, 2, 32))
  want = (1.0 - mean) / np.sqrt(var + 1e-4)
  np.testing.assert_allclose(vae.normalize_latents(x)[0, 0, 0], want, rtol=1e-6)
  np.testing.assert_allclose(vae.denormalize_latents(vae.normalize_latents(x)), x, atol=1e-5)


def test_bf16_load_keeps_statistics_f32(vae):
  half = md_vae.load_vae_flux2(fixture_path("vae_flux2"), dtype=jnp.bfloat16, progress=False)
  assert half.encoder.conv_in.kernel[...].dtype == jnp.bfloat16
  assert half.bn.running_var[...].dtype == jnp.float32


def test_keymap_alone():
  convert = md_vae.vae_flux2_convert_key
  assert convert("bn.running_mean") == md_core.Target(("bn", "running_mean"))
  assert convert("bn.running_var") == md_core.Target(("bn", "running_var"))
  assert convert("bn.num_batches_tracked") is None
  assert convert("quant_conv.weight") == md_core.Target(("quant_conv", "kernel"), "conv2d")
  target = convert("decoder.mid_block.attentions.0.to_out.0.weight")
  assert target == md_core.Target(
    ("decoder", "mid_block", "attentions", 0, "to_out", "kernel"), "linear"
  )
  assert convert("encoder.mid_block.attentions.0.query.weight").path[-2] == "to_q"


def test_manifest_coverage():
  data = load_manifest("vae_flux2")
  shapes = {k: v["shape"] for k, v in data["tensors"].items()}
  assert shapes["bn.running_mean"] == [128]
  cfg = md_vae.FLUX2_VAE_VARIANTS["flux2"]
  assert (
    md_vae.AutoencoderKLFlux2Config.from_json(
      repo_root() / "tools" / "configs" / "flux" / "vae_flux2.json"
    )
    == cfg
  )
  problems = md_core.coverage(
    shapes,
    lambda: md_vae.AutoencoderKLFlux2(cfg, rngs=nnx.Rngs(0)),
    md_vae.vae_flux2_convert_key,
    allow_unused=md_vae.FLUX2_VAE_ALLOW_UNUSED,
  )
  assert problems == []


def test_real_size_shapes():
  """The real VAE under eval_shape: 512x768 images ↔ [1, 32, 48, 128] transformer latents."""
  model = nnx.eval_shape(
    lambda: md_vae.AutoencoderKLFlux2(md_vae.FLUX2_VAE_VARIANTS["flux2"], rngs=nnx.Rngs(0))
  )
  graphdef, state = nnx.split(model)
  image = jax.ShapeDtypeStruct((1, 512, 768, 3), jnp.float32)
  lat = jax.eval_shape(lambda s, x: nnx.merge(graphdef, s).encode_latents(x), state, image)
  assert lat.shape == (1, 32, 48, 128)
  img = jax.eval_shape(lambda s, x: nnx.merge(graphdef, s).decode_latents(x), state, lat)
  assert img.shape == (1, 512, 768, 3)


def test_errors(vae):
  with pytest.raises(
    ValueError, match=r"latents of height and width \(5, 6\) cannot be cut into 2x2 patches"
  ):
    md_vae.patchify_latents(jnp.zeros((1, 5, 6, 8)))
  with pytest.raises(
    ValueError, match=r"images height and width \(18, 18\) must be multiples of 4"
  ):
    vae.encode_latents(jnp.zeros((1, 18, 18, 3)))  # encodable (factor 2) but not patchifiable
  with pytest.raises(ValueError, match=r"patchified latents must be channels-last \[B, H, W, 32\]"):
    vae.decode_latents(jnp.zeros((1, 2, 2, 8)))
  with pytest.raises(ValueError, match=r"must be \[B, h, w, C\*4\]"):
    md_vae.unpatchify_latents(jnp.zeros((1, 2, 2, 6)))
  with pytest.raises(ValueError, match=r"latents must be channels-last \[B, H, W, 8\]"):
    vae.decode(jnp.zeros((1, 8, 4, 4)))
  cfg = json.loads((fixture_path("vae_flux2") / "vae" / "config.json").read_text())
  with pytest.raises(ValueError, match=r"config keys \['shift_factor'\] are not supported"):
    md_vae.AutoencoderKLFlux2Config.from_dict({**cfg, "shift_factor": 0.1})
  with pytest.raises(
    ValueError, match="_class_name='AutoencoderKL', expected 'AutoencoderKLFlux2'"
  ):
    md_vae.AutoencoderKLFlux2Config.from_dict({**cfg, "_class_name": "AutoencoderKL"})
  with pytest.raises(ValueError, match="decoder_block_out_channels=\\[8\\] must have one entry"):
    md_vae.AutoencoderKLFlux2Config.from_dict({**cfg, "decoder_block_out_channels": [8]})
