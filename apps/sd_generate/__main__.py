"""sd_generate: Stable Diffusion 1.x / 2.x / XL images with md-sd; writes PNGs and the settings used.

Text-to-image, image-to-image (`--config.image=`), one or several ControlNets (also with an image), and the
SDXL base + refiner ensemble (`--config.refiner=`, md_sd.generate_with_refiner).

uv run apps/sd_generate --config.prompt="a red circle in the top left"   # md's shapes model (no --config)
uv run apps/sd_generate --config=apps/configs/sd.py:sd1.5 --config.prompt="a photo of a cat" --workdir=out
uv run apps/sd_generate --help --config=apps/configs/sd.py:tiny   # the variants, keys and values
"""

import os
import sys
import time

# Before jax loads: its C++ start-up INFO lines stay hidden unless --verbosity asks (md_core.apps.quiet).
if not any(a.startswith(("--verbosity", "-v")) for a in sys.argv[1:]):
  os.environ["TF_CPP_MIN_LOG_LEVEL"] = os.environ.get("TF_CPP_MIN_LOG_LEVEL") or "2"

from ml_collections import config_flags  # noqa: E402

from md_cache import settings as cache_settings  # noqa: E402
from md_core import apps  # noqa: E402
from md_lora import settings as lora_settings  # noqa: E402

# Without --config: the `default` variant, md's own shapes model (models/shapes-sd).
_DEFAULT_CONFIG = os.path.join(os.path.dirname(__file__), "..", "configs", "sd.py") + ":default"
_CONFIG = config_flags.DEFINE_config_file(
  "config",
  None,
  "ml-collections config file (apps/configs/sd.py:<variant>; without it: the `default` variant, md's "
  "shapes model).",
)
_WORKDIR, _OVERWRITE = apps.define_output_flags("outputs/sd", "images")
_FIXED = ("variant",)


def _check(config, folder):
  """Every check that needs no weights; returns (mesh, sources, image files)."""
  import md_sd

  p = apps.Problems(config)
  model = apps.check_local(p, "model")
  nets = apps.check_local(p, "controlnet")
  refiner = apps.check_local(p, "refiner")
  unet = apps.check_local(p, "unet_file")
  images = dict(
    image=apps.check_local(p, "image", image=True),
    control_image=apps.check_local(p, "control_image", image=True),
  )
  p.require(bool(model), "--config.model is empty: give a diffusers pipeline folder or hub id")
  p.call(md_sd.check_size, config.height, config.width)
  p.positive("num_inference_steps", "num_images_per_prompt")
  p.positive("clip_skip", optional=True)
  p.at_least("guidance_scale", 0)
  p.fraction("strength")
  p.fraction("guidance_rescale", low_open=False)
  p.dtype("dtype")
  controls = images["control_image"]
  if nets and not controls:
    p.add(f"variant {config.variant!r} uses a ControlNet: set --config.control_image=<image file>")
  elif nets and len(controls) != len(nets):
    p.add(
      f"{len(nets)} ControlNet(s) need as many control images (comma-separated), got {len(controls)}"
    )
  if controls and not nets:
    p.add("control_image is set but no ControlNet: set --config.controlnet=")
  if refiner and (images["image"] or nets):
    p.add("the base + refiner ensemble is text-to-image without ControlNet: unset image/controlnet")
  if refiner:
    p.fraction("refiner_start", high_open=True)
  if model:
    apps.scheduler_steps_problem(p, model[0])
  p.call(cache_settings.make_cache, config, md_sd.StableDiffusionPipeline)
  apps.check_quantization(p, config)
  lora_settings.check_loras(p, config)
  mesh = apps.finish_checks(p, config, folder)
  return mesh, dict(model=model[0], nets=nets, refiner=refiner, unet=unet), images


def main(argv):
  from md_core import media
  from md_core import progress as md_progress
  from md_data import prompt_warning

  config = _CONFIG.value
  folder = apps.output_folder(_WORKDIR.value, overwrite=_OVERWRITE.value)
  with md_progress.phase("checking"):
    mesh, src, files = _check(config, folder)
  print(apps.describe_mesh(mesh))
  if config.variant == "default" and (note := prompt_warning(config.prompt, kind="image")):
    print(f"warning: {note}", file=sys.stderr)  # md's shapes model draws its grammar only

  import jax.numpy as jnp
  import numpy as np

  import md_sd

  start = time.perf_counter()
  load = dict(
    mesh=mesh, dtype=jnp.dtype(config.dtype), quantization=config.quantization, progress=True
  )
  nets = src["nets"]
  with md_progress.phase("loading", announce=True):
    pipe = md_sd.load_pipeline(
      src["model"],
      controlnet=(nets[0] if len(nets) == 1 else nets) or None,
      unet_file=src["unet"][0] if src["unet"] else None,
      **load,
    )
    lora_settings.load_loras(pipe, config)  # --config.loras, at run time
    refiner = md_sd.load_pipeline(src["refiner"][0], **load) if src["refiner"] else None
  loaded = time.perf_counter() - start
  size = (config.height, config.width)
  options = {"timestep_spacing": config.timestep_spacing} if config.timestep_spacing else None
  kwargs = dict(
    height=config.height,
    width=config.width,
    num_inference_steps=config.num_inference_steps,
    guidance_scale=config.guidance_scale,
    guidance_rescale=config.guidance_rescale,
    num_images_per_prompt=config.num_images_per_prompt,
    seed=config.seed,
    clip_skip=config.clip_skip,
    scheduler=config.scheduler or None,
    scheduler_options=options,
  )
  if pipe.requires_aesthetics_score or refiner is not None:
    kwargs.update(
      aesthetic_score=config.aesthetic_score,
      negative_aesthetic_score=config.negative_aesthetic_score,
    )
  if files["image"]:
    kwargs.update(
      image=media.load_image(files["image"][0], size=size)[None], strength=config.strength
    )
  if nets:
    controls = [media.load_image(f, size=size)[None] for f in files["control_image"]]
    kwargs.update(
      control_image=controls[0] if len(controls) == 1 else controls,
      controlnet_conditioning_scale=config.controlnet_conditioning_scale,
      control_guidance_start=config.control_guidance_start,
      control_guidance_end=config.control_guidance_end,
    )
  kwargs["cache"] = cache_settings.make_cache(config, pipe)
  start = time.perf_counter()
  negative = config.negative_prompt or None
  with md_progress.phase("generating", announce=True):
    try:
      if refiner is None:
        images = pipe(config.prompt, negative, **kwargs)
      else:
        images = md_sd.generate_with_refiner(
          pipe, refiner, config.prompt, negative, refiner_start=config.refiner_start, **kwargs
        )
    except ValueError as e:
      raise apps.UsageError(str(e)) from None
    images = np.asarray(images)
  seconds = time.perf_counter() - start

  with md_progress.phase("writing"):
    names = [p.name for p in media.save_images(folder.staging(), images)]
    sched = pipe.make_scheduler(config.scheduler or None, **(options or {}))
    report = cache_settings.cache_report(pipe)
    apps.finish_run(
      folder,
      config,
      wrote=f"{len(names)} image(s)",
      seconds=seconds,
      loaded=loaded,
      lines=[cache_settings.cache_line(config.cache, report)],
      cache_report=report,
      scheduler=sched.name,
      scheduler_config=dict(sched.config),
      images=names,
    )


if __name__ == "__main__":
  if not any(a == "--config" or a.startswith("--config=") for a in sys.argv[1:]):
    sys.argv.insert(1, f"--config={_DEFAULT_CONFIG}")  # no --config: md's shapes model
  apps.run(main, doc=__doc__, fixed=_FIXED)
