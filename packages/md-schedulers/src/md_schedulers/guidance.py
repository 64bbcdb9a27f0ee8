"""Guidance as pure functions, and `Guidance`: which terms a sampling loop computes.

Every md pipeline batches its guidance branches in one canonical row order, each branch `B` rows:
`[negative, positive, perturbed, isolated]` (present branches only). `negative` is the unconditional /
negative-prompt pass of classifier-free guidance, `positive` the conditional pass, `perturbed` the
spatio-temporal guidance pass (the positive prompt with some blocks' self-attention skipped) and
`isolated` LTX-2's modality-isolation pass (the positive prompt without audio↔video attention).

Scales are per-step arrays (see `per_step`), so changing a scale never recompiles: `[steps]` for one value
per step, or `[steps, B]` for one value per row.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

BRANCHES = ("negative", "positive", "perturbed", "isolated")
SCALES = ("guidance", "rescale", "stg", "stg_rescale", "modality")


def cfg(uncond: jax.Array, cond: jax.Array, scale: jax.Array) -> jax.Array:
  """Classifier-free guidance: `uncond + scale * (cond - uncond)`."""
  return uncond + scale * (cond - uncond)


def _std(x: jax.Array) -> jax.Array:
  """Unbiased std over everything but the leading (batch) axis, kept for broadcasting."""
  return jnp.std(x, axis=tuple(range(1, x.ndim)), keepdims=True, ddof=1)


def rescale(guided: jax.Array, cond: jax.Array, phi: jax.Array) -> jax.Array:
  """Guidance rescale (Lin et al. 2023, §3.4): blend in the guided prediction scaled to the conditional
  prediction's per-example std (unbiased, as `torch.std`), by `phi` ∈ [0, 1]."""
  return phi * (guided * (_std(cond) / _std(guided))) + (1 - phi) * guided


def cfg_star(uncond: jax.Array, cond: jax.Array) -> jax.Array:
  """CFG-star's projection of the unconditional prediction onto the conditional one, per example."""
  b = uncond.shape[0]
  dot = jnp.sum((cond * uncond).reshape(b, -1), axis=1)
  norm = jnp.sum((uncond * uncond).reshape(b, -1), axis=1) + 1e-8
  return (dot / norm).reshape((b,) + (1,) * (uncond.ndim - 1)) * uncond


def stg(pred: jax.Array, cond: jax.Array, perturbed: jax.Array, scale: jax.Array) -> jax.Array:
  """Spatio-temporal guidance: push away from the block-skipped pass, `pred + scale * (cond - perturbed)`."""
  return pred + scale * (cond - perturbed)


def stg_rescale(guided: jax.Array, cond: jax.Array, r: jax.Array) -> jax.Array:
  """The official LTX-Video rescale after STG: `guided * (r * std(cond) / std(guided) + 1 - r)`."""
  b = guided.shape[0]
  std_cond = jnp.std(cond.reshape(b, -1), axis=1, ddof=1)
  std_guided = jnp.std(guided.reshape(b, -1), axis=1, ddof=1)
  factor = r * (std_cond / std_guided) + (1 - r)
  return guided * factor.reshape((b,) + (1,) * (guided.ndim - 1))


@dataclasses.dataclass(frozen=True)
class Guidance:
  """Which guidance terms a loop computes (static: part of the compiled program).

  Attributes:
    cfg: classifier-free guidance (a `negative` branch).
    rescale: guidance rescale after CFG (scale `rescale`), toward the conditional prediction's std
      (needs `cfg`, unless `rescale_last`).
    rescale_last: apply the rescale after every other term (CFG, STG and modality), as LTX-2 does,
      instead of right after CFG.
    cfg_star: project the unconditional prediction onto the conditional one first (CFG-star).
    gate: keep the conditional prediction where the guidance scale is <= 1 (the official LTX-Video
      repository's rule; diffusers computes the guided value everywhere).
    stg: spatio-temporal guidance (a `perturbed` branch; scale `stg`; skipped where the scale is 0).
    stg_rescale: the official LTX-Video std rescale after STG (scale `stg_rescale`; off where it is 1).
    modality: LTX-2 modality guidance (an `isolated` branch; scale `modality`).
    space: "prediction" combines the model outputs as they come; "x0" combines the implied clean
      samples `x - sigma * prediction` and turns the result back into a velocity (LTX-2).
    one_call: the reference runs the branches in one batched model call (diffusers' LTX-Video), so a
      cache that measures the model (first-block, TeaCache) decides once for the whole batch from the
      joint measure; otherwise (separate calls per branch: Wan, Flux, Klein) each branch decides alone.
  """

  cfg: bool = False
  rescale: bool = False
  rescale_last: bool = False
  cfg_star: bool = False
  gate: bool = False
  stg: bool = False
  stg_rescale: bool = False
  modality: bool = False
  space: str = "prediction"
  one_call: bool = False

  def __post_init__(self):
    if self.space not in ("prediction", "x0"):
      raise ValueError(f"Guidance.space={self.space!r}: expected 'prediction' or 'x0'")
    if self.rescale_last and not self.rescale:
      raise ValueError("Guidance.rescale_last needs rescale=True")
    for flag in ("rescale", "cfg_star", "gate"):
      if flag == "rescale" and self.rescale_last:
        continue  # a rescale after every term needs no CFG (LTX-2 rescales STG / modality alone too)
      if getattr(self, flag) and not self.cfg:
        raise ValueError(f"Guidance.{flag} needs cfg=True")
    if self.stg_rescale and not self.stg:
      raise ValueError("Guidance.stg_rescale needs stg=True")

  @property
  def branches(self) -> tuple[str, ...]:
    """The branches in row order."""
    on = dict(negative=self.cfg, positive=True, perturbed=self.stg, isolated=self.modality)
    return tuple(b for b in BRANCHES if on[b])

  @property
  def num_branches(self) -> int:
    return len(self.branches)

  @property
  def scale_names(self) -> tuple[str, ...]:
    """The per-step scales this guidance reads."""
    on = dict(
      guidance=self.cfg, rescale=self.rescale, stg=self.stg, stg_rescale=self.stg_rescale,
      modality=self.modality,
    )  # fmt: skip
    return tuple(s for s in SCALES if on[s])


NO_GUIDANCE = Guidance()


def per_step(
  num_steps: int, values: Mapping[str, Any], *, windows: Sequence[int] | None = None
) -> dict[str, np.ndarray]:
  """Per-step scale arrays for `sample`, built on the host.

  Args:
    num_steps: the schedule's number of model calls.
    values: scale name → a number (every step), a sequence of `num_steps` numbers, or with `windows`
      one number per window. A `[num_steps, B]` array gives per-row scales. A tuple gives one such
      value per leaf of a multi-modality sample (e.g. `(video, audio)`).
    windows: one window index per step (guidance windows): list-valued scales hold one value per window.

  Returns:
    name → float32 array `[num_steps]` or `[num_steps, B]` (a tuple of them for a tuple value).

  Raises:
    ValueError: a scale with the wrong number of values, or not a number.
  """
  out = {}
  for name, v in values.items():
    if isinstance(v, tuple):
      out[name] = tuple(per_step(num_steps, {name: leaf}, windows=windows)[name] for leaf in v)
      continue
    try:
      a = np.asarray(v, np.float32)
    except (TypeError, ValueError) as e:
      raise ValueError(f"guidance scale {name!r} must be a number or numbers, got {v!r}") from e
    if a.ndim == 2:
      if a.shape[0] != num_steps:
        raise ValueError(f"{name} has shape {a.shape}; per-row scales are [steps={num_steps}, B]")
      out[name] = a
      continue
    a = a.reshape(-1)
    if a.size == 1:
      out[name] = np.full((num_steps,), a[0], np.float32)
    elif windows is not None:
      if len(windows) != num_steps:
        raise ValueError(f"windows has {len(windows)} entries for {num_steps} steps")
      if max(windows) >= a.size:
        raise ValueError(f"{name} has {a.size} values for {max(windows) + 1} guidance windows")
      out[name] = a[np.asarray(windows)]
    elif a.size == num_steps:
      out[name] = a
    else:
      raise ValueError(f"{name} has {a.size} values; give one, or one per step ({num_steps})")
  return out


def _row(scale: jax.Array, like: jax.Array) -> jax.Array:
  """A scalar or per-row `[B]` scale shaped to broadcast against `like` `[B, ...]`."""
  scale = jnp.asarray(scale, jnp.float32)
  return scale.reshape(scale.shape + (1,) * (like.ndim - scale.ndim)) if scale.ndim else scale


def _combine_leaf(spec: Guidance, outs: Mapping[str, jax.Array], s: Mapping[str, jax.Array]):
  pos = outs["positive"]
  pred = pos
  if spec.cfg:
    g = _row(s["guidance"], pos)
    uncond = cfg_star(outs["negative"], pos) if spec.cfg_star else outs["negative"]
    guided = cfg(uncond, pos, g)
    if spec.rescale and not spec.rescale_last:
      guided = rescale(guided, pos, _row(s["rescale"], pos))
    pred = jnp.where(g > 1.0, guided, pos) if spec.gate else guided
  if spec.stg:
    scale = _row(s["stg"], pos)
    guided = stg(pred, pos, outs["perturbed"], scale)
    if spec.stg_rescale:
      r = _row(s["stg_rescale"], pos)
      guided = jnp.where(r != 1.0, stg_rescale(guided, pos, r), guided)
    pred = jnp.where(scale > 0.0, guided, pred)
  if spec.modality:
    pred = pred + (_row(s["modality"], pos) - 1) * (pos - outs["isolated"])
  if spec.rescale and spec.rescale_last:
    pred = rescale(pred, pos, _row(s["rescale"], pos))
  return pred


def combine(
  spec: Guidance,
  output: Any,
  scales: Mapping[str, Any],
  *,
  sample: Any = None,
  sigma: jax.Array | None = None,
) -> Any:
  """Combines the branches of one batched model output into the guided prediction.

  Args:
    spec: which terms to compute.
    output: the model output for all branches, rows `[branch₀ × B, branch₁ × B, …]` (a pytree of arrays
      for several modalities, e.g. LTX-2's `(video, audio)`).
    scales: this step's scales by name; each a scalar, a `[B]` array, or a tuple with one entry per
      leaf of `output` (per-modality scales).
    sample: the current sample (pytree like one branch of `output`); needed for `space="x0"`.
    sigma: the current noise level; needed for `space="x0"`.

  Returns:
    The guided prediction, shaped like one branch of `output`.
  """
  leaves, tree = jax.tree.flatten(output)
  n = spec.num_branches
  xs = [None] * len(leaves) if sample is None else jax.tree.leaves(sample)
  if spec.space == "x0" and (sample is None or sigma is None):
    raise ValueError("Guidance(space='x0') needs the sample and sigma")
  guided = []
  for j, (leaf, x) in enumerate(zip(leaves, xs)):
    parts = jnp.split(leaf, n, axis=0)
    if spec.space == "x0":
      parts = [x - p * sigma for p in parts]
    outs = dict(zip(spec.branches, parts))
    s = {k: (v[j] if isinstance(v, tuple) else v) for k, v in scales.items()}
    g = _combine_leaf(spec, outs, s) if n > 1 else outs["positive"]
    if spec.space == "x0":
      g = (x - g) / sigma
    guided.append(g)
  return jax.tree.unflatten(tree, guided)
