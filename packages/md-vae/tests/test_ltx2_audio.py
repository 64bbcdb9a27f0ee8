"""LTX-2 audio VAE and vocoders against diffusers' outputs (tests/fixtures/ltx2_audio): encode / decode of
two tiny audio VAEs, the LTX-2.0 vocoder and the LTX-2.3 vocoder with bandwidth extension, chunked runs
equal to one pass, latent packing and statistics, the real models' key manifests, input errors, and an MP4
whose audio stream has the vocoder's duration."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import save_file

import md_core
from md_core import media
from md_core.testing import fixture_path, load_arrays, load_manifest, repo_root
from md_vae._ltx2_audio import (
  LTX2_AUDIO_VAE_VARIANTS,
  LTX2AudioVAE,
  LTX2AudioVAEConfig,
  pack_audio_latents,
  unpack_audio_latents,
)
from md_vae._ltx2_audio_weights import load_vae_ltx2_audio, vae_ltx2_audio_convert_key
from md_vae._ltx2_vocoder import (
  LTX2_VOCODER_VARIANTS,
  LTX2Vocoder,
  LTX2VocoderBWEConfig,
  LTX2VocoderConfig,
  LTX2VocoderWithBWE,
  vocoder_config_from_json,
)
from md_vae._ltx2_vocoder_weights import load_vocoder_ltx2, vocoder_ltx2_convert_key

TOL = 1e-4  # components, f32 max abs
WAVE_TOL = 1e-5  # waveforms: measured 7e-8 (LTX2Vocoder) and 4e-7 (with BWE) on this fixture
FIXTURES = fixture_path("ltx2_audio")


def _cl(x):  # reference [B, C, T, M] → md [B, T, M, C]
  return jnp.asarray(x).transpose(0, 2, 3, 1)


@jax.jit
def _encode(graphdef, state, mel):
  dist = nnx.merge(graphdef, state).encode(mel)
  return dist.mean, dist.logvar


@jax.jit
def _decode(graphdef, state, latents):
  return nnx.merge(graphdef, state).decode(latents)


@jax.jit
def _vocode(graphdef, state, mel):
  return nnx.merge(graphdef, state)(mel)


@pytest.fixture(scope="module")
def vaes():
  return {case: load_vae_ltx2_audio(FIXTURES / case) for case in ("main", "variant")}


@pytest.fixture(scope="module")
def vocoders():
  return {case: load_vocoder_ltx2(FIXTURES / case) for case in ("vocoder", "bwe")}


@pytest.fixture(scope="module")
def waveforms(vocoders):
  out = {}
  for case, voc in vocoders.items():
    out[case] = _vocode(*nnx.split(voc), _cl(load_arrays(FIXTURES / f"{case}.npz")["mel"]))
  return out


@pytest.mark.parametrize("case", ("main", "variant"))
def test_vae_matches_diffusers(vaes, case):
  ref = load_arrays(FIXTURES / f"{case}.npz")
  graphdef, state = nnx.split(vaes[case])
  mean, logvar = _encode(graphdef, state, _cl(ref["mel"]))
  chex.assert_trees_all_close(
    (mean, logvar), (_cl(ref["mean"]), _cl(ref["logvar"])), atol=TOL, rtol=0
  )
  decoded = _decode(graphdef, state, _cl(ref["latents"]))
  chex.assert_shape(decoded, (2, 25, 16, 2))
  chex.assert_trees_all_close(decoded, _cl(ref["decoded"]), atol=TOL, rtol=0)


def test_vae_chunked_decode_equals_one_pass(vaes):
  ref = load_arrays(FIXTURES / "main.npz")
  vae = vaes["main"]
  z, want = _cl(ref["long_latents"]), _cl(ref["long_decoded"])  # 40 latent frames → 157 mel frames
  graphdef, state = nnx.split(vae)
  full = _decode(graphdef, state, z)
  chex.assert_trees_all_close(full, want, atol=TOL, rtol=0)
  # Windows [0, 30) and [30 - context, 40): the second starts past frame 0.
  assert vae.context_frames() < 30
  chunked = jax.jit(lambda s, z: nnx.merge(graphdef, s).decode(z, chunk_frames=30))(state, z)
  chex.assert_trees_all_close(chunked, full, atol=1e-5, rtol=0)


def test_latent_packing_and_statistics(vaes):
  vae = vaes["main"]
  ref = load_arrays(FIXTURES / "main.npz")
  z = ref["latents"]  # [B, C, L, M]
  packed = pack_audio_latents(_cl(z))
  want = z.transpose(0, 2, 1, 3).reshape(2, 7, 8)  # the pipeline's [B, L, C * M]
  np.testing.assert_array_equal(packed, want)
  np.testing.assert_array_equal(unpack_audio_latents(packed, 4), _cl(z))
  stats = md_core.open_checkpoint(FIXTURES / "main" / "audio_vae")
  mean, std = stats["latents_mean"], stats["latents_std"]
  np.testing.assert_array_equal(vae.latents_mean[...], mean)
  chex.assert_trees_all_close(vae.normalize_latents(packed), (want - mean) / std, atol=1e-6)
  chex.assert_trees_all_close(
    vae.denormalize_latents(vae.normalize_latents(packed)), want, atol=1e-6
  )


def test_pipeline_audio_path_matches_diffusers(vaes, vocoders):
  # LTX2Pipeline: packed normalised latents → denormalise → unpack → decode → vocode (same shapes
  # as the component tests, so nothing new compiles).
  ref = load_arrays(FIXTURES / "main.npz")
  vae = vaes["main"]
  z = vae.denormalize_latents(jnp.asarray(ref["packed"]))
  z = unpack_audio_latents(z, vae.config.latent_mel_bins)
  mel = _decode(*nnx.split(vae), z)
  wave = _vocode(*nnx.split(vocoders["vocoder"]), mel)
  chex.assert_trees_all_close(wave, ref["chain_waveform"].transpose(0, 2, 1), atol=WAVE_TOL, rtol=0)


@pytest.mark.parametrize("case", ("vocoder", "bwe"))
def test_vocoder_matches_diffusers(waveforms, case):
  want = load_arrays(FIXTURES / f"{case}.npz")["waveform"].transpose(0, 2, 1)
  assert want.shape == ((2, 6000, 2) if case == "vocoder" else (2, 12000, 2))
  chex.assert_trees_all_close(waveforms[case], want, atol=WAVE_TOL, rtol=0)


@pytest.mark.slow  # four more vocoder windows in one program: ~45 s on 2 loaded cores
def test_vocoder_chunked_equals_one_pass(vocoders, waveforms):
  voc = vocoders["vocoder"]
  mel = _cl(load_arrays(FIXTURES / "vocoder.npz")["mel"])  # 25 frames; context 12 on each side
  assert voc.context_frames() < 25 - 6
  graphdef, state = nnx.split(voc)
  chunked = jax.jit(lambda s, m: nnx.merge(graphdef, s)(m, chunk_frames=6))(state, mel)
  chex.assert_trees_all_close(chunked, waveforms["vocoder"], atol=1e-6, rtol=0)


@pytest.mark.slow  # a 96-frame BWE run plus three windows: ~40 s on 2 loaded cores
def test_bwe_vocoder_chunked_equals_one_pass(vocoders):
  voc = vocoders["bwe"]
  mel = jax.random.normal(jax.random.key(0), (1, 96, 16, 2))
  graphdef, state = nnx.split(voc)
  full = _vocode(graphdef, state, mel)
  chunked = jax.jit(lambda s, m: nnx.merge(graphdef, s)(m, chunk_frames=32))(state, mel)
  assert voc.context_frames() < 64  # the last window [64 - context, 96) starts past 0
  chex.assert_trees_all_close(chunked, full, atol=1e-5, rtol=0)


def test_mp4_audio_stream_has_the_vocoder_duration(vocoders, waveforms, tmp_path):
  # 6000 samples at 24 kHz and 12000 at 48 kHz: 0.25 s each, next to 6 frames at 24 fps.
  frames = np.zeros((6, 16, 16, 3), np.float32)
  for case, voc in vocoders.items():
    audio = np.asarray(waveforms[case][0]).T  # [channels, samples]
    path = media.save_video(
      tmp_path / f"{case}.mp4", frames, fps=24, audio=audio, sample_rate=voc.sample_rate
    )
    info = media.video_info(path)
    assert info["has_audio"] and info["audio_sample_rate"] == voc.sample_rate
    assert info["audio_duration"] == pytest.approx(audio.shape[1] / voc.sample_rate, abs=0.01)
    assert info["num_frames"] == 6


def test_convert_keys_alone():
  T = md_core.Target
  ck = vae_ltx2_audio_convert_key
  assert ck("decoder.up.1.block.0.conv1.conv.weight") == T(
    ("decoder", "up", 1, "block", 0, "conv1", "conv", "kernel"), "conv2d"
  )
  assert ck("encoder.down.0.downsample.conv.weight") == T(
    ("encoder", "down", 0, "downsample", "conv", "kernel"), "conv2d"
  )
  assert ck("encoder.mid.attn_1.q.bias") == T(("encoder", "mid", "attn_1", "q", "bias"))
  assert ck("decoder.norm_out.weight") == T(("decoder", "norm_out", "scale"))
  assert ck("latents_std") == T(("latents_std",))
  assert ck("vocoder.conv_in.weight") is None
  vk = vocoder_ltx2_convert_key
  assert vk("upsamplers.2.weight") == T(("upsamplers", 2, "kernel"), "conv1d")
  assert vk("resnets.4.acts2.1.act.beta") == T(("resnets", 4, "acts2", 1, "act", "beta"))
  assert vk("bwe_generator.act_out.downsample.filter") == T(
    ("bwe_generator", "act_out", "downsample", "filter")
  )
  assert vk("mel_stft.stft_fn.forward_basis") == T(
    ("mel_stft", "stft_fn", "forward_basis"), "conv1d"
  )
  assert vk("mel_stft.mel_basis") == T(("mel_stft", "mel_basis"))
  assert vk("encoder.conv_in.conv.weight.extra") is None


def _manifest(name):
  data = load_manifest(name)
  return {k: v["shape"] for k, v in data["tensors"].items()}


def test_real_audio_vae_is_covered():
  cfg = LTX2AudioVAEConfig.from_json(repo_root() / "tools/configs/ltx/ltx2_audio_vae.json")
  assert cfg == LTX2_AUDIO_VAE_VARIANTS["ltx-2"]
  assert (cfg.latent_mel_bins, cfg.latents_per_second) == (16, 25.0)
  model = nnx.eval_shape(lambda: LTX2AudioVAE(cfg))
  assert md_core.coverage(_manifest("ltx2_audio_vae"), model, vae_ltx2_audio_convert_key) == []


@pytest.mark.parametrize(
  "name, variant, cls",
  (("ltx2_vocoder", "ltx-2", LTX2Vocoder), ("ltx2_vocoder_bwe", "ltx-2.3", LTX2VocoderWithBWE)),
)
def test_real_vocoders_are_covered(name, variant, cls):
  cfg = vocoder_config_from_json(repo_root() / f"tools/configs/ltx/{name}.json")
  assert cfg == LTX2_VOCODER_VARIANTS[variant]
  model = nnx.eval_shape(lambda: cls(cfg))
  assert md_core.coverage(_manifest(name), model, vocoder_ltx2_convert_key) == []
  assert model.sample_rate == (24000 if variant == "ltx-2" else 48000)


def test_input_errors(vaes, vocoders):
  vae = vaes["main"]
  with pytest.raises(ValueError, match=r"mel must be \[B, T, mel_bins, in_channels=2\], got shape"):
    vae.encode(jnp.zeros((1, 17, 16)))
  with pytest.raises(ValueError, match=r"mel has 64 mel bins .* takes mel_bins=16"):
    vae.encode(jnp.zeros((1, 17, 64, 2)))
  with pytest.raises(ValueError, match=r"latent_channels=2\], got shape \(1, 5, 4, 3\)"):
    vae.decode(jnp.zeros((1, 5, 4, 3)))
  with pytest.raises(ValueError, match=r"packed audio latents must be \[B, L, 8\]"):
    vae.normalize_latents(jnp.zeros((1, 5, 4, 2)))
  with pytest.raises(ValueError, match="chunked decoding needs a decoder that is causal in time"):
    vaes["variant"].decode(jnp.zeros((1, 5, 4, 2)), chunk_frames=2)
  with pytest.raises(ValueError, match="mel_bins x channels = in_channels=32"):
    vocoders["vocoder"](jnp.zeros((1, 5, 8, 2)))
  with pytest.raises(ValueError, match=r"keys \['foo'\] are not supported"):
    LTX2AudioVAEConfig.from_dict({"foo": 1})
  with pytest.raises(ValueError, match="reads AutoencoderKLLTX2Audio"):
    LTX2AudioVAEConfig.from_dict({"_class_name": "AutoencoderKLLTXVideo"})
  with pytest.raises(ValueError, match="causality_axis='time'"):
    LTX2AudioVAEConfig(causality_axis="time")
  with pytest.raises(ValueError, match="leaky_relu' with antialias=True is not supported"):
    LTX2VocoderConfig(antialias=True)
  with pytest.raises(ValueError, match="must make 3 x hop_length = 240"):
    LTX2VocoderBWEConfig(bwe_upsample_factors=(6, 5, 2, 2, 1))


def test_missing_tensor_is_named(tmp_path):
  folder = tmp_path / "audio_vae"
  folder.mkdir()
  src = FIXTURES / "main" / "audio_vae"
  (folder / "config.json").write_text((src / "config.json").read_text())
  ckpt = md_core.open_checkpoint(src)
  tensors = {k: np.asarray(ckpt[k]) for k in ckpt.keys() if k != "decoder.conv_out.conv.bias"}
  tensors["decoder.conv_in.conv.weight"] = tensors["decoder.conv_in.conv.weight"][:, :1]
  save_file(tensors, str(folder / "diffusion_pytorch_model.safetensors"))
  with pytest.raises(md_core.WeightLoadError) as err:
    load_vae_ltx2_audio(tmp_path)
  assert "decoder.conv_in.conv.weight" in str(err.value)
  assert "decoder/conv_out/conv/bias" in str(err.value)
