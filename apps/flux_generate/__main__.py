"""flux_generate: Flux.1 (dev, schnell) and Flux.2 Klein (text-to-image, editing with up to 4 reference
images, KV-cache editing) images with md-flux; writes PNGs and the settings used.

uv run apps/flux_generate --config=apps/configs/flux.py:flux1-dev --config.prompt="a cat" --workdir=out
uv run apps/flux_generate --help --config=apps/configs/flux.py:tiny   # the variants, keys and values
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
  "config", None, "ml-collections config file (apps/configs/flux.py:<variant>)."
)
_WORKDIR, _OVERWRITE = apps.define_output_flags("outputs/flux", "images")
_FIXED = ("variant", "edit")


def _check(config, folder):
  """Every check that needs no weights; returns (mesh, model source, reference images, text layers)."""
  import md_attention as mda
  import md_flux

  p = apps.Problems(config)
  model = apps.check_local(p, "model")
  images = apps.check_local(p, "images", image=True)
  p.require(bool(model), "--config.model is empty: give a diffusers pipeline folder or hub id")
  if not config.edit or config.height is not None or config.width is not None:
    p.call(md_flux.check_size, config.height or 0, config.width or 0)
  p.positive("num_inference_steps", "num_images_per_prompt", "max_sequence_length")
  p.at_least("guidance_scale", 0)
  p.at_least("true_cfg_scale", 0)
  p.dtype("dtype", "text_dtype")
  if config.attention:
    p.choice("attention", mda.IMPLEMENTATIONS)
  if config.edit and not images:
    p.add(
      f"variant {config.variant!r} edits reference images: set --config.images=<file>[,<file>…]"
    )
  p.require(
    len(images) <= md_flux.MAX_REFERENCE_IMAGES,
    f"--config.images: at most {md_flux.MAX_REFERENCE_IMAGES} reference images, got {len(images)}",
  )
  if images and not config.edit:
    p.add("--config.images is set but this variant generates from text; use an *-edit variant")
  layers = ()
  try:
    layers = tuple(int(x) for x in config.text_layers.split(",") if x.strip())
  except ValueError:
    p.add(
      f"--config.text_layers={config.text_layers!r}: give comma-separated layer indices, e.g. 9,18,27"
    )
  p.call(cache_settings.make_cache, config, md_flux.FluxPipeline)
  apps.check_quantization(p, config)
  lora_settings.check_loras(p, config)
  return apps.finish_checks(p, config, folder), model[0], images, layers


def main(argv):
  from md_core import media
  from md_core import progress as md_progress

  config = _CONFIG.value
  folder = apps.output_folder(_WORKDIR.value, overwrite=_OVERWRITE.value)
  with md_progress.phase("checking"):
    mesh, model, references, layers = _check(config, folder)
  print(apps.describe_mesh(mesh))

  import jax.numpy as jnp
  import numpy as np

  import md_attention as mda
  import md_flux

  attention = mda.AttentionConfig(implementation=config.attention) if config.attention else None
  start = time.perf_counter()
  with md_progress.phase("loading", announce=True):
    pipe = md_flux.load_pipeline(
      model,
      mesh=mesh,
      dtype=jnp.dtype(config.dtype),
      text_dtype=jnp.dtype(config.text_dtype),
      quantization=config.quantization,
      attention=attention,
      progress=True,
    )
    lora_settings.load_loras(pipe, config)  # --config.loras, at run time
  loaded = time.perf_counter() - start
  klein = pipe.family == "flux2"
  if config.edit and not klein:
    raise apps.UsageError(
      f"{config.model}: reference images need a Flux.2 Klein checkpoint; this is a Flux.1 pipeline"
    )
  common = dict(
    height=config.height,
    width=config.width,
    num_inference_steps=config.num_inference_steps,
    guidance_scale=config.guidance_scale,
    num_images_per_prompt=config.num_images_per_prompt,
    max_sequence_length=config.max_sequence_length,
    seed=config.seed,
    cache=cache_settings.make_cache(config, pipe),
  )
  negative = config.negative_prompt or None
  start = time.perf_counter()
  with md_progress.phase("generating", announce=True):
    try:
      if klein:
        images = pipe(
          config.prompt,
          image=references or None,
          negative_prompt=negative,
          kv_cache=config.kv_cache or None,  # KV checkpoints always cache
          text_encoder_out_layers=layers,
          **common,
        )
      else:
        images = pipe(config.prompt, negative, true_cfg_scale=config.true_cfg_scale, **common)
    except (FileNotFoundError, ValueError) as e:
      raise apps.UsageError(str(e)) from None
    images = np.asarray(images)
  seconds = time.perf_counter() - start

  with md_progress.phase("writing"):
    names = [p.name for p in media.save_images(folder.staging(), images)]
    report = cache_settings.cache_report(pipe)
    apps.finish_run(
      folder,
      config,
      wrote=f"{len(names)} image(s)",
      seconds=seconds,
      loaded=loaded,
      lines=[cache_settings.cache_line(config.cache, report)],
      cache_report=report,
      scheduler_config=pipe.scheduler_config,
      image_size=list(images.shape[1:3]),
      kv_cache_used=bool(klein and references and (config.kv_cache or pipe.use_kv_cache)),
      images_written=names,
    )


if __name__ == "__main__":
  apps.run(main, doc=__doc__, fixed=_FIXED)
