"""SD pipeline features against diffusers (tests/fixtures/sd_features, from tools/fixtures/sd_features.py):
image-to-image with every kind of scheduler (multistep solvers restarted part-way, Heun's paired calls,
PNDM's counter), several ControlNets with guidance windows, ControlNet image-to-image, and the SDXL refiner
alone and after a base run cut by `denoising_end`. Each case repeats the reference's call on md's pipeline
and compares float images within 1e-3 (32 px, 3-6 steps)."""

import numpy as np
import pytest

import md_sd
from md_core import testing

ATOL = 1e-3
PROMPTS = ["a photo of a cat", "an astronaut riding a horse on the moon"]
SCHEDULERS = {
  "ddim": ("DDIMScheduler", {}),
  "euler": ("EulerDiscreteScheduler", {}),
  "dpm": ("DPMSolverMultistepScheduler", {}),
  "unipc": ("UniPCMultistepScheduler", {}),
  "pndm": ("PNDMScheduler", {"skip_prk_steps": True}),
  "heun": ("HeunDiscreteScheduler", {}),
  "lms": ("LMSDiscreteScheduler", {}),
  "dpm_single": ("DPMSolverSinglestepScheduler", {}),
  "pndm_prk": ("PNDMScheduler", {"skip_prk_steps": False}),
}
I2I = dict(num_inference_steps=4, strength=0.75, guidance_scale=5.0, progress=False)
COMMON = dict(height=32, width=32, num_inference_steps=3, guidance_scale=5.0, progress=False)
MULTI = dict(
  controlnet_conditioning_scale=[0.8, 0.5],
  control_guidance_start=[0.0, 0.34],
  control_guidance_end=[0.67, 1.0],
)


@pytest.fixture(scope="module")
def base():
  return testing.fixture_path("sd_pipeline")


@pytest.fixture(scope="module")
def root():
  return testing.fixture_path("sd_features")


@pytest.fixture(scope="module")
def outputs(root):
  return testing.load_cases(root / "outputs.npz")


@pytest.fixture(scope="module")
def sd(base):
  return md_sd.load_pipeline(base / "sd")


@pytest.fixture(scope="module")
def refiner(root):
  return md_sd.load_pipeline(root / "refiner")


def check(images, want):
  images = np.asarray(images)
  assert images.shape == want.shape and images.dtype == np.float32
  err = float(np.abs(images - want).max())
  print(f"max abs error {err:.2e}")  # shown with pytest -rP
  assert err < ATOL, f"max abs error {err:.2e}"


def sched_kw(name):
  cls, options = SCHEDULERS[name]
  return dict(scheduler=cls, scheduler_options=options or None)


def noises(case):
  return dict(image=case["image"], noise=case["noise"], encode_noise=case["encode_noise"])


@pytest.mark.parametrize(
  "sched",
  [
    "dpm",
    *(
      pytest.param(s, marks=pytest.mark.slow)
      for s in ("ddim", "euler", "unipc", "pndm", "heun", "lms", "dpm_single")
    ),
  ],
)
def test_image_to_image_every_scheduler(sd, outputs, sched):
  case = outputs[f"img2img_{sched}"]
  check(sd(PROMPTS, **noises(case), **I2I, **sched_kw(sched)), case["images"])


@pytest.mark.slow
def test_image_to_image_pndm_runge_kutta_warm_up(sd, outputs):
  case = outputs["img2img_pndm_prk"]
  images = sd(
    PROMPTS,
    **noises(case),
    num_inference_steps=6,
    strength=0.5,
    guidance_scale=5.0,
    progress=False,
    **sched_kw("pndm_prk"),
  )
  check(images, case["images"])


@pytest.mark.slow
def test_image_to_image_one_image_two_per_prompt(sd, outputs):
  case = outputs["img2img_dpm_repeat"]
  images = sd(
    PROMPTS,
    **noises(case),
    num_images_per_prompt=2,
    num_inference_steps=6,
    strength=0.5,
    guidance_scale=4.0,
    progress=False,
    **sched_kw("dpm"),
  )
  check(images, case["images"])


@pytest.mark.slow
def test_several_controlnets_sd(base, root, outputs):
  pipe = md_sd.load_pipeline(
    base / "sd", controlnet=[base / "controlnet_sd", root / "controlnet_sd_b"]
  )
  case = outputs["multi_controlnet_sd"]
  images = pipe(
    PROMPTS,
    latents=case["latents"],
    control_image=[case["image_0"], case["image_1"]],
    **MULTI,
    **COMMON,
  )
  check(images, case["images"])


@pytest.mark.slow
def test_several_controlnets_sdxl(base, root, outputs):
  pipe = md_sd.load_pipeline(
    base / "sdxl", controlnet=[base / "controlnet_sdxl", root / "controlnet_sdxl_b"]
  )
  case = outputs["multi_controlnet_sdxl"]
  images = pipe(
    PROMPTS,
    latents=case["latents"],
    control_image=[case["image_0"], case["image_1"]],
    scheduler="EulerDiscreteScheduler",
    **MULTI,
    **COMMON,
  )
  check(images, case["images"])


@pytest.mark.slow
def test_controlnet_image_to_image_sd(base, outputs):
  pipe = md_sd.load_pipeline(base / "sd", controlnet=base / "controlnet_sd")
  case = outputs["controlnet_img2img_sd"]
  images = pipe(
    PROMPTS,
    **noises(case),
    control_image=case["control_image"],
    controlnet_conditioning_scale=0.7,
    **I2I,
    **sched_kw("dpm"),
  )
  check(images, case["images"])


@pytest.mark.slow
def test_controlnet_image_to_image_sdxl(base, outputs):
  pipe = md_sd.load_pipeline(base / "sdxl", controlnet=base / "controlnet_sdxl")
  case = outputs["controlnet_img2img_sdxl"]
  images = pipe(
    PROMPTS,
    **noises(case),
    control_image=case["control_image"],
    controlnet_conditioning_scale=0.6,
    **I2I,
    **sched_kw("euler"),
  )
  check(images, case["images"])


@pytest.mark.slow
def test_sdxl_image_to_image_unipc(base, outputs):
  pipe = md_sd.load_pipeline(base / "sdxl")
  case = outputs["sdxl_img2img_unipc"]
  check(pipe(PROMPTS, **noises(case), **I2I, **sched_kw("unipc")), case["images"])


@pytest.mark.slow
def test_refiner_image_to_image(refiner, outputs):
  case = outputs["refiner_img2img"]
  images = refiner(
    PROMPTS,
    **noises(case),
    num_inference_steps=4,
    strength=0.5,
    guidance_scale=5.0,
    aesthetic_score=7.0,
    negative_aesthetic_score=2.0,
    progress=False,
    scheduler="EulerDiscreteScheduler",
  )
  check(images, case["images"])


@pytest.mark.parametrize("sched", ["euler", pytest.param("dpm", marks=pytest.mark.slow)])
def test_base_then_refiner(base, refiner, outputs, sched):
  """The ensemble of experts: the base stops at denoising_end and returns latents; the refiner continues
  from them with denoising_start (no noise added)."""
  xl = md_sd.load_pipeline(base / "sdxl")
  case = outputs[f"ensemble_{sched}"]
  run = dict(num_inference_steps=5, guidance_scale=5.0, progress=False, **sched_kw(sched))
  latents = xl(
    PROMPTS,
    latents=case["latents"],
    height=32,
    width=32,
    denoising_end=0.6,
    output_type="latent",
    **run,
  )
  check(latents, case["latents_out"])
  images = refiner(PROMPTS, image_latents=case["latents_out"], denoising_start=0.6, **run)
  check(images, case["images"])


def test_refiner_and_feature_errors(refiner, sd):
  with pytest.raises(ValueError, match="image-to-image model.*pass image or image_latents"):
    refiner(PROMPTS, height=32, width=32, progress=False)
  with pytest.raises(ValueError, match="denoising_start continues a run"):
    refiner(PROMPTS, height=32, width=32, denoising_start=0.5, progress=False)
  with pytest.raises(ValueError, match="SDXL options"):
    sd(PROMPTS, height=32, width=32, denoising_end=0.5, progress=False)
  with pytest.raises(ValueError, match="not latents"):
    sd(
      PROMPTS,
      image=np.zeros((2, 32, 32, 3), np.float32),
      latents=np.zeros((2, 4, 4, 4), np.float32),
      progress=False,
    )
  with pytest.raises(ValueError, match=r"image must be \[B, H, W, 3\].*got shape \(2, 4, 4, 4\)"):
    sd(PROMPTS, image=np.zeros((2, 4, 4, 4), np.float32), progress=False)
  with pytest.raises(ValueError, match="clip_skip=5 is out of range"):
    sd(PROMPTS, height=32, width=32, clip_skip=5, progress=False)
  with pytest.raises(ValueError, match="strength=0.1 with 4 steps leaves no step"):
    sd(PROMPTS, image=np.zeros((2, 32, 32, 3), np.float32), strength=0.1, num_inference_steps=4)


def test_several_controlnets_errors(base, sd):
  net = md_sd.load_controlnet(base / "controlnet_sd", subfolder=None)
  multi = md_sd.StableDiffusionPipeline(
    kind="sd",
    unet=sd.unet,
    vae=sd.vae,
    text_encoder=sd.text_encoder,
    tokenizer=sd.tokenizer,
    scheduler_config=sd.scheduler_config,
    controlnet=[net, net],
  )
  image = np.zeros((1, 32, 32, 3), np.float32)
  with pytest.raises(ValueError, match="2 ControlNets need a list of 2 control images, got 1"):
    multi(PROMPTS, height=32, width=32, control_image=image, progress=False)
  with pytest.raises(ValueError, match="controlnet_conditioning_scale has 3 entries"):
    multi(
      PROMPTS,
      height=32,
      width=32,
      control_image=[image, image],
      controlnet_conditioning_scale=[1.0, 1.0, 1.0],
      progress=False,
    )
  with pytest.raises(ValueError, match="control_guidance_start.*below control_guidance_end"):
    multi(
      PROMPTS,
      height=32,
      width=32,
      control_image=[image, image],
      control_guidance_start=0.5,
      control_guidance_end=0.5,
      progress=False,
    )
