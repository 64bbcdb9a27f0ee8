"""Mesh helpers: the shard_map shim across jax versions, activation specs, and the split context axis."""

from __future__ import annotations

import functools
import math

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

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


def batch_spec(mesh: Mesh, axes: tuple[str, ...], batch: int):
  """The batch axes (in order) whose product divides `batch`; others are left replicated."""
  used, product = [], 1
  for name in axes:
    size = axis_size(mesh, name)
    if size > 1 and batch % (product * size) == 0:
      used.append(name)
      product *= size
  if not used:
    return None
  return tuple(used) if len(used) > 1 else used[0]


def heads_spec(mesh: Mesh, axis: str | None, heads: int):
  size = axis_size(mesh, axis)
  return axis if size > 1 and heads % size == 0 else None


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


def lcm(a: int, b: int) -> int:
  return a * b // math.gcd(a, b)
