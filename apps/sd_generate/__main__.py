"""sd_generate: Stable Diffusion 1.x / 2.x / XL images with md-sd; writes PNGs and the settings used.

Text-to-image, image-to-image (`--config.image=`), one or several ControlNets (also with an image), and the
SDXL base + refiner ensemble (`--config.refiner=`).

uv run apps/sd_generate --config=apps/configs/sd.py:sd1.5 --config.prompt="a photo of a cat" --workdir=out
"""

import json
import pathlib
import time

from absl import app, flags
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file(
  "config", None, "ml-collections config file (apps/configs/sd.py:<variant>)."
)
_WORKDIR = flags.DEFINE_string(
  "workdir", "outputs/sd", "Folder the images and settings.json go to."
)


def _check(config) -> None:
  if not config.model:
    raise app.UsageError("--config.model is empty: give a diffusers pipeline folder or hub id")
  if config.height % 8 or config.width % 8:
    import md_sd

    try:
      md_sd.check_size(config.height, config.width)
    except ValueError as e:
      raise app.UsageError(str(e)) from None
  nets, images = _split(config.controlnet), _split(config.control_image)
  if nets and not images:
    raise app.UsageError(
      f"variant {config.variant!r} uses a ControlNet: set --config.control_image=<image file>"
    )
  if nets and len(images) != len(nets):
    raise app.UsageError(
      f"{len(nets)} ControlNet(s) need as many control images (comma-separated), got {len(images)}"
    )
  if images and not nets:
    raise app.UsageError("control_image is set but no ControlNet: set --config.controlnet=")
  if config.refiner and (config.image or nets):
    raise app.UsageError(
      "the base + refiner ensemble is text-to-image without ControlNet: unset image/controlnet"
    )
  if config.refiner and not 0.0 < config.refiner_start < 1.0:
    raise app.UsageError(f"refiner_start must be in (0, 1), got {config.refiner_start}")


def _split(value: str) -> list[str]:
  return [v.strip() for v in value.split(",") if v.strip()] if value else []


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(
      f"unexpected arguments {argv[1:]}; settings go through --config.<key>=<value>"
    )
  config = _CONFIG.value
  if config is None:
    raise app.UsageError("--config is required, e.g. --config=apps/configs/sd.py:sd1.5")
  _check(config)
  from md_core import apps, media

  try:
    mesh = apps.start(config)
  except ValueError as e:  # a mesh that does not fit the devices
    raise app.UsageError(str(e)) from None
  print(apps.describe_mesh(mesh))

  import jax.numpy as jnp
  import numpy as np

  import md_sd

  start = time.perf_counter()
  nets = _split(config.controlnet)
  load = dict(mesh=mesh, dtype=jnp.dtype(config.dtype), progress=True)
  try:
    pipe = md_sd.load_pipeline(
      config.model,
      controlnet=(nets[0] if len(nets) == 1 else nets) or None,
      unet_file=config.unet_file or None,
      **load,
    )
    refiner = md_sd.load_pipeline(config.refiner, **load) if config.refiner else None
  except (FileNotFoundError, ValueError) as e:
    raise app.UsageError(str(e)) from None
  loaded = time.perf_counter() - start
  size = (config.height, config.width)
  options = {"timestep_spacing": config.timestep_spacing} if config.timestep_spacing else None
  kwargs = dict(
    height=config.height,
    width=config.width,
    num_inference_steps=config.steps,
    guidance_scale=config.guidance_scale,
    guidance_rescale=config.guidance_rescale,
    num_images_per_prompt=config.num_images_per_prompt,
    seed=config.seed,
    clip_skip=config.clip_skip or None,
    scheduler=config.scheduler or None,
    scheduler_options=options,
  )
  if pipe.requires_aesthetics_score:
    kwargs.update(
      aesthetic_score=config.aesthetic_score,
      negative_aesthetic_score=config.negative_aesthetic_score,
    )
  if config.image:
    kwargs.update(image=media.load_image(config.image, size=size)[None], strength=config.strength)
  if nets:
    controls = [media.load_image(f, size=size)[None] for f in _split(config.control_image)]
    kwargs.update(
      control_image=controls[0] if len(controls) == 1 else controls,
      controlnet_conditioning_scale=config.controlnet_conditioning_scale,
      control_guidance_start=config.control_guidance_start,
      control_guidance_end=config.control_guidance_end,
    )
  start = time.perf_counter()
  negative = config.negative_prompt or None
  try:
    if refiner is None:
      images = pipe(config.prompt, negative, **kwargs)
    else:
      # The ensemble of experts: the base denoises the high-noise share and hands over its latents.
      latents = pipe(
        config.prompt, negative, denoising_end=config.refiner_start, output_type="latent", **kwargs
      )
      refine = {k: v for k, v in kwargs.items() if k not in ("height", "width")}
      refine.update(
        aesthetic_score=config.aesthetic_score,
        negative_aesthetic_score=config.negative_aesthetic_score,
        num_images_per_prompt=1,
      )
      images = refiner(
        [config.prompt] * latents.shape[0],
        None if negative is None else [negative] * latents.shape[0],
        image_latents=latents,
        denoising_start=config.refiner_start,
        **refine,
      )
  except ValueError as e:
    raise app.UsageError(str(e)) from None
  images = np.asarray(images)
  seconds = time.perf_counter() - start

  out = pathlib.Path(_WORKDIR.value)
  paths = media.save_images(out, images)
  sched = pipe.make_scheduler(config.scheduler or None, **(options or {}))
  settings = dict(
    config.to_dict(),
    scheduler=sched.name,
    scheduler_config=dict(sched.config),
    images=[p.name for p in paths],
    load_seconds=round(loaded, 2),
    generate_seconds=round(seconds, 2),
  )
  (out / "settings.json").write_text(json.dumps(settings, indent=2, default=str) + "\n")
  print(
    f"wrote {len(paths)} image(s) and settings.json to {out} ({seconds:.1f}s, load {loaded:.1f}s)"
  )


if __name__ == "__main__":
  app.run(main)
