"""Batch sizes from a per-device batch size, which may be fractional."""

from __future__ import annotations

import jax
import numpy as np

# A per-device batch size such as 0.1 is not exact in binary floating point; products within this
# distance of a whole number count as that number.
_TOLERANCE = 1e-6


def _check_count(value, what: str) -> int:
  if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 1:
    raise ValueError(f"{what} must be a positive int, got {value!r}")
  return int(value)


def global_batch_size(per_device_batch_size: float, num_devices: int | None = None) -> int:
  """The global batch size: `per_device_batch_size * num_devices`, which must be a whole number.

  A fractional per-device batch size (e.g. 0.25 on 8 devices → 2 examples) lets big models train or
  sample with fewer examples than devices; the batch is then split over fewer devices than the mesh
  has.

  Args:
    per_device_batch_size: examples per device; positive, may be fractional.
    num_devices: the device count; `jax.device_count()` (all processes) by default.

  Returns:
    The global batch size.

  Raises:
    ValueError: a non-positive per-device batch size, or a product that is not a whole positive
      number.
  """
  if num_devices is None:
    num_devices = jax.device_count()
  num_devices = _check_count(num_devices, "num_devices")
  if isinstance(per_device_batch_size, bool) or not isinstance(
    per_device_batch_size, int | float | np.integer | np.floating
  ):
    raise ValueError(f"per_device_batch_size must be a number, got {per_device_batch_size!r}")
  if not per_device_batch_size > 0:
    raise ValueError(f"per_device_batch_size must be positive, got {per_device_batch_size}")
  product = per_device_batch_size * num_devices
  whole = round(product)
  if whole < 1 or abs(product - whole) > _TOLERANCE * max(1.0, abs(product)):
    multiple = 1 / num_devices
    raise ValueError(
      f"per_device_batch_size={per_device_batch_size} times num_devices={num_devices} is "
      f"{product:g}, not a "
      f"whole positive number of examples; use a multiple of 1/{num_devices} = {multiple:g}"
    )
  return whole


def per_process_batch_size(
  per_device_batch_size: float,
  num_devices: int | None = None,
  num_processes: int | None = None,
) -> int:
  """The number of examples each process (host) loads: the global batch split evenly over processes.

  Args:
    per_device_batch_size: examples per device; positive, may be fractional.
    num_devices: the global device count; `jax.device_count()` by default.
    num_processes: the process count; `jax.process_count()` by default.

  Returns:
    The per-process batch size.

  Raises:
    ValueError: the global batch is not whole, or does not split evenly over the processes.
  """
  batch = global_batch_size(per_device_batch_size, num_devices)
  if num_processes is None:
    num_processes = jax.process_count()
  num_processes = _check_count(num_processes, "num_processes")
  if batch % num_processes:
    raise ValueError(
      f"the global batch of {batch} examples (per_device_batch_size={per_device_batch_size} on "
      f"{num_devices if num_devices is not None else jax.device_count()} devices) does not split "
      "evenly over "
      f"{num_processes} processes; use a global batch that is a multiple of {num_processes}"
    )
  return batch // num_processes
