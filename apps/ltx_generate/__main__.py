"""ltx_generate: LTX-Video and LTX-2 (video with sound) with md-ltx; writes MP4s and the settings used.

uv run apps/ltx_generate --config=apps/configs/ltx.py:2b-0.9.1 --config.prompt="a cat surfing" --workdir=out
uv run apps/ltx_generate --config=apps/configs/ltx.py:ltx2-t2v --config.prompt="a cat playing a piano"
"""

import json
import math
import pathlib
import time

from absl import app, flags
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file(
  "config", None, "ml-collections config file (apps/configs/ltx.py:<variant>)."
)
_WORKDIR = flags.DEFINE_string(
  "workdir", "outputs/ltx", "Folder the videos and settings.json go to."
)


def _keyframes(spec: str) -> list[tuple[str, int]]:
  out = []
  for item in filter(None, (s.strip() for s in spec.split(","))):
    path, sep, index = item.rpartition("@")
    if not sep or not path or not index.strip().lstrip("-").isdigit():
      raise app.UsageError(
        f"--config.keyframes item {item!r} must be <image file>@<frame index>, e.g. end.png@160"
      )
    out.append((path, int(index)))
  return out


def _timesteps(spec: str) -> list[float] | None:
  if not spec.strip():
    return None
  try:
    return [float(t) for t in spec.split(",")]
  except ValueError:
    raise app.UsageError(
      f"--config.timesteps={spec!r} must be comma-separated numbers, e.g. 1000,993,987"
    ) from None


def _blocks(spec: str) -> list[int]:
  try:
    return [int(b) for b in spec.split(",") if b.strip()]
  except ValueError:
    raise app.UsageError(
      f"--config.stg_blocks={spec!r} must be comma-separated block indices, e.g. 11,25"
    ) from None


def _check(config) -> None:
  if not config.model:
    raise app.UsageError("--config.model is empty: give a diffusers pipeline folder or hub id")
  if config.needs_image and not config.image:
    raise app.UsageError(
      f"variant {config.variant!r} is image-to-video: set --config.image=<first frame image file>"
    )
  if config.needs_transformer and not config.transformer:
    example = (
      "ltx-2-19b-distilled.safetensors from Lightricks/LTX-2"
      if config.family == "ltx2"
      else "ltxv-13b-0.9.8-distilled.safetensors from Lightricks/LTX-Video"
    )
    raise app.UsageError(
      f"variant {config.variant!r} needs its transformer file: set --config.transformer=<path to "
      f"the original single file, e.g. {example}>"
    )
  if config.fps <= 0:
    raise app.UsageError(f"--config.fps={config.fps} must be positive")
  if config.upsampler and not 0 < config.downscale_factor <= 1:
    raise app.UsageError(f"--config.downscale_factor={config.downscale_factor} must be in (0, 1]")


def _read_conditions(config, media, num_frames: int) -> list[tuple]:
  """(pixels, frame index, strength) of the conditioning images, read before any model is loaded (a
  clear error for a frame outside the video or a file that is not an image)."""
  items = []
  specs = ([(config.image, 0, config.image_strength)] if config.image else []) + [
    (path, index, 1.0) for path, index in _keyframes(config.keyframes)
  ]
  for path, index, strength in specs:
    if not 0 <= index < num_frames:
      raise app.UsageError(
        f"conditioning image {path!r} at frame {index} is outside the video (frames 0 … "
        f"{num_frames - 1})"
      )
    try:
      pixels = media.load_image(path)
    except (FileNotFoundError, OSError, ValueError) as e:
      raise app.UsageError(f"cannot read the conditioning image {path!r}: {e}") from None
    items.append((pixels, index, strength))
  return items


def _sigmas(spec: str) -> list[float] | None:
  spec = spec.strip()
  if not spec:
    return None
  if spec == "distilled":
    import md_schedulers

    return list(md_schedulers.LTX2_DISTILLED_SIGMAS)
  try:
    return [float(s) for s in spec.split(",")]
  except ValueError:
    raise app.UsageError(
      f"--config.sigmas={spec!r} must be 'distilled' or comma-separated numbers, e.g. 1.0,0.99,0.9"
    ) from None


def _near(value: int, step: int, offset: int) -> str:
  below = max(offset, offset + step * ((value - offset) // step))
  return str(below) if below == value else f"{below} or {below + step}"


def _ltx2_size_check(config) -> None:
  """The sizes the LTX-2 VAE and packing take, checked before loading: from the folder's vae/ and
  transformer/ configs when it is local, else LTX-2's (32x spatial, 8x temporal, patch 1)."""
  spatial, temporal, patch, patch_t = 32, 8, 1, 1
  root = pathlib.Path(config.model)
  if (root / "vae" / "config.json").is_file():
    vae = json.loads((root / "vae" / "config.json").read_text())
    spatial = int(vae.get("spatial_compression_ratio", spatial))
    temporal = int(vae.get("temporal_compression_ratio", temporal))
  if not config.transformer and (root / "transformer" / "config.json").is_file():
    tr = json.loads((root / "transformer" / "config.json").read_text())
    patch, patch_t = int(tr.get("patch_size", patch)), int(tr.get("patch_size_t", patch_t))
  m = math.lcm(32, spatial * patch)
  t = temporal * patch_t
  bad = [
    f"--config.{name}={v} → {_near(max(v, m), m, m)}"
    for name, v in (("height", config.height), ("width", config.width))
    if v <= 0 or v % m
  ]
  if config.num_frames < 1 or (config.num_frames - 1) % t:
    bad.append(
      f"--config.num_frames={config.num_frames} → {_near(max(config.num_frames, 1), t, 1)}"
    )
  if bad:
    raise app.UsageError(
      f"the LTX-2 VAE takes height and width multiples of {m} and num_frames = 1 + {t}k; nearest "
      f"valid: {', '.join(bad)}"
    )


def _main_ltx2(config) -> None:
  """LTX-2: one pass of md_ltx.load_ltx2_pipeline, MP4s with the audio track, settings.json."""
  if config.keyframes:
    raise app.UsageError("--config.keyframes is LTX-Video only; LTX-2 takes one --config.image")
  if config.upsampler:
    raise app.UsageError("--config.upsampler (multi-scale) is LTX-Video only; LTX-2 runs one pass")
  if config.timesteps.strip():
    raise app.UsageError("--config.timesteps is LTX-Video only; LTX-2 takes --config.sigmas=")
  if config.cfg_star:
    raise app.UsageError("--config.cfg_star is LTX-Video only")
  if config.image_crf < 0:
    raise app.UsageError(
      f"--config.image_crf={config.image_crf} must be >= 0 (0: no re-compression)"
    )
  if config.motion_speed <= 0:
    raise app.UsageError(f"--config.motion_speed={config.motion_speed} must be positive")
  _ltx2_size_check(config)
  sigmas = _sigmas(config.sigmas)
  blocks = _blocks(config.stg_blocks)
  from md_core import apps, media

  image = _read_conditions(config, media, config.num_frames)
  try:
    mesh = apps.start(config)
  except ValueError as e:
    raise app.UsageError(str(e)) from None
  print(apps.describe_mesh(mesh))

  import jax.numpy as jnp
  import numpy as np

  import md_ltx

  start = time.perf_counter()
  try:
    pipe = md_ltx.load_ltx2_pipeline(
      config.model,
      transformer=config.transformer or None,
      image_to_video=True if (config.needs_image or config.image) else None,
      mesh=mesh,
      dtype=jnp.dtype(config.dtype),
      attention=config.attention,
      remat=config.remat,
      progress=True,
    )
  except FileNotFoundError as e:
    raise app.UsageError(str(e)) from None
  loaded = time.perf_counter() - start
  start = time.perf_counter()
  try:
    result = pipe(
      config.prompt,
      config.negative_prompt or None,
      image=image[0][0] if image else None,
      image_crf=config.image_crf,
      height=config.height,
      width=config.width,
      num_frames=config.num_frames,
      frame_rate=float(config.fps),
      motion_speed=config.motion_speed,
      num_inference_steps=config.steps,
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
      decode_noise_scale=None if config.decode_noise_scale < 0 else config.decode_noise_scale,
      use_cross_timestep=config.use_cross_timestep,
      max_sequence_length=config.max_sequence_length,
      progress=True,
    )
  except ValueError as e:
    raise app.UsageError(str(e)) from None
  frames, audio = np.asarray(result.frames), np.asarray(result.audio)
  seconds = time.perf_counter() - start

  out = pathlib.Path(_WORKDIR.value)
  paths = [
    md_ltx.save_ltx2_video(out / f"video_{i:04d}.mp4", result, config.fps, index=i)
    for i in range(frames.shape[0])
  ]
  settings = dict(
    config.to_dict(),
    num_frames_generated=int(frames.shape[1]),
    frame_size=dict(height=int(frames.shape[2]), width=int(frames.shape[3])),
    mode="i2v" if (image or pipe.image_to_video) else "t2v",
    sigmas_used=sigmas,
    sample_rate=int(result.sample_rate),
    audio_channels=int(audio.shape[1]),
    audio_seconds=round(audio.shape[-1] / result.sample_rate, 4),
    video_seconds=round(frames.shape[1] / config.fps, 4),
    scheduler_config=dict(pipe.scheduler_config),
    videos=[p.name for p in paths],
    load_seconds=round(loaded, 2),
    generate_seconds=round(seconds, 2),
  )
  (out / "settings.json").write_text(json.dumps(settings, indent=2, default=str) + "\n")
  print(
    f"wrote {len(paths)} video(s) with audio and settings.json to {out} ({seconds:.1f}s, load "
    f"{loaded:.1f}s)"
  )


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(
      f"unexpected arguments {argv[1:]}; settings go through --config.<key>=<value>"
    )
  config = _CONFIG.value
  if config is None:
    raise app.UsageError("--config is required, e.g. --config=apps/configs/ltx.py:2b-0.9.1")
  _check(config)
  if config.family == "ltx2":
    return _main_ltx2(config)
  if config.family != "ltx":
    raise app.UsageError(f"--config.family={config.family!r} must be 'ltx' or 'ltx2'")
  timesteps = _timesteps(config.timesteps)
  from md_core import apps, media

  images = _read_conditions(config, media, config.num_frames)

  try:
    mesh = apps.start(config)
  except ValueError as e:  # a mesh that does not fit the devices
    raise app.UsageError(str(e)) from None
  print(apps.describe_mesh(mesh))

  import jax
  import jax.numpy as jnp
  import numpy as np

  import md_ltx

  conditions = [md_ltx.LTXCondition(p, frame_index=i, strength=s) for p, i, s in images]
  start = time.perf_counter()
  try:
    pipe = md_ltx.load_pipeline(
      config.model,
      transformer=config.transformer or None,
      condition=True if config.condition else None,
      mesh=mesh,
      dtype=jnp.dtype(config.dtype),
      attention=config.attention,
      remat=config.remat,
      progress=True,
    )
    upsampler = None
    if config.upsampler:
      upsampler = md_ltx.load_latent_upsampler(config.upsampler, mesh=mesh, progress=True)
  except FileNotFoundError as e:
    raise app.UsageError(str(e)) from None
  loaded = time.perf_counter() - start
  kwargs = dict(
    num_frames=config.num_frames,
    frame_rate=config.fps,
    guidance_scale=config.guidance_scale,
    guidance_rescale=config.guidance_rescale,
    stg_scale=config.stg_scale,
    stg_blocks=_blocks(config.stg_blocks),
    stg_mode=config.stg_mode,
    stg_rescale=config.stg_rescale,
    cfg_star=config.cfg_star,
    num_videos_per_prompt=config.num_videos_per_prompt,
    seed=config.seed,
    conditions=conditions or None,
    decode_timestep=config.decode_timestep,
    decode_noise_scale=None if config.decode_noise_scale < 0 else config.decode_noise_scale,
  )
  prompt, negative = config.prompt, config.negative_prompt or None
  steps = dict(num_inference_steps=config.steps, timesteps=timesteps)
  start = time.perf_counter()
  try:
    if upsampler is None:
      frames = pipe(
        prompt, negative, height=config.height, width=config.width,
        image_cond_noise_scale=config.image_cond_noise_scale, **steps, **kwargs,
      )  # fmt: skip
      passes = [(config.height, config.width)]
    else:
      m = pipe.size_multiple
      h1 = max(m, int(config.height * config.downscale_factor) // m * m)
      w1 = max(m, int(config.width * config.downscale_factor) // m * m)
      latents = pipe(
        prompt, negative, height=h1, width=w1, output_type="latent",
        image_cond_noise_scale=config.image_cond_noise_scale, **steps, **kwargs,
      )  # fmt: skip
      vae = pipe.vae
      up = md_ltx.upsample_latents(
        upsampler, latents, vae.latents_mean[...], vae.latents_std[...],
        scaling_factor=vae.config.scaling_factor, adain_factor=config.adain_factor, layout="BCFHW",
      )  # fmt: skip
      h2, w2 = h1 * (up.shape[3] // latents.shape[3]), w1 * (up.shape[4] // latents.shape[4])
      frames = pipe(
        prompt, negative, height=h2, width=w2, latents=up,
        denoise_strength=config.second_pass_denoise_strength,
        num_inference_steps=config.second_pass_steps,
        image_cond_noise_scale=config.second_pass_image_cond_noise_scale, **kwargs,
      )  # fmt: skip
      if (h2, w2) != (config.height, config.width):
        b, f = frames.shape[:2]
        frames = jnp.clip(
          jax.image.resize(frames, (b, f, config.height, config.width, 3), method="lanczos3"), 0, 1
        )
      passes = [(h1, w1), (h2, w2)]
  except ValueError as e:
    raise app.UsageError(str(e)) from None
  frames = np.asarray(frames)
  seconds = time.perf_counter() - start

  out = pathlib.Path(_WORKDIR.value)
  paths = [
    media.save_video(out / f"video_{i:04d}.mp4", video, config.fps)
    for i, video in enumerate(frames)
  ]
  settings = dict(
    config.to_dict(),
    num_frames_generated=int(frames.shape[1]),
    passes=[dict(height=h, width=w) for h, w in passes],
    mode="condition" if (conditions or pipe.condition_pipeline) else "t2v",
    scheduler_config=dict(pipe.scheduler_config),
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
