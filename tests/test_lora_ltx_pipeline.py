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
    assert got.shape == want[case]["frames"].shape, got.shape
    return float(np.abs(got - want[case]["frames"]).max())

  before = testing.base_weights(pipe.transformer)
  errors = {}
  pipe.load_lora(root / "ltx_a.safetensors", name="a", max_rank=8)
  pipe.load_lora(root / "ltx_b.safetensors", name="b")
  pipe.set_adapters({})  # the slots in place, all scales 0: the same program as every case
  errors["base"] = err("base")
  pipe.set_adapters({"a": 1.0})
  errors["one runtime"] = err("one")
  pipe.set_adapters({"a": 0.7, "b": 1.3})
  errors["two runtime"] = err("two")
  pipe.fuse_lora()
  errors["two fused"] = err("two")
  pipe.unfuse_lora()
  pipe.set_adapters({"a": 0.8})
  errors["fused-at-0.8 as runtime"] = err("fused")
  pipe.fuse_lora("a")
  errors["fused at 0.8"] = err("fused")
  pipe.unfuse_lora()
  pipe.unload_lora()
  after = testing.base_weights(pipe.transformer)
  unload = max(float(np.abs(after[k] - before[k]).max()) for k in before)
  assert unload < 1e-6, f"unload_lora leaves the weights {unload:.1e} off"
  print({k: f"{v:.1e}" for k, v in errors.items()})
  assert max(errors.values()) < ATOL, errors
  for case in ("one", "two", "fused"):  # the LoRAs matter
    assert np.abs(want[case]["frames"] - want["base"]["frames"]).max() > 0.05, case
