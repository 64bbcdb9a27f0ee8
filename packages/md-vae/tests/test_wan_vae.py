"""Wan causal video VAE: parity with diffusers' AutoencoderKLWan (2.1- and 2.2-like tiny models), real-size key
manifests, chunked memory, configs, errors."""

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
import md_vae
from md_core.testing import fixture_path, load_arrays, load_manifest, repo_root

# LLVM optimisation off: the same numbers (buffer assignment and HLO passes are unchanged) at a third of the
# compile time on the shared CI cores.
_FAST = {"xla_backend_optimization_level": 0}


def _compiled(fn, *args):
  return jax.jit(fn).lower(*args).compile(compiler_options=_FAST)


def _to_md(x):  # torch [B, C, F, H, W] → md [B, F, H, W, C]
  return jnp.asarray(x).transpose(0, 2, 3, 4, 1)


def _to_torch(x):
  return np.asarray(x).transpose(0, 4, 1, 2, 3)


@pytest.fixture(scope="module", params=["wan21", "wan22"])
def case(request):
  name = request.param
  vae = md_vae.load_vae_wan(fixture_path("vae_wan") / name, subfolder=None)
  return name, vae, load_arrays(fixture_path("vae_wan") / f"{name}.npz")


def test_encode_matches_reference(case):
  name, vae, ref = case
  graphdef, state = nnx.split(vae)

  def encode(state, video):
    dist = nnx.merge(graphdef, state).encode(video)
    return dist.mean, dist.logvar

  video = _to_md(ref["video9"])
  mean, logvar = _compiled(encode, state, video)(state, video)
  chex.assert_shape(mean, (1, 3, 2, 3, vae.config.z_dim))
  chex.assert_trees_all_close(_to_torch(mean), ref["mean9"], atol=1e-4, rtol=0)
  chex.assert_trees_all_close(_to_torch(logvar), ref["logvar9"], atol=1e-4, rtol=0)
  # The 5-frame reference video is the start of the 9-frame one: causal chunks give the same first 2 latents.
  chex.assert_trees_all_close(_to_torch(mean[:, :2]), ref["mean5"], atol=1e-4, rtol=0)
  chex.assert_trees_all_close(_to_torch(logvar[:, :2]), ref["logvar5"], atol=1e-4, rtol=0)


def test_decode_matches_reference(case):
  name, vae, ref = case
  graphdef, state = nnx.split(vae)

  def decode(state, latents):
    return nnx.merge(graphdef, state).decode(latents)

  latents = _to_md(ref["latents3"])
  video = _compiled(decode, state, latents)(state, latents)
  chex.assert_shape(video, (1, 9, 16 * vae.config.patch, 24 * vae.config.patch, 3))
  chex.assert_trees_all_close(_to_torch(video), ref["decoded3"], atol=1e-4, rtol=0)
  chex.assert_trees_all_close(_to_torch(video[:, :5]), ref["decoded2"], atol=1e-4, rtol=0)
  frames = md_vae.video_to_uint8(video)
  assert frames.dtype == jnp.uint8 and frames.shape == video.shape
  want = np.round(np.clip(np.asarray(video) * 0.5 + 0.5, 0, 1) * 255)
  np.testing.assert_array_equal(np.asarray(frames), want.astype(np.uint8))


def test_sharded_decode_matches_reference():
  import md_sharding as mds

  mesh = mds.make_mesh(
    mds.MeshConfig(
      ici_data_parallelism=2,
      ici_fsdp_parallelism=2,
      ici_context_parallelism=1,
      ici_tensor_parallelism=2,
    )
  )
  vae = md_vae.load_vae_wan(fixture_path("vae_wan") / "wan21", subfolder=None, mesh=mesh)
  kernel = vae.decoder.mid_block.resnets[0].conv1.kernel[...]  # (3, 3, 3, 8, 8): conv_out → tensor
  assert tuple(kernel.sharding.spec) == (None, None, None, None, "tensor")
  ref = load_arrays(fixture_path("vae_wan") / "wan21.npz")
  graphdef, state = nnx.split(vae)
  latents = jnp.concatenate([_to_md(ref["latents3"])] * 4, axis=0)  # batch 4 over data x fsdp
  batch = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(("data", "fsdp")))
  latents = jax.device_put(latents, batch)
  out = _compiled(lambda s, z: nnx.merge(graphdef, s).decode(z), state, latents)(state, latents)
  for row in range(4):
    chex.assert_trees_all_close(_to_torch(out[row : row + 1]), ref["decoded3"], atol=1e-4, rtol=0)


@pytest.mark.parametrize("name", ["wan21", pytest.param("wan22", marks=pytest.mark.slow)])
def test_tiled_decode_matches_reference(name):
  vae = md_vae.load_vae_wan(fixture_path("vae_wan") / name, subfolder=None)
  ref = load_arrays(fixture_path("vae_wan") / f"{name}.npz")
  graphdef, state = nnx.split(vae)
  tile = 4 * vae.config.spatial_factor

  def decode(state, latents):
    model = nnx.merge(graphdef, state)
    return model.decode(latents, tiled=True, tile_sample_size=tile, tile_sample_stride=tile // 2)

  latents = _to_md(ref["tiled_latents"])
  video = _compiled(decode, state, latents)(state, latents)
  chex.assert_trees_all_close(_to_torch(video), ref["tiled_decoded"], atol=1e-4, rtol=0)
  # The tiles are visible: the whole decode differs where they were blended.
  assert ref["tiled_decode_vs_whole"] > 0.05
  with pytest.raises(ValueError, match="must be multiples of the spatial factor"):
    vae.decode(latents, tiled=True, tile_sample_size=tile + 1)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["wan21", "wan22"])
def test_tiled_encode_matches_reference(name):
  vae = md_vae.load_vae_wan(fixture_path("vae_wan") / name, subfolder=None)
  ref = load_arrays(fixture_path("vae_wan") / f"{name}.npz")
  graphdef, state = nnx.split(vae)

  def encode(state, video):
    dist = nnx.merge(graphdef, state).encode(
      video, tiled=True, tile_sample_size=32, tile_sample_stride=16
    )
    return dist.mean, dist.logvar

  video = _to_md(ref["tiled_video"])
  mean, logvar = _compiled(encode, state, video)(state, video)
  chex.assert_trees_all_close(_to_torch(mean), ref["tiled_mean"], atol=1e-4, rtol=0)
  chex.assert_trees_all_close(_to_torch(logvar), ref["tiled_logvar"], atol=1e-4, rtol=0)
  assert ref["tiled_encode_vs_whole"] > 0.05


@pytest.mark.slow
@pytest.mark.parametrize("name", ["wan21", "wan22"])
def test_short_clip_and_single_frame_match_reference(name):
  vae = md_vae.load_vae_wan(fixture_path("vae_wan") / name, subfolder=None)
  ref = load_arrays(fixture_path("vae_wan") / f"{name}.npz")
  graphdef, state = nnx.split(vae)
  dist = jax.jit(lambda s, x: nnx.merge(graphdef, s).encode(x))(
    state, _to_md(ref["video9"][:, :, :5])
  )
  chex.assert_trees_all_close(_to_torch(dist.mean), ref["mean5"], atol=1e-4, rtol=0)
  video = jax.jit(lambda s, z: nnx.merge(graphdef, s).decode(z))(state, _to_md(ref["latents2"]))
  chex.assert_trees_all_close(_to_torch(video), ref["decoded2"], atol=1e-4, rtol=0)
  # An image (one frame) is the first chunk alone.
  image = jax.jit(lambda s, x: nnx.merge(graphdef, s).encode(x).mean)(
    state, _to_md(ref["video9"][:, :, :5])[:, :1]
  )
  chex.assert_trees_all_close(_to_torch(image), ref["mean5"][:, :, :1], atol=1e-4, rtol=0)


def test_inflated_vae_is_the_still_vae_frame_by_frame():
  # After inflation a clip's latent frame k is the still (one-frame) latent of frame 4k, and a static clip
  # decodes to its frame, as the one-frame path does.
  vae = md_vae.load_vae_wan(fixture_path("vae_wan") / "wan21", subfolder=None)
  md_vae.inflate_wan_vae(vae)
  frames = jnp.asarray(np.random.default_rng(0).uniform(-1, 1, (1, 9, 16, 16, 3)), jnp.float32)
  graphdef, state = nnx.split(vae)
  encode = jax.jit(lambda s, x: nnx.merge(graphdef, s).encode(x).mean)
  decode = jax.jit(lambda s, z: nnx.merge(graphdef, s).decode(z))
  clip = encode(state, frames)
  for k in range(3):
    still = encode(state, frames[:, 4 * k : 4 * k + 1])
    chex.assert_trees_all_close(clip[:, k : k + 1], still, atol=1e-5, rtol=0)
  static = jnp.repeat(frames[:, :1], 9, axis=1)
  out = decode(state, encode(state, static))
  one = decode(state, encode(state, frames[:, :1]))
  chex.assert_trees_all_close(out, jnp.repeat(one, 9, axis=1), atol=1e-5, rtol=0)
  # Not the identity: before inflation the same clip encodes differently.
  plain = md_vae.load_vae_wan(fixture_path("vae_wan") / "wan21", subfolder=None)
  assert float(jnp.abs(plain.encode(frames).mean[:, 1:] - clip[:, 1:]).max()) > 1e-3


def test_inflating_a_wan22_vae_is_refused():
  vae = nnx.eval_shape(lambda: md_vae.WanVAE(md_vae.WAN_VARIANTS["tiny-2.2"], rngs=nnx.Rngs(0)))
  with pytest.raises(ValueError, match="is_residual"):
    md_vae.inflate_wan_vae(vae)


def test_chunked_decode_memory_does_not_grow_with_frames():
  vae = nnx.eval_shape(lambda: md_vae.WanVAE(md_vae.WAN_VARIANTS["tiny"], rngs=nnx.Rngs(0)))
  graphdef, state = nnx.split(vae)  # shapes only: compiled, never run

  def decode(state, latents):
    return nnx.merge(graphdef, state).decode(latents)

  def memory(latent_frames):
    latents = jax.ShapeDtypeStruct((1, latent_frames, 4, 4, 4), jnp.float32)
    return _compiled(decode, state, latents).memory_analysis()

  m9, m33 = memory(3), memory(9)  # 9 and 33 frames
  frame_bytes = 32 * 32 * 3 * 4
  assert m9.output_size_in_bytes == 9 * frame_bytes and m33.output_size_in_bytes == 33 * frame_bytes
  # Only the output grows: temporaries (activations of one chunk, the caches) stay the same.
  assert m33.temp_size_in_bytes <= m9.temp_size_in_bytes + 16 * 1024, (
    m9.temp_size_in_bytes,
    m33.temp_size_in_bytes,
  )


# --- real checkpoints: key manifests --------------------------------------------------------------------------


@pytest.mark.parametrize("version", ["2.1", "2.2"])
def test_manifest_coverage(version):
  manifest = load_manifest(f"vae_wan{version}")
  shapes = {k: v["shape"] for k, v in manifest["tensors"].items()}
  config = md_vae.WanVAEConfig.from_json(
    repo_root() / "tools/configs/wan" / f"vae_wan{version}.json"
  )
  assert config == md_vae.WAN_VARIANTS[f"wan{version}"]
  factory = lambda: md_vae.WanVAE(config, rngs=nnx.Rngs(0))  # noqa: E731
  assert md_core.coverage(shapes, factory, md_vae.vae_wan_convert_key) == []
  params = sum(int(np.prod(s)) for s in shapes.values())
  model = nnx.eval_shape(factory)
  assert sum(v.size for v in jax.tree.leaves(nnx.state(model, nnx.Param))) == params
  # A mis-shaped tensor is named with both shapes.
  shapes["decoder.conv_in.weight"] = [7, *shapes["decoder.conv_in.weight"][1:]]
  (problem,) = md_core.coverage(shapes, factory, md_vae.vae_wan_convert_key)
  assert "'decoder.conv_in.weight'" in problem and "decoder/conv_in/kernel" in problem


def test_original_file_manifest_coverage():
  # Names of the original Wan 2.1 VAE file, checked by the tool against diffusers' own single-file converter.
  manifest = load_manifest("vae_wan2.1_original")
  shapes = {k: v["shape"] for k, v in manifest["tensors"].items()}
  diffusers = load_manifest("vae_wan2.1")["tensors"]
  config = md_vae.WAN_VARIANTS["wan2.1"]
  renamed = {md_vae.wan_original_to_diffusers_name(k, config): v for k, v in shapes.items()}
  assert renamed == {k: v["shape"] for k, v in diffusers.items()}
  factory = lambda: md_vae.WanVAE(config, rngs=nnx.Rngs(0))  # noqa: E731
  assert md_core.coverage(shapes, factory, md_vae.wan_original_keymap(config)) == []
  assert md_vae.wan_original_to_diffusers_name("decoder.upsamples.7.resample.1.weight", config) == (
    "decoder.up_blocks.1.upsamplers.0.resample.1.weight"
  )
  assert md_vae.wan_original_to_diffusers_name("decoder.upsamples.4.shortcut.bias", config) == (
    "decoder.up_blocks.1.resnets.0.conv_shortcut.bias"
  )
  assert (
    md_vae.wan_original_to_diffusers_name("decoder.upsamples.15.residual.0.gamma", config) is None
  )
  with pytest.raises(ValueError, match="Wan 2.1 VAE only"):
    md_vae.load_vae_wan_original("unused.safetensors", config=md_vae.WAN_VARIANTS["wan2.2"])
  # The tiny fixture's weights under the original names load to the same model as the diffusers file.
  tiny = md_vae.WanVAEConfig.from_json(fixture_path("vae_wan") / "wan21" / "config.json")
  original = md_vae.load_vae_wan_original(
    fixture_path("vae_wan") / "wan21_original.safetensors", config=tiny
  )
  diffusers = md_vae.load_vae_wan(fixture_path("vae_wan") / "wan21", subfolder=None)
  chex.assert_trees_all_equal(nnx.state(original, nnx.Param), nnx.state(diffusers, nnx.Param))


def test_real_sizes():
  # Wan 2.1 VAE: 127M parameters (its 508 MB float32 file); Wan 2.2 VAE: 705M (2.8 GB).
  counts = {}
  for version in ("2.1", "2.2"):
    manifest = load_manifest(f"vae_wan{version}")
    counts[version] = sum(int(np.prod(t["shape"])) for t in manifest["tensors"].values())
  assert 126e6 < counts["2.1"] < 128e6 and 704e6 < counts["2.2"] < 706e6, counts
  wan22 = md_vae.WAN_VARIANTS["wan2.2"]
  assert (wan22.spatial_factor, wan22.temporal_factor, wan22.video_channels) == (16, 4, 3)
  assert (md_vae.WAN_VARIANTS["wan2.1"].spatial_factor, md_vae.WAN_VARIANTS["wan2.1"].z_dim) == (
    8,
    16,
  )


def test_convert_key():
  t = md_vae.vae_wan_convert_key
  assert t("encoder.conv_in.weight") == md_core.Target(("encoder", "conv_in", "kernel"), "conv3d")
  assert t("decoder.up_blocks.1.upsamplers.0.resample.1.weight") == md_core.Target(
    ("decoder", "up_blocks", 1, "upsamplers", 0, "resample", "kernel"), "conv2d"
  )
  assert t("decoder.up_blocks.0.upsampler.time_conv.bias") == md_core.Target(
    ("decoder", "up_blocks", 0, "upsampler", "time_conv", "bias")
  )
  assert t("encoder.down_blocks.3.norm1.gamma") == md_core.Target(
    ("encoder", "down_blocks", 3, "norm1", "scale"), "conv2d"
  )
  assert t("encoder.mid_block.attentions.0.norm.gamma") == md_core.Target(
    ("encoder", "mid_block", "attentions", 0, "norm", "scale"), "conv1d"
  )
  assert t("encoder.mid_block.attentions.0.to_qkv.weight").layout == "conv2d"
  assert t("quant_conv.weight") == md_core.Target(("quant_conv", "kernel"), "conv3d")
  for unknown in (
    "encoder.conv_in.running_mean",
    "text_encoder.weight",
    "decoder.norm_out.weight",
    "x",
  ):
    assert t(unknown) is None, unknown


def test_load_from_pipeline_layout_and_bad_checkpoint(tmp_path):
  shutil.copytree(fixture_path("vae_wan") / "wan21", tmp_path / "vae")
  vae = md_vae.load_vae_wan(tmp_path, dtype=jnp.bfloat16)
  assert vae.decoder.conv_in.kernel[...].dtype == jnp.bfloat16
  assert vae.encoder.mid_block.attentions[0].norm.scale[...].shape == (1, 1, 8)
  # bfloat16 end to end: the scan carries bfloat16 caches; the frames stay near the float32 reference (30-odd
  # bfloat16 convs and norms deep).
  ref = load_arrays(fixture_path("vae_wan") / "wan21.npz")
  graphdef, state = nnx.split(vae)
  latents = _to_md(ref["latents3"]).astype(jnp.bfloat16)
  video = _compiled(lambda s, z: nnx.merge(graphdef, s).decode(z), state, latents)(state, latents)
  assert video.dtype == jnp.bfloat16
  err = np.abs(_to_torch(video.astype(jnp.float32)) - ref["decoded3"])
  assert err.mean() < 0.01 and err.max() < 0.15, (err.mean(), err.max())  # the frames' std is 0.15
  src = md_core.open_checkpoint(tmp_path / "vae")
  tensors = {k: np.array(src[k]) for k in src}
  tensors["decoder.conv_out.weight"] = tensors["decoder.conv_out.weight"][:, :2]
  (tmp_path / "vae" / "diffusion_pytorch_model.safetensors").unlink()
  md_core.save_safetensors(tmp_path / "vae" / "diffusion_pytorch_model.safetensors", tensors)
  with pytest.raises(
    md_core.WeightLoadError, match=r"'decoder.conv_out.weight' has shape \(3, 2, 3, 3, 3\)"
  ):
    md_vae.load_vae_wan(tmp_path)


# --- configs, distribution, latent statistics, errors --------------------------------------------------------


def test_config_errors():
  with pytest.raises(
    ValueError, match=r"'temporal_downsample' \(did you mean 'temperal_downsample'\?\)"
  ):
    md_vae.WanVAEConfig.from_dict({"temporal_downsample": [False, True, True]})
  with pytest.raises(ValueError, match=r"attn_scales=\[0.5\] is not supported"):
    md_vae.WanVAEConfig.from_dict({"attn_scales": [0.5]})
  with pytest.raises(ValueError, match="latents_mean has 3 entries, expected z_dim=16"):
    md_vae.WanVAEConfig(latents_mean=(0.0, 0.0, 0.0))
  with pytest.raises(ValueError, match="scale_factor_spatial=8 disagrees .* = 16"):
    md_vae.WanVAEConfig.from_dict({**json.loads(_real_config("2.2")), "scale_factor_spatial": 8})
  with pytest.raises(ValueError, match="not AutoencoderKLWan"):
    md_vae.WanVAEConfig.from_dict({"_class_name": "AutoencoderKL"})
  # Keys the reference ignores at inference are accepted.
  assert (
    md_vae.WanVAEConfig.from_dict({"dropout": 0.1, "clip_output": False}) == md_vae.WanVAEConfig()
  )


def _real_config(version):
  return (repo_root() / "tools/configs/wan" / f"vae_wan{version}.json").read_text()


@pytest.fixture(scope="module")
def tiny():
  # Shapes only: the checks run before any computation.
  return nnx.eval_shape(lambda: md_vae.WanVAE(md_vae.WAN_VARIANTS["tiny"], rngs=nnx.Rngs(0)))


def test_input_errors(tiny):
  with pytest.raises(
    ValueError, match=r"num_frames = 1 \+ 4k; got 6 frames; nearest valid counts: 5 or 9"
  ):
    tiny.encode(jnp.zeros((1, 6, 16, 16, 3)))
  with pytest.raises(ValueError, match=r"got 0 frames; nearest valid counts: 1"):
    tiny.encode(jnp.zeros((1, 0, 16, 16, 3)))
  with pytest.raises(
    ValueError, match=r"multiples of the spatial factor 8; got 20x16 \(try 16x16 or 24x16\)"
  ):
    tiny.encode(jnp.zeros((1, 5, 20, 16, 3)))
  with pytest.raises(ValueError, match=r"3-channel videos .* got 4 channels"):
    tiny.encode(jnp.zeros((1, 5, 16, 16, 4)))
  with pytest.raises(ValueError, match=r"videos \[B, F, H, W, C\]; got shape \(5, 16, 16, 3\)"):
    tiny.encode(jnp.zeros((5, 16, 16, 3)))
  with pytest.raises(
    ValueError, match=r"latents \[B, f, h, w, 4\] .* got shape \(1, 2, 2, 2, 16\)"
  ):
    tiny.decode(jnp.zeros((1, 2, 2, 2, 16)))
  wan22 = nnx.eval_shape(lambda: md_vae.WanVAE(md_vae.WAN_VARIANTS["tiny-2.2"], rngs=nnx.Rngs(0)))
  with pytest.raises(ValueError, match=r"spatial factor 16; got 24x32"):
    wan22.check_video(jnp.zeros((1, 5, 24, 32, 3)))
  with pytest.raises(ValueError, match=r"expected decoded frames \[B, F, H, W, 3\]"):
    md_vae.video_to_uint8(jnp.zeros((1, 2, 4, 4, 12)))


def test_distribution_and_latent_statistics():
  # Wan 2.1's statistics on a tiny model: they need no weights.
  real = md_vae.WAN_VARIANTS["wan2.1"]
  cfg = dataclasses.replace(
    md_vae.WAN_VARIANTS["tiny"],
    z_dim=16,
    latents_mean=real.latents_mean,
    latents_std=real.latents_std,
  )
  vae = nnx.eval_shape(lambda: md_vae.WanVAE(cfg, rngs=nnx.Rngs(0)))
  key = jax.random.key(3)

  @jax.jit
  def run(mean, z):
    dist = md_vae.WanLatentDist(mean, jnp.full_like(mean, jnp.log(0.25)))
    noise = jax.random.normal(key, mean.shape)
    normalized = vae.normalize_latents(z)
    return (
      dist.sample(key),
      noise,
      normalized,
      vae.denormalize_latents(z),
      vae.denormalize_latents(normalized),
    )

  rng = np.random.default_rng(0)
  mean = rng.normal(size=(1, 2, 2, 3, 16)).astype(np.float32)
  z = rng.normal(size=(1, 2, 2, 3, 16)).astype(np.float32)
  sample, noise, normalized, denormalized, roundtrip = run(mean, z)
  chex.assert_trees_all_close(sample, mean + 0.5 * np.asarray(noise), atol=1e-6, rtol=0)
  dist = md_vae.WanLatentDist(mean, mean)
  assert dist.mode() is mean
  # Per-channel statistics as the Wan pipelines apply them.
  m, s = np.asarray(real.latents_mean), np.asarray(real.latents_std)
  chex.assert_trees_all_close(normalized, (z - m) / s, atol=1e-5, rtol=0)
  chex.assert_trees_all_close(denormalized, z * s + m, atol=1e-5, rtol=0)
  chex.assert_trees_all_close(roundtrip, z, atol=1e-5, rtol=0)
