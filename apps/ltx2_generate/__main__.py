"""ltx2_generate: LTX-2 videos with sound with md-ltx; writes MP4s (H.264 + AAC) and the settings used.

uv run apps/ltx2_generate --config=apps/configs/ltx2.py:ltx2-t2v --config.prompt="a cat playing a piano"
uv run apps/ltx2_generate --help --config=apps/configs/ltx2.py:tiny   # the variants, keys and values
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
  "config", None, "ml-collections config file (apps/configs/ltx2.py:<variant>)."
)
_WORKDIR, _OVERWRITE = apps.define_output_flags("outputs/ltx2", "videos")
_FIXED = ("variant", "needs_image", "needs_transformer")


def _check(config, folder):
  import md_attention as mda
  import md_ltx
  import md_schedulers

  p = apps.Problems(config)
  model = apps.check_local(p, "model")
  transformer = apps.check_local(p, "transformer")
  image = apps.check_local(p, "image", image=True)
  if config.needs_image and not config.image:
    p.add(
      f"variant {config.variant!r} is image-to-video: set --config.image=<first frame image file>"
    )
  if config.needs_transformer and not config.transformer:
    p.add(
      f"variant {config.variant!r} needs its transformer file: set --config.transformer=<path to the "
      "original single file, e.g. ltx-2-19b-distilled.safetensors from Lightricks/LTX-2>"
    )
  p.positive("num_inference_steps", "frame_rate", "num_videos_per_prompt", "motion_speed")
  p.at_least("image_crf", 0)
  p.at_least("guidance_scale", 0)
  p.dtype("dtype")
  p.choice("attention", mda.IMPLEMENTATIONS)
  sigmas = None
  spec = (config.sigmas or "").strip()
  if spec == "distilled":
    sigmas = list(md_schedulers.LTX2_DISTILLED_SIGMAS)
  elif spec:
    try:
      sigmas = [float(s) for s in spec.split(",")]
    except ValueError:
      p.add(
        f"--config.sigmas={spec!r} must be 'distilled' or comma-separated numbers, e.g. 1.0,0.99,0.9"
      )
  try:
    blocks = [int(b) for b in config.stg_blocks.split(",") if b.strip()]
  except ValueError:
    blocks = []
    p.add(
      f"--config.stg_blocks={config.stg_blocks!r} must be comma-separated block indices, e.g. 11,25"
    )
  if model:
    p.call(
      md_ltx.check_ltx2_size, model[0], config.height, config.width, config.num_frames,
      transformer=(transformer or [None])[0],
    )  # fmt: skip
  p.call(cache_settings.make_cache, config, md_ltx.LTX2VideoPipeline)
  apps.check_quantization(p, config)
  lora_settings.check_loras(p, config)
  mesh = apps.finish_checks(p, config, folder)
  return mesh, model[0], (transformer or [None])[0], (image or [None])[0], sigmas, blocks


def main(argv):
  from md_core import media
  from md_core import progress as md_progress

  config = _CONFIG.value
  folder = apps.output_folder(_WORKDIR.value, overwrite=_OVERWRITE.value)
  with md_progress.phase("checking"):
    mesh, model, transformer, image, sigmas, blocks = _check(config, folder)
  print(apps.describe_mesh(mesh))

  import jax.numpy as jnp
  import numpy as np

  import md_ltx

  start = time.perf_counter()
  with md_progress.phase("loading", announce=True):
    pipe = md_ltx.load_ltx2_pipeline(
      model,
      transformer=transformer,
      image_to_video=True if (config.needs_image or image) else None,
      mesh=mesh,
      dtype=jnp.dtype(config.dtype),
      quantization=config.quantization,
      attention=config.attention,
      remat=config.remat,
      progress=True,
    )
    lora_settings.load_loras(pipe, config)  # --config.loras, at run time
  loaded = time.perf_counter() - start
  start = time.perf_counter()
  with md_progress.phase("generating", announce=True):
    try:
      result = pipe(
        config.prompt,
        config.negative_prompt or None,
        image=media.load_image(image) if image else None,
        image_crf=config.image_crf,
        height=config.height,
        width=config.width,
        num_frames=config.num_frames,
        frame_rate=float(config.frame_rate),
        motion_speed=config.motion_speed,
        num_inference_steps=config.num_inference_steps,
        sigmas=sigmas,
        guidance_scale=config.guidance_scale,
        stg_scale=config.stg_scale,
        modality_scale=config.modality_scale,
        guidance_rescale=config.guidance_rescale,
        audio_guidance_scale=config.audio_guidance_scale,
        audio_stg_scale=config.audio_stg_scale,
        audio_modality_scale=config.audio_modality_scale,
        audio_guidance_rescale=config.audio_guidance_rescale,
        spatio_temporal_guidance_blocks=blocks,
        num_videos_per_prompt=config.num_videos_per_prompt,
        seed=config.seed,
        decode_timestep=config.decode_timestep,
        decode_noise_scale=config.decode_noise_scale,
        use_cross_timestep=config.use_cross_timestep,
        max_sequence_length=config.max_sequence_length,
        cache=cache_settings.make_cache(config, pipe),
        progress=True,
      )
    except ValueError as e:
      raise apps.UsageError(str(e)) from None
    frames, audio = np.asarray(result.frames), np.asarray(result.audio)
  seconds = time.perf_counter() - start

  with md_progress.phase("writing"):
    staging = folder.staging()
    names = [
      md_ltx.save_ltx2_video(
        staging / f"video_{i:04d}.mp4", result, config.frame_rate, index=i
      ).name
      for i in range(frames.shape[0])
    ]
    report = cache_settings.cache_report(pipe)
    apps.finish_run(
      folder,
      config,
      wrote=f"{len(names)} video(s) with audio",
      seconds=seconds,
      loaded=loaded,
      lines=[cache_settings.cache_line(config.cache, report)],
      cache_report=report,
      num_frames_generated=int(frames.shape[1]),
      frame_size=dict(height=int(frames.shape[2]), width=int(frames.shape[3])),
      mode="i2v" if (image or pipe.image_to_video) else "t2v",
      sigmas_used=sigmas,
      sample_rate=int(result.sample_rate),
      audio_channels=int(audio.shape[1]),
      audio_seconds=round(audio.shape[-1] / result.sample_rate, 4),
      video_seconds=round(frames.shape[1] / config.frame_rate, 4),
      scheduler_config=dict(pipe.scheduler_config),
      videos=names,
    )

  asked, got = (config.num_frames, config.height, config.width), frames.shape[1:4]
  if tuple(int(n) for n in got) != asked:  # the checkpoint's VAE decides the decoded size
    print(f"note: the video has {got[0]} frames of {got[1]} x {got[2]}; asked {asked[0]} of "
          f"{asked[1]} x {asked[2]} (the model's VAE decodes to that size)", file=sys.stderr)  # fmt: skip


if __name__ == "__main__":
  apps.run(main, doc=__doc__, fixed=_FIXED)
