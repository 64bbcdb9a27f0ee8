"""LTX-2 video VAE against diffusers' outputs (tests/fixtures/vae_ltx2): encode and decode of a tiny model in
the released layout and of a timestep-conditioned one, forced-causal decode, tiled decode and encode, loading
the original single-file names, the real VAE's key manifests, and input errors."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import md_core
from md_core.testing import fixture_path, load_arrays, load_manifest, repo_root
from md_vae import (
  LTX2_VAE_VARIANTS,
  LTX2Tiling,
  LTX2VideoVAE,
  LTX2VideoVAEConfig,
  load_vae_ltx2,
  load_vae_ltx2_original,
  vae_ltx2_convert_key,
  vae_ltx2_original_keymap,
  vae_ltx2_original_to_diffusers,
)

TOL = 1e-4
# The fixture's tiling (tools/fixtures/vae_ltx2.py TILING).
TILING = LTX2Tiling(
  tile_sample_min_height=24, tile_sample_min_width=32, tile_sample_min_num_frames=16,
  tile_sample_stride_height=16, tile_sample_stride_width=24, tile_sample_stride_num_frames=8,
)  # fmt: skip


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
  return {case: load_vae_ltx2(fixture_path("vae_ltx2") / case) for case in ("v2", "cond")}


@pytest.fixture(scope="module")
def refs():
  return {case: load_arrays(fixture_path("vae_ltx2") / f"{case}.npz") for case in ("v2", "cond")}


@pytest.mark.parametrize("case", ("v2", "cond"))
def test_decode_matches_diffusers(vaes, refs, case):
  ref, vae = refs[case], vaes[case]
  t = jnp.asarray(ref["timestep"]) if "timestep" in ref else None
  key = jax.random.key(0) if any(vae.config.decoder_inject_noise) else None
  out = _decode(*nnx.split(vae), _cl(ref["latents"]), t, key)
  chex.assert_trees_all_close(out, _cl(ref["sample"]), atol=TOL, rtol=0)


@pytest.mark.parametrize("case", ("v2", "cond"))
def test_encode_matches_diffusers(vaes, refs, case):
  ref = refs[case]
  mean, logvar = _encode(*nnx.split(vaes[case]), _cl(ref["video"]))
  chex.assert_trees_all_close(
    (mean, logvar), (_cl(ref["mean"]), _cl(ref["logvar"])), atol=TOL, rtol=0
  )


def test_forced_causal_decode_matches_diffusers(vaes, refs):
  ref, vae = refs["v2"], vaes["v2"]
  assert not vae.config.decoder_causal
  # On a module closed over by the jitted function: the override mutates nothing.
  out = jax.jit(lambda z: vae.decode(z, causal=True))(_cl(ref["latents"]))
  chex.assert_trees_all_close(out, _cl(ref["sample_causal"]), atol=TOL, rtol=0)
  assert float(jnp.max(jnp.abs(out - _cl(ref["sample"])))) > 1e-3  # causal=True changed something
  assert all(not m.causal for _, m in nnx.iter_modules(vae.decoder) if hasattr(m, "kernel_t"))


def test_tiled_decode_matches_diffusers(vaes, refs):
  ref, vae = refs["v2"], vaes["v2"]
  graphdef, state = nnx.split(vae)
  fn = jax.jit(lambda s, z: nnx.merge(graphdef, s).decode(z, tiling=TILING))
  out = fn(state, _cl(ref["tiled_latents"]))
  chex.assert_trees_all_close(out, _cl(ref["tiled_sample"]), atol=TOL, rtol=0)


@pytest.mark.slow  # the encoder compiled for 6 tile shapes; ~90 s on 2 loaded cores
def test_tiled_encode_matches_diffusers(vaes, refs):
  ref, vae = refs["v2"], vaes["v2"]
  graphdef, state = nnx.split(vae)

  def fn(s, v):
    dist = nnx.merge(graphdef, s).encode(v, tiling=TILING)
    return dist.mean, dist.logvar

  mean, logvar = jax.jit(fn)(state, _cl(ref["tiled_video"]))
  chex.assert_trees_all_close(
    (mean, logvar), (_cl(ref["tiled_mean"]), _cl(ref["tiled_logvar"])), atol=TOL, rtol=0
  )


@pytest.mark.parametrize("case", ("extra", "defaults"))
def test_configs_counted_as_diffusers_counts_them(case):
  # Per-block options longer than the blocks (tests/fixtures/vae_ltx2_configs): diffusers counts the blocks by
  # the widths and reads only the entries they need (the decoder's from the end); md refused these.
  folder = fixture_path("vae_ltx2_configs") / case
  ref = load_arrays(fixture_path("vae_ltx2_configs") / f"{case}.npz")
  vae = load_vae_ltx2(folder)
  mean, logvar = _encode(*nnx.split(vae), _cl(ref["video"]))
  chex.assert_trees_all_close(
    (mean, logvar), (_cl(ref["mean"]), _cl(ref["logvar"])), atol=TOL, rtol=0
  )
  out = _decode(*nnx.split(vae), _cl(ref["latents"]), None, None)
  chex.assert_trees_all_close(out, _cl(ref["sample"]), atol=TOL, rtol=0)


def test_original_single_file_loads_the_same_weights(vaes):
  cfg = vaes["v2"].config
  vae = load_vae_ltx2_original(
    fixture_path("vae_ltx2") / "v2" / "ltx-2-tiny.safetensors", config=cfg
  )
  chex.assert_trees_all_equal(nnx.state(vae), nnx.state(vaes["v2"]))


def test_latent_statistics_are_loaded(vaes):
  vae = vaes["v2"]
  stats = md_core.open_checkpoint(fixture_path("vae_ltx2") / "v2" / "vae")
  np.testing.assert_array_equal(vae.latents_std[...], stats["latents_std"])
  z = jnp.asarray(np.random.default_rng(0).standard_normal((1, 2, 2, 2, 8)), jnp.float32)
  chex.assert_trees_all_close(
    vae.denormalize_latents(vae.normalize_latents(z)), z, atol=1e-6, rtol=0
  )
  mean, std = stats["latents_mean"], stats["latents_std"]
  want = (z - mean.reshape(1, 1, 1, 1, -1)) / std.reshape(1, 1, 1, 1, -1)
  chex.assert_trees_all_close(vae.normalize_latents(z), want, atol=1e-6, rtol=0)


def test_convert_keys_alone():
  T = md_core.Target
  ck = vae_ltx2_convert_key
  assert ck("decoder.up_blocks.2.conv_in.conv_shortcut.weight") == T(
    ("decoder", "up_blocks", 2, "conv_in", "conv_shortcut", "conv", "kernel"), "conv3d"
  )
  assert ck("decoder.up_blocks.2.conv_in.conv_shortcut.bias").path[-3:] == (
    "conv_shortcut", "conv", "bias",
  )  # fmt: skip
  assert ck("decoder.up_blocks.2.conv_in.conv_shortcut.conv.weight") is None
  assert ck("encoder.down_blocks.1.downsamplers.0.conv.conv.weight").layout == "conv3d"
  assert ck("latents_mean") == T(("latents_mean",))
  o = vae_ltx2_original_to_diffusers
  assert o("vae.encoder.down_blocks.8.res_blocks.1.conv2.conv.bias") == (
    "encoder.mid_block.resnets.1.conv2.conv.bias"
  )
  assert o("vae.decoder.up_blocks.6.res_blocks.0.norm3.weight") == (
    "decoder.up_blocks.2.resnets.0.norm3.weight"
  )
  assert o("vae.per_channel_statistics.std-of-means") == "latents_std"
  assert o("audio_vae.per_channel_statistics.mean-of-means") is None
  assert vae_ltx2_original_keymap("vae.decoder.up_blocks.1.conv.conv.weight").path == (
    "decoder", "up_blocks", 0, "upsamplers", 0, "conv", "conv", "kernel",
  )  # fmt: skip


def _manifest(name):
  data = load_manifest(name)
  return {k: v["shape"] for k, v in data["tensors"].items()}


def test_real_vae_is_covered():
  cfg = LTX2VideoVAEConfig.from_json(repo_root() / "tools/configs/ltx/ltx2_vae.json")
  assert cfg == LTX2_VAE_VARIANTS["2.0"]
  assert (cfg.spatial_ratio, cfg.temporal_ratio) == (32, 8)
  model = nnx.eval_shape(lambda: LTX2VideoVAE(cfg, rngs=nnx.Rngs(0)))
  assert md_core.coverage(_manifest("ltx2_vae"), model, vae_ltx2_convert_key) == []
  original = {
    k: v for k, v in _manifest("ltx2_vae_original").items() if vae_ltx2_original_keymap(k)
  }
  dropped = set(_manifest("ltx2_vae_original")) - set(original)
  assert dropped == {f"vae.per_channel_statistics.{s}" for s in ("channel", "mean-of-stds")}
  assert md_core.coverage(original, model, vae_ltx2_original_keymap) == []


def test_input_errors(vaes):
  vae = nnx.eval_shape(lambda: LTX2VideoVAE(LTX2_VAE_VARIANTS["2.0"], rngs=nnx.Rngs(0)))
  with pytest.raises(ValueError, match=r"LTX-2 video VAE cannot encode.*frames=12 is not 1 \+ 8k "
                     r"\(nearest: 9 or 17\)"):  # fmt: skip
    vae.check_video(jnp.zeros((1, 12, 64, 64, 3)))
  with pytest.raises(ValueError, match=r"width=80 is not a multiple of 32 \(nearest: 64 or 96\)"):
    vae.check_video(jnp.zeros((1, 9, 64, 80, 3)))
  vae.check_video(jnp.zeros((1, 17, 64, 96, 3)))
  with pytest.raises(ValueError, match=r"latent_channels=128\], got \(1, 2, 2, 2, 16\)"):
    vae.decode(jnp.zeros((1, 2, 2, 2, 16)))
  with pytest.raises(ValueError, match="not timestep-conditioned: pass no timestep"):
    vae.decode(jnp.zeros((1, 2, 2, 2, 128)), 0.05)
  cond = vaes["cond"]
  with pytest.raises(ValueError, match="LTX-2 video VAE decoder is timestep-conditioned"):
    cond.decode(jnp.zeros((1, 2, 2, 2, 8)), key=jax.random.key(0))
  with pytest.raises(ValueError, match="injects noise: pass key="):
    cond.decode(jnp.zeros((1, 2, 2, 2, 8)), 0.05)
  with pytest.raises(
    ValueError, match=r"tile_sample_stride_width=20 is not a positive multiple of 32"
  ):
    vae.decode(jnp.zeros((1, 2, 2, 2, 128)), tiling=LTX2Tiling(tile_sample_stride_width=20))
  with pytest.raises(
    ValueError, match=r"stride_num_frames=24 exceeds tile_sample_min_num_frames=16"
  ):
    vae.decode(jnp.zeros((1, 2, 2, 2, 128)), tiling=LTX2Tiling(tile_sample_stride_num_frames=24))
  with pytest.raises(ValueError, match=r"keys \['foo'\] are not supported"):
    LTX2VideoVAEConfig.from_dict({"foo": 1})
  with pytest.raises(ValueError, match=r"AutoencoderKLLTXVideo.*md_vae.LTXVideoVAEConfig"):
    LTX2VideoVAEConfig.from_dict({"_class_name": "AutoencoderKLLTXVideo"})
  with pytest.raises(ValueError, match="decoder_spatial_padding_mode='circular' not supported"):
    LTX2VideoVAEConfig(decoder_spatial_padding_mode="circular")
  with pytest.raises(ValueError, match=r"upsample_type \['conv'\] not supported"):
    LTX2VideoVAEConfig(upsample_type=("conv", "spatial", "spatial"))
  # One down block is fine: the mid block takes layers_per_block[-1], as in diffusers.
  LTX2VideoVAEConfig(block_out_channels=(8,))
  with pytest.raises(
    ValueError,
    match=r"6 down blocks .*need more entries in: layers_per_block=\(4, 6, 6, 2, 2\) has 5, needs 6",
  ):
    LTX2VideoVAEConfig(block_out_channels=(8,) * 6)
  with pytest.raises(ValueError, match=r"upsample_factor=\(2, 2\) has 2, needs 3"):
    LTX2VideoVAEConfig(upsample_factor=(2, 2))
  with pytest.raises(ValueError, match=r"decoder_layers_per_block=\(5, 5, 5\) has 3, needs 4"):
    LTX2VideoVAEConfig(decoder_layers_per_block=(5, 5, 5))


def test_missing_key_is_named(tmp_path):
  src = fixture_path("vae_ltx2") / "v2" / "vae"
  (tmp_path / "vae").mkdir()
  (tmp_path / "vae" / "config.json").write_text((src / "config.json").read_text())
  ckpt = md_core.open_checkpoint(src)
  from safetensors.numpy import save_file

  tensors = {k: np.asarray(ckpt[k]) for k in ckpt.keys() if k != "decoder.conv_out.conv.bias"}
  save_file(tensors, str(tmp_path / "vae" / "diffusion_pytorch_model.safetensors"))
  with pytest.raises(Exception, match=r"decoder/conv_out/conv/bias"):
    load_vae_ltx2(tmp_path)


@pytest.mark.slow  # traces the full-size encoder and decoder for 8 tile shapes each; ~15 s
def test_real_size_tiled_shapes():
  # The released VAE, abstractly: 121 frames of 512 x 768 through the default tiling (2 x 2 tiles of 512
  # every 448 pixels, 16-frame chunks every 8), both ways.
  model = nnx.eval_shape(lambda: LTX2VideoVAE(LTX2_VAE_VARIANTS["2.0"], rngs=nnx.Rngs(0)))
  graphdef, state = nnx.split(model)
  z = jax.ShapeDtypeStruct((1, 16, 16, 24, 128), jnp.bfloat16)
  out = jax.eval_shape(lambda s, z: nnx.merge(graphdef, s).decode(z, tiling=True), state, z)
  assert (out.shape, out.dtype) == ((1, 121, 512, 768, 3), jnp.bfloat16)
  video = jax.ShapeDtypeStruct((1, 121, 512, 768, 3), jnp.bfloat16)
  dist = jax.eval_shape(lambda s, v: nnx.merge(graphdef, s).encode(v, tiling=True), state, video)
  assert dist.mean.shape == dist.logvar.shape == (1, 16, 16, 24, 128)
