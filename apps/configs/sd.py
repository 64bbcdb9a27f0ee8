"""sd_generate: Stable Diffusion 1.x / 2.x / XL text-to-image (image-to-image, ControlNet) with md-sd.

uv run apps/sd_generate --config.prompt="a red circle in the top left"   # md's shapes model (no --config)
uv run apps/sd_generate --config=apps/configs/sd.py:sd1.5 --config.prompt="a photo of a cat"
uv run apps/sd_generate --config=apps/configs/sd.py:sdxl --config.prompt="a cat surfing" --config.seed=3
uv run apps/sd_generate --config=apps/configs/sd.py:sdxl-lightning --config.prompt="a cat surfing"
uv run apps/sd_generate --config=apps/configs/sd.py:controlnet-sd --config.control_image=edges.png
uv run apps/sd_generate --config=apps/configs/sd.py:sd1.5 --config.image=photo.png --config.strength=0.6
uv run apps/sd_generate --config=apps/configs/sd.py:controlnet-multi-sd \
  --config.control_image=edges.png,depth.png      # one image per ControlNet, comma-separated
uv run apps/sd_generate --config=apps/configs/sd.py:sdxl-base-refiner --config.prompt="a lion"
uv run apps/sd_generate --config=apps/configs/sd.py:sdxl-refiner --config.image=photo.png
uv run apps/sd_generate --config=apps/configs/sd.py:tiny --workdir=/tmp/sd   # the bundled tiny pipeline
uv run apps/sd_generate --help --config=apps/configs/sd.py:tiny   # the variant's keys and values

Variants: default (md's own shapes model, models/shapes-sd), sd1.4, sd1.5, sd2-base, sd2.1, sdxl, sdxl-lightning, sdxl-refiner (image-to-image),
sdxl-base-refiner (base then refiner, the ensemble of experts), controlnet-sd, controlnet-sdxl,
controlnet-multi-sd, and tiny, tiny-sdxl, tiny-lightning, tiny-controlnet, tiny-controlnet-sdxl,
tiny-img2img, tiny-controlnet-img2img, tiny-multi-controlnet, tiny-refiner, tiny-sdxl-refiner
(tests/fixtures/sd_pipeline, tests/fixtures/sd_features). Hub ids need the hub cache (or network); offline
they fail with a message that says how to get them.
"""

import pathlib

import ml_collections
from ml_collections.config_dict import placeholder

from md_cache import settings as cache_settings
from md_core import apps as md_apps
from md_lora import settings as lora_settings

_FIXTURES = "tests/fixtures/sd_pipeline"
_FEATURES = "tests/fixtures/sd_features"
_TINY = dict(height=32, width=32, num_inference_steps=3)
# md's shapes model, found from this file so the default runs from any directory.
_SHAPES_MODEL = str(pathlib.Path(__file__).resolve().parents[2] / "models" / "shapes-sd")

# variant -> settings that differ from the defaults below
VARIANTS = {
  # md's own shapes model (models/shapes-sd, trained by apps/configs/default_models.py): what
  # `uv run apps/sd_generate --config.prompt="a red circle in the top left"` runs without --config.
  "default": dict(
    model=_SHAPES_MODEL,
    prompt="a red circle in the top left on a white background",
    negative_prompt="",
    height=64,
    width=64,
    num_inference_steps=20,
    guidance_scale=3.0,
  ),
  "sd1.4": dict(model="CompVis/stable-diffusion-v1-4"),
  "sd1.5": dict(model="stable-diffusion-v1-5/stable-diffusion-v1-5"),
  "sd2-base": dict(model="stabilityai/stable-diffusion-2-base"),
  "sd2.1": dict(model="stabilityai/stable-diffusion-2-1", height=768, width=768),
  "sdxl": dict(
    model="stabilityai/stable-diffusion-xl-base-1.0", height=1024, width=1024, guidance_scale=5.0
  ),
  "sdxl-lightning": dict(
    model="stabilityai/stable-diffusion-xl-base-1.0",
    unet_file="ByteDance/SDXL-Lightning/sdxl_lightning_4step_unet.safetensors",
    height=1024,
    width=1024,
    num_inference_steps=4,
    guidance_scale=0.0,
    scheduler="EulerDiscreteScheduler",
    timestep_spacing="trailing",
  ),
  "sdxl-refiner": dict(
    model="stabilityai/stable-diffusion-xl-refiner-1.0",
    height=1024,
    width=1024,
    guidance_scale=5.0,
    strength=0.3,
  ),
  "sdxl-base-refiner": dict(
    model="stabilityai/stable-diffusion-xl-base-1.0",
    refiner="stabilityai/stable-diffusion-xl-refiner-1.0",
    refiner_start=0.8,
    height=1024,
    width=1024,
    num_inference_steps=40,
    guidance_scale=5.0,
  ),
  "controlnet-multi-sd": dict(
    model="stable-diffusion-v1-5/stable-diffusion-v1-5",
    controlnet="lllyasviel/sd-controlnet-canny,lllyasviel/sd-controlnet-depth",
  ),
  "controlnet-sd": dict(
    model="stable-diffusion-v1-5/stable-diffusion-v1-5", controlnet="lllyasviel/sd-controlnet-canny"
  ),
  "controlnet-sdxl": dict(
    model="stabilityai/stable-diffusion-xl-base-1.0",
    controlnet="diffusers/controlnet-canny-sdxl-1.0",
    height=1024,
    width=1024,
    guidance_scale=5.0,
  ),
  "tiny": dict(model=f"{_FIXTURES}/sd", height=32, width=32, num_inference_steps=3),
  "tiny-sdxl": dict(
    model=f"{_FIXTURES}/sdxl", height=32, width=32, num_inference_steps=3, guidance_scale=5.0
  ),
  "tiny-lightning": dict(
    model=f"{_FIXTURES}/sdxl",
    unet_file=f"{_FIXTURES}/lightning_unet.safetensors",
    height=32,
    width=32,
    num_inference_steps=3,
    guidance_scale=0.0,
    scheduler="EulerDiscreteScheduler",
    timestep_spacing="trailing",
  ),
  "tiny-controlnet": dict(
    model=f"{_FIXTURES}/sd",
    controlnet=f"{_FIXTURES}/controlnet_sd",
    control_image=f"{_FIXTURES}/control.png",
    height=32,
    width=32,
    num_inference_steps=3,
  ),
  "tiny-controlnet-sdxl": dict(
    model=f"{_FIXTURES}/sdxl",
    controlnet=f"{_FIXTURES}/controlnet_sdxl",
    control_image=f"{_FIXTURES}/control.png",
    height=32,
    width=32,
    num_inference_steps=3,
    guidance_scale=5.0,
  ),
  "tiny-img2img": dict(
    model=f"{_FIXTURES}/sd",
    image=f"{_FIXTURES}/control.png",
    strength=0.7,
    scheduler="DPMSolverMultistepScheduler",
    **_TINY,
  ),
  "tiny-controlnet-img2img": dict(
    model=f"{_FIXTURES}/sd",
    controlnet=f"{_FIXTURES}/controlnet_sd",
    control_image=f"{_FIXTURES}/control.png",
    image=f"{_FIXTURES}/control.png",
    strength=0.7,
    **_TINY,
  ),
  "tiny-multi-controlnet": dict(
    model=f"{_FIXTURES}/sd",
    controlnet=f"{_FIXTURES}/controlnet_sd,{_FEATURES}/controlnet_sd_b",
    control_image=f"{_FIXTURES}/control.png,{_FIXTURES}/control.png",
    control_guidance_end=0.7,
    **_TINY,
  ),
  "tiny-refiner": dict(
    model=f"{_FEATURES}/refiner",
    image=f"{_FIXTURES}/control.png",
    strength=0.5,
    guidance_scale=5.0,
    **_TINY,
  ),
  "tiny-sdxl-refiner": dict(
    model=f"{_FIXTURES}/sdxl",
    refiner=f"{_FEATURES}/refiner",
    refiner_start=0.6,
    guidance_scale=5.0,
    **dict(_TINY, num_inference_steps=4),
  ),
}


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  name = arg or "sd1.5"
  if name not in VARIANTS:
    raise ValueError(
      f"apps/configs/sd.py: unknown variant {name!r}; choose one of {sorted(VARIANTS)}"
    )
  c = ml_collections.ConfigDict()
  c.variant = name
  # The pipeline: a diffusers folder or hub id; optional ControlNet(s) (comma-separated folders / hub ids,
  # used together) and UNet-only file (local or org/name/file).
  c.model = ""
  c.controlnet = ""
  c.unet_file = ""
  # SDXL ensemble of experts: a refiner pipeline that takes over at `refiner_start` (the base stops there
  # with denoising_end and hands its latents over; the refiner continues with denoising_start).
  c.refiner = ""
  c.refiner_start = 0.8
  # SDXL refiner micro-conditioning (pipelines with requires_aesthetics_score).
  c.aesthetic_score = 6.0
  c.negative_aesthetic_score = 2.5
  c.dtype = "float32"
  # What to generate.
  c.prompt = "a photo of an astronaut riding a horse on the moon"
  c.negative_prompt = ""
  c.num_images_per_prompt = 1
  c.height = 512
  c.width = 512
  c.num_inference_steps = 30
  c.guidance_scale = 7.5
  c.guidance_rescale = 0.0
  # Skip this many final text-encoder layers for the prompt (None: none), as diffusers' clip_skip.
  c.clip_skip = placeholder(int)
  c.seed = 0
  # A diffusers scheduler class name ("" keeps the checkpoint's) and its timestep spacing ("" keeps it).
  c.scheduler = ""
  c.timestep_spacing = ""
  # Image-to-image: an input image (resized to height x width) and the share of the schedule to run.
  c.image = ""
  c.strength = 0.8
  # ControlNet: the conditioning image(s) (resized to height x width; comma-separated, one per ControlNet),
  # the residuals' scale and the share of the steps each ControlNet acts on (applied to every ControlNet).
  c.control_image = ""
  c.controlnet_conditioning_scale = 1.0
  c.control_guidance_start = 0.0
  c.control_guidance_end = 1.0
  md_apps.add_runtime_config(c)  # mesh, distributed, compilation_cache
  cache_settings.add_cache_config(c)  # cache, cache_options (md-cache)
  md_apps.add_quantization_config(c)  # quantization: int8, int8-dynamic or fp8
  lora_settings.add_lora_config(c)  # loras: "file[:scale][@component],…" (md-lora, at run time)
  c.update(VARIANTS[name])
  c.lock()
  return c
