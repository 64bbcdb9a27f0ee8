"""LTX-Video LoRAs through the whole pipeline against diffusers' `LTXPipeline.load_lora_weights`
(tests/fixtures/lora_ltx_pipeline, tools/fixtures/lora_ltx_pipeline.py): the tiny text-to-video pipeline with
one file, two files with their own scales, and one file fused; md at run time (one compiled denoiser for every
case) and fused. The denoiser parity against diffusers is in tests/test_lora_families.py."""

import numpy as np
import pytest

import md_ltx
from md_core import testing

PROMPT = "a cat surfing a wave at sunset"
NEGATIVE = "worst quality, blurry"
COMMON = dict(
  height=32, width=32, num_frames=9, num_inference_steps=3, guidance_scale=3.0,
  max_sequence_length=8, decode_timestep=0.05, decode_noise_scale=0.0, progress=False,
)  # fmt: skip
ATOL = 1e-3


@pytest.mark.filterwarnings("ignore:prompt .* tokens long")
def test_ltx_pipeline_loras_match_diffusers():
  pipe = md_ltx.load_pipeline(testing.fixture_path("ltx_pipeline") / "t2v")
  root = testing.fixture_path("lora_ltx")
  want = testing.load_cases(testing.fixture_path("lora_ltx_pipeline") / "outputs.npz")

  def err(case):
    got = np.asarray(pipe(PROMPT, NEGATIVE, latents=want[case]["latents"], **COMMON))
    assert got.shape == (1, 9, 32, 32, 3), got.shape
    got = got[:, want[case]["frame_index"]]  # the frames the fixture keeps (first, middle, last)
    assert got.shape == want[case]["frames"].shape, got.shape
    return float(np.abs(got - want[case]["frames"]).max())

  errors = testing.lora_pipeline_errors(
    pipe, (root / "ltx_a.safetensors", root / "ltx_b.safetensors"), err
  )
  print({k: f"{v:.1e}" for k, v in errors.items()})
  assert max(errors.values()) < ATOL, errors
  for case in ("one", "two", "fused"):  # the LoRAs matter
    assert np.abs(want[case]["frames"] - want["base"]["frames"]).max() > 0.05, case
