"""prepare_data: caches a dataset's VAE latents and text states as TFRecords (`latents`, `encoder_hidden_states`).

uv run apps/prepare_data --config=apps/configs/prepare_data.py:tiny --workdir=/tmp/prepared-tiny
uv run apps/prepare_data --config=apps/configs/prepare_data.py:sd --config.source=my_images --workdir=runs/data
uv run apps/prepare_data --config=apps/configs/prepare_data.py:wan --config.source=my_clips --workdir=runs/clips
uv run apps/prepare_data --config=apps/configs/prepare_data.py:sd --config.source=raw.tfrecord \\
  --config.source_type=tfrecord --config.eval_count=16 --workdir=runs/data
uv run apps/prepare_data --help --config=apps/configs/prepare_data.py:tiny   # the variants, keys and values

Variants: sd (md's shapes-sd: an SD VAE + CLIP text encoder; any SD 1.x / 2.x pipeline folder or hub id
through --config.model), wan (md's shapes-wan: the Wan VAE + UMT5; `frames` set: video clips, None: still
images as one-frame clips), tiny (shapes-sd on 8 procedural shapes images at 32x32: runs in seconds).
`source_type`: folder (images / videos with `x.txt` captions, or metadata.jsonl / metadata.csv with
file_name and `caption_column`), tfrecord or arrayrecord (raw-image records: `image` + `text`), shapes
(`shapes_count` samples of md_data's shapes dataset). The workdir gets train/ (and eval/ when
`eval_count` > 0: the last `eval_count` examples, with fixed `timesteps` spread over
[0, num_train_timesteps)) and settings.json; running the same command again skips the shards already
written. Read them with `md_data.read_latent_records(<workdir>/train, batch_size=...)`.
"""

import pathlib

import ml_collections
from ml_collections.config_dict import placeholder

from md_core import apps as md_apps

_MODELS = pathlib.Path(__file__).resolve().parents[2] / "models"

# variant -> settings that differ from the defaults below
VARIANTS = {
  "sd": dict(family="sd", model=str(_MODELS / "shapes-sd"), height=64, width=64),
  "wan": dict(
    family="wan",
    model=str(_MODELS / "shapes-wan"),
    height=64,
    width=64,
    frames=9,
    max_sequence_length=64,
  ),
  "tiny": dict(
    family="sd",
    model=str(_MODELS / "shapes-sd"),
    source_type="shapes",
    shapes_count=8,
    height=32,
    width=32,
    batch_size=4,
    records_per_shard=4,
    eval_count=2,
  ),
}


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  name = arg or "tiny"
  if name not in VARIANTS:
    raise ValueError(f"unknown variant {name!r}; choose one of {', '.join(VARIANTS)}")
  config = ml_collections.ConfigDict(
    dict(
      variant=name,
      family="sd",
      model="",
      source="",
      source_type="folder",
      caption_column="text",
      shapes_count=64,
      height=64,
      width=64,
      frames=placeholder(int),
      max_sequence_length=placeholder(int),
      batch_size=8,
      records_per_shard=1024,
      eval_count=0,
      num_train_timesteps=1000,
      channels_first=False,
      seed=0,
    )
  )
  config.update(VARIANTS[name])
  md_apps.add_runtime_config(config)
  config.lock()
  return config
