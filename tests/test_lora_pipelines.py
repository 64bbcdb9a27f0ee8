"""md-lora on whole pipelines against diffusers (tests/fixtures/lora, made by tools/fixtures/lora.py).

PEFT LoRAs made by peft on the tiny SD UNet, loaded by diffusers' `load_lora_weights` + `set_adapters`;
md reads the same files, merges them into its UNet and runs the same inputs (3 DDIM steps, 32 px).
"""

import numpy as np
import pytest
from flax import nnx

import md_lora
import md_sd
from md_core import testing

ATOL = 1e-3
PROMPTS = ["a photo of a cat", "an astronaut riding a horse on the moon"]
COMMON = dict(height=32, width=32, num_inference_steps=3, guidance_scale=5.0, progress=False)


@pytest.fixture(scope="module")
def root():
  return testing.fixture_path("lora")


@pytest.fixture(scope="module")
def outputs(root):
  return testing.load_cases(root / "outputs.npz")


@pytest.fixture(scope="module")
def sd():
  return md_sd.load_pipeline(testing.fixture_path("sd_pipeline") / "sd")


def _read(sd, path, **kw):
  return md_lora.load_lora(path, md_sd.unet_key_map(sd.unet.cfg), sd.unet, **kw)


def _generate(sd, base, adapters, latents):
  sd.replace_unet(md_lora.merge(base, adapters))
  try:
    return np.asarray(sd(PROMPTS, latents=latents, **COMMON))
  finally:
    sd.replace_unet(base)


@pytest.mark.parametrize("case", ["one", "two"])
def test_merged_lora_matches_diffusers(sd, root, outputs, case):
  a = _read(sd, root / "sd_a.safetensors")
  assert a.format == "peft" and len(a.weights) > 20
  assert {w.scale for w in a.weights.values()} == {2.0}  # lora_alpha 8 / r 4 from the header
  adapters = [(a, 1.0)]
  if case == "two":
    b = _read(sd, root / "sd_b.safetensors")
    assert {w.scale for w in b.weights.values()} == {0.5}
    adapters = [(a, 0.7), (b, 1.3)]
  want = outputs[case]["images"]
  got = _generate(sd, sd.unet, adapters, outputs[case]["latents"])
  err = float(np.abs(got - want).max())
  print(f"{case}: max abs error {err:.2e}")
  assert err < ATOL, f"max abs error {err:.2e}"


def test_kohya_file_equals_peft_file(sd, root):
  peft = _read(sd, root / "sd_a.safetensors")
  kohya = _read(sd, root / "sd_a_kohya.safetensors")
  assert kohya.format == "kohya" and set(kohya.weights) == set(peft.weights)
  for site, w in peft.weights.items():
    np.testing.assert_allclose(kohya.weights[site].delta(), w.delta(), atol=1e-6, rtol=0)
  # The merged UNets agree weight for weight (so do their outputs).
  merged = [nnx.state(md_lora.merge(sd.unet, [(x, 0.9)])) for x in (peft, kohya)]
  for (p, v0), (_, v1) in zip(*(nnx.to_flat_state(m) for m in merged)):
    np.testing.assert_allclose(v1.get_value(), v0.get_value(), atol=1e-6, rtol=0, err_msg=str(p))


def test_unmerge_restores_the_unet(sd, root):
  a = _read(sd, root / "sd_a.safetensors")
  back = md_lora.unmerge(md_lora.merge(sd.unet, [(a, 0.8)]), [(a, 0.8)])
  for (p, v0), (_, v1) in zip(
    nnx.to_flat_state(nnx.state(sd.unet)), nnx.to_flat_state(nnx.state(back))
  ):
    np.testing.assert_allclose(
      np.asarray(v1.get_value()), np.asarray(v0.get_value()), atol=1e-5, err_msg=str(p)
    )
