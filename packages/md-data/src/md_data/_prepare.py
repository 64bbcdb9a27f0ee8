"""Caching latents: a source of pictures + captions, an encoder, and shards of cached-latent TFRecords.

The encoder (a family's VAE and text encoder) comes from the caller, so md-data imports no family package;
`apps/prepare_data` builds it for SD and Wan. Writing is resumable: each shard is written under a
temporary name and renamed when complete, so a shard file that exists is whole and is skipped on a rerun.
"""

from __future__ import annotations

import os
import pathlib
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np

from md_data._grain import stack_batch
from md_data._tfrecord import latent_example, write_tfrecord

# pixels [B, H, W, 3] or [B, F, H, W, 3] in [0, 1], captions → (latents [B, ...], states [B, S, D])
Encoder = Callable[[np.ndarray, list[str]], tuple[Any, Any]]


class ShardReport(NamedTuple):
  folder: pathlib.Path
  written: list[str]  # shard file names written by this call
  skipped: list[str]  # shard file names that were already complete
  records: int  # records in all the shards (written or skipped)


def shard_name(prefix: str, index: int, count: int) -> str:
  """`<prefix>-00003-of-00010.tfrecord`."""
  return f"{prefix}-{index:05d}-of-{count:05d}.tfrecord"


def write_latent_shards(
  source: Any,
  encode: Encoder,
  folder: str | os.PathLike,
  *,
  records_per_shard: int = 1024,
  batch_size: int = 8,
  indices: Sequence[int] | None = None,
  timesteps: Sequence[int] | None = None,
  channels_first: bool = False,
  prefix: str = "data",
  desc: str | None = None,
) -> ShardReport:
  """Encodes a source's examples and writes them as cached-latent TFRecord shards.

  Args:
    source: random access (`len`, `[i]`) to `{"pixels", "captions"}` examples, e.g. `FolderSource`.
    encode: `(pixels [B, ...], captions) -> (latents [B, ...], encoder_hidden_states [B, S, D])`. It
      always gets `batch_size` examples (the last batch is padded with its last example and the padding
      dropped), so a jitted encoder compiles once.
    folder: where the shards go (created).
    records_per_shard: records per file.
    batch_size: examples per `encode` call.
    indices: which examples of `source`, in order (default: all).
    timesteps: a fixed timestep per record (held-out eval records; MaxDiffusion's eval layout), cycled
      when shorter than the records.
    channels_first: store latents channels first (`[c, h, w]`, `[c, f, h, w]`), the layout MaxDiffusion
      writes; default md's channels last.
    prefix: the shard files' prefix.
    desc: the progress bar's label.

  Returns:
    A `ShardReport`.
  """
  from md_core import progress

  if records_per_shard < 1 or batch_size < 1:
    raise ValueError(
      f"records_per_shard={records_per_shard} and batch_size={batch_size} must be positive"
    )
  order = list(range(len(source))) if indices is None else [int(i) for i in indices]
  if not order:
    raise ValueError(f"write_latent_shards: no examples to write ({source!r})")
  if timesteps is not None and len(timesteps) == 0:
    raise ValueError("write_latent_shards: timesteps is empty; give None or at least one")
  folder = pathlib.Path(folder)
  folder.mkdir(parents=True, exist_ok=True)
  count = -(-len(order) // records_per_shard)
  stale = sorted(
    p.name
    for p in folder.glob(f"{prefix}-*-of-*.tfrecord")
    if not p.name.endswith(f"-of-{count:05d}.tfrecord")
  )
  if stale:
    raise ValueError(
      f"{folder} holds shards of another split ({stale[0]}, ...), not of {count} shards of "
      f"{records_per_shard} records from {len(order)} examples; use another folder or delete them"
    )
  written, skipped = [], []
  import tqdm

  bar = tqdm.tqdm(
    total=len(order), desc=desc or f"encoding {prefix}", unit="example",
    disable=not progress.progress_enabled(),
  )  # fmt: skip
  with bar:
    for k in range(count):
      part = order[k * records_per_shard : (k + 1) * records_per_shard]
      name = shard_name(prefix, k, count)
      if (folder / name).is_file():
        skipped.append(name)
        bar.update(len(part))
        continue
      records = []
      for start in range(0, len(part), batch_size):
        chunk = part[start : start + batch_size]
        batch = stack_batch([source[i] for i in chunk + chunk[-1:] * (batch_size - len(chunk))])
        latents, states = encode(batch["pixels"], list(batch["captions"]))
        latents, states = np.asarray(latents), np.asarray(states)
        for j in range(len(chunk)):
          lat = np.moveaxis(latents[j], -1, 0) if channels_first else latents[j]
          n = k * records_per_shard + start + j
          t = None if timesteps is None else int(timesteps[n % len(timesteps)])
          records.append(latent_example(lat, states[j], timesteps=t))
        bar.update(len(chunk))
      write_tfrecord(folder / name, records)
      written.append(name)
  return ShardReport(folder, written, skipped, len(order))
