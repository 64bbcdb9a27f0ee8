"""flux_generate: Flux.1 (dev, schnell) and Flux.2 Klein (text-to-image, editing with up to 4 reference
images, KV-cache editing) images with md-flux; writes PNGs and the settings used.

uv run apps/flux_generate --config=apps/configs/flux.py:flux1-dev --config.prompt="a cat" --workdir=out
"""

import json
import pathlib
import time

from absl import app, flags
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file(
  "config", None, "ml-collections config file (apps/configs/flux.py:<variant>)."
)
_WORKDIR = flags.DEFINE_string(
  "workdir", "outputs/flux", "Folder the images and settings.json go to."
)


def _images(config) -> list[str]:
  return [p.strip() for p in config.images.split(",") if p.strip()]


def _layers(config) -> tuple[int, ...]:
  try:
    return tuple(int(x) for x in config.text_layers.split(",") if x.strip())
  except ValueError:
    raise app.UsageError(
      f"--config.text_layers={config.text_layers!r}: give comma-separated layer indices, e.g. 9,18,27"
    ) from None


def _check(config) -> None:
  if not config.model:
    raise app.UsageError("--config.model is empty: give a diffusers pipeline folder or hub id")
  import md_flux

  images = _images(config)
  # Editing: a height or width of 0 is the first reference image's (prepared) size.
  fill = 16 if config.edit else 0
  try:
    md_flux.check_size(config.height or fill, config.width or fill)
  except ValueError as e:
    raise app.UsageError(str(e)) from None
  if config.edit and not images:
    raise app.UsageError(
      f"variant {config.variant!r} edits reference images: set --config.images=<file>[,<file>…]"
    )
  if len(images) > 4:
    raise app.UsageError(f"at most 4 reference images are supported; got {len(images)}")
  if images and not config.edit:
    raise app.UsageError(
      "--config.images is set but this variant generates from text; use an *-edit variant"
    )
  from PIL import Image

  for i, path in enumerate(images):  # before loading the model: a bad file fails in a second
    if not pathlib.Path(path).is_file():
      raise app.UsageError(f"reference image {i}: no such file {path!r}")
    try:
      with Image.open(path) as im:
        im.verify()
    except Exception as e:  # noqa: BLE001 - Pillow raises many kinds for a broken file
      raise app.UsageError(f"reference image {i}: cannot read {path!r}: {e}") from None


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(
      f"unexpected arguments {argv[1:]}; settings go through --config.<key>=<value>"
    )
  config = _CONFIG.value
  if config is None:
    raise app.UsageError("--config is required, e.g. --config=apps/configs/flux.py:flux1-dev")
  _check(config)
  from md_core import apps, media

  try:
    mesh = apps.start(config)
  except ValueError as e:  # a mesh that does not fit the devices
    raise app.UsageError(str(e)) from None
  print(apps.describe_mesh(mesh))

  import jax.numpy as jnp
  import numpy as np

  import md_attention as mda
  import md_flux

  attention = mda.AttentionConfig(implementation=config.attention) if config.attention else None
  start = time.perf_counter()
  try:
    pipe = md_flux.load_pipeline(
      config.model,
      mesh=mesh,
      dtype=jnp.dtype(config.dtype),
      text_dtype=jnp.dtype(config.text_dtype),
      attention=attention,
      progress=True,
    )
  except (FileNotFoundError, ValueError) as e:
    raise app.UsageError(str(e)) from None
  loaded = time.perf_counter() - start
  klein = isinstance(pipe, md_flux.Flux2KleinPipeline)
  if config.edit and not klein:
    raise app.UsageError(
      f"{config.model}: reference images need a Flux.2 Klein checkpoint; this is a Flux.1 pipeline"
    )
  common = dict(
    height=config.height or None,
    width=config.width or None,
    num_inference_steps=config.steps,
    guidance_scale=config.guidance_scale,
    num_images_per_prompt=config.num_images_per_prompt,
    max_sequence_length=config.max_sequence_length,
    seed=config.seed,
  )
  start = time.perf_counter()
  try:
    if klein:
      images = pipe(
        config.prompt,
        image=_images(config) or None,
        negative_prompt=config.negative_prompt or None,
        kv_cache=config.kv_cache or None,  # KV checkpoints always cache
        text_encoder_out_layers=_layers(config),
        **common,
      )
    else:
      images = pipe(
        config.prompt,
        config.negative_prompt or None,
        true_cfg_scale=config.true_cfg_scale,
        **common,
      )
  except (FileNotFoundError, ValueError) as e:
    raise app.UsageError(str(e)) from None
  images = np.asarray(images)
  seconds = time.perf_counter() - start

  out = pathlib.Path(_WORKDIR.value)
  paths = media.save_images(out, images)
  settings = dict(
    config.to_dict(),
    scheduler_config=pipe.scheduler_config,
    image_size=list(images.shape[1:3]),
    kv_cache_used=bool(klein and _images(config) and (config.kv_cache or pipe.use_kv_cache)),
    images_written=[p.name for p in paths],
    load_seconds=round(loaded, 2),
    generate_seconds=round(seconds, 2),
  )
  (out / "settings.json").write_text(json.dumps(settings, indent=2, default=str) + "\n")
  print(
    f"wrote {len(paths)} image(s) and settings.json to {out} ({seconds:.1f}s, load {loaded:.1f}s)"
  )


if __name__ == "__main__":
  app.run(main)
