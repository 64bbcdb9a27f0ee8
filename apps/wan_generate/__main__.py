"""wan_generate: Wan 2.1 / 2.2 videos with md-wan; writes MP4s and the settings used.

uv run apps/wan_generate --config=apps/configs/wan.py:2.1-t2v-1.3b --config.prompt="a cat surfing" --workdir=out
"""

import json
import pathlib
import time

from absl import app, flags
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file(
  "config", None, "ml-collections config file (apps/configs/wan.py:<variant>)."
)
_WORKDIR = flags.DEFINE_string(
  "workdir", "outputs/wan", "Folder the videos and settings.json go to."
)


def _check(config) -> None:
  if not config.model:
    raise app.UsageError("--config.model is empty: give a diffusers pipeline folder or hub id")
  if config.needs_image and not config.image:
    raise app.UsageError(
      f"variant {config.variant!r} is image-to-video: set --config.image=<first frame image file>"
    )
  if config.needs_last_image and not config.last_image:
    raise app.UsageError(
      f"variant {config.variant!r} is first/last-frame-to-video: set --config.last_image=<last frame "
      "image file> (and --config.image=<first frame>)"
    )
  if config.last_image and not config.image:
    raise app.UsageError("--config.last_image needs --config.image (the first frame) too")
  if config.fps <= 0:
    raise app.UsageError(f"--config.fps={config.fps} must be positive")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(
      f"unexpected arguments {argv[1:]}; settings go through --config.<key>=<value>"
    )
  config = _CONFIG.value
  if config is None:
    raise app.UsageError("--config is required, e.g. --config=apps/configs/wan.py:2.1-t2v-1.3b")
  _check(config)
  from md_core import apps, media

  try:
    mesh = apps.start(config)
  except ValueError as e:  # a mesh that does not fit the devices
    raise app.UsageError(str(e)) from None
  print(apps.describe_mesh(mesh))

  import jax.numpy as jnp
  import numpy as np

  import md_wan

  start = time.perf_counter()
  try:
    pipe = md_wan.load_pipeline(
      config.model,
      mesh=mesh,
      dtype=jnp.dtype(config.dtype),
      attention=config.attention,
      remat=config.remat,
      progress=True,
    )
  except FileNotFoundError as e:
    raise app.UsageError(str(e)) from None
  loaded = time.perf_counter() - start
  size = (config.height, config.width)
  options = {"flow_shift": config.flow_shift} if config.flow_shift else {}
  kwargs = dict(
    height=config.height,
    width=config.width,
    num_frames=config.num_frames,
    num_inference_steps=config.steps,
    guidance_scale=config.guidance_scale,
    guidance_scale_2=None if config.guidance_scale_2 < 0 else config.guidance_scale_2,
    num_videos_per_prompt=config.num_videos_per_prompt,
    seed=config.seed,
    scheduler_options=options,
  )
  if config.image:
    kwargs["image"] = media.load_image(config.image, size=size)
  if config.last_image:
    kwargs["last_image"] = media.load_image(config.last_image, size=size)
  start = time.perf_counter()
  try:
    frames = pipe(config.prompt, config.negative_prompt or None, **kwargs)
  except ValueError as e:
    raise app.UsageError(str(e)) from None
  frames = np.asarray(frames)
  seconds = time.perf_counter() - start

  out = pathlib.Path(_WORKDIR.value)
  paths = [
    media.save_video(out / f"video_{i:04d}.mp4", video, config.fps)
    for i, video in enumerate(frames)
  ]
  sched = pipe.make_scheduler(**options)
  settings = dict(
    config.to_dict(),
    num_frames_generated=int(frames.shape[1]),
    scheduler=sched.name,
    scheduler_config=dict(sched.config),
    videos=[p.name for p in paths],
    load_seconds=round(loaded, 2),
    generate_seconds=round(seconds, 2),
  )
  (out / "settings.json").write_text(json.dumps(settings, indent=2, default=str) + "\n")
  print(
    f"wrote {len(paths)} video(s) and settings.json to {out} ({seconds:.1f}s, load {loaded:.1f}s)"
  )


if __name__ == "__main__":
  app.run(main)
