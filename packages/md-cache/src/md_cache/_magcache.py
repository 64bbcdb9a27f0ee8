"""MagCache: skip whole steps of the block stacks while the accumulated change of the residual's
magnitude (predicted from per-step magnitude ratios) stays small; and its calibration run."""

from __future__ import annotations

import functools
import json
import os
import pathlib
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

import md_schedulers as mdsch
from md_cache import _common as c
from md_cache._published import PUBLISHED_MAG_RATIOS, published_mag_ratios


class MagCacheState(NamedTuple):
  """MagCache's loop state.

  Attributes:
    threshold: (), float32. Largest accumulated error a skipped step may reach.
    max_skip_steps: (), int32. Most consecutive skipped steps (K).
    retention_step: (), int32. Steps before it always run.
    mag_ratios: (num_steps,), float32. The model's residual-magnitude ratio of each step to the previous.
    accumulated_ratio: (), float32. Product of the ratios since the last computed step.
    accumulated_err: (), float32. Sum of |1 - accumulated_ratio| since the last computed step.
    accumulated_steps: (), int32. Steps counted since the last computed step.
    valid: (), bool. A computed step has filled `slots`.
    computed: (num_steps,), bool. Steps where the blocks ran.
    calibration: (G, num_steps), float32. Calibration mode: the measured ratio of each step (1 at the
      first) per guidance branch where the reference calls the branches separately (G branches, in the
      loop's row order `[negative, positive, …]`), one list for the batch where it calls them together
      (G = 1: `Guidance.one_call`, or no guidance); ones otherwise. `(num_steps,)` until sized.
    prev: [R, S, D], float32. Calibration mode: the whole stack's hidden-state residual at the last
      step (None otherwise, and until sized).
    slots: per hooked block stack, its carry's residual at the last computed step (None until sized).
  """

  threshold: jax.Array
  max_skip_steps: jax.Array
  retention_step: jax.Array
  mag_ratios: jax.Array
  accumulated_ratio: jax.Array
  accumulated_err: jax.Array
  accumulated_steps: jax.Array
  valid: jax.Array
  computed: jax.Array
  calibration: jax.Array
  prev: Any
  slots: Any


def magcache(
  mag_ratios: Sequence[float] | np.ndarray | str | os.PathLike | None = None,
  *,
  threshold: float = 0.06,
  max_skip_steps: int = 3,
  retention_ratio: float = 0.2,
  calibrate: bool = False,
) -> mdsch.StepCache:
  """Skips the transformer blocks at a step (adding the blocks' residual of the last computed step to
  their input) while the error accumulated from the model's per-step magnitude ratios since the last
  computed step stays within `threshold` and at most `max_skip_steps` steps in a row are skipped; the
  first `retention_ratio` of the steps always run. The schedule is deterministic given the ratios.

  Published defaults: `threshold=0.06`, `max_skip_steps=3` (K), `retention_ratio=0.2`. The ratios are
  model- and schedule-specific: measure them once with `calibrate=True` (every step runs and the state
  records each step's mean ratio of residual norms, one list per guidance branch where the reference
  runs the branches as separate calls, as diffusers' cache contexts do; read them with
  `calibrated_ratios`, save them with `save_mag_ratios`). Ratios of another length are resampled to the
  step count (nearest).

  Args:
    mag_ratios: per-step ratios, a JSON file written by `save_mag_ratios`, or the name of ratios the
      MagCache authors published for a real checkpoint (`PUBLISHED_MAG_RATIOS`: "wan2.1-t2v-1.3b",
      "wan2.1-t2v-14b", "wan2.1-i2v-14b-480p", "wan2.1-i2v-14b-720p", "flux.1-dev"), which need no
      calibration.
    threshold: the accumulated-error threshold (traced).
    max_skip_steps: K (traced).
    retention_ratio: the fraction of leading steps that always run (traced).
    calibrate: record ratios instead of skipping.

  Returns:
    A block-level `md_schedulers.StepCache`.

  Raises:
    ValueError: no `mag_ratios` and not `calibrate`.
  """
  if mag_ratios is None and not calibrate:
    raise ValueError(
      "magcache needs the model's mag_ratios (they depend on the checkpoint and the schedule): run "
      "once with md_cache.magcache(calibrate=True), read md_cache.calibrated_ratios(state) and save "
      "them with md_cache.save_mag_ratios(path, ratios); then pass magcache(mag_ratios=path)"
    )
  if isinstance(mag_ratios, str) and mag_ratios in PUBLISHED_MAG_RATIOS:
    mag_ratios = published_mag_ratios(mag_ratios)  # the authors' list for a real checkpoint
  elif isinstance(mag_ratios, str | os.PathLike):
    mag_ratios = load_mag_ratios(mag_ratios)
  ratios = None if mag_ratios is None else np.asarray(mag_ratios, np.float32).reshape(-1)
  if ratios is not None and not ratios.size:
    raise ValueError("magcache: mag_ratios is empty")
  values = dict(
    ratios=ratios, threshold=float(threshold), max_skip_steps=int(max_skip_steps),
    retention_ratio=float(retention_ratio),
  )  # fmt: skip
  return _policy(bool(calibrate))._replace(
    init=c._Init("magcache", (bool(calibrate),), _init, values)
  )


def resample_ratios(ratios: np.ndarray, num_steps: int) -> np.ndarray:
  """`ratios` at `num_steps` points by nearest index (round half to even on a float32 grid)."""
  ratios = np.asarray(ratios, np.float32)
  if len(ratios) == num_steps:
    return ratios
  if num_steps == 1:
    return ratios[-1:]
  scale = np.float32((len(ratios) - 1) / (num_steps - 1))
  return ratios[np.round(np.arange(num_steps, dtype=np.float32) * scale).astype(np.int64)]


def _init(values, latents, num_steps: int) -> MagCacheState:
  del latents
  ratios = values["ratios"]
  ratios = np.ones(num_steps, np.float32) if ratios is None else resample_ratios(ratios, num_steps)
  return MagCacheState(
    threshold=jnp.float32(values["threshold"]),
    max_skip_steps=jnp.int32(values["max_skip_steps"]),
    retention_step=jnp.int32(int(values["retention_ratio"] * num_steps + 0.5)),
    mag_ratios=jnp.asarray(ratios),
    accumulated_ratio=jnp.float32(1.0),
    accumulated_err=jnp.float32(0.0),
    accumulated_steps=jnp.int32(0),
    valid=jnp.zeros((), bool),
    computed=jnp.zeros((num_steps,), bool),
    calibration=jnp.ones((num_steps,), jnp.float32),
    prev=None,
    slots=None,
  )


def _policy(calibrate: bool) -> mdsch.StepCache:
  return c.block_policy(_hook_maker(calibrate))


@functools.cache
def _hook_maker(calibrate: bool):
  def make(state, step, sample, *, joint=False):
    # One skip decision for every row already (the schedule comes from the ratios); calibration
    # records one list per branch group.
    return _Hook(state, step, calibrate, sample, joint)

  return make


class _Hook:
  def __init__(self, state: MagCacheState, step, calibrate: bool, sample=None, joint=False):
    self._st, self._step, self._calibrate = state, step, calibrate
    self._sample, self._joint = sample, joint
    self._shapes: dict[int, Any] = {}
    self._slots: dict[int, Any] = {}
    self._outs: dict[int, Any] = {}
    self._skip = self._acc = self._head_in = None

  def _decide(self):
    st, step = self._st, self._step
    if self._calibrate:
      return jnp.zeros((), bool), (st.accumulated_ratio, st.accumulated_err, st.accumulated_steps)
    ratio = st.accumulated_ratio * st.mag_ratios[step]
    count = st.accumulated_steps + 1
    err = st.accumulated_err + jnp.abs(1.0 - ratio)
    counted = step >= st.retention_step
    skip = counted & st.valid & (err <= st.threshold) & (count <= st.max_skip_steps)
    reset = counted & ~skip
    acc = (
      jnp.where(reset, 1.0, jnp.where(counted, ratio, st.accumulated_ratio)).astype(jnp.float32),
      jnp.where(reset, 0.0, jnp.where(counted, err, st.accumulated_err)).astype(jnp.float32),
      jnp.where(reset, 0, jnp.where(counted, count, st.accumulated_steps)).astype(jnp.int32),
    )
    return skip, acc

  def __call__(self, run, carry, *, num_layers: int, index: int):
    st = self._st
    if st.slots is None:  # the slot probe
      self._shapes[index] = c.avals(carry)
      return run(carry, 0, num_layers)
    if index >= len(st.slots):
      raise ValueError(f"magcache: block stack {index} was not seen when the slots were sized")
    if index == 0:
      self._skip, self._acc = self._decide()
      self._head_in = c.first(carry)
    if self._skip is None:
      raise ValueError("magcache: the first hooked stack must be block stack 0")
    slot = st.slots[index]
    out = jax.lax.cond(self._skip, lambda: c.add(carry, slot), lambda: run(carry, 0, num_layers))
    self._slots[index] = jax.tree.map(
      lambda new, old: jnp.where(self._skip, old, new), c.sub(out, carry), slot
    )
    self._outs[index] = out
    return out

  @property
  def state(self) -> MagCacheState:
    st = self._st
    if st.slots is None:
      if not self._shapes:
        raise c.no_stacks_error("magcache")
      shapes = [self._shapes[i] for i in sorted(self._shapes)]
      head = c.first(shapes[0])
      prev = jax.ShapeDtypeStruct(head.shape, jnp.float32) if self._calibrate else None
      groups = 1
      if self._calibrate and self._sample is not None:
        groups = c.groups_of(head.shape[0], self._sample, self._joint)

      def fill(s):
        calibration = jnp.ones((groups, s.computed.shape[0]), jnp.float32)
        return s._replace(
          prev=None if prev is None else c.zeros(prev), slots=tuple(map(c.zeros, shapes)),
          calibration=calibration if prev is not None else s.calibration,
        )  # fmt: skip

      raise c._Sized(fill)
    if self._skip is None:  # the model ran outside the hook this step (the Klein KV edit's step 0)
      return c.outside(st, self._step)
    ratio, err, count = self._acc
    new = st._replace(
      accumulated_ratio=ratio, accumulated_err=err, accumulated_steps=count,
      valid=jnp.ones((), bool), computed=st.computed.at[self._step].set(~self._skip),
      slots=tuple(self._slots.get(i, s) for i, s in enumerate(st.slots)),
    )  # fmt: skip
    if self._calibrate:
      # The whole stack's hidden-state residual: the last stack's output (its trailing tokens when
      # it also carries the text, as Flux's single blocks do) minus the first stack's input.
      head = self._head_in
      tail = c.first(self._outs[max(self._outs)])[:, -head.shape[1] :]
      residual = (tail - head).astype(jnp.float32)
      norms = jnp.linalg.norm(residual, axis=-1) / (jnp.linalg.norm(st.prev, axis=-1) + 1e-8)
      groups = st.calibration.shape[0]
      ratio = jnp.where(st.valid, norms.reshape(groups, -1).mean(-1), 1.0)  # [G]
      new = new._replace(calibration=st.calibration.at[:, self._step].set(ratio), prev=residual)
    return new


BRANCH_NAMES = ("negative", "positive")  # the first guidance branches in the loop's row order


def calibrated_ratios(state: MagCacheState, branch: str | int | None = None) -> np.ndarray:
  """The per-step ratios a `magcache(calibrate=True)` run recorded, `[num_steps]` float32.

  Where the reference calls the guidance branches separately (Flux.1 true CFG, Wan, Klein) the run
  recorded one list per branch, as diffusers' cache contexts do; `branch` picks one ("negative",
  "positive" or its index in the row order), by default the positive (conditional) branch's.
  `calibrated_branches` names what a state holds.
  """
  table = np.asarray(state.calibration, np.float32)
  if table.ndim == 1:
    table = table[None]
  names = calibrated_branches(state)
  if branch is None:
    branch = "positive" if "positive" in names else names[0]
  index = names.index(branch) if isinstance(branch, str) and branch in names else branch
  if not isinstance(index, int) or not 0 <= index < len(table):
    raise ValueError(f"calibrated_ratios: branch={branch!r}; this run recorded {names}")
  return table[index]


def calibrated_branches(state: MagCacheState) -> tuple[str, ...]:
  """The branches a calibration recorded ratios for, in row order: ("batch",) for one list (no
  guidance, or branches the reference runs in one call), else ("negative", "positive", ...)."""
  table = np.asarray(state.calibration)
  groups = 1 if table.ndim == 1 else table.shape[0]
  if groups == 1:
    return ("batch",)
  return tuple(BRANCH_NAMES[i] if i < len(BRANCH_NAMES) else f"branch {i}" for i in range(groups))


def save_mag_ratios(path: str | os.PathLike, ratios: Sequence[float], **info: Any) -> None:
  """Writes `{"mag_ratios": [...], **info}` (e.g. model, num_steps) as JSON."""
  data = {"mag_ratios": [float(r) for r in np.asarray(ratios).reshape(-1)], **info}
  pathlib.Path(path).write_text(json.dumps(data, indent=1) + "\n")


def load_mag_ratios(path: str | os.PathLike) -> np.ndarray:
  """The ratios of a JSON file from `save_mag_ratios` (or a bare list)."""
  data = json.loads(pathlib.Path(path).read_text())
  ratios = data["mag_ratios"] if isinstance(data, dict) else data
  return np.asarray(ratios, np.float32)
