"""Flux.1 LoRAs through the whole pipeline against diffusers' `FluxPipeline.load_lora_weights`
(tests/fixtures/lora_flux_pipeline, tools/fixtures/lora_flux_pipeline.py): the tiny dev-like pipeline with one
file, two files with their own scales, and one file fused; md at run time (one compiled denoiser for every
case) and fused. The denoiser parity against diffusers is in tests/test_lora_families.py."""

import numpy as np
import pytest

import md_flux
from md_core import testing

PROMPTS = ["a photo of a cat", "an astronaut riding a horse on the moon"]
COMMON = dict(
  height=32, width=48, num_inference_steps=3, guidance_scale=3.5, max_sequence_length=8,
  progress=False,
)  # fmt: skip
ATOL = 1e-3


@pytest.mark.filterwarnings("ignore:prompt . is .* tokens long")
def test_flux_pipeline_loras_match_diffusers():
  pipe = md_flux.load_pipeline(testing.fixture_path("flux_pipeline") / "dev")
  root = testing.fixture_path("lora_flux")
  want = testing.load_cases(testing.fixture_path("lora_flux_pipeline") / "outputs.npz")

  def err(case):
    got = np.asarray(pipe(PROMPTS, latents=want[case]["latents"], **COMMON))
    assert got.shape == want[case]["images"].shape, got.shape
    return float(np.abs(got - want[case]["images"]).max())

  errors = testing.lora_pipeline_errors(
    pipe, (root / "flux_a.safetensors", root / "flux_b.safetensors"), err
  )
  print({k: f"{v:.1e}" for k, v in errors.items()})
  assert max(errors.values()) < ATOL, errors
  for case in ("one", "two", "fused"):  # the LoRAs matter
    assert np.abs(want[case]["images"] - want["base"]["images"]).max() > 0.05, case
