"""SDXL LoRAs through the pipeline API against diffusers (tests/fixtures/lora_sdxl, made by
tools/fixtures/lora_sdxl.py): one file with PEFT LoRAs on the UNet and both CLIP text encoders, a second
UNet-only file, and the first in kohya's SDXL layout (SGM names, `lora_te1_` / `lora_te2_`), at run time and
fused, on the tiny SDXL pipeline (3 Euler steps, CFG 5, final latents). The reference loads the UNet LoRAs
with diffusers (`load_lora_into_unet` + `set_adapters`) and merges the text encoders' in torch (transformers
5.24 refuses peft 0.21 for text-encoder LoRAs).
"""

import numpy as np
import pytest

import md_core
import md_sd
from md_core import testing

ATOL = 1e-3
PROMPTS = ["a photo of a cat", "an astronaut riding a horse on the moon"]
COMMON = dict(
  height=32, width=32, num_inference_steps=3, guidance_scale=5.0, output_type="latent",
  progress=False,
)  # fmt: skip
COMPONENTS = {"unet", "text_encoder", "text_encoder_2"}


@pytest.fixture(scope="module")
def root():
  return testing.fixture_path("lora_sdxl")


@pytest.fixture(scope="module")
def outputs(root):
  return testing.load_cases(root / "outputs.npz")


@pytest.fixture(scope="module")
def sdxl(root):
  """The tiny SDXL pipeline with sdxl_a (UNet + both text encoders) and sdxl_b (UNet) at run time."""
  pipe = md_sd.load_pipeline(testing.fixture_path("sd_pipeline") / "sdxl")
  pipe.load_lora(root / "sdxl_a.safetensors", name="a", max_rank=8)
  pipe.load_lora(root / "sdxl_b.safetensors", name="b")
  return pipe


def _err(pipe, case):
  got = np.asarray(pipe(PROMPTS, latents=case["latents"], **COMMON))
  assert got.shape == case["latents_out"].shape, got.shape
  return float(np.abs(got - case["latents_out"]).max())


def test_runtime_and_fused_match_diffusers(sdxl, root, outputs):
  pipe = sdxl
  assert set(pipe.loras["a"]["scales"]) == COMPONENTS
  assert pipe.loras["b"]["scales"] == {"unet": 1.0}
  assert all(md_core.lora_rank(getattr(pipe, c)) == 8 for c in COMPONENTS)
  errors = {}
  pipe.set_adapters({})
  errors["base"] = _err(pipe, outputs["base"])
  pipe.set_adapters({"a": 1.0})
  errors["one runtime"] = _err(pipe, outputs["one"])
  pipe.set_adapters({"a": 0.7, "b": 1.3})
  errors["two runtime"] = _err(pipe, outputs["two"])
  pipe.fuse_lora()
  errors["two fused"] = _err(pipe, outputs["two"])
  pipe.unfuse_lora()
  errors["two unfused"] = _err(pipe, outputs["two"])
  pipe.set_adapters("a")
  pipe.fuse_lora("a")
  errors["one fused"] = _err(pipe, outputs["one"])
  pipe.unfuse_lora()
  # The same weights in kohya's SDXL layout (SGM UNet names, lora_te1_ / lora_te2_).
  pipe.load_lora(root / "sdxl_a_kohya.safetensors", name="kohya")
  assert set(pipe.loras["kohya"]["scales"]) == COMPONENTS
  pipe.set_adapters("kohya")
  errors["one kohya runtime"] = _err(pipe, outputs["one"])
  pipe.unload_lora("kohya")
  print({k: f"{v:.1e}" for k, v in errors.items()})
  assert max(errors.values()) < ATOL, errors
  moved = np.abs(outputs["one"]["latents_out"] - outputs["base"]["latents_out"]).max()
  assert moved > 0.05  # the LoRA matters


def test_text_encoder_only_and_errors(sdxl, root, tmp_path):
  """A file with only text_encoder_2's keys adapts only it; components outside the pipeline's are named."""
  pipe = sdxl
  source = md_core.SafetensorsFile(root / "sdxl_a.safetensors")
  te2 = {k: np.asarray(source[k]) for k in source if k.startswith("text_encoder_2.")}
  md_core.save_safetensors(tmp_path / "te2.safetensors", te2, metadata=source.metadata)
  pipe.load_lora(tmp_path / "te2.safetensors", name="te2")
  assert pipe.loras["te2"]["scales"] == {"text_encoder_2": 1.0}
  with pytest.raises(ValueError, match=r"must name exactly \['text_encoder_2'\]"):
    pipe.set_adapters({"te2": {"unet": 1.0}})
  pipe.unload_lora("te2")
  with pytest.raises(ValueError, match=r"LoRAs apply to \['unet'\] \(and \['text_encoder', "):
    pipe.load_lora(root / "sdxl_b.safetensors", name="c", component="transformer")
