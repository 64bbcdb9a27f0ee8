"""Mesh helpers: the shard_map shim across jax versions, the context mesh, activation specs."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
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


def context_mesh():
  """The mesh set by `jax.set_mesh` (concrete outside jit, abstract inside) or `with mesh:`."""
  get_mesh = getattr(jax.sharding, "get_mesh", None)
  if get_mesh is not None:
    try:
      mesh = get_mesh()
    except (RuntimeError, ValueError):  # inside jit only the abstract mesh is known
      mesh = None
    if mesh is not None and not mesh.empty:
      return mesh
  get_abstract_mesh = getattr(jax.sharding, "get_abstract_mesh", None)
  if get_abstract_mesh is not None:
    mesh = get_abstract_mesh()
    if mesh is not None and not mesh.empty:
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


def divisors(n: int) -> list[int]:
  return [d for d in range(1, n + 1) if n % d == 0]


def fit_kv_head_count(heads: int, kv_heads: int, divisor: int) -> int:
  """The K/V head count `fit_kv_heads` leaves: `kv_heads` times the least factor that makes it
  divisible by `divisor`."""
  if kv_heads % divisor == 0:
    return kv_heads
  groups = heads // kv_heads
  r = next(r for r in range(1, groups + 1) if groups % r == 0 and (kv_heads * r) % divisor == 0)
  return kv_heads * r


def fit_kv_heads(k, v, heads: int, divisor: int):
  """Repeats grouped K/V heads the least that makes their count divisible by `divisor` (the devices
  the heads are split over); each key/value head keeps serving the same query heads."""
  h_kv = k.shape[2]
  r = fit_kv_head_count(heads, h_kv, divisor) // h_kv
  if r == 1:
    return k, v
  return tuple(jnp.repeat(x, r, axis=2) for x in (k, v))
