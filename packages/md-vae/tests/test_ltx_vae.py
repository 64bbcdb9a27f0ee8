"""LTX-Video VAE against diffusers' outputs (tests/fixtures/vae_ltx): encode and decode of 0.9.0-, 0.9.1- and
0.9.5-like tiny models, noise injection, latent statistics, the real VAEs' key manifests, and input errors."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import md_core
import md_vae
from md_core.testing import fixture_path, load_arrays, load_manifest, repo_root
from md_vae import (
  LTX_VAE_VARIANTS,
  LTXVideoVAE,
  LTXVideoVAEConfig,
  load_vae_ltx,
  vae_ltx_convert_key,
)

CASES = ("v090", "v091", "v095")
TOL = 1e-4


def _cl(x):  # [B, C, F, H, W] → [B, F, H, W, C]
  return jnp.asarray(x).transpose(0, 2, 3, 4, 1)


@jax.jit
def _encode(graphdef, state, video):
  dist = nnx.merge(graphdef, state).encode(video)
  return dist.mean, dist.logvar


@jax.jit
def _decode(graphdef, state, latents, t, key):
  return nnx.merge(graphdef, state).decode(latents, t, key=key)


@pytest.fixture(scope="module")
def vaes():
  return {case: load_vae_ltx(fixture_path("vae_ltx") / case) for case in CASES}


@pytest.mark.parametrize("case", CASES)
def test_decode_matches_diffusers(vaes, case):
  ref = load_arrays(fixture_path("vae_ltx") / f"{case}.npz")
  vae = vaes[case]
  t = jnp.asarray(ref["timestep"]) if "timestep" in ref else None
  key = jax.random.key(0) if any(vae.config.decoder_inject_noise) else None
  out = _decode(*nnx.split(vae), _cl(ref["latents"]), t, key)
  chex.assert_trees_all_close(out, _cl(ref["sample"]), atol=TOL, rtol=0)


@pytest.mark.parametrize("case", ("v090", "v095"))
def test_encode_matches_diffusers(vaes, case):
  ref = load_arrays(fixture_path("vae_ltx") / f"{case}.npz")
  mean, logvar = _encode(*nnx.split(vaes[case]), _cl(ref["video"]))
  chex.assert_trees_all_close(
    (mean, logvar), (_cl(ref["mean"]), _cl(ref["logvar"])), atol=TOL, rtol=0
  )


def test_latent_statistics_are_loaded(vaes):
  vae = vaes["v090"]
  stats = md_core.open_checkpoint(fixture_path("vae_ltx") / "v090" / "vae")
  np.testing.assert_array_equal(vae.latents_mean[...], stats["latents_mean"])
  z = jnp.asarray(np.random.default_rng(0).standard_normal((1, 2, 2, 2, 8)), jnp.float32)
  chex.assert_trees_all_close(
    vae.denormalize_latents(vae.normalize_latents(z)), z, atol=1e-6, rtol=0
  )


@pytest.mark.slow  # three more decoder runs; ~40 s on 2 loaded cores
def test_noise_injection_uses_the_key(vaes):
  vae = vaes["v091"]
  graphdef, state = nnx.split(vae)
  z, t = jnp.ones((1, 2, 2, 2, 8)), jnp.asarray([0.05])
  base = _decode(graphdef, state, z, t, jax.random.key(0))
  noisy = jax.tree.map(lambda x: x, state)
  scale = noisy["decoder"]["up_blocks"][0]["resnets"][0]["per_channel_scale1"]
  scale.set_value(jnp.full(scale.get_value().shape, 0.5))
  a = _decode(graphdef, noisy, z, t, jax.random.key(0))
  b = _decode(graphdef, noisy, z, t, jax.random.key(1))
  assert float(jnp.max(jnp.abs(a - base))) > 1e-3
  assert float(jnp.max(jnp.abs(a - b))) > 1e-3
  chex.assert_trees_all_close(a, _decode(graphdef, noisy, z, t, jax.random.key(0)))


def test_convert_key_alone():
  T = md_core.Target
  ck = vae_ltx_convert_key
  assert ck("encoder.down_blocks.0.resnets.1.conv1.conv.weight") == T(
    ("encoder", "down_blocks", 0, "resnets", 1, "conv1", "conv", "kernel"), "conv3d"
  )
  assert ck("encoder.down_blocks.1.downsamplers.0.conv.conv.bias") == T(
    ("encoder", "down_blocks", 1, "downsamplers", 0, "conv", "conv", "bias")
  )
  assert ck("decoder.up_blocks.0.time_embedder.timestep_embedder.linear_1.weight") == T(
    ("decoder", "up_blocks", 0, "time_embedder", "timestep_embedder", "linear_1", "kernel"),
    "linear",
  )
  assert ck("encoder.down_blocks.0.conv_out.norm3.weight").path[-1] == "scale"
  assert ck("decoder.timestep_scale_multiplier") == T(("decoder", "timestep_scale_multiplier"))
  assert ck("latents_std") == T(("latents_std",))
  assert ck("decoder.mid_block.resnets.0.per_channel_scale2") == T(
    ("decoder", "mid_block", "resnets", 0, "per_channel_scale2")
  )
  assert ck("text_encoder.weight") is None


@pytest.mark.parametrize("name", ("0.9.0", "0.9.1", "0.9.5"))
def test_real_vaes_are_covered(name):
  cfg = LTXVideoVAEConfig.from_json(repo_root() / f"tools/configs/ltx/ltx_video_{name}_vae.json")
  assert cfg == LTX_VAE_VARIANTS[name]
  assert (cfg.spatial_ratio, cfg.temporal_ratio) == (32, 8)
  data = load_manifest(f"ltx_vae_{name}")
  manifest = {k: v["shape"] for k, v in data["tensors"].items()}
  model = nnx.eval_shape(lambda: LTXVideoVAE(cfg, rngs=nnx.Rngs(0)))
  assert md_core.coverage(manifest, model, vae_ltx_convert_key) == []


def test_input_errors():
  vae = nnx.eval_shape(lambda: LTXVideoVAE(LTX_VAE_VARIANTS["0.9.1"], rngs=nnx.Rngs(0)))
  with pytest.raises(ValueError, match=r"frames=10 is not 1 \+ 8k \(nearest: 9 or 17\)"):
    vae.check_video(jnp.zeros((1, 10, 64, 64, 3)))
  with pytest.raises(ValueError, match=r"height=48 is not a multiple of 32 \(nearest: 32 or 64\)"):
    vae.check_video(jnp.zeros((1, 9, 48, 64, 3)))
  vae.check_video(jnp.zeros((1, 9, 64, 96, 3)))
  with pytest.raises(ValueError, match=r"latent_channels=128\], got \(1, 2, 2, 2, 16\)"):
    vae.decode(jnp.zeros((1, 2, 2, 2, 16)), 0.05, key=jax.random.key(0))
  with pytest.raises(ValueError, match="pass timestep="):
    vae.decode(jnp.zeros((1, 2, 2, 2, 128)), key=jax.random.key(0))
  with pytest.raises(ValueError, match="injects noise"):
    vae.decode(jnp.zeros((1, 2, 2, 2, 128)), 0.05)
  with pytest.raises(ValueError, match=r"keys \['foo'\] are not supported"):
    LTXVideoVAEConfig.from_dict({"foo": 1})


def test_original_names_alone():
  o = md_vae.vae_ltx_original_to_diffusers
  assert o("vae.decoder.up_blocks.2.res_blocks.0.conv1.conv.weight", "0.9.1") == (
    "decoder.up_blocks.0.resnets.0.conv1.conv.weight"
  )
  assert o("vae.decoder.up_blocks.4.conv_shortcut.weight", "0.9.0") == (
    "decoder.up_blocks.2.conv_in.conv_shortcut.conv.weight"
  )
  assert o("vae.decoder.last_scale_shift_table", "0.9.1") == "decoder.scale_shift_table"
  assert o("vae.encoder.down_blocks.8.res_blocks.1.norm3.norm.bias", "0.9.5") == (
    "encoder.mid_block.resnets.1.norm3.bias"
  )
  assert o("vae.per_channel_statistics.std-of-means", "0.9.0") == "latents_std"
  assert o("model.diffusion_model.proj_out.weight", "0.9.0") is None


@pytest.mark.parametrize("name", ("0.9.0", "0.9.1", "0.9.5"))
def test_real_single_file_vaes_are_covered(name):
  data = load_manifest(f"ltx_vae_{name}_original")

  class Shapes(dict):
    def shape(self, key):
      return tuple(self[key])

  manifest = Shapes({k: v["shape"] for k, v in data["tensors"].items()})
  assert md_vae.vae_ltx_original_version(manifest) == name
  model = nnx.eval_shape(lambda: LTXVideoVAE(LTX_VAE_VARIANTS[name], rngs=nnx.Rngs(0)))
  keymap = md_vae.vae_ltx_original_keymap(name)
  allow = md_vae.VAE_LTX_ORIGINAL_ALLOW_UNUSED
  assert md_core.coverage(manifest, model, keymap, allow_unused=allow) == []


def test_original_single_file_loads_to_the_same_weights(vaes):
  path = fixture_path("vae_ltx") / "v090" / "ltxv-tiny.safetensors"
  vae = md_vae.load_vae_ltx_original(path, config=vaes["v090"].config, version="0.9.0")
  chex.assert_trees_all_equal(nnx.state(vae), nnx.state(vaes["v090"]))
