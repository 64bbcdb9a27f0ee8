"""Flux.2 Klein LoRAs through the whole pipeline against diffusers' `Flux2KleinPipeline.load_lora_weights`
(tests/fixtures/lora_flux2_pipeline, tools/fixtures/lora_flux2_pipeline.py): the tiny Klein pipeline from text
with one file, two files with their own scales and one file fused, and an edit with two reference images; md
at run time (one compiled denoiser per image size) and fused. The denoiser parity against diffusers is in
tests/test_lora_families.py."""

import numpy as np
import pytest

import md_flux
from md_core import testing

FIXTURES = testing.fixture_path("flux2_pipeline")
PROMPTS = ["a photo of a cat", "An astronaut riding a horse on the moon"]
REFS = [FIXTURES / "ref_0.png", FIXTURES / "ref_1.png"]
TEXT = dict(
  num_inference_steps=3, guidance_scale=4.0, max_sequence_length=40,
  text_encoder_out_layers=(1, 2, 3), progress=False,
)  # fmt: skip
ATOL = 1e-3


@pytest.mark.filterwarnings("ignore:prompt . is .* tokens long")
def test_klein_pipeline_loras_match_diffusers():
  pipe = md_flux.load_pipeline(FIXTURES / "klein")
  root = testing.fixture_path("lora_flux2_pipeline")
  want = testing.load_cases(root / "outputs.npz")

  def err(case, **kw):
    kw = dict(prompt=PROMPTS, height=32, width=48) | kw
    got = np.asarray(pipe(latents=want[case]["latents"], **TEXT, **kw))
    assert got.shape == want[case]["images"].shape, got.shape
    return float(np.abs(got - want[case]["images"]).max())

  edit = dict(prompt=PROMPTS[1], image=REFS, num_images_per_prompt=2, height=None, width=None)
  errors = testing.lora_pipeline_errors(
    pipe,
    (root / "flux2_a.safetensors", root / "flux2_b.safetensors"),
    err,
    {"edit runtime": ("edit", edit)},
  )
  print({k: f"{v:.1e}" for k, v in errors.items()})
  assert max(errors.values()) < ATOL, errors
  for case in ("one", "two", "fused"):  # the LoRAs matter
    assert np.abs(want[case]["images"] - want["base"]["images"]).max() > 0.05, case
