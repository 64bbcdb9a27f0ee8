"""SD inputs as the reference reads them: a str is one prompt; PIL / uint8 / float images on diffusers'
scale (others refused); a saved ControlNet pipeline folder loads its ControlNet(s).

Parity cases come from tests/fixtures/sd_controlnet_folder (tools/fixtures/sd_controlnet_folder.py): the
reference ran with PIL images, stored as the uint8 arrays they were made from. 3 steps, 32x32 pixels.
"""

import json
import shutil

import numpy as np
import pytest
from PIL import Image

import md_sd
from md_core import testing

ATOL = 1e-3
PROMPTS = ["a photo of a cat", "an astronaut riding a horse on the moon"]
COMMON = dict(height=32, width=32, num_inference_steps=3, progress=False)
ROOT = testing.fixture_path("sd_controlnet_folder")


@pytest.fixture(scope="module")
def outputs():
  return testing.load_cases(ROOT / "outputs.npz")


@pytest.fixture(scope="module")
def control_sd():
  return md_sd.load_pipeline(ROOT / "sd")


def _pil(pixels):
  return [Image.fromarray(p) for p in pixels]


def _err(got, want) -> float:
  got = np.asarray(got)
  assert got.shape == want.shape and got.dtype == np.float32
  return float(np.abs(got - want).max())


@pytest.mark.parametrize("folder", ["sd", "sdxl"])
def test_encode_prompt_str_is_one_prompt(folder):
  pipe = md_sd.load_pipeline(testing.fixture_path("sd_pipeline") / folder)
  one, listed = pipe.encode_prompt("a cat"), pipe.encode_prompt(["a cat"])
  for a, b in zip(one, listed, strict=True):
    if b is None:
      assert a is None
      continue
    assert a.shape[0] == 1
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_controlnet_folder_loads_its_controlnet(control_sd, outputs):
  """A saved StableDiffusionControlNetPipeline runs its ControlNet without `controlnet=`; the control
  image as PIL images, uint8 or the same pixels as floats gives the reference's images."""
  assert len(control_sd.controlnets) == 1
  assert isinstance(control_sd.controlnet, md_sd.ControlNetModel)
  case = outputs["sd_text"]
  kw = dict(
    latents=case["latents"], guidance_scale=5.0, controlnet_conditioning_scale=0.8, **COMMON
  )
  pixels = case["control_image"]
  from_pil = np.asarray(control_sd(PROMPTS, control_image=_pil(pixels), **kw))
  assert _err(from_pil, case["images"]) < ATOL
  for same in (pixels, pixels / np.float32(255.0), list(pixels)):
    np.testing.assert_array_equal(
      np.asarray(control_sd(PROMPTS, control_image=same, **kw)), from_pil
    )


def test_image_to_image_with_pil_inputs(control_sd, outputs):
  """ControlNet image-to-image with PIL `image` and `control_image` (the reference's
  StableDiffusionControlNetImg2ImgPipeline on the folder's components); uint8 gives the same."""
  case = outputs["sd_img2img"]
  kw = dict(
    strength=0.7,
    noise=case["noise"],
    encode_noise=case["encode_noise"],
    guidance_scale=5.0,
    controlnet_conditioning_scale=0.8,
    **COMMON,
  )
  image, control = case["image"], case["control_image"]
  from_pil = np.asarray(control_sd(PROMPTS, image=_pil(image), control_image=_pil(control), **kw))
  assert _err(from_pil, case["images"]) < ATOL
  from_uint8 = np.asarray(control_sd(PROMPTS, image=image, control_image=control, **kw))
  np.testing.assert_array_equal(from_uint8, from_pil)
  as_float = np.asarray(
    control_sd(PROMPTS, image=image / np.float32(255), control_image=control, **kw)
  )
  np.testing.assert_array_equal(as_float, from_pil)


def test_plain_image_to_image_uint8_and_pil():
  """SD image-to-image (tests/fixtures/sd_pipeline): the reference's float image quantised to 8 bits
  gives the same images as uint8, as PIL images and as the floats u / 255 (uint8 used to be read as
  floats in [0, 255]); the float input itself matches the reference (test_pipeline.py)."""
  sd = md_sd.load_pipeline(testing.fixture_path("sd_pipeline") / "sd")
  case = {
    k.split("/")[1]: v
    for k, v in testing.load_arrays(testing.fixture_path("sd_pipeline") / "outputs.npz").items()
    if k.startswith("img2img_ddim/")
  }
  kw = dict(
    strength=0.7,
    noise=case["noise"],
    encode_noise=case["encode_noise"],
    guidance_scale=5.0,
    scheduler="DDIMScheduler",
    **COMMON,
  )
  assert _err(sd(PROMPTS, image=case["image"], **kw), case["images"]) < ATOL
  u = np.round(case["image"] * 255).astype(np.uint8)
  from_float = np.asarray(sd(PROMPTS, image=u / np.float32(255), **kw))
  np.testing.assert_array_equal(np.asarray(sd(PROMPTS, image=u, **kw)), from_float)
  np.testing.assert_array_equal(np.asarray(sd(PROMPTS, image=_pil(u), **kw)), from_float)
  assert _err(from_float, case["images"]) < 0.05  # 8-bit rounding of the input, nothing more


@pytest.mark.slow
def test_sdxl_multi_controlnet_folder(outputs):
  """An SDXL pipeline saved with a MultiControlNetModel (`controlnet/`, `controlnet_1/`) loads both."""
  pipe = md_sd.load_pipeline(ROOT / "sdxl_multi")
  assert pipe.kind == "sdxl" and len(pipe.controlnets) == 2
  case = outputs["sdxl_multi_text"]
  images = pipe(
    PROMPTS,
    latents=case["latents"],
    control_image=[Image.fromarray(case["control_image_0"][0]), case["control_image_1"]],
    guidance_scale=5.0,
    controlnet_conditioning_scale=[0.8, 0.5],
    control_guidance_start=[0.0, 0.34],
    control_guidance_end=[0.67, 1.0],
    scheduler="EulerDiscreteScheduler",
    **COMMON,
  )
  assert _err(images, case["images"]) < ATOL


def test_image_inputs_refused(control_sd):
  x = np.random.default_rng(0).random((1, 32, 32, 3), np.float32)
  kw = dict(prompt="a cat", num_inference_steps=2, progress=False)
  bad = [
    (
      dict(image=x * 2 - 1, control_image=x),
      ValueError,
      r"image: float pixels must be in \[0, 1\]",
    ),
    (dict(image=x, control_image=x * 255), ValueError, r"control_image: float .*\[0, 255\]"),
    (dict(image=(x * 255).astype(np.int32), control_image=x), TypeError, "image: .*dtype int32"),
    (dict(image=x, control_image=x > 0.5), TypeError, "control_image: .*dtype bool"),
    (dict(image=x.astype(np.complex64), control_image=x), TypeError, "dtype complex64"),
    (dict(image=x[..., :1], control_image=x), ValueError, r"image: .*shape \(1, 32, 32, 1\)"),
    (dict(image=x, control_image=x[0, :, :, 0]), ValueError, r"control_image: .*shape \(32, 32\)"),
    (dict(image=x, control_image={"x": x}), TypeError, "control_image: .*got dict"),
    (dict(image="a cat", control_image=x), FileNotFoundError, "image: a cat: no such file"),
    (dict(image=np.zeros((1, 4, 4, 4), np.float32)), ValueError, "latents .* go in image_latents"),
    (dict(image=x, control_image=x[:, :16]), ValueError, r"control_image must be \[B, 32, 32, 3\]"),
  ]
  for inputs, error, match in bad:
    with pytest.raises(error, match=match):
      control_sd(**inputs, **kw)


def test_listed_controlnet_errors(tmp_path):
  """A ControlNet class md does not run, or a missing `controlnet/`, is refused by name."""
  src = ROOT / "sd"
  for name in ("unet", "vae", "text_encoder", "tokenizer", "scheduler"):
    (tmp_path / name).symlink_to(src / name)
  index = json.loads((src / "model_index.json").read_text())
  index["controlnet"] = ["diffusers", "ControlNetUnionModel"]
  (tmp_path / "model_index.json").write_text(json.dumps(index))
  with pytest.raises(ValueError, match=r"controlnet is a 'ControlNetUnionModel'; md loads"):
    md_sd.load_pipeline(tmp_path)
  index["controlnet"] = ["diffusers", "ControlNetModel"]
  (tmp_path / "model_index.json").write_text(json.dumps(index))
  with pytest.raises(FileNotFoundError, match=r"component 'controlnet' is missing"):
    md_sd.load_pipeline(tmp_path)
  shutil.copytree(src / "controlnet", tmp_path / "controlnet")
  assert len(md_sd.load_pipeline(tmp_path).controlnets) == 1
