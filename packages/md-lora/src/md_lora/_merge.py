"""Merging adapters into a model's weights: `W + s · scale · tensordot(down, up)`, on the weights' devices (DoRA
sites: `m / ||W + Δ|| · (W + Δ)`, each against the base weight)."""

from __future__ import annotations

import functools
import math
import numbers
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from md_lora._adapter import Adapter, LoRAWeight, Site


def _scales(adapters: Sequence[tuple[Adapter, float]]) -> list[float]:
  out = []
  for i, pair in enumerate(adapters):
    if not (isinstance(pair, tuple) and len(pair) == 2 and isinstance(pair[0], Adapter)):
      raise TypeError(f"adapters[{i}] must be an (Adapter, scale) pair, got {type(pair).__name__}")
    s = pair[1]
    if isinstance(s, bool) or not isinstance(s, numbers.Real) or not math.isfinite(s):
      raise TypeError(f"adapters[{i}] ({pair[0].source}): scale {s!r} is not a finite number")
    out.append(float(s))
  return out


def _value(var: Any) -> Any:
  return var.get_value() if hasattr(var, "get_value") else var.value


def merge(
  model_or_state: Any, adapters: Sequence[tuple[Adapter, float]], *, sign: float = 1.0
) -> Any:
  """Adds each adapter's delta, times its scale, into the weights it adapts.

  One jitted program per call: the deltas are formed on the weights' devices (sharded weights stay
  sharded; only the small factors travel), added in float32 and cast back to each weight's dtype. The
  input is left as it was.

  A DoRA site (`LoRAWeight.magnitude`) adds `m / ||W + Δ|| · (W + Δ) - W` with `Δ` its scaled low-rank
  delta and `W` the weight before this call, as peft runs several adapters side by side; the scale
  multiplies `Δ` inside the norm (peft's `scale_layer`), so scale 0 still rescales `W` to `m`.

  Args:
    model_or_state: an NNX module, or its `nnx.State`.
    adapters: `(Adapter, scale)` pairs, e.g. `[(style, 0.8), (detail, 0.5)]`.
    sign: -1 removes them again (see `unmerge`).

  Returns:
    A new module (for a module) or state (for a state) with the merged weights.

  Raises:
    TypeError: a pair that is not `(Adapter, number)`.
    ValueError: an adapter site the model does not have, or of another shape; `sign=-1` (`unmerge`) with
      a DoRA adapter (its rescaling cannot be taken back from the merged weight: keep the input).
  """
  scales = _scales(adapters)
  if sign != 1.0:
    for adapter, _ in adapters:
      if adapter.dora:
        raise ValueError(
          f"{adapter.source}: a DoRA adapter cannot be unmerged (its renormalisation of each weight is "
          "not a delta that subtracts); merge returns a new model and leaves the input as it was: keep that"
        )
  graphdef = None
  state = model_or_state
  if isinstance(model_or_state, nnx.Module):
    graphdef, state = nnx.split(model_or_state)
  flat = list(nnx.to_flat_state(state))
  index = {tuple(p): i for i, (p, _) in enumerate(flat)}

  touched: dict[tuple, Any] = {}
  factors: list[tuple[Site, LoRAWeight, float]] = []  # (site, weight, the user's scale · sign)
  for (adapter, s), _ in zip(adapters, scales):
    for site, w in adapter.weights.items():
      if site.path not in index:
        raise ValueError(f"{adapter.source}: {str(site)!r} is not a parameter of this model")
      value = _value(flat[index[site.path]][1])
      want = tuple(value.shape[1:] if site.layer is not None else value.shape)
      got = tuple(w.down.shape[:-1]) + tuple(w.up.shape[1:])
      if got != want:
        raise ValueError(
          f"{adapter.source}: delta for {str(site)!r} is {got}, the weight is {want}"
        )
      touched[site.path] = value
      factors.append((site, w, sign * float(s)))
  if not factors:
    return model_or_state

  paths = tuple(touched)
  # (path, layer, DoRA rule or None): the program's static structure.
  sites = tuple(
    (site.path, site.layer, w.dora_rule if w.magnitude is not None else None)
    for site, w, _ in factors
  )
  weights = [touched[p] for p in paths]
  shardings = [getattr(w, "sharding", None) for w in weights]
  # On a mesh the merged weights keep their shardings; on one device they stay as placed (an uncommitted
  # weight stays uncommitted: committedness is part of a compiled program's key).
  named = all(isinstance(s, jax.sharding.NamedSharding) for s in shardings)
  out_shardings = tuple(shardings) if named else None
  new = _program(paths, sites, out_shardings)(
    weights,
    [w.down for _, w, _ in factors],
    [w.up for _, w, _ in factors],
    jnp.asarray([k * w.scale for _, w, k in factors], jnp.float32),  # Δ's scale, peft's rule
    [w.magnitude for _, w, _ in factors],
    jnp.asarray([[w.scale, k] for _, w, k in factors], jnp.float32),  # LyCORIS': file scale, user's
  )
  replaced = dict(zip(paths, new))
  merged = nnx.from_flat_state(
    [(p, v.replace(replaced[tuple(p)]) if tuple(p) in replaced else v) for p, v in flat]
  )
  return merged if graphdef is None else nnx.merge(graphdef, merged)


@functools.lru_cache(maxsize=16)
def _program(paths: tuple, sites: tuple, out_shardings: tuple | None):
  """The merge program for one set of sites (cached: fusing, unfusing and other scales reuse it)."""

  def apply(weights, downs, ups, mults, magnitudes, scales):
    base = {p: weights[i].astype(jnp.float32) for i, p in enumerate(paths)}
    acc = dict(base)
    for i, ((path, layer, rule), d, u) in enumerate(zip(sites, downs, ups)):
      product = jnp.tensordot(
        d.astype(jnp.float32), u.astype(jnp.float32), 1, precision=jax.lax.Precision.HIGHEST
      )
      delta = mults[i] * product
      if rule is not None:  # DoRA: the weight rescaled to its magnitudes (see LoRAWeight)
        m = magnitudes[i].astype(jnp.float32)
        w = base[path] if layer is None else base[path][layer]
        file_scale, user_scale = scales[i, 0], scales[i, 1]
        v = w + (delta if rule == "peft" else file_scale * product)
        axes = tuple(ax for ax in range(v.ndim) if m.shape[ax] == 1)
        norm = jnp.sqrt(jnp.sum(v * v, axis=axes, keepdims=True))
        if rule == "peft":
          delta = m / norm * v - w
        else:
          g = m / (norm + jnp.finfo(jnp.float32).eps)
          delta = v * (user_scale * (g - 1.0) + 1.0) - w
      acc[path] = acc[path] + delta if layer is None else acc[path].at[layer].add(delta)
    return [acc[p].astype(weights[i].dtype) for i, p in enumerate(paths)]

  return jax.jit(apply, out_shardings=None if out_shardings is None else list(out_shardings))


def unmerge(model_or_state: Any, adapters: Sequence[tuple[Adapter, float]]) -> Any:
  """Subtracts what `merge` added (exact in float32; low-precision weights keep a rounding residue)."""
  return merge(model_or_state, adapters, sign=-1.0)
