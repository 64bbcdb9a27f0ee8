"""sd_generate: Stable Diffusion 1.x / 2.x / XL images with md-sd; writes PNGs and the settings used.

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
  if config.controlnet and not config.control_image:
    raise app.UsageError(
      f"variant {config.variant!r} uses a ControlNet: set --config.control_image=<image file>"
    )
  if config.image and config.controlnet:
    raise app.UsageError(
      "image-to-image with a ControlNet is not supported: set image or controlnet, not both"
    )


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
  try:
    pipe = md_sd.load_pipeline(
      config.model,
      controlnet=config.controlnet or None,
      unet_file=config.unet_file or None,
      mesh=mesh,
      dtype=jnp.dtype(config.dtype),
      progress=True,
    )
  except FileNotFoundError as e:
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
    scheduler=config.scheduler or None,
    scheduler_options=options,
  )
  if config.image:
    kwargs.update(image=media.load_image(config.image, size=size)[None], strength=config.strength)
  if config.control_image:
    kwargs.update(
      control_image=media.load_image(config.control_image, size=size)[None],
      controlnet_conditioning_scale=config.controlnet_conditioning_scale,
    )
  start = time.perf_counter()
  try:
    images = pipe(config.prompt, config.negative_prompt or None, **kwargs)
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
