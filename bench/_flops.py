"""Matmul and convolution FLOPs of a jitted function, counted from its jaxpr with loop bodies times their trip
counts. (XLA's `cost_analysis()` of a lowered program counts a `while` body once, so a scanned stack of 40
blocks reads as one block.) Elementwise work is not counted: the number is the model FLOPs MFU is quoted in."""

from __future__ import annotations

import math

import jax
from jax import core as _core  # noqa: F401  (jaxpr types live here across jax versions)


def _dot_flops(eqn) -> int:
  lhs, rhs = (v.aval.shape for v in eqn.invars[:2])
  (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
  batch = math.prod(lhs[d] for d in lb)
  contract = math.prod(lhs[d] for d in lc)
  free_l = math.prod(s for d, s in enumerate(lhs) if d not in lc and d not in lb)
  free_r = math.prod(s for d, s in enumerate(rhs) if d not in rc and d not in rb)
  return 2 * batch * contract * free_l * free_r


def _conv_flops(eqn) -> int:
  out = eqn.outvars[0].aval.shape
  rhs = eqn.invars[1].aval.shape
  dn = eqn.params["dimension_numbers"]
  spec = dn.rhs_spec  # (out feature dim, in feature dim, *spatial)
  window = math.prod(rhs[d] for d in spec[2:])
  in_per_group = rhs[spec[1]]
  return 2 * math.prod(out) * window * in_per_group


def _sub_jaxprs(eqn):
  for value in eqn.params.values():
    items = value if isinstance(value, (tuple, list)) else (value,)
    for item in items:
      if hasattr(item, "jaxpr") and hasattr(item.jaxpr, "eqns"):  # ClosedJaxpr
        yield item.jaxpr
      elif hasattr(item, "eqns"):  # Jaxpr
        yield item


def jaxpr_flops(jaxpr) -> int:
  total = 0
  for eqn in jaxpr.eqns:
    name = eqn.primitive.name
    if name == "dot_general":
      total += _dot_flops(eqn)
    elif name == "conv_general_dilated":
      total += _conv_flops(eqn)
    elif name == "scan":
      total += eqn.params["length"] * jaxpr_flops(eqn.params["jaxpr"].jaxpr)
    elif name == "cond":
      total += max(jaxpr_flops(b.jaxpr) for b in eqn.params["branches"])
    elif name == "while":
      body = jaxpr_flops(eqn.params["body_jaxpr"].jaxpr)
      if body:
        raise ValueError("a while loop with matmuls has no static trip count; use fori_loop bounds")
    else:
      total += sum(jaxpr_flops(j) for j in _sub_jaxprs(eqn))
  return total


def count_flops(fn, *args, **kwargs) -> int:
  """Matmul + conv FLOPs of `fn(*args, **kwargs)` (arrays or `jax.ShapeDtypeStruct`s)."""
  return jaxpr_flops(jax.make_jaxpr(fn)(*args, **kwargs).jaxpr)


def best_seconds(fn, repeats: int) -> float:
  """The fastest of `repeats` timed calls of `fn()` (blocked until ready), after one untimed call."""
  import time

  jax.block_until_ready(fn())
  best = float("inf")
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn())
    best = min(best, time.perf_counter() - start)
  return best


def measure_peak(n: int, dtype, repeats: int) -> float:
  """FLOP/s of an `n x n @ n x n` jitted matmul (best of `repeats`), multiplied as md's dense layers do
  (`md_core.nn.matmul`, float32 accumulation): the peak the benches' "% of peak" is quoted against."""
  import md_core

  a = jax.random.normal(jax.random.key(0), (n, n), dtype)
  b = jax.random.normal(jax.random.key(1), (n, n), dtype)
  mm = jax.jit(md_core.nn.matmul)
  return 2 * n**3 / best_seconds(lambda: mm(a, b), repeats)
