"""prepare_data: encodes images or clips with a family's VAE and text encoder into cached-latent TFRecords.

uv run apps/prepare_data --config=apps/configs/prepare_data.py:tiny --workdir=/tmp/prepared-tiny
uv run apps/prepare_data --config=apps/configs/prepare_data.py:sd --config.source=my_images --workdir=runs/data
uv run apps/prepare_data --help --config=apps/configs/prepare_data.py:tiny   # the variants, keys and values

The workdir gets train/ and (with --config.eval_count) eval/ shards of `latents` + `encoder_hidden_states`
records (eval ones with fixed `timesteps`), and settings.json. SD latents are the VAE posterior mean times
its `scaling_factor` (diffusers' train_text_to_image.py); Wan latents the posterior mode, normalised with
the VAE's latents_mean / latents_std (as md's Wan training). Running again with the same workdir skips the
shards already written completely.
"""

import os
import sys

# Before jax loads: its C++ start-up INFO lines stay hidden unless --verbosity asks (md_core.apps.quiet).
if not any(a.startswith(("--verbosity", "-v")) for a in sys.argv[1:]):
  os.environ["TF_CPP_MIN_LOG_LEVEL"] = os.environ.get("TF_CPP_MIN_LOG_LEVEL") or "2"

from absl import flags  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from md_core import apps  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file(
  "config", None, "ml-collections config file (apps/configs/prepare_data.py:<variant>)."
)
_FIXED = ("variant",)
# Not apps.define_output_flags: the workdir is reused on purpose (that is how a run resumes).
_WORKDIR = flags.DEFINE_string(
  "workdir", "runs/prepared", "Folder of the records: train/, eval/ and settings.json."
)
FAMILIES = ("sd", "wan")
SOURCE_TYPES = ("folder", "tfrecord", "arrayrecord", "shapes")


def _check(config, workdir):
  import pathlib

  p = apps.Problems(config)
  p.choice("family", FAMILIES)
  p.choice("source_type", SOURCE_TYPES)
  model = apps.check_local(p, "model")
  p.require(bool(model), "--config.model is empty: give a diffusers pipeline folder or hub id")
  p.positive("height", "width", "batch_size", "records_per_shard", "num_train_timesteps")
  p.positive("frames", "max_sequence_length", optional=True)
  p.at_least("eval_count", 0)
  if config.source_type == "shapes":
    p.positive("shapes_count")
  elif not config.source:
    p.add(f"--config.source is empty: give the {config.source_type} to encode")
  elif not pathlib.Path(config.source).expanduser().exists():
    p.add(f"--config.source={config.source!r} does not exist")
  if config.family == "sd" and config.frames is not None:
    p.add(
      f"--config.frames={config.frames}: SD encodes still images; unset frames or use family=wan"
    )
  if config.family == "wan" and config.frames is not None and (config.frames - 1) % 4:
    p.add(f"--config.frames={config.frames} must be 1 + a multiple of 4 (Wan's VAE), e.g. 5 or 9")
  path = pathlib.Path(workdir).expanduser()
  existing = next((q for q in (path, *path.parents) if q.exists()), None)
  if existing is not None and not existing.is_dir():
    p.add(f"--workdir={workdir!r} is (inside) a file; give a folder")
  mesh = p.call(apps.start, config, prefix="--config.mesh: ")
  p.raise_if_any()
  return model[0], mesh


def _source(config):
  """The examples to encode, as a random-access source of {"pixels", "captions"}."""
  import md_data as mdd

  size = (config.height, config.width)
  frames = config.frames if config.family == "wan" else None
  kind = config.source_type
  if kind == "shapes":
    shapes = mdd.ShapesConfig(size=max(size), frames=frames)
    return mdd.ShapesSource(shapes, seed=config.seed, count=config.shapes_count)
  if kind == "folder":
    return mdd.FolderSource(
      config.source, image_size=size, frames=frames, caption_column=config.caption_column
    )
  if kind == "tfrecord":
    return mdd.TFRecordImageSource(config.source, image_size=size)
  return mdd.ArrayRecordSource(config.source, kind="images", image_size=size)


def _encoder(config, model, mesh):
  """(pixels, captions) → (latents, encoder_hidden_states) for the family, jitted once."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  from flax import nnx

  def split_jit(module, fn):
    graphdef, state = nnx.split(module)
    run = jax.jit(lambda s, x: fn(nnx.merge(graphdef, s), x))
    return lambda x: run(state, jnp.asarray(x))

  if config.family == "sd":
    import md_sd

    pipe = md_sd.load_pipeline(model, mesh=mesh)
    factor = float(pipe.vae.config.scaling_factor)
    latents = split_jit(pipe.vae, lambda vae, x: vae.encode(x * 2 - 1).mean * factor)
    return lambda pixels, captions: (latents(pixels), pipe.encode_prompt(captions)[0])

  import md_wan

  pipe = md_wan.load_pipeline(model, mesh=mesh)
  length = config.max_sequence_length or 512  # the Wan pipeline's default
  latents = split_jit(pipe.vae, lambda vae, x: vae.normalize_latents(vae.encode(x * 2 - 1).mode()))

  def encode(pixels, captions):
    clips = pixels if pixels.ndim == 5 else pixels[:, None]  # still images: one-frame clips
    states = pipe.encode_prompt(captions, max_sequence_length=length)
    return latents(np.asarray(clips)), states

  return encode


def main(argv):
  import json
  import pathlib
  import time

  import numpy as np

  import md_data as mdd
  from md_core import progress as md_progress

  config = _CONFIG.value
  workdir = pathlib.Path(_WORKDIR.value).expanduser()
  with md_progress.phase("checking"):
    model, mesh = _check(config, _WORKDIR.value)
    try:
      source = _source(config)
    except (ValueError, ImportError) as e:
      raise apps.UsageError(f"--config.source={config.source!r}: {e}") from None
    if config.eval_count >= len(source):
      raise apps.UsageError(
        f"--config.eval_count={config.eval_count} leaves no training examples of {len(source)}"
      )
  print(apps.describe_mesh(mesh))
  start = time.perf_counter()
  with md_progress.phase("loading", announce=True):
    encode = _encoder(config, model, mesh)
  n_train = len(source) - config.eval_count
  splits = {"train": (list(range(n_train)), None)}
  if config.eval_count:
    spread = np.linspace(0, config.num_train_timesteps - 1, config.eval_count)
    splits["eval"] = (list(range(n_train, len(source))), np.round(spread).astype(int).tolist())
  reports = {}
  for split, (indices, timesteps) in splits.items():
    try:
      report = mdd.write_latent_shards(
        source,
        encode,
        workdir / split,
        records_per_shard=config.records_per_shard,
        batch_size=config.batch_size,
        indices=indices,
        timesteps=timesteps,
        channels_first=config.channels_first,
        prefix=split,
        desc=f"encoding {split}",
      )
    except ValueError as e:
      raise apps.UsageError(str(e).splitlines()) from None
    reports[split] = dict(
      records=report.records, written=len(report.written), skipped=len(report.skipped)
    )
  seconds = time.perf_counter() - start
  settings = apps.settings_of(config, splits=reports, seconds=round(seconds, 2))
  tmp = workdir / ".settings.json.tmp"
  tmp.write_text(json.dumps(settings, indent=2, default=str) + "\n")
  tmp.replace(workdir / "settings.json")
  summary = "; ".join(
    f"{s}: {r['records']} records in {r['written'] + r['skipped']} shards ({r['skipped']} already there)"
    for s, r in reports.items()
  )
  print(f"{summary}; in {workdir} ({seconds:.1f}s)")


if __name__ == "__main__":
  apps.run(main, doc=__doc__, fixed=_FIXED)
