"""ltx_generate: LTX-Video text-to-video, image-to-video, keyframes and multi-scale with md-ltx; writes MP4s
and the settings used (LTX-2, video with sound: apps/ltx2_generate).

uv run apps/ltx_generate --config=apps/configs/ltx.py:2b-0.9.1 --config.prompt="a cat surfing" --workdir=out
uv run apps/ltx_generate --help --config=apps/configs/ltx.py:tiny   # the variants, keys and values
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

_CONFIG = config_flags.DEFINE_config_file(
  "config", None, "ml-collections config file (apps/configs/ltx.py:<variant>)."
)
_WORKDIR, _OVERWRITE = apps.define_output_flags("outputs/ltx", "videos")
_FIXED = ("variant", "needs_image", "needs_transformer")


def _numbers(p, key: str, kind, example: str) -> list:
  try:
    return [kind(x) for x in p.config[key].split(",") if x.strip()]
  except ValueError:
    p.add(f"--config.{key}={p.config[key]!r} must be comma-separated numbers, e.g. {example}")
    return []


def _conditions(p, config) -> list[tuple[str, int, float]]:
  """(image file, frame index, strength) of the image and the keyframes."""
  items = [(config.image, 0, config.image_strength)] if config.image else []
  for item in filter(None, (s.strip() for s in config.keyframes.split(","))):
    path, sep, index = item.rpartition("@")
    if not sep or not path or not index.strip().lstrip("-").isdigit():
      p.add(
        f"--config.keyframes item {item!r} must be <image file>@<frame index>, e.g. end.png@160"
      )
    else:
      items.append((path, int(index), 1.0))
  out = []
  for path, index, strength in items:
    path = apps.repo_path(path, apps.config_file())
    p.require(
      0 <= index < config.num_frames,
      f"conditioning image {path!r} at frame {index} is outside the video (frames 0 … "
      f"{config.num_frames - 1})",
    )
    line = apps.check_image_file(path)
    p.require(line is None, f"cannot read the conditioning image {path!r}: {line}")
    out.append((path, index, strength))
  return out


def _check(config, folder):
  import md_attention as mda
  import md_ltx

  p = apps.Problems(config)
  model = apps.check_local(p, "model")
  transformer = apps.check_local(p, "transformer")
  upsampler = apps.check_local(p, "upsampler")
  if config.needs_image and not config.image:
    p.add(
      f"variant {config.variant!r} is image-to-video: set --config.image=<first frame image file>"
    )
  if config.needs_transformer and not config.transformer:
    p.add(
      f"variant {config.variant!r} needs its transformer file: set --config.transformer=<path to the "
      "original single file, e.g. ltxv-13b-0.9.8-distilled.safetensors from Lightricks/LTX-Video>"
    )
  p.positive("num_inference_steps", "frame_rate", "num_videos_per_prompt")
  p.at_least("guidance_scale", 0)
  p.dtype("dtype")
  p.choice("attention", mda.IMPLEMENTATIONS)
  p.choice("stg_mode", ("attention_values", "attention_skip"))
  if upsampler:  # multi-scale: each pass's size comes from the downscale; the pipeline checks them
    p.fraction("downscale_factor")
    p.positive("second_pass_num_inference_steps")
  elif model:
    p.call(
      md_ltx.check_ltx_size, model[0], config.height, config.width, config.num_frames,
      transformer=(transformer or [None])[0],
    )  # fmt: skip
  steps = dict(
    timesteps=_numbers(p, "timesteps", float, "1000,993,987") or None,
    stg_blocks=_numbers(p, "stg_blocks", int, "11,25"),
  )
  conditions = _conditions(p, config)
  p.call(cache_settings.make_cache, config, md_ltx.LTXVideoPipeline)
  apps.check_quantization(p, config)
  lora_settings.check_loras(p, config)
  mesh = apps.finish_checks(p, config, folder)
  return (
    mesh,
    dict(model=model[0], transformer=(transformer or [None])[0], upsampler=upsampler),
    steps,
    conditions,
  )


def main(argv):
  from md_core import media
  from md_core import progress as md_progress

  config = _CONFIG.value
  folder = apps.output_folder(_WORKDIR.value, overwrite=_OVERWRITE.value)
  with md_progress.phase("checking"):
    mesh, src, lists, conditions = _check(config, folder)
  print(apps.describe_mesh(mesh))

  import jax.numpy as jnp
  import numpy as np

  import md_ltx

  start = time.perf_counter()
  with md_progress.phase("loading", announce=True):
    pipe = md_ltx.load_pipeline(
      src["model"],
      transformer=src["transformer"],
      condition=True if config.condition else None,
      mesh=mesh,
      dtype=jnp.dtype(config.dtype),
      quantization=config.quantization,
      attention=config.attention,
      remat=config.remat,
      progress=True,
    )
    lora_settings.load_loras(pipe, config)  # --config.loras, at run time
    upsampler = None
    if src["upsampler"]:
      upsampler = md_ltx.load_latent_upsampler(src["upsampler"][0], mesh=mesh, progress=True)
  loaded = time.perf_counter() - start
  kwargs = dict(
    num_frames=config.num_frames,
    frame_rate=config.frame_rate,
    guidance_scale=config.guidance_scale,
    guidance_rescale=config.guidance_rescale,
    stg_scale=config.stg_scale,
    stg_blocks=lists["stg_blocks"],
    stg_mode=config.stg_mode,
    stg_rescale=config.stg_rescale,
    cfg_star=config.cfg_star,
    num_videos_per_prompt=config.num_videos_per_prompt,
    seed=config.seed,
    conditions=[
      md_ltx.LTXCondition(media.load_image(f), frame_index=i, strength=s) for f, i, s in conditions
    ]
    or None,
    decode_timestep=config.decode_timestep,
    decode_noise_scale=config.decode_noise_scale,
    num_inference_steps=config.num_inference_steps,
    timesteps=lists["timesteps"],
    image_cond_noise_scale=config.image_cond_noise_scale,
    cache=cache_settings.make_cache(config, pipe),
  )
  prompt, negative = config.prompt, config.negative_prompt or None
  start = time.perf_counter()
  with md_progress.phase("generating", announce=True):
    try:
      if upsampler is None:
        frames = pipe(prompt, negative, height=config.height, width=config.width, **kwargs)
        passes = [(config.height, config.width)]
      else:
        frames, passes = md_ltx.generate_multiscale(
          pipe, upsampler, prompt, negative, height=config.height, width=config.width,
          downscale_factor=config.downscale_factor, adain_factor=config.adain_factor,
          second_pass_num_inference_steps=config.second_pass_num_inference_steps,
          second_pass_denoise_strength=config.second_pass_denoise_strength,
          second_pass_image_cond_noise_scale=config.second_pass_image_cond_noise_scale, **kwargs,
        )  # fmt: skip
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
    report = cache_settings.cache_report(pipe)
    apps.finish_run(
      folder,
      config,
      wrote=f"{len(names)} video(s)",
      seconds=seconds,
      loaded=loaded,
      lines=[cache_settings.cache_line(config.cache, report)],
      cache_report=report,
      num_frames_generated=int(frames.shape[1]),
      passes=[dict(height=h, width=w) for h, w in passes],
      mode="condition" if (conditions or pipe.condition_pipeline) else "t2v",
      scheduler_config=dict(pipe.scheduler_config),
      videos=names,
    )


if __name__ == "__main__":
  apps.run(main, doc=__doc__, fixed=_FIXED)
