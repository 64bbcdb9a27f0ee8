"""Per-process batches → global `jax.Array`s, through `md_sharding.host_local_to_global`.

jax and md-sharding are imported when used, so `import md_data` stays light for NumPy-only users.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

if TYPE_CHECKING:
  import jax

DATA_AXES = ("data", "fsdp")


class BatchSizes(NamedTuple):
  global_batch_size: int  # examples per step over all processes
  per_process_batch_size: int  # what each process's iterator yields
  data_parallel: int  # devices the batch is split over (the mesh's data x fsdp)


def _data_axes(mesh: jax.sharding.Mesh) -> tuple[str, ...]:
  return tuple(a for a in DATA_AXES if a in mesh.shape)


def batch_sizes(
  mesh: jax.sharding.Mesh,
  *,
  global_batch_size: int | None = None,
  per_device_batch_size: float | None = None,
  process_count: int | None = None,
) -> BatchSizes:
  """The global and per-process batch sizes from one of a global or a per-device batch size.

  A fractional `per_device_batch_size` (MaxDiffusion's setting) counts all the mesh's devices: 0.5 on 8
  devices is a global batch of 4, which the mesh's data-parallel axes (`data` x `fsdp`) must divide.

  Raises:
    ValueError: both or neither given, a product that is not whole, or a global batch that the
      data-parallel size or the process count does not divide (the numbers named).
  """
  import jax

  import md_sharding as mds

  if (global_batch_size is None) == (per_device_batch_size is None):
    raise ValueError(
      "give one of global_batch_size and per_device_batch_size, got "
      f"global_batch_size={global_batch_size}, per_device_batch_size={per_device_batch_size}"
    )
  devices = mesh.devices.size
  if per_device_batch_size is not None:
    total = mds.global_batch_size(per_device_batch_size, devices)
    origin = f"per_device_batch_size={per_device_batch_size} x {devices} devices = {total}"
  else:
    if isinstance(global_batch_size, bool) or not isinstance(global_batch_size, int | np.integer):
      raise ValueError(f"global_batch_size must be an int, got {global_batch_size!r}")
    total = int(global_batch_size)
    if total < 1:
      raise ValueError(f"global_batch_size must be positive, got {total}")
    origin = f"global_batch_size={total}"
  axes = _data_axes(mesh)
  dp = int(np.prod([mesh.shape[a] for a in axes], dtype=np.int64))
  if total % dp:
    shape = " x ".join(f"{a}={mesh.shape[a]}" for a in axes) or "none"
    raise ValueError(
      f"{origin} is not a multiple of the data-parallel size {dp} (mesh {shape}); use a global batch "
      f"of {max(dp, total // dp * dp)} or {(total // dp + 1) * dp}, or put fewer devices on data / fsdp"
    )
  processes = jax.process_count() if process_count is None else int(process_count)
  if total % processes:
    raise ValueError(f"{origin} does not split evenly over {processes} processes")
  return BatchSizes(total, total // processes, dp)


class GlobalBatches:
  """Wraps an iterator of this process's batches; yields them as global `jax.Array`s.

  Array leaves (numpy, leading axis = the per-process batch) are placed with the batch axis split over
  the mesh's `data` x `fsdp` axes (`md_sharding.host_local_to_global`); other leaves (lists of captions,
  labels) pass through. Dicts and NamedTuples (e.g. `ShapesBatch`) keep their type. `state()` and
  `restore()` are the wrapped iterator's, so `md_train.fit` checkpoints and resumes through this.
  """

  def __init__(
    self,
    batches: Iterator[Any],
    mesh: jax.sharding.Mesh,
    *,
    global_batch_size: int | None = None,
    per_device_batch_size: float | None = None,
  ):
    self.sizes = batch_sizes(
      mesh, global_batch_size=global_batch_size, per_device_batch_size=per_device_batch_size
    )
    from jax.sharding import PartitionSpec

    self._batches, self._mesh = batches, mesh
    self._spec = PartitionSpec(_data_axes(mesh) or None)

  def __iter__(self) -> Iterator[Any]:
    return self

  def _place(self, key: str, value: Any) -> Any:
    import jax

    import md_sharding as mds

    if not isinstance(value, np.ndarray | jax.Array):
      return value
    want = self.sizes.per_process_batch_size
    if value.ndim == 0 or value.shape[0] != want:
      raise ValueError(
        f"GlobalBatches: {key!r} has shape {tuple(value.shape)}, expected a leading batch of {want} "
        f"per process (global batch {self.sizes.global_batch_size} over {jax.process_count()} "
        "processes); build the iterator with batch_size=sizes.per_process_batch_size"
      )
    return mds.host_local_to_global(np.asarray(value), self._mesh, self._spec)

  def __next__(self) -> Any:
    batch = next(self._batches)
    if isinstance(batch, tuple) and hasattr(batch, "_asdict"):
      return type(batch)(**{k: self._place(k, v) for k, v in batch._asdict().items()})
    if isinstance(batch, Mapping):
      return {k: self._place(k, v) for k, v in batch.items()}
    return self._place("batch", batch)

  # Properties, so that `hasattr(batches, "state")` (how md_train.fit decides whether a run can resume)
  # is False when the wrapped iterator has no saved position.
  @property
  def state(self):
    """The wrapped iterator's `state` (an AttributeError when it has none)."""
    return self._batches.state

  @property
  def restore(self):
    """The wrapped iterator's `restore`."""
    return self._batches.restore
