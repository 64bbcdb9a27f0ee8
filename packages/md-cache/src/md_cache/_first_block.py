"""First-block cache: run the first transformer block, reuse the rest of the stack when its output barely
moved since the last fully computed step."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

import md_schedulers as mdsch
from md_cache import _common as c


class FirstBlockCacheState(NamedTuple):
  """The first-block cache's loop state.

  Attributes:
    threshold: (), float32. Relative L1 change under which the remaining blocks are reused.
    valid: (), bool. A computed step has filled `head` and `slots`.
    computed: (num_steps,), bool. Steps where the remaining blocks ran (for any guidance branch).
    head: [R, S, D] (model dtype). Block 0's hidden-state residual at each row's last computed step
      (R = branches × batch; None until `md_cache.prepare` sizes it).
    slots: per hooked block stack, a residual shaped like its carry: what the skipped blocks added at
      the last computed step (None until sized).
  """

  threshold: jax.Array
  valid: jax.Array
  computed: jax.Array
  head: Any
  slots: Any


def first_block_cache(threshold: float = 0.05) -> mdsch.StepCache:
  """Computes block 0 of the first block stack at every step and compares its hidden-state residual
  (output minus input) with the one of the last computed step; when the mean absolute change relative to
  the previous residual's mean magnitude is at most `threshold`, the remaining blocks (of every stack)
  are skipped and their residual from the last computed step is added instead. Guidance branches decide
  as the reference calls them: separately where it runs one model call per branch (Wan, Flux, Klein; a
  step that some branch recomputes runs the blocks for all and keeps the others' reuse), once for the
  batch from the joint measure where it runs them in one call (LTX-Video, `Guidance.one_call`).

  Published default: `threshold=0.05` (0.08–0.2 trade more quality for speed on video models).

  Args:
    threshold: the relative-L1 threshold (traced: changing it never recompiles).

  Returns:
    A block-level `md_schedulers.StepCache` (pass it as a pipeline's `cache=`).
  """
  return _policy()._replace(
    init=c._Init("first_block_cache", (), _init, {"threshold": float(threshold)})
  )


def _init(values, latents, num_steps: int) -> FirstBlockCacheState:
  del latents
  return FirstBlockCacheState(
    threshold=jnp.float32(values["threshold"]),
    valid=jnp.zeros((), bool),
    computed=jnp.zeros((num_steps,), bool),
    head=None,
    slots=None,
  )


def _policy() -> mdsch.StepCache:
  return c.block_policy(_Hook)


class _Hook:
  def __init__(self, state: FirstBlockCacheState, step, sample, *, joint: bool = False):
    self._st, self._step, self._sample, self._joint = state, step, sample, joint
    self._shapes: dict[int, Any] = {}
    self._slots: dict[int, Any] = {}
    self._rows = self._any = self._head = None

  def __call__(self, run, carry, *, num_layers: int, index: int):
    st = self._st
    if st.slots is None:  # the slot probe
      self._shapes[index] = c.avals(carry)
      return run(carry, 0, num_layers)
    if index >= len(st.slots):
      raise ValueError(
        f"first_block_cache: block stack {index} was not seen when the slots were sized"
      )
    start, x = 0, carry
    if index == 0:
      x = run(carry, 0, 1)
      residual = c.first(x) - c.first(carry)  # [R, S, D]
      rows = residual.shape[0]
      g = c.groups_of(rows, self._sample, self._joint)
      cur = residual.reshape(g, -1).astype(jnp.float32)
      prev = st.head.reshape(g, -1).astype(jnp.float32)
      change = jnp.abs(cur - prev).mean(-1) / jnp.abs(prev).mean(-1)  # [G]
      recompute = jnp.logical_or(~st.valid, change > st.threshold)
      self._rows, self._any = c.per_row(recompute, rows), jnp.any(recompute)
      self._head = c.select_rows(self._rows, residual, st.head)
      start = 1
    if self._rows is None:
      raise ValueError("first_block_cache: the first hooked stack must be block stack 0")
    slot = st.slots[index]
    rows = c.rows_for(self._rows, self._any, carry)
    reused = c.add(x, slot)
    full = jax.lax.cond(self._any, lambda: run(x, start, num_layers), lambda: reused)
    out = c.select_rows(rows, full, reused)
    self._slots[index] = c.select_rows(rows, c.sub(out, x), slot)
    return out

  @property
  def state(self) -> FirstBlockCacheState:
    st = self._st
    if st.slots is None:
      if not self._shapes:
        raise c.no_stacks_error("first_block_cache")
      shapes = [self._shapes[i] for i in sorted(self._shapes)]

      def fill(s):
        return s._replace(head=c.zeros(c.first(shapes[0])), slots=tuple(map(c.zeros, shapes)))

      raise c._Sized(fill)
    if self._rows is None:  # the model ran outside the hook this step (the Klein KV edit's step 0)
      return c.outside(st, self._step)
    slots = tuple(self._slots.get(i, s) for i, s in enumerate(st.slots))
    return st._replace(
      valid=jnp.ones((), bool),
      computed=st.computed.at[self._step].set(self._any),
      head=self._head,
      slots=slots,
    )
