"""Merging adapters into a model's weights: `W + s · scale · tensordot(down, up)`, on the weights' devices (DoRA
sites: `m / ||W + Δ|| · (W + Δ)`; OFT / BOFT sites: `rescale · R W`; each against the base weight)."""

from __future__ import annotations

import functools
import math
import numbers
from collections import Counter
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from md_lora._adapter import Adapter, GLoRAWeight, IA3Weight, LoRAWeight, OFTWeight, Site

_HIGHEST = jax.lax.Precision.HIGHEST


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
  An OFT / BOFT site (`OFTWeight`) adds `rescale · R_k W - W`, its rotation taken toward the identity
  by the scale k as LyCORIS' `get_merged_weight(multiplier=k)` does (see `OFTWeight`); PEFT's OFT adds
  `W R_kᵀ - W` (torch's layout), R rotating the inputs.

  Args:
    model_or_state: an NNX module, or its `nnx.State`.
    adapters: `(Adapter, scale)` pairs, e.g. `[(style, 0.8), (detail, 0.5)]`.
    sign: -1 removes them again (see `unmerge`): OFT rotations are inverted after the other
      adapters' deltas are taken off.

  Returns:
    A new module (for a module) or state (for a state) with the merged weights.

  Raises:
    TypeError: a pair that is not `(Adapter, number)`.
    ValueError: an adapter site the model does not have, or of another shape; `sign=-1` (`unmerge`) with
      a DoRA adapter (its rescaling cannot be taken back from the merged weight: keep the input), with
      two OFT rotations of one weight in one call, or with an OFT `rescale` holding a zero.
  """
  scales = _scales(adapters)
  if sign != 1.0:
    for adapter, _ in adapters:
      if adapter.dora:
        raise ValueError(
          f"{adapter.source}: a DoRA adapter cannot be unmerged (its renormalisation of each weight is "
          "not a delta that subtracts); merge returns a new model and leaves the input as it was: keep that"
        )
    _check_unmerge_oft(adapters)
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
      if isinstance(w, IA3Weight):
        axis = -2 if w.on_input else -1
        if len(want) < 2 or len(w.vector) != want[axis]:
          raise ValueError(
            f"{adapter.source}: the IA3 vector {np.shape(w.vector)} for {str(site)!r} scales its "
            f"{'inputs' if w.on_input else 'outputs'}, the weight is {want}"
          )
      elif isinstance(w, OFTWeight):
        rescale = None if w.rescale is None else np.shape(w.rescale)
        if w.rule == "peft":  # inputs: a kernel's axes but its last, flattened
          bad = len(want) < 2 or w.size != math.prod(want[:-1])
          bad = bad or rescale not in (None, (want[-1],))
        else:
          bad = not want or w.size != want[-1] or rescale not in (None, (w.size,))
        if bad:
          axis = "inputs" if w.rule == "peft" else "outputs"
          raise ValueError(
            f"{adapter.source}: the OFT blocks {np.shape(w.blocks)} for {str(site)!r} rotate "
            f"{w.size} {axis} (rescale {rescale}), the weight is {want}"
          )
      else:
        got = tuple(w.down.shape[:-1]) + tuple(w.up.shape[1:])
        if got != want:
          raise ValueError(
            f"{adapter.source}: delta for {str(site)!r} is {got}, the weight is {want}"
          )
        if isinstance(w, GLoRAWeight) and np.shape(w.mix_a)[0] != want[-2]:
          raise ValueError(
            f"{adapter.source}: the GLoRA for {str(site)!r} mixes {np.shape(w.mix_a)[0]} inputs, "
            f"the weight is {want}"
          )
      touched[site.path] = value
      factors.append((site, w, sign * float(s)))
  if not factors:
    return model_or_state

  paths = tuple(touched)
  # (path, layer, kind): the program's static structure; kind None (LoRA), a DoRA rule ("peft" /
  # "lycoris"), or ("oft" | "boft", inverted) for a rotation.
  sites = tuple((site.path, site.layer, _kind(w, sign)) for site, w, _ in factors)
  lora = [isinstance(w, LoRAWeight) for _, w, _ in factors]
  low_rank = [isinstance(w, LoRAWeight | GLoRAWeight) for _, w, _ in factors]  # down / up factors
  glora = [isinstance(w, GLoRAWeight) for _, w, _ in factors]
  ia3 = [isinstance(w, IA3Weight) for _, w, _ in factors]
  weights = [touched[p] for p in paths]
  shardings = [getattr(w, "sharding", None) for w in weights]
  # On a mesh the merged weights keep their shardings; on one device they stay as placed (an uncommitted
  # weight stays uncommitted: committedness is part of a compiled program's key).
  named = all(isinstance(s, jax.sharding.NamedSharding) for s in shardings)
  out_shardings = tuple(shardings) if named else None
  new = _program(paths, sites, out_shardings)(
    weights,
    [w.down if f else None for (_, w, _), f in zip(factors, low_rank)],
    [w.up if f else None for (_, w, _), f in zip(factors, low_rank)],
    # Δ's scale (peft's rule; GLoRA's γ times the user's scale); 0 for a rotation
    jnp.asarray(
      [k * w.scale if f else 0.0 for (_, w, k), f in zip(factors, low_rank)], jnp.float32
    ),
    [w.magnitude if is_lora else None for (_, w, _), is_lora in zip(factors, lora)],
    # LyCORIS' DoRA: (file scale, user's); a rotation: (norm bound, the user's scale without the sign)
    jnp.asarray(
      [
        [w.scale, k] if is_lora else [0.0 if g or v else w.constraint, k * sign]
        for (_, w, k), is_lora, g, v in zip(factors, lora, glora, ia3)
      ],
      jnp.float32,
    ),
    # a rotation's blocks; GLoRA's input mix (a1, a2)
    [
      None if is_lora else (w.mix_a, w.mix_b) if g else w.vector if v else w.blocks
      for (_, w, _), is_lora, g, v in zip(factors, lora, glora, ia3)
    ],
    [
      None if is_lora or g or v else w.rescale
      for (_, w, _), is_lora, g, v in zip(factors, lora, glora, ia3)
    ],
  )
  replaced = dict(zip(paths, new))
  merged = nnx.from_flat_state(
    [(p, v.replace(replaced[tuple(p)]) if tuple(p) in replaced else v) for p, v in flat]
  )
  return merged if graphdef is None else nnx.merge(graphdef, merged)


def _kind(w: LoRAWeight | OFTWeight, sign: float) -> Any:
  if isinstance(w, GLoRAWeight):
    return ("glora", sign < 0)
  if isinstance(w, IA3Weight):
    return ("ia3-in" if w.on_input else "ia3-out", sign < 0)
  if isinstance(w, OFTWeight):
    kind = "boft" if w.butterfly else "oft"
    return ("peft-" + kind if w.rule == "peft" else kind, sign < 0)
  return w.dora_rule if w.magnitude is not None else None


def _check_unmerge_oft(adapters: Sequence[tuple[Adapter, float]]) -> None:
  """What keeps an unmerge from taking OFT rotations back exactly: two on one weight in one call (merged
  together, each rotated the same base weight: their sum is no rotation to invert), a zero rescale."""
  rotated = Counter(
    site
    for adapter, _ in adapters
    for site, w in adapter.weights.items()
    if isinstance(w, OFTWeight | GLoRAWeight | IA3Weight)
  )
  twice = [str(site) for site, n in rotated.items() if n > 1]
  if twice:
    raise ValueError(
      f"unmerge: {len(twice)} weight(s) carry OFT rotations of several of these adapters, e.g. "
      f"{twice[0]!r}; unmerge them one call per adapter, in the reverse order of their merges (or keep "
      "the model merge was given)"
    )
  for adapter, _ in adapters:
    for site, w in adapter.weights.items():
      if isinstance(w, OFTWeight) and w.rescale is not None and not np.all(np.asarray(w.rescale)):
        raise ValueError(
          f"{adapter.source}: {str(site)!r}: its OFT rescale holds a zero, which merging cannot take "
          "back; keep the model merge was given"
        )


def _rotations(blocks: jax.Array, bound: jax.Array, scale: jax.Array) -> jax.Array:
  """`k·R + (1 - k)·I` for every block `[stages, num, b, b]`: `R = (I + Q)(I - Q)⁻¹` with `Q = B - Bᵀ`,
  scaled onto the norm bound (over all blocks) where it exceeds a positive one."""
  blocks = blocks.astype(jnp.float32)
  eye = jnp.broadcast_to(jnp.eye(blocks.shape[-1], dtype=jnp.float32), blocks.shape)
  q = blocks - jnp.swapaxes(blocks, -1, -2)
  norm = jnp.sqrt(jnp.sum(q * q)) + 1e-8
  q = jnp.where((bound > 0) & (norm > bound), q * (bound / norm), q)
  # (I + Q) and (I - Q)⁻¹ commute: R = (I - Q)⁻¹ (I + Q), one solve per block.
  r = jnp.linalg.solve(eye - q, eye + q)
  return scale * r + (1.0 - scale) * eye


def _rotate_inputs(w: jax.Array, mats: jax.Array, butterfly: bool, inverse: bool) -> jax.Array:
  """`M K` for `w` (md layout `(*k, in, out)`), its inputs flattened as torch flattens them (`(in, *k)`):
  PEFT's `W Mᵀ` in torch's layout. OFT: M block-diagonal from `mats` `[1, num, b, b]`. BOFT: M the
  product of stages `P_i D_i P_iᵀ` (stage 0 first), `D_i` block-diagonal from `mats[i]` and `P_i` PEFT's
  butterfly permutation (`_butterfly_perm`); `inverse`: the stages in reverse order (`mats` then hold the
  inverses)."""
  stages, num, b, _ = mats.shape
  x = jnp.moveaxis(w, -2, 0)  # (in, *k, out)
  flat = x.reshape(num * b, -1)
  order = range(stages - 1, -1, -1) if inverse else range(stages)
  for i in order:
    perm = _butterfly_perm(num * b, num // 2**i, b // 2) if butterfly and stages > 1 else None
    y = flat if perm is None else flat[np.argsort(perm)]  # Pᵀ x
    y = jnp.einsum("nij,njo->nio", mats[i], y.reshape(num, b, -1), precision=_HIGHEST)
    y = y.reshape(num * b, -1)
    flat = y if perm is None else y[perm]  # P y
  return jnp.moveaxis(flat.reshape(x.shape), 0, -2)


def _butterfly_perm(n: int, groups: int, half: int) -> np.ndarray:
  """PEFT's `block_butterfly_perm(n, groups, half)` as indices (its matrix P has `P[i, perm[i]] = 1`): the
  inputs cut into `groups` runs, each run into chunks of `half`, and every run's even chunks put before
  its odd ones (stage 0, runs of one block, is the identity)."""
  run = n // groups
  chunks = run // half
  order = np.concatenate([np.arange(0, chunks, 2), np.arange(1, chunks, 2)])
  return np.arange(n).reshape(groups, chunks, half)[:, order].reshape(n)


def _rotate(w: jax.Array, mats: jax.Array, butterfly: bool, inverse: bool) -> jax.Array:
  """`w` (md layout, outputs last) with every stage's blocks `mats` `[stages, num, b, b]` applied to its
  outputs (see `OFTWeight`); `inverse`: the stages in reverse order (`mats` then hold the inverses)."""
  *lead, out = w.shape
  stages, num, b, _ = mats.shape
  if not butterfly:  # output group n times block n: torch's `"k n m, k n ... -> k m ..."`
    x = jnp.einsum("...kn,knm->...km", w.reshape(*lead, num, b), mats[0], precision=_HIGHEST)
    return x.reshape(w.shape)
  order = range(stages - 1, -1, -1) if inverse else range(stages)
  for i in order:
    span = 2**i * (b // 2)  # stage i pairs outputs `span` apart into blocks of b
    x = w.reshape(*lead, out // (2 * span), 2, span)
    x = jnp.swapaxes(x, -1, -2).reshape(*lead, num, b)
    x = jnp.einsum("...nj,nij->...ni", x, mats[i], precision=_HIGHEST)
    x = jnp.swapaxes(x.reshape(*lead, out // (2 * span), span, 2), -1, -2)
    w = x.reshape(*lead, out)
  return w


@functools.lru_cache(maxsize=16)
def _program(paths: tuple, sites: tuple, out_shardings: tuple | None):
  """The merge program for one set of sites (cached: fusing, unfusing and other scales reuse it)."""

  def apply(weights, downs, ups, mults, magnitudes, scales, blocks, rescales):
    base = {p: weights[i].astype(jnp.float32) for i, p in enumerate(paths)}
    acc = dict(base)
    rotations = []
    for i, ((path, layer, rule), d, u) in enumerate(zip(sites, downs, ups)):
      if isinstance(rule, tuple):  # OFT / BOFT: below, after every delta
        rotations.append(i)
        continue
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
    for i in rotations:
      path, layer, (kind, inverse) = sites[i]
      if kind.startswith("ia3"):  # W · (1 + k v) along the outputs (last axis) or the inputs
        ndim = base[path].ndim - (layer is not None)
        shape = (1,) * (ndim - 2) + ((-1, 1) if kind == "ia3-in" else (1, -1))
        factor = 1.0 + scales[i, 1] * blocks[i].astype(jnp.float32).reshape(shape)
        if not inverse:
          w = base[path] if layer is None else base[path][layer]
          delta = w * (factor - 1.0)
          acc[path] = acc[path] + delta if layer is None else acc[path].at[layer].add(delta)
        else:  # unmerge: W = W' / (1 + k v), the other adapters' deltas taken off first
          w = (acc[path] if layer is None else acc[path][layer]) / factor
          acc[path] = w if layer is None else acc[path].at[layer].set(w)
        continue
      if kind == "glora":  # W + γ (W ×ᵢₙ P + D), P = a1 a2 mixing the kernel's input axis
        a1, a2 = (x.astype(jnp.float32) for x in blocks[i])
        mix = jnp.matmul(a1, a2, precision=_HIGHEST)  # [in, in]
        product = jnp.tensordot(
          downs[i].astype(jnp.float32), ups[i].astype(jnp.float32), 1, precision=_HIGHEST
        )
        gamma = -mults[i] if inverse else mults[i]  # the user's scale, its sign taken off
        if not inverse:
          w = base[path] if layer is None else base[path][layer]
          delta = gamma * (jnp.einsum("...io,ij->...jo", w, mix, precision=_HIGHEST) + product)
          acc[path] = acc[path] + delta if layer is None else acc[path].at[layer].add(delta)
          continue
        # unmerge: W = (W' - γ D) ×ᵢₙ (I + γ P)⁻¹, W' the weight with the other adapters' deltas off
        w = (acc[path] if layer is None else acc[path][layer]) - gamma * product
        eye = jnp.eye(mix.shape[0], dtype=jnp.float32)
        w = jnp.einsum("...io,ij->...jo", w, jnp.linalg.inv(eye + gamma * mix), precision=_HIGHEST)
        acc[path] = w if layer is None else acc[path].at[layer].set(w)
        continue
      if kind.startswith(
        "peft-"
      ):  # the rotations themselves, taken toward the identity by the scale
        mats = blocks[i].astype(jnp.float32)
        eye = jnp.broadcast_to(jnp.eye(mats.shape[-1], dtype=jnp.float32), mats.shape)
        mats = scales[i, 1] * mats + (1.0 - scales[i, 1]) * eye
      else:
        mats = _rotations(blocks[i], scales[i, 0], scales[i, 1])
      turn = None
      if kind.startswith("peft-"):
        turn = functools.partial(_rotate_inputs, butterfly=kind == "peft-boft")
      rescale = rescales[i]
      if rescale is not None:  # [out] against the weight's last axis
        ndim = base[path].ndim - (layer is not None)
        rescale = rescale.astype(jnp.float32).reshape((1,) * (ndim - 1) + (-1,))
      if not inverse:  # rescale · R W, against the weight before this call
        w = base[path] if layer is None else base[path][layer]
        rotated = turn(w, mats, inverse=False) if turn else _rotate(w, mats, kind == "boft", False)
        delta = (rotated if rescale is None else rotated * rescale) - w
        acc[path] = acc[path] + delta if layer is None else acc[path].at[layer].add(delta)
        continue
      # unmerge: W = R⁻¹ (W' / rescale), W' the weight with the other adapters' deltas taken off
      w = acc[path] if layer is None else acc[path][layer]
      w = w if rescale is None else w / rescale
      inv = jnp.linalg.inv(mats)
      w = turn(w, inv, inverse=True) if turn else _rotate(w, inv, kind == "boft", True)
      acc[path] = w if layer is None else acc[path].at[layer].set(w)
    return [acc[p].astype(weights[i].dtype) for i, p in enumerate(paths)]

  return jax.jit(apply, out_shardings=None if out_shardings is None else list(out_shardings))


def unmerge(model_or_state: Any, adapters: Sequence[tuple[Adapter, float]]) -> Any:
  """Subtracts what `merge` added (exact in float32; low-precision weights keep a rounding residue).

  OFT / BOFT rotations are inverted (`R⁻¹ (W' / rescale)`, after the other adapters' deltas are taken
  off), up to float32 rounding; one rotation per weight and call (unmerge several adapters that rotate
  the same weight one call each, in the reverse order of their merges). DoRA adapters are refused.
  """
  return merge(model_or_state, adapters, sign=-1.0)
