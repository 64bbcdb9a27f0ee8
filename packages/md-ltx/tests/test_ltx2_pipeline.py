"""LTX-2 pipelines against diffusers' LTX2Pipeline / LTX2ImageToVideoPipeline on a tiny saved pipeline
(tests/fixtures/ltx2_pipeline, built by tools/fixtures/ltx2_pipeline.py): same prompts, latents and recorded
noise, 3 steps, frames and waveforms within 1e-3."""

import json

import jax
import numpy as np
import pytest

import md_core
import md_ltx
import md_schedulers as mdsch
import md_sharding as mds
import md_vae
from md_core import testing
from md_ltx import LTX2Output, load_ltx2_pipeline, save_ltx2_video

PROMPTS = ["a cat playing a piano", "waves on a beach at sunset, seagulls calling"]
NEGATIVE = "blurry, distorted"
ROOT = testing.fixture_path("ltx2_pipeline")
KW = dict(
  height=32, width=64, num_frames=9, frame_rate=24.0, num_inference_steps=3, max_sequence_length=16,
  progress=False,
)  # fmt: skip
ERR = dict(KW, spatio_temporal_guidance_blocks=[1])  # the tiny transformer has 2 blocks
T2V = dict(spatio_temporal_guidance_blocks=[1], decode_timestep=0.05, decode_noise_scale=0.025)
# The fixture's prompts are longer than its 16 Gemma tokens (as the reference, they are cut).
pytestmark = pytest.mark.filterwarnings("ignore:prompt .* tokens long")
I2V = dict(
  guidance_scale=4.0, stg_scale=0.0, audio_stg_scale=0.0, modality_scale=1.0, audio_modality_scale=1.0,
  guidance_rescale=0.0, audio_guidance_rescale=0.0, decode_timestep=0.05, decode_noise_scale=0.025,
)  # fmt: skip


@pytest.fixture(scope="module")
def ref():
  return testing.load_arrays(ROOT / "io.npz")


@pytest.fixture(scope="module")
def pipe():
  return load_ltx2_pipeline(ROOT / "pipe")


def _max_diff(out, want):
  return float(np.abs(np.asarray(out) - want).max())


@pytest.fixture(scope="module")
def t2v_out(pipe, ref):
  return pipe(
    PROMPTS, NEGATIVE, latents=ref["t2v_latents"], audio_latents=ref["t2v_audio_latents"],
    decode_noise=ref["t2v_decode_noise"], **T2V, **KW,
  )  # fmt: skip


def test_t2v_matches_reference(t2v_out, ref):
  """CFG (3 / audio 7), STG, modality guidance, rescale 0.7, decode timestep + noise: frames and audio."""
  assert isinstance(t2v_out, LTX2Output)
  assert t2v_out.frames.shape == ref["t2v_frames"].shape
  assert t2v_out.audio.shape == ref["t2v_audio"].shape
  assert t2v_out.sample_rate == 24000
  assert _max_diff(t2v_out.frames, ref["t2v_frames"]) < 1e-3
  assert _max_diff(t2v_out.audio, ref["t2v_audio"]) < 1e-3


def test_i2v_matches_reference(pipe, ref):
  """Image-to-video with given latents and CFG: the first latent frame is the condition (kept, its
  tokens at timestep 0); frames and audio as the reference."""
  out = pipe(
    PROMPTS, NEGATIVE, image=np.zeros((32, 64, 3), np.uint8), latents=ref["i2v_latents"],
    audio_latents=ref["i2v_audio_latents"], decode_noise=ref["i2v_decode_noise"], **I2V, **KW,
  )  # fmt: skip
  assert out.frames.shape == ref["i2v_frames"].shape
  assert _max_diff(out.frames, ref["i2v_frames"]) < 1e-3
  assert _max_diff(out.audio, ref["i2v_audio"]) < 1e-3


@pytest.mark.slow
def test_seed_and_latent_output(pipe, ref, t2v_out):
  """Without latents a seed draws them (repeatably); output_type="latent" gives the reference layouts
  (slow: ~10 s of eager random-number compiles)."""
  a = pipe(PROMPTS, NEGATIVE, seed=3, **T2V, **KW)
  b = pipe(PROMPTS, NEGATIVE, seed=3, **T2V, **KW)
  np.testing.assert_array_equal(np.asarray(a.frames), np.asarray(b.frames))
  np.testing.assert_array_equal(np.asarray(a.audio), np.asarray(b.audio))
  assert _max_diff(a.frames, np.asarray(t2v_out.frames)) > 1e-2
  lat = pipe(
    PROMPTS, NEGATIVE, latents=ref["t2v_latents"], audio_latents=ref["t2v_audio_latents"],
    output_type="latent", **T2V, **KW,
  )  # fmt: skip
  assert lat.frames.shape == ref["t2v_latents"].shape
  assert lat.audio.shape == ref["t2v_audio_latents"].shape


def test_image_latents_match_reference(pipe, ref):
  """The image path: resize / normalise, VAE encode (mode), statistics, first-frame blend and mask."""
  packed, mask = pipe.prepare_image_latents(
    ref["image"], height=32, width=64, noise=ref["image_noise"]
  )
  assert _max_diff(packed, ref["image_latents"]) < 1e-4
  np.testing.assert_array_equal(np.asarray(mask), ref["image_mask"])
  # The call's default H.264 re-compression (CRF 33) changes the image a little, only the first frame.
  crf, _ = pipe.prepare_image_latents(
    ref["image"], height=32, width=64, noise=ref["image_noise"], image_crf=33
  )
  first = np.asarray(mask[0]) > 0
  assert 0 < _max_diff(np.asarray(crf)[:, first], np.asarray(packed)[:, first])
  np.testing.assert_array_equal(np.asarray(crf)[:, ~first], np.asarray(packed)[:, ~first])


def test_size_errors_name_nearest_valid(pipe):
  with pytest.raises(md_core.pipeline.SizeError, match=r"num_frames=10 → 9 or 17"):
    pipe(PROMPTS[0], **dict(ERR, num_frames=10))
  with pytest.raises(ValueError, match=r"height=40 → 32 or 64"):
    pipe(PROMPTS[0], **dict(ERR, height=40))
  with pytest.raises(ValueError, match="has block 28; the transformer has 2 blocks"):
    pipe(PROMPTS[0], **KW)


def test_unreadable_image(pipe, tmp_path):
  bad = tmp_path / "broken.png"
  bad.write_bytes(b"not a png")
  with pytest.raises(ValueError, match="cannot read the image file"):
    pipe(PROMPTS[0], image=bad, **ERR)


def test_i2v_folder_class_and_errors(tmp_path):
  """model_index.json's LTX2ImageToVideoPipeline makes an image-to-video pipeline (image required)."""
  folder = tmp_path / "i2v"
  md_core.pipeline.copy_pipeline(ROOT / "pipe", folder)  # self-contained: shared components in
  index = json.loads((folder / "model_index.json").read_text())
  (folder / "model_index.json").write_text(
    json.dumps(dict(index, _class_name="LTX2ImageToVideoPipeline"))
  )
  pipe = load_ltx2_pipeline(folder)
  assert pipe.image_to_video
  with pytest.raises(ValueError, match="needs an image"):
    pipe(PROMPTS[0], **ERR)
  (folder / "model_index.json").write_text(json.dumps(dict(index, _class_name="LTXPipeline")))
  with pytest.raises(ValueError, match="LTXPipeline"):
    load_ltx2_pipeline(folder)


def test_save_mp4_with_audio(t2v_out, tmp_path):
  """The MP4 holds a video stream of F / fps seconds and an audio stream of samples / rate seconds."""
  path = save_ltx2_video(tmp_path / "out.mp4", t2v_out, index=1)
  info = md_core.media.video_info(path)
  frames = t2v_out.frames.shape[1]
  samples = t2v_out.audio.shape[-1]
  assert info["num_frames"] == frames and info["fps"] == 24.0
  assert (info["height"], info["width"]) == t2v_out.frames.shape[2:4]
  assert info["has_audio"] and info["audio_sample_rate"] == 24000
  assert abs(info["audio_duration"] - samples / 24000) < 0.05
  # Each stream keeps its own length: 5 frames (0.21 s) of video, 4080 samples (0.17 s) of audio.
  assert abs(info["duration"] - max(frames / 24.0, samples / 24000)) < 0.05


@pytest.mark.slow
def test_sharded_equals_single_device(pipe, ref):
  """fsdp 2 x context 2 x tensor 2: the same frames and waveform as one device (t2v, all guidance terms)."""
  mesh = mds.make_mesh(
    mds.MeshConfig(ici_fsdp_parallelism=2, ici_context_parallelism=2, ici_tensor_parallelism=2)
  )
  sharded = load_ltx2_pipeline(ROOT / "pipe", mesh=mesh)
  kw = dict(latents=ref["t2v_latents"], audio_latents=ref["t2v_audio_latents"],
            decode_noise=ref["t2v_decode_noise"], **T2V, **KW)  # fmt: skip
  one = pipe(PROMPTS, NEGATIVE, **kw)
  out = sharded(PROMPTS, NEGATIVE, **kw)
  assert jax.device_count() >= 8
  assert _max_diff(out.frames, np.asarray(one.frames)) < 1e-5
  assert _max_diff(out.audio, np.asarray(one.audio)) < 1e-5


def test_load_pipeline_dispatches_ltx2_folders():
  pipe = md_ltx.load_pipeline(ROOT / "pipe")
  assert isinstance(pipe, md_ltx.LTX2VideoPipeline)
  with pytest.raises(ValueError, match="condition"):
    md_ltx.load_pipeline(ROOT / "pipe", condition=True)


# --- the shared loop's call contract: latent output, callback, cancel ----------------------------------------

T2V_IN = dict(T2V, **KW)


@pytest.fixture(scope="module")
def t2v_latent(pipe, ref):
  return pipe(
    PROMPTS, NEGATIVE, latents=ref["t2v_latents"], audio_latents=ref["t2v_audio_latents"],
    output_type="latent", chunk=None, **T2V_IN,
  )  # fmt: skip


def test_latent_output_decodes_to_the_frames(pipe, ref, t2v_out, t2v_latent):
  """output_type="latent": denormalised video `[B, C, f, h, w]` and audio `[B, C, L, M]` latents (the
  reference's layouts) that the VAEs decode to the "np" call's frames and waveform."""
  assert t2v_latent.frames.shape == ref["t2v_latents"].shape
  assert t2v_latent.audio.shape == ref["t2v_audio_latents"].shape
  assert pipe.last_calls == 3
  z = pipe.vae.normalize_latents(np.transpose(np.asarray(t2v_latent.frames), (0, 2, 3, 4, 1)))
  frames = pipe.decode_video(
    z, decode_timestep=0.05, decode_noise_scale=0.025, decode_noise=ref["t2v_decode_noise"]
  )
  assert _max_diff(frames, np.asarray(t2v_out.frames)) < 1e-5
  packed = md_vae.pack_audio_latents(np.transpose(np.asarray(t2v_latent.audio), (0, 2, 3, 1)))
  audio = pipe.decode_audio(pipe.audio_vae.normalize_latents(packed))
  assert _max_diff(audio, np.asarray(t2v_out.audio)) < 1e-5
  with pytest.raises(ValueError, match="output_type='pil'"):
    pipe(PROMPTS, NEGATIVE, output_type="pil", **T2V_IN)


def test_callback_sees_every_step(pipe, ref, t2v_latent):
  """Steps 0, 1, 2 with the schedule's timesteps (flow-match Euler, sigmas shifted by the 64 tokens'
  mu); the last latents are the result's (normalised, packed); chunked runs equal one fori_loop."""
  seen = []
  out = pipe(
    PROMPTS, NEGATIVE, latents=ref["t2v_latents"], audio_latents=ref["t2v_audio_latents"],
    output_type="latent", callback=lambda i, t, lat: seen.append((i, float(t), lat)), **T2V_IN,
  )  # fmt: skip
  cfg = pipe.scheduler_config
  want = mdsch.from_config(cfg).init(sigmas=mdsch.ltx_uniform_sigmas(3), mu=mdsch.ltx_mu(64, cfg))
  assert [i for i, _, _ in seen] == [0, 1, 2]
  np.testing.assert_allclose([t for _, t, _ in seen], np.asarray(want.timesteps), rtol=0, atol=0)
  video, audio = seen[-1][2]
  assert video.shape == (2, 64, 8) and audio.shape == (2, 5, 8)
  z = pipe.vae.denormalize_latents(np.asarray(video).reshape(2, 2, 4, 8, 8))
  np.testing.assert_array_equal(np.transpose(np.asarray(z), (0, 4, 1, 2, 3)), out.frames)
  np.testing.assert_array_equal(np.asarray(out.frames), np.asarray(t2v_latent.frames))
  np.testing.assert_array_equal(np.asarray(out.audio), np.asarray(t2v_latent.audio))


def test_cancel_stops_at_a_step_boundary(pipe, ref):
  polls = []

  def cancel():
    polls.append(1)
    return len(polls) >= 2

  with pytest.raises(mdsch.Cancelled) as err:
    pipe(
      PROMPTS, NEGATIVE, latents=ref["t2v_latents"], audio_latents=ref["t2v_audio_latents"],
      output_type="latent", cancel=cancel, **T2V_IN,
    )  # fmt: skip
  assert (err.value.step, err.value.total, int(err.value.state.calls)) == (2, 3, 2)
  assert len(polls) == 2
