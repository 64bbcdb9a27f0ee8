"""TeaCache: skip the block stacks while the accumulated, polynomially rescaled relative L1 change of
block 0's modulated input (the model's `scan_layers` probe; else the block's input) stays under a
threshold, adding the stacks' residual of the last computed step."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

import md_schedulers as mdsch
from md_cache import _common as c

# Published rescaling polynomials (highest power first), fitted per model on the relative L1 change of
# the modulated input of block 0 (Wan: of the timestep modulation, its "ret_steps" mode).
TEACACHE_COEFFICIENTS: dict[str, tuple[float, ...]] = {
  "flux": (4.98651651e02, -2.83781631e02, 5.58554382e01, -3.82021401e00, 2.64230861e-01),
  "ltx-video": (2.14700694e01, -1.28016453e01, 2.31279151e00, 7.92487521e-01, 9.69274326e-03),
  "wan2.1-t2v-1.3b": (
    -5.21862437e04,
    9.23041404e03,
    -5.28275948e02,
    1.36987616e01,
    -4.99875664e-02,
  ),
  "wan2.1-t2v-14b": (-3.03318725e05, 4.90537029e04, -2.65530556e03, 5.87365115e01, -3.15583525e-01),
  "wan2.1-i2v-480p": (2.57151496e05, -3.54229917e04, 1.40286849e03, -1.35890334e01, 1.32517977e-01),
  "wan2.1-i2v-720p": (8.10705460e03, 2.13393892e03, -3.72934672e02, 1.66203073e01, -4.17769401e-02),
  "identity": (1.0, 0.0),
}


class TeaCacheState(NamedTuple):
  """TeaCache's loop state.

  Attributes:
    threshold: (), float32. Accumulated rescaled distance under which a step is skipped.
    coefficients: (K,), float32. The rescaling polynomial, highest power first.
    valid: (), bool. A computed step has filled `prev` and `slots`.
    computed: (num_steps,), bool. Steps where the blocks ran (for any guidance branch).
    distance: [R], float32. Per row, the rescaled distance accumulated since its last computed step
      (None until sized).
    prev: [R, S, D], float32. Block 0's input at the previous step (None until sized).
    slots: per hooked block stack, its carry's residual at the last computed step (None until sized).
  """

  threshold: jax.Array
  coefficients: jax.Array
  valid: jax.Array
  computed: jax.Array
  distance: Any
  prev: Any
  slots: Any


# The threshold when none is given: the published 0.25 with a fitted polynomial, a lower one on the raw
# relative L1 change ("identity"), which skips more readily (md-cache README, 2026-12-07).
DEFAULT_THRESHOLD = 0.25
DEFAULT_IDENTITY_THRESHOLD = 0.15


def teacache(
  threshold: float | None = None, coefficients: str | Sequence[float] = "identity"
) -> mdsch.StepCache:
  """At every step, measures the relative L1 change of block 0's modulated input (see below) since the
  previous step (`mean|x - x_prev| / mean|x_prev|`), rescales it with a polynomial (clamped at 0) and accumulates
  it; while the sum stays under `threshold` the block stacks are skipped (each adds its residual of the
  last computed step), otherwise they run and the sum restarts at 0. The first and the last step always
  run. Guidance branches decide separately.

  Published defaults: `threshold=0.25` with the model's polynomial (`TEACACHE_COEFFICIENTS`: "flux",
  "ltx-video", "wan2.1-…"; 0.4 / 0.6 / 0.8 trade more quality for speed on Flux). With "identity" (the
  raw change, no fitted polynomial) md's default is 0.15: on md's default video model 0.25 computed 7
  of 20 steps and lowered its quality score by 2.8 points, 0.15 computed 11 and lowered it by 1.9.
  What is measured is what TeaCache measures where the model says so (`md_core.scan_layers(probe=)`,
  handed to the hook as `run.probe`): Flux.1's and Flux.2's first double block's modulated image input, LTX-Video's first
  block's modulated input, LTX-2's first block's modulated video input, Wan's timestep projection (its
  "ret_steps" mode), each equal to the PyTorch model's (tests/test_cache_teacache.py); a model without
  a probe has its first block's input hidden states measured. Flux.2 and LTX-2 have no published
  polynomial: "identity" or the caller's own.

  Args:
    threshold: the accumulated-distance threshold (traced: changing it never recompiles); None:
      0.15 with "identity", else 0.25.
    coefficients: a name in `TEACACHE_COEFFICIENTS` or the polynomial, highest power first.

  Returns:
    A block-level `md_schedulers.StepCache`.
  """
  if threshold is None:
    identity = isinstance(coefficients, str) and coefficients == "identity"
    threshold = DEFAULT_IDENTITY_THRESHOLD if identity else DEFAULT_THRESHOLD
  if isinstance(coefficients, str):
    if coefficients not in TEACACHE_COEFFICIENTS:
      raise ValueError(
        f"teacache: unknown coefficients {coefficients!r}; expected one of "
        f"{sorted(TEACACHE_COEFFICIENTS)} or a list of floats (highest power first)"
      )
    coefficients = TEACACHE_COEFFICIENTS[coefficients]
  coeffs = np.asarray(coefficients, np.float32).reshape(-1)
  if not coeffs.size:
    raise ValueError("teacache: coefficients is empty")
  values = dict(threshold=float(threshold), coefficients=coeffs)
  return _policy()._replace(init=c._Init("teacache", (int(coeffs.size),), _init, values))


def rescaled(coefficients: jax.Array, x: jax.Array) -> jax.Array:
  """The polynomial (highest power first) at `x`, by Horner's rule, clamped at 0."""
  out = jnp.zeros_like(x)
  for k in range(coefficients.shape[0]):
    out = out * x + coefficients[k]
  return jnp.maximum(out, 0.0)


def _init(values, latents, num_steps: int) -> TeaCacheState:
  del latents
  return TeaCacheState(
    threshold=jnp.float32(values["threshold"]),
    coefficients=jnp.asarray(values["coefficients"]),
    valid=jnp.zeros((), bool),
    computed=jnp.zeros((num_steps,), bool),
    distance=None,
    prev=None,
    slots=None,
  )


def _policy() -> mdsch.StepCache:
  return c.block_policy(_Hook)


class _Hook:
  def __init__(self, state: TeaCacheState, step, sample, *, joint: bool = False):
    self._st, self._step, self._sample, self._joint = state, step, sample, joint
    self._shapes: dict[int, Any] = {}
    self._slots: dict[int, Any] = {}
    self._rows = self._any = self._distance = self._prev = None
    self._head_shape = None

  def _decide(self, head: jax.Array) -> None:
    st = self._st
    x = head.astype(jnp.float32)  # [R, S, D]
    rows = x.shape[0]
    g = c.groups_of(rows, self._sample, self._joint)
    cur, prev = x.reshape(g, -1), st.prev.reshape(g, -1)
    change = jnp.abs(cur - prev).mean(-1) / jnp.abs(prev).mean(-1)  # [G]
    total = st.distance.reshape(g, -1)[:, 0] + rescaled(st.coefficients, change)
    last = self._step == st.computed.shape[0] - 1
    recompute = ~st.valid | last | (total >= st.threshold)  # [G]
    self._rows, self._any = c.per_row(recompute, rows), jnp.any(recompute)
    self._distance = c.per_row(jnp.where(recompute, 0.0, total), rows)
    self._prev = x

  @staticmethod
  def _head(run, carry):
    """What is measured: the model's probe (block 0's modulated input; Wan: its timestep
    projection) where the model gives one, else block 0's input hidden states."""
    probe = getattr(run, "probe", None)
    return c.first(carry) if probe is None else probe(carry)

  def __call__(self, run, carry, *, num_layers: int, index: int):
    st = self._st
    if st.slots is None:  # the slot probe
      self._shapes[index] = c.avals(carry)
      if index == 0:
        self._head_shape = jax.eval_shape(lambda x: self._head(run, x), carry)
      return run(carry, 0, num_layers)
    if index >= len(st.slots):
      raise ValueError(f"teacache: block stack {index} was not seen when the slots were sized")
    if index == 0:
      self._decide(self._head(run, carry))
    if self._rows is None:
      raise ValueError("teacache: the first hooked stack must be block stack 0")
    slot = st.slots[index]
    rows = c.rows_for(self._rows, self._any, carry)
    reused = c.add(carry, slot)
    full = jax.lax.cond(self._any, lambda: run(carry, 0, num_layers), lambda: reused)
    out = c.select_rows(rows, full, reused)
    self._slots[index] = c.select_rows(rows, c.sub(out, carry), slot)
    return out

  @property
  def state(self) -> TeaCacheState:
    st = self._st
    if st.slots is None:
      if not self._shapes:
        raise c.no_stacks_error("teacache")
      shapes = [self._shapes[i] for i in sorted(self._shapes)]
      head = self._head_shape

      def fill(s):
        return s._replace(
          distance=jnp.zeros(head.shape[:1], jnp.float32),
          prev=jnp.zeros(head.shape, jnp.float32),
          slots=tuple(map(c.zeros, shapes)),
        )

      raise c._Sized(fill)
    if self._rows is None:  # the model ran outside the hook this step (the Klein KV edit's step 0)
      return c.outside(st, self._step)
    return st._replace(
      valid=jnp.ones((), bool),
      computed=st.computed.at[self._step].set(self._any),
      distance=self._distance,
      prev=self._prev,
      slots=tuple(self._slots.get(i, s) for i, s in enumerate(st.slots)),
    )
