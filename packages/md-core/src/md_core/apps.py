"""What every md app does at start-up: process-wide JAX settings, multihost start, the mesh, a summary."""

from __future__ import annotations

import os
import pathlib
from collections.abc import Mapping
from typing import Any

import jax

_AXES = ("data", "fsdp", "context", "tensor")
_DEFAULT_CACHE = (
  pathlib.Path(os.environ.get("XDG_CACHE_HOME", "~/.cache")).expanduser() / "md" / "jax"
)


def configure_jax(*, compilation_cache: str | os.PathLike | None | bool = True) -> None:
  """Process-wide settings apps use (libraries never set these).

  Args:
    compilation_cache: a folder for JAX's persistent compilation cache; True for `~/.cache/md/jax`
      (or `$MD_COMPILATION_CACHE`), False/None to leave it off.
  """
  jax.config.update("jax_threefry_partitionable", True)
  if compilation_cache:
    folder = (
      pathlib.Path(os.environ.get("MD_COMPILATION_CACHE", _DEFAULT_CACHE))
      if compilation_cache is True
      else pathlib.Path(compilation_cache)
    )
    folder.expanduser().mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(folder.expanduser()))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)


def add_runtime_config(config: Any) -> Any:
  """Adds the settings every app shares to an ml-collections `config` and returns it.

  `config.mesh`: md-sharding's `MeshConfig` fields (`ici_*` / `dcn_*` parallelism per axis; fsdp takes
  the devices left, -1), `config.distributed`: `jax.distributed` start-up (`coordinator_address`,
  `num_processes`, `process_id`; empty / -1: detect or single process), `config.compilation_cache`
  (see `configure_jax`). `start(config)` reads them back.
  """
  import ml_collections

  mesh = {f"{kind}_{axis}_parallelism": 1 for kind in ("ici", "dcn") for axis in _AXES}
  mesh["ici_fsdp_parallelism"] = -1
  config.mesh = ml_collections.ConfigDict(mesh)
  config.distributed = ml_collections.ConfigDict(
    dict(coordinator_address="", num_processes=-1, process_id=-1)
  )
  config.compilation_cache = True
  return config


def start(config: Mapping[str, Any] | None = None) -> jax.sharding.Mesh:
  """Starts multihost JAX if configured, applies process settings and builds the mesh from `config.mesh`."""
  import md_sharding as mds

  config = config or {}
  dist = dict(config.get("distributed", {}) or {})
  mds.initialize(**{k: v for k, v in dist.items() if v not in (None, "", -1)})
  configure_jax(compilation_cache=config.get("compilation_cache", True))
  return mds.make_mesh(mds.MeshConfig.from_dict(dict(config.get("mesh", {}) or {})))


def describe_mesh(mesh: jax.sharding.Mesh) -> str:
  """One line per fact: devices, processes, mesh shape by axis."""
  devices = mesh.devices.flatten()
  kinds = sorted({d.device_kind for d in devices})
  shape = ", ".join(f"{name}={size}" for name, size in mesh.shape.items())
  return (
    f"mesh: {shape} ({devices.size} devices: {', '.join(kinds)}; "
    f"{jax.process_count()} process(es), this is process {jax.process_index()})"
  )


def load_checkpoint_onto_mesh(
  source: str | os.PathLike,
  mesh: jax.sharding.Mesh,
  *,
  dtype: Any = "float32",
  progress: bool = True,
) -> str:
  """Reads every tensor of a safetensors checkpoint and places it on `mesh`, each split over `fsdp` along its
  first divisible axis (replicated when none divides). Returns a short report; a smoke test of the I/O path."""
  import time

  import numpy as np

  from md_core import _safetensors
  from md_core import progress as _progress

  start = time.perf_counter()
  path = pathlib.Path(source)
  ckpt = _safetensors.open_checkpoint(path)
  fsdp = mesh.shape.get("fsdp", 1)
  count = nbytes = 0
  sharded = 0
  keys = list(ckpt)
  for key in _progress.track(keys, desc="placing tensors") if progress else keys:
    array = np.asarray(ckpt[key]).astype(dtype)
    axis = next((i for i, d in enumerate(array.shape) if fsdp > 1 and d % fsdp == 0), None)
    spec = [None] * array.ndim
    if axis is not None:
      spec[axis] = "fsdp"
      sharded += 1
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*spec))
    placed = jax.device_put(array, sharding)
    count += placed.size
    nbytes += placed.nbytes
  jax.block_until_ready(placed) if keys else None
  seconds = time.perf_counter() - start
  return (
    f"loaded {len(keys)} tensors ({count:,} values, {nbytes / 2**20:.2f} MiB as {np.dtype(dtype).name}) from "
    f"{ckpt.name} in {seconds:.2f}s; {sharded} split over fsdp={fsdp}, {len(keys) - sharded} replicated"
  )
