"""Mesh helpers: the shard_map shim across jax versions, activation specs, and the split context axis."""

from __future__ import annotations

import functools
import math

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import md_sharding as mds
from md_attention._config import ACTIVATION_AXES

try:  # jax >= 0.7 exports shard_map at the top level; older versions only under experimental.
  _shard_map = jax.shard_map
  _NO_CHECK = {"check_vma": False}
except AttributeError:  # pragma: no cover - depends on the installed jax
  from jax.experimental.shard_map import shard_map as _shard_map

  _NO_CHECK = {"check_rep": False}


def shard_map(f, *, mesh, in_specs, out_specs):
  """`shard_map` without replication checks (the bodies use collectives the checker cannot type)."""
  return _shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, **_NO_CHECK)


def context_mesh() -> Mesh | None:
  """The concrete mesh set by `jax.set_mesh`/`with mesh:`, if any."""
  get_mesh = getattr(jax.sharding, "get_mesh", None)
  if get_mesh is not None:
    try:
      mesh = get_mesh()
    except (RuntimeError, ValueError):
      mesh = None
    if isinstance(mesh, Mesh) and not mesh.empty:
      return mesh
  try:  # the legacy `with mesh:` context
    from jax._src import mesh as mesh_lib

    mesh = mesh_lib.thread_resources.env.physical_mesh
  except (ImportError, AttributeError):  # pragma: no cover - depends on the installed jax
    return None
  return None if mesh.empty else mesh


def axis_size(mesh: Mesh | None, name: str | None) -> int:
  if mesh is None or name is None or name not in mesh.shape:
    return 1
  return mesh.shape[name]


def activation_specs(mesh: Mesh, rules, shape) -> tuple:
  """Mesh axes of the batch and heads dimensions of a `[B, S, H, D]` activation.

  md-sharding's rules decide (the sequence is placed by the attention implementation itself).
  """
  spec = mds.logical_to_spec(ACTIVATION_AXES, rules=rules, mesh=mesh, shape=shape)
  spec = tuple(spec) + (None,) * (4 - len(spec))
  return spec[0], spec[2]


def spec_size(mesh: Mesh, entry) -> int:
  """Devices that a PartitionSpec entry splits a dimension over."""
  if entry is None:
    return 1
  names = (entry,) if isinstance(entry, str) else entry
  return math.prod(axis_size(mesh, n) for n in names)


def constrain(x, mesh: Mesh, spec: P):
  return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))


RING_SUFFIX = "_ring"
ULYSSES_SUFFIX = "_ulysses"


@functools.lru_cache(maxsize=64)
def split_context_mesh(mesh: Mesh, context_axis: str, ulysses: int) -> Mesh:
  """`mesh` with `context_axis` replaced by `(context_ring, context_ulysses)`, Ulysses inner.

  Device `c` of the context axis becomes `(c // ulysses, c % ulysses)`, so an array sharded over
  `context` is sharded the same way over `(context_ring, context_ulysses)`: no data moves.
  """
  size = mesh.shape[context_axis]
  if size % ulysses:
    raise ValueError(f"ulysses degree {ulysses} must divide the {context_axis!r} axis ({size})")
  index = mesh.axis_names.index(context_axis)
  shape = mesh.devices.shape
  devices = np.asarray(mesh.devices).reshape(
    shape[:index] + (size // ulysses, ulysses) + shape[index + 1 :]
  )
  names = (
    mesh.axis_names[:index]
    + (context_axis + RING_SUFFIX, context_axis + ULYSSES_SUFFIX)
    + mesh.axis_names[index + 1 :]
  )
  axis_types = getattr(mesh, "axis_types", None)
  if axis_types is None:  # pragma: no cover - jax without axis types
    return Mesh(devices, names)
  axis_types = tuple(axis_types)
  axis_types = axis_types[:index] + (axis_types[index],) * 2 + axis_types[index + 1 :]
  return Mesh(devices, names, axis_types=axis_types)


def divisors(n: int) -> list[int]:
  return [d for d in range(1, n + 1) if n % d == 0]
