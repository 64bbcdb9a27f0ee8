"""AutoencoderKL against diffusers (tests/fixtures/vae_kl, tools/fixtures/vae_kl.py)."""

import dataclasses
import json
import shutil

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import md_core
import md_sharding as mds
import md_vae
from md_core.testing import fixture_path, load_arrays, load_manifest, repo_root

ATOL = 1e-4
nhwc, nchw = md_vae.nchw_to_nhwc, md_vae.nhwc_to_nchw


def _jit(model, method, *args, **kwargs):
  graphdef, state = nnx.split(model)
  fn = lambda s, *a: getattr(nnx.merge(graphdef, s), method)(*a, **kwargs)  # noqa: E731
  return jax.jit(fn)(state, *args)


@pytest.fixture(scope="module")
def sd():
  return md_vae.load_vae_kl(fixture_path("vae_kl") / "sd", progress=False), load_arrays(
    fixture_path("vae_kl") / "sd.npz"
  )


@pytest.fixture(scope="module")
def flux():
  return md_vae.load_vae_kl(fixture_path("vae_kl") / "flux", progress=False), load_arrays(
    fixture_path("vae_kl") / "flux.npz"
  )


def _encode_decode(model, ref):
  graphdef, state = nnx.split(model)

  @jax.jit
  def run(state, image, z):
    vae = nnx.merge(graphdef, state)
    post = vae.encode(image)
    # One decoder pass for both: the posterior's mode (a reconstruction) and the given latents.
    images = vae.decode(jnp.concatenate([post.mode(), z]))
    return post, images

  return run(state, nhwc(ref["image"]), nhwc(ref["z"]))


@pytest.fixture(scope="module")
def flux_run(flux):
  return _encode_decode(*flux)


@pytest.mark.parametrize("which", ["sd", "flux"])
def test_encode_decode_match_diffusers(which, request):
  model, ref = request.getfixturevalue(which)
  post, images = (
    request.getfixturevalue("flux_run") if which == "flux" else _encode_decode(model, ref)
  )
  chex.assert_trees_all_close(nchw(post.mean), ref["mean"], atol=ATOL, rtol=0)
  chex.assert_trees_all_close(nchw(post.logvar), ref["logvar"], atol=ATOL, rtol=0)
  chex.assert_trees_all_close(nchw(images[:2]), ref["recon"], atol=ATOL, rtol=0)
  chex.assert_trees_all_close(nchw(images[2:]), ref["decoded"], atol=ATOL, rtol=0)


def test_tiled_decode_matches_diffusers(sd):
  model, ref = sd
  # 28 latents in 16-latent tiles (32 px): full and partial edge tiles, blended both ways.
  tiled = _jit(model, "decode", nhwc(ref["big_z"]), tiled=True)
  chex.assert_trees_all_close(nchw(tiled), ref["tiled_decoded"], atol=ATOL, rtol=0)
  # Tiles really were cut: the untiled reference differs.
  assert float(np.max(np.abs(ref["tiled_decoded"] - ref["untiled_decoded"]))) > 1e-3


@pytest.mark.slow
def test_tiled_encode_matches_diffusers(sd):
  model, ref = sd
  # 56 px images in 32 px tiles (four tile shapes, four more encoder compiles: slow on CPU).
  post = _jit(model, "encode", nhwc(ref["big_image"]), tiled=True)
  moments = jnp.concatenate([post.mean, post.logvar], axis=-1)
  chex.assert_trees_all_close(nchw(moments), ref["tiled_moments"], atol=ATOL, rtol=0)


def test_batch_slicing_and_attention_chunks_match(sd):
  model, ref = sd
  # Mid-block attention at 16x16 latents with at most 48 query positions: chunks of 2 rows (the largest
  # divisor of 16 with 16 * rows <= 48), eight of them, each one lax.map step.
  config = dataclasses.replace(model.config, attention_query_chunk=48)
  chunked = nnx.eval_shape(lambda: md_vae.AutoencoderKL(config, rngs=nnx.Rngs(0)))
  nnx.update(chunked, nnx.state(model))
  sliced = _jit(chunked, "decode", nhwc(ref["z"]), batch_slice=1)
  chex.assert_trees_all_close(nchw(sliced), ref["decoded"], atol=ATOL, rtol=0)
  with pytest.raises(ValueError, match="batch_slice=3 must divide the batch size 4"):
    chunked.decode(jnp.zeros((4, 16, 16, 4)), batch_slice=3)


def test_posterior_sample_kl_and_scaling(flux, flux_run):
  model, _ = flux
  post, _ = flux_run
  key = jax.random.key(3)
  eps = jax.random.normal(key, post.mean.shape)
  chex.assert_trees_all_close(
    post.sample(key), post.mean + jnp.exp(0.5 * post.logvar) * eps, atol=1e-6, rtol=0
  )
  mean, logvar = np.asarray(post.mean, np.float64), np.asarray(post.logvar, np.float64)
  kl = 0.5 * np.sum(mean**2 + np.exp(logvar) - 1 - logvar, axis=(1, 2, 3))
  chex.assert_trees_all_close(post.kl(), kl.astype(np.float32), atol=1e-3, rtol=1e-5)
  z = post.mode()
  scaled = model.scale_latents(z)
  chex.assert_trees_all_close(scaled, (z - 0.1159) * 0.3611, atol=1e-6, rtol=0)
  chex.assert_trees_all_close(model.unscale_latents(scaled), z, atol=1e-5, rtol=0)


def test_force_upcast_computes_in_f32(sd):
  model, ref = sd
  bf16 = md_vae.load_vae_kl(fixture_path("vae_kl") / "sd", dtype=jnp.bfloat16, progress=False)
  assert bf16.decoder.conv_in.kernel[...].dtype == jnp.bfloat16
  out = _jit(bf16, "decode", nhwc(ref["z"]).astype(jnp.bfloat16))
  assert out.dtype == jnp.float32  # force_upcast (the default) keeps activations in f32
  # Only the weights' rounding separates it from the f32 reference.
  chex.assert_trees_all_close(nchw(out), ref["decoded"], atol=0.1, rtol=0)


def test_legacy_attention_names_load(tmp_path, sd):
  _, ref = sd
  src = fixture_path("vae_kl") / "sd" / "vae"
  dst = tmp_path / "vae"
  shutil.copytree(src, dst)
  ckpt = md_core.open_checkpoint(src)
  legacy = {"to_q": "query", "to_k": "key", "to_v": "value", "to_out.0": "proj_attn"}
  tensors = {}
  for k in ckpt:
    name = k
    for new, old in legacy.items():
      name = name.replace(f".attentions.0.{new}.", f".attentions.0.{old}.")
    tensors[name] = np.array(ckpt[k])
  assert any(".attentions.0.query.weight" in k for k in tensors)
  for f in dst.glob("*.safetensors"):
    f.unlink()
  md_core.save_safetensors(dst / "diffusion_pytorch_model.safetensors", tensors)
  model = md_vae.load_vae_kl(dst, subfolder=None, progress=False)
  # The same parameters as from the current names (whose decode the parity test checks).
  chex.assert_trees_all_equal(nnx.state(model), nnx.state(sd[0]))


def test_convert_key_alone():
  f = md_vae.vae_kl_convert_key
  assert f("encoder.down_blocks.1.resnets.0.conv_shortcut.weight") == md_core.Target(
    ("encoder", "down_blocks", 1, "resnets", 0, "conv_shortcut", "kernel"), "conv2d"
  )
  assert f("decoder.up_blocks.0.upsamplers.0.conv.bias").path == (
    "decoder",
    "up_blocks",
    0,
    "upsamplers",
    0,
    "conv",
    "bias",
  )
  assert f("encoder.mid_block.attentions.0.group_norm.weight").path[-2:] == ("group_norm", "scale")
  want = md_core.Target(("decoder", "mid_block", "attentions", 0, "to_out", "kernel"), "linear")
  assert f("decoder.mid_block.attentions.0.to_out.0.weight") == want
  assert f("decoder.mid_block.attentions.0.proj_attn.weight") == want
  assert f("decoder.mid_block.attentions.0.query.bias").path[-2:] == ("to_q", "bias")
  assert f("quant_conv.weight") == md_core.Target(("quant_conv", "kernel"), "conv2d")
  assert f("decoder.conv_norm_out.weight").path == ("decoder", "conv_norm_out", "scale")
  assert f("model.diffusion_model.x.weight") is None
  assert f("encoder.conv_in.running_mean") is None


def _config(name):
  d = json.loads((repo_root() / "tools" / "configs" / "sd" / f"{name}.json").read_text())
  d.pop("_comment")
  return md_vae.AutoencoderKLConfig.from_dict(d)


@pytest.mark.parametrize(
  "manifest,config,variant",
  [
    ("vae_sd15", "vae_sd15", "sd"),
    ("vae_sd15_legacy", "vae_sd15", "sd"),
    ("vae_sd21", "vae_sd21", "sd2"),
    ("vae_sdxl", "vae_sdxl", "sdxl"),
    ("vae_flux", "vae_flux", "flux"),
  ],
)
def test_real_checkpoint_key_manifests(manifest, config, variant):
  cfg = _config(config)
  assert cfg == md_vae.KL_VARIANTS[variant]
  data = load_manifest(manifest)
  shapes = {k: v["shape"] for k, v in data["tensors"].items()}
  assert md_core.coverage(shapes, _abstract(cfg), md_vae.vae_kl_convert_key) == []


_ABSTRACT = {}


def _abstract(cfg):
  """One abstract model per parameter layout (SD 1.x, 2.x and SDXL VAEs share one)."""
  layout = (cfg.block_out_channels, cfg.layers_per_block, cfg.latent_channels, cfg.use_quant_conv)
  if layout not in _ABSTRACT:
    _ABSTRACT[layout] = nnx.eval_shape(lambda: md_vae.AutoencoderKL(cfg, rngs=nnx.Rngs(0)))
  return _ABSTRACT[layout]


def test_config_errors():
  with pytest.raises(ValueError, match=r"config keys \['norm_type'\] are not supported"):
    md_vae.AutoencoderKLConfig.from_dict({"norm_type": "spatial"})
  with pytest.raises(ValueError, match="_class_name='AutoencoderKLWan', expected 'AutoencoderKL'"):
    md_vae.AutoencoderKLConfig.from_dict({"_class_name": "AutoencoderKLWan"})
  with pytest.raises(ValueError, match=r"down_block_types=\['AttnDownEncoderBlock2D'\]"):
    md_vae.AutoencoderKLConfig(
      block_out_channels=(32,), down_block_types=("AttnDownEncoderBlock2D",)
    )
  with pytest.raises(ValueError, match="norm_num_groups=32 must divide block_out_channels 8"):
    md_vae.AutoencoderKLConfig(block_out_channels=(8, 16))
  # Missing keys take diffusers' defaults; a list sample_size reads as square.
  cfg = md_vae.AutoencoderKLConfig.from_dict({"sample_size": [64, 64]})
  assert cfg.sample_size == 64 and cfg.block_out_channels == (64,) and cfg.downscale == 1


def test_input_errors():
  tiny = md_vae.KL_VARIANTS["tiny"]
  model = nnx.eval_shape(lambda: md_vae.AutoencoderKL(tiny, rngs=nnx.Rngs(0)))
  with pytest.raises(
    ValueError, match=r"height and width \(33, 32\) must be multiples of the VAE factor 2"
  ):
    model.encode(jnp.zeros((1, 33, 32, 3)))
  with pytest.raises(ValueError, match=r"images must be channels-last \[B, H, W, 3\]"):
    model.encode(jnp.zeros((1, 3, 32, 32)))
  with pytest.raises(ValueError, match=r"latents must be channels-last \[B, H, W, 4\]"):
    model.decode(jnp.zeros((1, 4, 8, 8)))


def test_missing_component_and_truncated_file(tmp_path):
  with pytest.raises(FileNotFoundError, match="checkpoint has no component 'vae'"):
    md_vae.load_vae_kl(fixture_path("vae_kl") / "sd" / "vae", progress=False)
  dst = tmp_path / "vae"
  shutil.copytree(fixture_path("vae_kl") / "sd" / "vae", dst)
  weights = dst / "diffusion_pytorch_model.safetensors"
  weights.write_bytes(weights.read_bytes()[:-100])
  with pytest.raises(
    md_core.SafetensorsError, match=r"diffusion_pytorch_model.safetensors: .*truncated"
  ):
    md_vae.load_vae_kl(dst, subfolder=None, progress=False)


def _set_mesh(mesh):
  return jax.set_mesh(mesh) if hasattr(jax, "set_mesh") else jax.sharding.use_mesh(mesh)


def test_sharded_decode_matches_single_device(sd):
  model, ref = sd
  mesh = mds.make_mesh(
    mds.MeshConfig(
      ici_data_parallelism=2,
      ici_fsdp_parallelism=2,
      ici_context_parallelism=1,
      ici_tensor_parallelism=2,
    )
  )
  sharded = md_vae.load_vae_kl(fixture_path("vae_kl") / "sd", mesh=mesh, progress=False)
  kernel = sharded.decoder.mid_block.resnets[0].conv1.kernel[
    ...
  ]  # (3, 3, 16, 16): conv_out → tensor
  assert tuple(kernel.sharding.spec) == (None, None, None, "tensor")
  z = jnp.concatenate([nhwc(ref["z"]), -nhwc(ref["z"])], axis=0)  # batch 4 over data x fsdp
  single = _jit(model, "decode", z)
  with _set_mesh(mesh):
    out = _jit(sharded, "decode", z)
  assert out.sharding.spec[0] in (("data", "fsdp"), "data")
  chex.assert_trees_all_close(out, single, atol=1e-5, rtol=0)
  chex.assert_trees_all_close(nchw(out[:2]), ref["decoded"], atol=ATOL, rtol=0)
