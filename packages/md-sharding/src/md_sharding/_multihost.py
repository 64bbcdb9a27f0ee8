"""Multi-process start-up and per-process data → global arrays."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from md_sharding._rules import Rules, logical_to_spec

_ENV_ADDRESS = "JAX_COORDINATOR_ADDRESS"
_ENV_NUM_PROCESSES = "JAX_NUM_PROCESSES"
_ENV_PROCESS_ID = "JAX_PROCESS_ID"


def _env_int(name: str) -> int | None:
  value = os.environ.get(name)
  if value is None or value.strip() == "":
    return None
  try:
    return int(value)
  except ValueError:
    raise ValueError(f"environment variable {name} must be an int, got {value!r}") from None


def _cluster_detected() -> bool:
  """Whether a cluster that jax auto-detects (SLURM, Open MPI, Cloud TPU, k8s) is present."""
  try:
    # Private in jax; only used to decide whether calling `jax.distributed.initialize()` without
    # arguments can work. Guarded so that a move inside jax degrades to "no cluster" instead of
    # failing.
    from jax._src.clusters import ClusterEnv
  except ImportError:
    return False
  for env in getattr(ClusterEnv, "_cluster_types", ()):
    if getattr(env, "opt_in_only_method", False):
      continue
    try:
      if env.is_env_present():
        return True
    except Exception:  # noqa: BLE001 -- a detector that cannot run means "not this cluster".
      continue
  return False


def initialize(
  coordinator_address: str | None = None,
  num_processes: int | None = None,
  process_id: int | None = None,
  *,
  local_device_ids: int | Sequence[int] | None = None,
  **kwargs: Any,
) -> bool:
  """Starts `jax.distributed` when the job has several processes; call it before any other JAX work.

  Settings come from the arguments, else from `JAX_COORDINATOR_ADDRESS`, `JAX_NUM_PROCESSES` and
  `JAX_PROCESS_ID`, else from what jax detects on clusters (SLURM, Open MPI, Cloud TPU, Kubernetes).
  With none of these, or with `num_processes=1` and no coordinator, it does nothing and returns
  False, so single-process runs need no special case. Calling it again after a successful start
  returns True without restarting.

  Args:
    coordinator_address: "host:port" of process 0's coordinator service.
    num_processes: the number of processes in the job.
    process_id: this process's index in `[0, num_processes)`.
    local_device_ids: the local devices this process uses (GPU jobs with one process per device).
    **kwargs: passed to `jax.distributed.initialize` (e.g. `initialization_timeout`,
      `cluster_detection_method`).

  Returns:
    True when `jax.distributed` is running (started now or before), False for a plain single-process
    run.

  Raises:
    ValueError: a partial configuration (e.g. a process count without a coordinator address), or
      settings that disagree with an already started `jax.distributed`.
  """
  if jax.distributed.is_initialized():
    if num_processes is not None and num_processes != jax.process_count():
      raise ValueError(
        f"jax.distributed is already running with {jax.process_count()} processes; got "
        f"num_processes={num_processes}"
      )
    if process_id is not None and process_id != jax.process_index():
      raise ValueError(
        f"jax.distributed is already running as process {jax.process_index()}; got "
        f"process_id={process_id}"
      )
    return True

  coordinator_address = coordinator_address or os.environ.get(_ENV_ADDRESS) or None
  if num_processes is None:
    num_processes = _env_int(_ENV_NUM_PROCESSES)
  if process_id is None:
    process_id = _env_int(_ENV_PROCESS_ID)

  explicit = coordinator_address is not None or kwargs.get("cluster_detection_method") is not None
  if not explicit:
    if num_processes == 1:
      return False
    if not _cluster_detected():
      if num_processes is not None:
        raise ValueError(
          f"num_processes={num_processes} needs a coordinator address: pass "
          f"coordinator_address='host:port' (process 0's host) or set {_ENV_ADDRESS}"
        )
      return False

  if coordinator_address is not None and not _cluster_detected():
    missing = [
      f"{name} (or {env})"
      for name, value, env in (
        ("num_processes", num_processes, _ENV_NUM_PROCESSES),
        ("process_id", process_id, _ENV_PROCESS_ID),
      )
      if value is None
    ]
    if missing:
      raise ValueError(
        f"coordinator_address={coordinator_address!r} is set but {' and '.join(missing)} is not; "
        "a multi-process job needs all three outside a cluster that jax detects"
      )
  jax.distributed.initialize(
    coordinator_address=coordinator_address,
    num_processes=num_processes,
    process_id=process_id,
    local_device_ids=local_device_ids,
    **kwargs,
  )
  return True


def host_local_to_global(
  tree: Any,
  mesh: Mesh,
  names_or_spec: Sequence[str | None] | PartitionSpec,
  *,
  rules: Rules | None = None,
) -> Any:
  """Assembles each process's slice of the data into global `jax.Array`s.

  Every process passes its own part (e.g. its `per_process_batch_size` examples); the global array
  concatenates the processes' parts along the sharded dimensions, in process order of the mesh. With
  one process the result is the input placed with the requested sharding.

  Args:
    tree: a pytree of host arrays (numpy or anything `np.asarray` takes), this process's data.
    mesh: the global mesh.
    names_or_spec: a `PartitionSpec`, or logical names (one per dimension, e.g. `("batch", None,
      None)`) mapped with `rules`, for every leaf. Leaves of other ranks are an error.
    rules: the rule set for logical names; `DEFAULT_RULES` by default.

  Returns:
    The same pytree of global `jax.Array`s.

  Raises:
    ValueError: a leaf whose rank does not match the names, or data that the sharding cannot split.
  """
  if isinstance(names_or_spec, PartitionSpec):
    spec = names_or_spec
    rank = None
  else:
    # The spec is chosen without the data's shape: the layout of per-process data must not depend on
    # how large it happens to be, or the processes' parts would not line up.
    spec = logical_to_spec(names_or_spec, rules=rules, mesh=mesh)
    rank = len(tuple(names_or_spec))
  sharding = NamedSharding(mesh, spec)

  def place(leaf):
    local = np.asarray(leaf)
    if rank is not None and local.ndim != rank:
      raise ValueError(
        f"host_local_to_global: a leaf of shape {local.shape} does not match the {rank} logical "
        "names "
        f"{tuple(names_or_spec)}"
      )
    if len(spec) > local.ndim:
      raise ValueError(
        f"host_local_to_global: spec {spec} has more entries than the leaf's rank {local.ndim}"
      )
    return jax.make_array_from_process_local_data(sharding, local)

  return jax.tree.map(place, tree)
