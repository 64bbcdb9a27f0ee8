"""LTX latent upsamplers: parity with diffusers' models and the latent-upsample pipelines' step, loaders for
the diffusers folder and original single files, key maps against the real upsamplers' manifests, errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import md_core
from md_core.testing import fixture_path, load_arrays, load_manifest, repo_root
from md_ltx._upsampler import (
  VARIANTS,
  LatentUpsampler,
  LatentUpsamplerConfig,
  _temporal_shuffle,
  adain_filter_latent,
  binomial_kernel,
  blur_downsample,
  pixel_shuffle,
  tone_map_latents,
  upsample_latents,
  upsample_latents_ltx2,
)
from md_ltx._upsampler_weights import (
  config_from_checkpoint,
  load_latent_upsampler,
  upsampler_keymap,
)

T = md_core.Target
ATOL = 1e-4


def _fixture(name):
  return load_arrays(fixture_path("ltx_upsampler") / f"{name}.npz")


def _cl(x):  # [B, C, F, H, W] → [B, F, H, W, C]
  return jnp.moveaxis(jnp.asarray(x), 1, -1)


def _max_err(got, want):
  return float(np.max(np.abs(np.asarray(got) - np.asarray(want))))


def _run(model, x):
  graphdef, state = nnx.split(model)
  return jax.jit(lambda s, x: nnx.merge(graphdef, s)(x))(state, x)


@pytest.fixture(scope="module")
def ltx_video():
  return load_latent_upsampler(fixture_path("ltx_upsampler") / "ltx_video")


@pytest.fixture(scope="module")
def ltx2():
  return load_latent_upsampler(fixture_path("ltx_upsampler") / "ltx2")


def test_keymap_alone():
  km = upsampler_keymap(VARIANTS["ltx-video-0.9.7"])
  assert km("initial_conv.weight") == T(("initial_conv", "kernel"), "conv3d")
  assert km("initial_norm.bias") == T(("initial_norm", "bias"))
  assert km("res_blocks.2.conv1.weight") == T(("res_blocks", "conv1", "kernel"), "conv3d", layer=2)
  assert km("post_upsample_res_blocks.3.norm2.weight") == T(
    ("post_upsample_res_blocks", "norm2", "scale"), layer=3
  )
  assert km("upsampler.0.weight") == T(("upsampler", "conv", "kernel"), "conv2d")
  assert km("upsampler.0.bias") == T(("upsampler", "conv", "bias"))
  assert km("final_conv.weight") == T(("final_conv", "kernel"), "conv3d")
  assert km("upsampler.conv.weight") is None  # only the rational resampler has it
  assert km("upsampler.blur_down.kernel") is None
  assert km("res_blocks.4.conv1.weight") is None  # 4 blocks per stage
  km2 = upsampler_keymap(VARIANTS["ltx-2"])
  assert km2("upsampler.conv.weight") == T(("upsampler", "conv", "kernel"), "conv2d")
  assert km2("upsampler.blur_down.kernel") == T(("upsampler", "blur_kernel"))
  assert km2("upsampler.0.weight") is None
  flat = upsampler_keymap(LatentUpsamplerConfig(dims=2))
  assert flat("initial_conv.weight") == T(("initial_conv", "kernel"), "conv2d")
  st = upsampler_keymap(LatentUpsamplerConfig(temporal_upsample=True))
  assert st("upsampler.0.weight") == T(("upsampler", "conv", "kernel"), "conv3d")


# manifest stem (tests/fixtures/manifests) → (config in tools/configs/ltx, VARIANTS key)
REAL = {
  "ltx_video_0.9.7_latent_upsampler": "ltx-video-0.9.7",
  "ltx_video_0.9.8_latent_upsampler": "ltx-video-0.9.8",
  "ltx2_latent_upsampler": "ltx-2",
}


@pytest.mark.parametrize("name", sorted(REAL))
def test_real_manifest_coverage(name):
  data = load_manifest(name)
  shapes = {k: v["shape"] for k, v in data["tensors"].items()}
  cfg = LatentUpsamplerConfig.from_json(repo_root() / "tools/configs/ltx" / f"{name}.json")
  assert cfg == VARIANTS[REAL[name]]
  factory = lambda: LatentUpsampler(cfg, rngs=nnx.Rngs(0))  # noqa: E731
  assert md_core.coverage(shapes, factory, upsampler_keymap(cfg)) == []

  class Shapes(dict):  # the manifest as a checkpoint without data, for config_from_checkpoint
    def shape(self, key):
      return tuple(self[key])

  assert config_from_checkpoint(Shapes(shapes)) == cfg


def test_ops_parity():
  ref = _fixture("ops")
  x = ref[
    "shuffle1_in"
  ]  # [B, C*2, F, H, W]: the temporal shuffle is the model's; check via a model path
  got2 = pixel_shuffle(jnp.moveaxis(ref["shuffle2_in"], 1, -1), (2, 2))
  np.testing.assert_allclose(np.moveaxis(got2, -1, 1), ref["shuffle2_out"], atol=0)
  got3 = pixel_shuffle(_cl(ref["shuffle3_in"]), (2, 2, 2))
  np.testing.assert_allclose(np.moveaxis(got3, -1, 1), ref["shuffle3_out"], atol=0)
  got1 = _temporal_shuffle(_cl(x))
  np.testing.assert_allclose(np.moveaxis(got1, -1, 1), ref["shuffle1_out"], atol=0)
  blur = blur_downsample(jnp.moveaxis(ref["blur_in"], 1, -1), binomial_kernel(5), 2)
  assert _max_err(np.moveaxis(blur, -1, 1), ref["blur_out"]) < 1e-6


def test_model_parity_ltx_video(ltx_video):
  ref = _fixture("ltx_video")
  assert ltx_video.config == LatentUpsamplerConfig(
    in_channels=8, mid_channels=32, num_blocks_per_stage=1
  )
  out = _run(ltx_video, _cl(ref["model_in"]))
  err = _max_err(jnp.moveaxis(out, -1, 1), ref["model_out"])
  assert err < ATOL, err


def test_model_parity_ltx2(ltx2):
  ref = _fixture("ltx2")
  assert ltx2.config.kind == "rational" and ltx2.config.rational_spatial_scale == 2.0
  out = _run(ltx2, _cl(ref["model_in"]))
  err = _max_err(jnp.moveaxis(out, -1, 1), ref["model_out"])
  assert err < ATOL, err


def test_single_files_parity():
  path = fixture_path("ltx_upsampler")
  # Settings from the original `config` metadata (scale 1.5 cannot be read from the shapes).
  model = load_latent_upsampler(path / "ltx2_dims2_r15.safetensors")
  assert model.config == LatentUpsamplerConfig(
    in_channels=8, mid_channels=32, num_blocks_per_stage=1, dims=2, rational_spatial_scale=1.5,
    use_rational_resampler=True,
  )  # fmt: skip
  ref = _fixture("ltx2_dims2_r15")
  err = _max_err(jnp.moveaxis(_run(model, _cl(ref["model_in"])), -1, 1), ref["model_out"])
  assert err < ATOL, err
  # Settings from the shapes (no metadata): temporal x2, no residual blocks.
  model = load_latent_upsampler(path / "temporal.safetensors")
  assert model.config.kind == "temporal" and model.config.num_blocks_per_stage == 0
  ref = _fixture("temporal")
  out = _run(model, _cl(ref["model_in"]))
  assert out.shape[1] == 2 * ref["model_in"].shape[2] - 1
  err = _max_err(jnp.moveaxis(out, -1, 1), ref["model_out"])
  assert err < ATOL, err


@pytest.mark.parametrize(
  "case, kwargs",
  [("pipe_plain", {}), ("pipe_adain", dict(adain_factor=1.0, tone_map_compression_ratio=0.6))],
)
def test_pipeline_step_ltx_video(ltx_video, case, kwargs):
  ref = _fixture("ltx_video")
  out = upsample_latents(
    ltx_video, ref["latents"], ref["latents_mean"], ref["latents_std"],
    scaling_factor=float(ref["scaling_factor"]), layout="BCFHW", **kwargs,
  )  # fmt: skip
  err = _max_err(out, ref[case])
  assert err < ATOL, (case, err)


def test_pipeline_step_ltx2(ltx2):
  ref = _fixture("ltx2")
  stats = dict(
    latents_mean=ref["latents_mean"], latents_std=ref["latents_std"],
    scaling_factor=float(ref["scaling_factor"]),
  )  # fmt: skip
  plain = upsample_latents_ltx2(ltx2, _cl(ref["latents"]))  # channels-last in and out
  assert _max_err(jnp.moveaxis(plain, -1, 1), ref["pipe_plain"]) < ATOL
  norm = upsample_latents_ltx2(
    ltx2, ref["latents"], latents_normalized=True, adain_factor=0.5, tone_map_compression_ratio=0.3,
    layout="BCFHW", **stats,
  )  # fmt: skip
  assert _max_err(norm, ref["pipe_norm"]) < ATOL
  packed = upsample_latents_ltx2(
    ltx2, ref["packed"], num_frames=int(ref["num_frames"]), height=int(ref["height"]),
    width=int(ref["width"]), vae_temporal_compression=int(ref["vae_temporal_compression"]),
    vae_spatial_compression=int(ref["vae_spatial_compression"]), layout="BCFHW",
  )  # fmt: skip
  assert _max_err(packed, ref["pipe_packed"]) < ATOL


def test_adain_and_tone_map_closed_form():
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.normal(size=(2, 3, 4, 5, 6)) * 3.0 + 1.0, jnp.float32)
  r = jnp.asarray(rng.normal(size=(2, 2, 2, 3, 6)), jnp.float32)
  adain = jax.jit(adain_filter_latent)
  tone = jax.jit(tone_map_latents)
  assert _max_err(adain(x, r, 0.0), x) == 0.0
  y, rn = np.asarray(adain(x, r, 1.0)), np.asarray(r)
  # Matched per (sample, channel): the reference's mean and unbiased standard deviation.
  np.testing.assert_allclose(y.mean(axis=(1, 2, 3)), rn.mean(axis=(1, 2, 3)), atol=1e-5)
  np.testing.assert_allclose(
    y.std(axis=(1, 2, 3), ddof=1), rn.std(axis=(1, 2, 3), ddof=1), rtol=1e-5
  )
  half = np.asarray(adain(x, r, 0.5))
  np.testing.assert_allclose(half, 0.5 * (np.asarray(x) + y), atol=1e-5)
  assert _max_err(tone(x, 0.0), x) == 0.0
  t, xn = np.asarray(tone(x, 1.0)), np.asarray(x)
  np.testing.assert_allclose(t, xn * (1 - 0.6 / (1 + np.exp(-3.0 * (np.abs(xn) - 1)))), rtol=1e-5)


def test_bf16_load_keeps_blur_kernel_f32():
  model = load_latent_upsampler(fixture_path("ltx_upsampler") / "ltx2", dtype=jnp.bfloat16)
  assert model.upsampler.blur_kernel[...].dtype == jnp.float32
  assert model.initial_conv.kernel[...].dtype == jnp.bfloat16


def test_errors(ltx_video, tmp_path):
  x = jnp.zeros((1, 2, 3, 4, 8))
  with pytest.raises(ValueError, match=r"tone_map_compression_ratio=1.5 must be in the range"):
    upsample_latents(ltx_video, x, jnp.zeros(8), jnp.ones(8), tone_map_compression_ratio=1.5)
  with pytest.raises(ValueError, match="latents_mean and latents_std"):
    upsample_latents(ltx_video, x)
  with pytest.raises(ValueError, match="have 4 channels; the upsampler takes 8"):
    upsample_latents(ltx_video, jnp.zeros((1, 2, 3, 5, 4)), latents_normalized=False,
                     normalize_output=False)  # fmt: skip
  with pytest.raises(ValueError, match="one value per channel"):
    upsample_latents(ltx_video, x, jnp.zeros(7), jnp.ones(7))
  with pytest.raises(ValueError, match="layout='NCHW'"):
    upsample_latents(ltx_video, x, jnp.zeros(8), jnp.ones(8), layout="NCHW")
  with pytest.raises(ValueError, match="need num_frames, height and width"):
    upsample_latents_ltx2(ltx_video, jnp.zeros((1, 12, 8)))
  with pytest.raises(ValueError, match="latents must be"):
    ltx_video(jnp.zeros((1, 2, 3, 4, 5)))
  with pytest.raises(ValueError, match="rational_spatial_scale=3.0 is not supported"):
    LatentUpsamplerConfig(use_rational_resampler=True, rational_spatial_scale=3.0)
  with pytest.raises(ValueError, match="mid_channels=48 must be a multiple of 32"):
    LatentUpsamplerConfig(mid_channels=48)
  with pytest.raises(ValueError, match="temporal_upsample needs dims=3"):
    LatentUpsamplerConfig(dims=2, temporal_upsample=True)
  with pytest.raises(ValueError, match="unknown latent upsampler config key 'mid_channel'"):
    LatentUpsamplerConfig.from_dict({"mid_channel": 32})
  # A rational resampler by 3 without metadata: scale 1.5 or 0.75 cannot be told from the shapes.
  f = md_core.open_checkpoint(fixture_path("ltx_upsampler") / "ltx2_dims2_r15.safetensors")
  tensors = {k: f[k] for k in f}
  md_core.save_safetensors(tmp_path / "bare.safetensors", tensors)
  with pytest.raises(ValueError, match="pass rational_spatial_scale="):
    load_latent_upsampler(tmp_path / "bare.safetensors")
  model = load_latent_upsampler(tmp_path / "bare.safetensors", rational_spatial_scale=0.75)
  assert model.config.rational_spatial_scale == 0.75 and model.config.dims == 2
  # A wrong shape is reported with the file, the key and both shapes.
  tensors["final_conv.weight"] = tensors["final_conv.weight"][:4]
  md_core.save_safetensors(tmp_path / "bad.safetensors", tensors)
  with pytest.raises(md_core.WeightLoadError, match="final_conv.weight"):
    load_latent_upsampler(tmp_path / "bad.safetensors", rational_spatial_scale=1.5)
  with pytest.raises(ValueError, match="not found; is this an LTX latent upsampler"):
    md_core.save_safetensors(
      tmp_path / "other.safetensors", {"x.weight": np.zeros((2,), np.float32)}
    )
    load_latent_upsampler(tmp_path / "other.safetensors")


@pytest.mark.slow
def test_sharded_load_and_upsample():
  """Loaded onto an 8-device mesh (fsdp=2, tensor=4), latents split over the batch: the pipeline step
  under the mesh gives the reference's result."""
  import md_sharding as mds

  ref = _fixture("ltx_video")
  mesh = mds.make_mesh(mds.MeshConfig(ici_fsdp_parallelism=2, ici_tensor_parallelism=4))
  model = load_latent_upsampler(fixture_path("ltx_upsampler") / "ltx_video", mesh=mesh)
  latents = jax.device_put(
    _cl(ref["latents"]), jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("fsdp"))
  )
  with jax.set_mesh(mesh):
    out = upsample_latents(
      model, latents, ref["latents_mean"], ref["latents_std"],
      scaling_factor=float(ref["scaling_factor"]), adain_factor=1.0, tone_map_compression_ratio=0.6,
    )  # fmt: skip
  err = _max_err(jnp.moveaxis(out, -1, 1), ref["pipe_adain"])
  assert err < ATOL, err
