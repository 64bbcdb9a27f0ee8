"""flux_generate: Flux.1 (dev, schnell) images with md-flux; writes PNGs and the settings used.

Flux.2 Klein checkpoints load, then stop with a message: md-flux's Klein pipeline needs prompt embeddings
and reference latents until the Qwen3 encoder and the Flux.2 VAE are wired in.

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


def _check(config) -> None:
  if not config.model:
    raise app.UsageError("--config.model is empty: give a diffusers pipeline folder or hub id")
  import md_flux

  try:
    md_flux.check_size(config.height, config.width)
  except ValueError as e:
    raise app.UsageError(str(e)) from None
  images = [p for p in config.images.split(",") if p.strip()]
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
  if isinstance(pipe, md_flux.Flux2KleinPipeline):
    raise app.UsageError(
      f"{config.model}: Flux.2 Klein pipelines in md-flux run from prompt embeddings and reference "
      "latents only (the Qwen3 encoder and the Flux.2 VAE are not wired in yet); call "
      "md_flux.load_pipeline(...)(prompt_embeds=..., image_latents=[...]) from Python"
    )
  start = time.perf_counter()
  try:
    images = pipe(
      config.prompt,
      config.negative_prompt or None,
      height=config.height,
      width=config.width,
      num_inference_steps=config.steps,
      guidance_scale=config.guidance_scale,
      true_cfg_scale=config.true_cfg_scale,
      num_images_per_prompt=config.num_images_per_prompt,
      max_sequence_length=config.max_sequence_length,
      seed=config.seed,
    )
  except ValueError as e:
    raise app.UsageError(str(e)) from None
  images = np.asarray(images)
  seconds = time.perf_counter() - start

  out = pathlib.Path(_WORKDIR.value)
  paths = media.save_images(out, images)
  settings = dict(
    config.to_dict(),
    scheduler_config=pipe.scheduler_config,
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
