"""The grain pipeline: a global shuffle, per-process shards, batches, and a saved position (`md-data[grain]`)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from md_data._sources import import_grain


def stack_batch(items: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
  """Stacks a list of examples: arrays and numbers along a new first axis, strings into a list."""
  out = {}
  for key in items[0]:
    values = [item[key] for item in items]
    if isinstance(values[0], str | bytes):
      out[key] = list(values)
      continue
    shapes = {np.shape(v) for v in values}
    if len(shapes) > 1:
      raise ValueError(
        f"cannot batch {key!r}: the examples have shapes {sorted(shapes)}; give the source an "
        "image_size (and frames) so every example has one shape"
      )
    out[key] = np.stack([np.asarray(v) for v in values])
  return out


class GrainIterator:
  """Batches from a random-access source through grain, resumable from `state()`.

  The order: one global permutation per epoch (`seed`; the same on every process), then this process's
  shard of it (every `shard_count`-th example from `shard_index`, shards cut to equal length so processes
  take the same number of steps), then batches. `state()` is grain's iterator state (JSON-able);
  `restore(state)` continues so that the next batch equals the uninterrupted run's, bit for bit.
  """

  def __init__(
    self,
    source: Any,
    *,
    batch_size: int,
    seed: int | None = 0,
    num_epochs: int | None = None,
    drop_remainder: bool = True,
    shard: Any = None,
    transform: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
    num_threads: int = 2,
    prefetch: int = 8,
  ):
    """Builds the pipeline.

    Args:
      source: a random-access source (`len`, `[i]`): `FolderSource`, `ArrayRecordSource`, or any grain
        source of dicts.
      batch_size: this process's batch (the global batch / process count).
      seed: the shuffle seed; None keeps the source's order.
      num_epochs: passes over the data; None repeats forever.
      drop_remainder: drop a last, smaller batch (at the end of the last epoch).
      shard: a `grain.sharding.ShardOptions` (e.g. `ShardByJaxProcess()`, the default).
      transform: applied to each example before batching.
      num_threads, prefetch: grain's read threads and prefetch buffer.
    """
    grain = import_grain()
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
      raise ValueError(f"GrainIterator: batch_size must be a positive int, got {batch_size!r}")
    if shard is None:
      shard = grain.sharding.ShardByJaxProcess(drop_remainder=True)
    size = len(source)
    per_shard = size // shard.shard_count
    if per_shard == 0:
      raise ValueError(
        f"GrainIterator: {size} examples cannot be split over {shard.shard_count} processes"
      )
    if drop_remainder and per_shard < batch_size:
      raise ValueError(
        f"GrainIterator: a shard of {per_shard} examples ({size} over {shard.shard_count} processes) "
        f"is smaller than batch_size={batch_size}, so drop_remainder=True would leave no batch"
      )
    ds = grain.MapDataset.source(source)
    if seed is not None:
      ds = ds.shuffle(seed=int(seed))
    ds = ds[: per_shard * shard.shard_count][shard.shard_index :: shard.shard_count]
    ds = ds.repeat(num_epochs)
    if transform is not None:
      ds = ds.map(transform)
    ds = ds.batch(batch_size, drop_remainder=drop_remainder, batch_fn=stack_batch)
    options = grain.ReadOptions(num_threads=num_threads, prefetch_buffer_size=prefetch)
    self._dataset = ds.to_iter_dataset(options)
    self._it = iter(self._dataset)
    self.shard = shard
    self.batch_size = batch_size

  def __iter__(self) -> Iterator[dict[str, Any]]:
    return self

  def __next__(self) -> dict[str, Any]:
    return next(self._it)

  def state(self) -> dict[str, Any]:
    """grain's position of this process's iterator (JSON-able)."""
    return {"grain": _plain(self._it.get_state())}

  def restore(self, state: Mapping[str, Any]) -> None:
    """Continues from a `state()`."""
    if "grain" not in state:
      raise ValueError(f"GrainIterator.restore: not a GrainIterator state: {dict(state)!r}")
    self._it = iter(self._dataset)
    self._it.set_state(state["grain"])


def _plain(value: Any) -> Any:
  """numpy scalars and tuples → JSON's ints, floats and lists."""
  if isinstance(value, Mapping):
    return {str(k): _plain(v) for k, v in value.items()}
  if isinstance(value, list | tuple):
    return [_plain(v) for v in value]
  if isinstance(value, np.generic):
    return value.item()
  return value
