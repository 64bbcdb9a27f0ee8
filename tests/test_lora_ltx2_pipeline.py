"""LTX-2 LoRAs through the whole audio + video pipeline against diffusers' `LTX2Pipeline.load_lora_weights`
(tests/fixtures/lora_ltx2_pipeline, tools/fixtures/lora_ltx2_pipeline.py): one file, two files with their own
scales, one file fused; md at run time (one compiled denoiser for every case) and fused. Frames and
waveforms. The denoiser parity against diffusers is in tests/test_lora_families.py."""

import numpy as np
import pytest

from md_core import testing
from md_ltx import load_ltx2_pipeline

PROMPT = "a cat playing a piano"
NEGATIVE = "blurry, distorted"
COMMON = dict(
  height=32, width=64, num_frames=9, frame_rate=24.0, num_inference_steps=3, max_sequence_length=16,
  guidance_scale=4.0, stg_scale=0.0, audio_stg_scale=0.0, modality_scale=1.0, audio_modality_scale=1.0,
  guidance_rescale=0.0, audio_guidance_rescale=0.0, decode_timestep=0.05, decode_noise_scale=0.0,
  progress=False,
)  # fmt: skip
ATOL = 1e-3


@pytest.mark.filterwarnings("ignore:prompt .* tokens long")
def test_ltx2_pipeline_loras_match_diffusers():
  pipe = load_ltx2_pipeline(testing.fixture_path("ltx2_pipeline") / "pipe")
  root = testing.fixture_path("lora_ltx2_pipeline")
  want = testing.load_cases(root / "outputs.npz")

  def err(case):
    w = want[case]
    out = pipe(PROMPT, NEGATIVE, latents=w["latents"], audio_latents=w["audio_latents"], **COMMON)
    assert out.frames.shape == w["frames"].shape and out.audio.shape == w["audio"].shape
    frames = float(np.abs(np.asarray(out.frames) - w["frames"]).max())
    audio = float(np.abs(np.asarray(out.audio) - w["audio"]).max())
    return frames, audio

  errors = testing.lora_pipeline_errors(
    pipe, (root / "ltx2_a.safetensors", root / "ltx2_b.safetensors"), err
  )
  print({k: f"frames {f:.1e}, audio {a:.1e}" for k, (f, a) in errors.items()})
  for case in ("one", "two", "fused"):  # the LoRAs matter, in the picture and in the sound
    moved = np.abs(want[case]["frames"] - want["base"]["frames"]).max()
    heard = np.abs(want[case]["audio"] - want["base"]["audio"]).max()
    assert moved > 0.05 and heard > 1e-3, (case, moved, heard)
  assert max(f for f, _ in errors.values()) < ATOL, errors
  # The waveforms are small (the LoRAs move them by ~1e-3): held to 1% of that.
  assert max(a for _, a in errors.values()) < 1e-5, errors
