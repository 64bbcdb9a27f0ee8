"""TaylorSeer: on cached steps, extrapolate the prediction with a Taylor series whose derivatives are
finite differences of the predictions of the last computed steps."""

from __future__ import annotations

import functools
import math
import operator
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

import md_schedulers as mdsch
from md_cache import _common as c

_DTYPES = ("float32", "bfloat16", "float16")


class TaylorSeerState(NamedTuple):
  """TaylorSeer's loop state.

  Attributes:
    interval: (), int32. A full step every `interval` steps after the warm-up.
    warmup_steps: (), int32. Steps before it always run.
    stop_step: (), int32. Steps from it on always run (-1: none).
    orders: (), int32. Taylor terms held in `factors` (0 before the first computed step).
    last_step: (), int32. The last computed step (-1: none).
    computed: (num_steps,), bool. Steps where the denoiser ran.
    factors: like the latents, each leaf `[max_order + 1, B, …]` in the factors' dtype: the prediction
      at the last computed step and its divided differences of orders 1…max_order.
  """

  interval: jax.Array
  warmup_steps: jax.Array
  stop_step: jax.Array
  orders: jax.Array
  last_step: jax.Array
  computed: jax.Array
  factors: Any


def default_interval(num_steps: int) -> int:
  """TaylorSeer's `interval` when none is given: the published 5 on schedules of 35 steps or more, and
  about one full step in 7 on shorter ones, at least every other step (20 steps: 3; 14: 2).

  At 20 steps the published 5 computes 7 of 20 steps and lowered md's default models' quality scores
  by 13.1 (image) and 5.6 (video) points (2026-12-05); 3, with `default_stop_step`'s full last quarter,
  keeps the shipped models within 2 points (md-cache README).

  >>> [default_interval(n) for n in (8, 14, 20, 28, 35, 50)]
  [2, 2, 3, 4, 5, 5]
  """
  return max(2, min(5, round(num_steps / 7)))


def default_stop_step(num_steps: int) -> int | None:
  """TaylorSeer's `stop_step` when "auto": none (the published schedule) on schedules of 35 steps or
  more; on shorter ones the last quarter of the steps always runs (20 steps: steps 15-19).

  The last steps draw the detail: on md's default video model (20 steps, interval 3) extrapolating them
  lowered the quality score by 6.9 points, computing them in full (12 of 20 steps instead of 9) by 0.5
  (md-cache README, 2026-12-07).

  >>> [default_stop_step(n) for n in (8, 14, 20, 28, 34, 35, 50)]
  [6, 11, 15, 21, 26, None, None]
  """
  return None if num_steps >= 35 else num_steps - num_steps // 4


def taylorseer(
  interval: int | None = None,
  *,
  warmup_steps: int = 3,
  stop_step: int | str | None = "auto",
  max_order: int = 1,
  factors_dtype: str = "float32",
) -> mdsch.StepCache:
  """Runs the denoiser on the first `warmup_steps` steps, then on every `interval`-th step (steps
  `warmup_steps + 1 + k * interval`) and on every step from `stop_step` on; at the other steps the
  prediction is `sum_k f_k · d^k / k!`, with `d` the steps since the last computed one and `f_k` the
  k-th divided difference (over step indices) of the computed predictions, up to `max_order`.
  A step-level cache: it applies to every denoiser (UNet included); guidance branches are extrapolated
  together (the guided prediction), which equals extrapolating each branch for fixed linear guidance.

  Published defaults (diffusers' TaylorSeerCacheConfig): `interval=5`, `warmup_steps=3`, `max_order=1`;
  md's default interval is that 5 from 35 steps on and shorter on shorter schedules
  (`default_interval`), and on those shorter schedules the last quarter of the steps runs in full
  (`default_stop_step`; diffusers' `disable_cache_after_step`, None by default). diffusers keeps the
  factors in bfloat16 by default, md in float32 (`factors_dtype="bfloat16"` for diffusers' default
  numerics). The schedule follows diffusers' lite mode (the model output is
  extrapolated); diffusers' default mode extrapolates each attention output instead.

  Args:
    interval: steps between full computations after the warm-up (traced; None: `default_interval` of
      the run's step count).
    warmup_steps: leading steps that always run (traced); a step with no computed step before it
      always runs.
    stop_step: steps from this one on always run (traced); "auto": `default_stop_step` of the run's
      step count; None, or a step at or past the schedule's end (the apps' `cache_options.stop_step`
      takes integers only): none.
    max_order: the highest Taylor order (static: it sizes the state).
    factors_dtype: the dtype the factors are stored in.

  Returns:
    A step-level `md_schedulers.StepCache`.
  """
  if interval is not None and int(interval) < 1:
    raise ValueError(f"taylorseer: interval={interval} must be at least 1")
  if not (stop_step is None or stop_step == "auto" or (_is_int(stop_step) and int(stop_step) >= 0)):
    raise ValueError(
      f"taylorseer: stop_step={stop_step!r} must be a step index >= 0, 'auto' or None"
    )
  if int(max_order) < 0:
    raise ValueError(f"taylorseer: max_order={max_order} must be at least 0")
  if factors_dtype not in _DTYPES:
    raise ValueError(f"taylorseer: factors_dtype={factors_dtype!r}, expected one of {_DTYPES}")
  values = dict(
    interval=None if interval is None else int(interval), warmup_steps=int(warmup_steps),
    stop_step=stop_step if stop_step in (None, "auto") else int(stop_step),
  )  # fmt: skip
  static = (int(max_order), factors_dtype)
  return _policy(*static)._replace(init=c._Init("taylorseer", static, _init(*static), values))


def _is_int(x: Any) -> bool:
  if isinstance(x, bool):
    return False
  try:
    operator.index(x)
  except TypeError:
    return False
  return True


def _stop_step(value: int | str | None, num_steps: int) -> int:
  """The state's stop step: -1 for none."""
  if value == "auto":
    value = default_stop_step(num_steps)
  return -1 if value is None else int(value)


@functools.cache
def _init(max_order: int, factors_dtype: str):
  def make(values, latents, num_steps: int) -> TaylorSeerState:
    factors = jax.tree.map(lambda a: jnp.zeros((max_order + 1,) + a.shape, factors_dtype), latents)
    return TaylorSeerState(
      interval=jnp.int32(
        default_interval(num_steps) if values["interval"] is None else values["interval"]
      ),
      warmup_steps=jnp.int32(values["warmup_steps"]),
      stop_step=jnp.int32(_stop_step(values["stop_step"], num_steps)),
      orders=jnp.int32(0),
      last_step=jnp.int32(-1),
      computed=jnp.zeros((num_steps,), bool),
      factors=factors,
    )

  return make


@functools.cache
def _policy(max_order: int, factors_dtype: str) -> mdsch.StepCache:
  del factors_dtype  # in the state's arrays

  def decide(st: TaylorSeerState, step, t, sample):
    del t
    step = jnp.asarray(step, jnp.int32)
    run = (
      (step < st.warmup_steps)
      | ((step - st.warmup_steps - 1) % st.interval == 0)
      | ((st.stop_step >= 0) & (step >= st.stop_step))
      | (st.orders == 0)
    )
    d = (step - st.last_step).astype(jnp.float32)

    def extrapolate(f, x):
      out = jnp.zeros(f.shape[1:], x.dtype)
      for k in range(max_order + 1):
        coeff = jnp.where(k < st.orders, d**k / math.factorial(k), 0.0).astype(x.dtype)
        out = out + f[k].astype(x.dtype) * coeff
      return out

    return ~run, jax.tree.map(extrapolate, st.factors, sample)

  def update(st: TaylorSeerState, step, t, sample, prediction, reused):
    del t, sample

    def refresh():
      d = (step - st.last_step).astype(jnp.float32)

      def differences(f, p):
        new, prev = [p], f.astype(p.dtype)
        for k in range(max_order):
          new.append(jnp.where(k < st.orders, (new[k] - prev[k]) / d.astype(p.dtype), 0))
        return jnp.stack(new).astype(f.dtype)

      factors = jax.tree.map(differences, st.factors, prediction)
      return st._replace(
        orders=jnp.minimum(st.orders + 1, max_order + 1).astype(jnp.int32),
        last_step=jnp.asarray(step, jnp.int32),
        computed=st.computed.at[step].set(True),
        factors=factors,
      )

    return jax.lax.cond(reused, lambda: st, refresh)

  return mdsch.StepCache(init=None, decide=decide, update=update)
