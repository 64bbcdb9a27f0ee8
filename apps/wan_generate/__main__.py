"""wan_generate: Wan 2.1 / 2.2 videos with md-wan; writes MP4s and the settings used.

uv run apps/wan_generate --config.prompt="a green triangle moving up on a black background"   # md's shapes model (no --config)
uv run apps/wan_generate --config=apps/configs/wan.py:2.1-t2v-1.3b --config.prompt="a cat surfing" --workdir=out
uv run apps/wan_generate --help --config=apps/configs/wan.py:tiny   # the variants, keys and values
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

# Without --config: the `default` variant, md's own shapes model (models/shapes-wan).
_DEFAULT_CONFIG = os.path.join(os.path.dirname(__file__), "..", "configs", "wan.py") + ":default"
_CONFIG = config_flags.DEFINE_config_file(
  "config",
  None,
  "ml-collections config file (apps/configs/wan.py:<variant>; without it: the `default` variant, md's "
  "shapes model).",
)
_WORKDIR, _OVERWRITE = apps.define_output_flags("outputs/wan", "videos")
_FIXED = ("variant", "needs_image", "needs_last_image")


def _check(config, folder):
  """Every check that needs no weights; returns (mesh, model folder, images)."""
  import md_attention as mda
  import md_wan

  problems = apps.Problems(config)
  model = (apps.check_local(problems, "model") or [""])[0]
  source = apps.check_source("model", model)
  if config.needs_image and not config.image:
    problems.add(f"variant {config.variant!r} is image-to-video: set --config.image=<image file>")
  if config.needs_last_image and not config.last_image:
    problems.add(
      f"variant {config.variant!r} is first/last-frame-to-video: set --config.last_image=<image "
      "file> (and --config.image=<first frame>)"
    )
  if config.last_image and not config.image:
    problems.add("--config.last_image needs --config.image (the first frame) too")
  images = {
    k: apps.check_local(problems, k, image=True)[0] for k in ("image", "last_image") if config[k]
  }
  problems.positive(
    "num_inference_steps", "frame_rate", "num_videos_per_prompt", "max_sequence_length"
  )
  problems.positive("flow_shift", optional=True)
  problems.at_least("guidance_scale", 0)
  problems.at_least("guidance_scale_2", 0, optional=True)
  problems.dtype("dtype")
  problems.choice("attention", mda.IMPLEMENTATIONS)
  if source is None:
    for line in md_wan.WanVideoPipeline.size_problems(
      model, config.height, config.width, config.num_frames
    ):
      problems.add(f"--config.{line}")
    apps.scheduler_steps_problem(problems, model)
  problems.call(cache_settings.make_cache, config, md_wan.WanVideoPipeline)
  apps.check_quantization(problems, config)
  lora_settings.check_loras(problems, config)
  return apps.finish_checks(problems, config, folder), model, images


def main(argv):
  from md_core import media
  from md_core import progress as md_progress
  from md_data import prompt_warning

  config = _CONFIG.value
  folder = apps.output_folder(_WORKDIR.value, overwrite=_OVERWRITE.value)
  with md_progress.phase("checking"):
    mesh, model, images = _check(config, folder)
  print(apps.describe_mesh(mesh))
  if config.variant == "default" and (note := prompt_warning(config.prompt, kind="video")):
    print(f"warning: {note}", file=sys.stderr)  # md's shapes model draws its grammar only

  import jax.numpy as jnp
  import numpy as np

  import md_wan

  start = time.perf_counter()
  with md_progress.phase("loading", announce=True):
    pipe = md_wan.load_pipeline(
      model,
      mesh=mesh,
      dtype=jnp.dtype(config.dtype),
      quantization=config.quantization,
      attention=config.attention,
      remat=config.remat,
      progress=True,
    )
    lora_settings.load_loras(pipe, config)  # --config.loras, at run time
  loaded = time.perf_counter() - start
  size = (config.height, config.width)
  options = {} if config.flow_shift is None else {"flow_shift": config.flow_shift}
  pixels = {k: media.load_image(path, size=size) for k, path in images.items()}
  start = time.perf_counter()
  with md_progress.phase("generating", announce=True):
    try:
      frames = pipe(
        config.prompt,
        config.negative_prompt or None,
        height=config.height,
        width=config.width,
        num_frames=config.num_frames,
        num_inference_steps=config.num_inference_steps,
        guidance_scale=config.guidance_scale,
        guidance_scale_2=config.guidance_scale_2,
        num_videos_per_prompt=config.num_videos_per_prompt,
        seed=config.seed,
        max_sequence_length=config.max_sequence_length,
        scheduler_options=options,
        cache=cache_settings.make_cache(config, pipe),
        **pixels,
      )
    except ValueError as e:
      raise apps.UsageError(str(e)) from None
    frames = np.asarray(frames)
  seconds = time.perf_counter() - start

  with md_progress.phase("writing"):
    staging = folder.staging()
    names = [
      media.save_video(staging / f"video_{i:04d}.mp4", video, config.frame_rate).name
      for i, video in enumerate(frames)
    ]
    # A contact sheet per video: its frames side by side, left to right.
    sheets = [
      media.save_image(staging / f"video_{i:04d}_frames.png", np.concatenate(list(video), 1)).name
      for i, video in enumerate(frames)
    ]
    sched = pipe.make_scheduler(**options)
    report = cache_settings.cache_report(pipe)
    apps.finish_run(
      folder,
      config,
      wrote=f"{len(names)} video(s)",
      seconds=seconds,
      loaded=loaded,
      lines=[
        f"contact sheet(s) of the frames: {', '.join(sheets)}",
        cache_settings.cache_line(config.cache, report),
      ],
      cache_report=report,
      num_frames_generated=int(frames.shape[1]),
      scheduler=sched.name,
      scheduler_config=dict(sched.config),
      videos=names,
      contact_sheets=sheets,
    )


if __name__ == "__main__":
  if not any(a == "--config" or a.startswith("--config=") for a in sys.argv[1:]):
    sys.argv.insert(1, f"--config={_DEFAULT_CONFIG}")  # no --config: md's shapes model
  apps.run(main, doc=__doc__, fixed=_FIXED)
