"""SenCache: reuse the last computed prediction while a first-order estimate of how much the model
output moved since then (its sensitivity to the sample and to the timestep, times how far each has
drifted) stays under a tolerance."""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

import md_schedulers as mdsch
from md_cache import _common as c


class SenCacheState(NamedTuple):
  """SenCache's loop state.

  Attributes:
    epsilon: (), float32. The tolerance on the sensitivity score.
    max_reuse: (), int32. Most consecutive reused steps.
    start_step: (), int32. Steps before it always run (warm-up and the leading no-cache zone).
    end_step: (), int32. Steps from it on always run (the trailing no-cache zone).
    alphas: (2,), float32. Sensitivity weights (α_x for the sample, α_t for the timestep).
    accumulated: (2,), float32. Since the last computed step, the summed RMS distance of the sample
      from the reference sample, and the summed |t - t_ref| (timesteps over 1000).
    reuse_count: (), int32. Steps reused since the last computed one.
    valid: (), bool. A computed step has filled the references.
    computed: (num_steps,), bool. Steps where the denoiser ran.
    ref_t: (), float32. The normalised timestep of the last computed step.
    ref_sample: like the latents: the sample at the last computed step.
    ref_prediction: like the latents: the guided prediction of the last computed step.
  """

  epsilon: jax.Array
  max_reuse: jax.Array
  start_step: jax.Array
  end_step: jax.Array
  alphas: jax.Array
  accumulated: jax.Array
  reuse_count: jax.Array
  valid: jax.Array
  computed: jax.Array
  ref_t: jax.Array
  ref_sample: Any
  ref_prediction: Any


def sencache(
  epsilon: float = 0.1,
  *,
  max_reuse: int = 3,
  warmup_steps: int = 1,
  nocache_start_ratio: float = 0.3,
  nocache_end_ratio: float = 0.1,
  alpha_x: float = 1.0,
  alpha_t: float = 1.0,
) -> mdsch.StepCache:
  """Sensitivity-aware caching (SenCache, Haghighi & Alahi 2026, as in MaxDiffusion's Wan 2.2 loop).
  Steps before `max(warmup_steps, int(nocache_start_ratio · N))` and from
  `int(N · (1 - nocache_end_ratio))` on always run. At another step, with `x_ref`, `t_ref` the sample
  and timestep (over 1000) of the last computed step, the running sums `Σ rms(x - x_ref)` and
  `Σ |t - t_ref|` over the steps since then (this one included) give the score
  `α_x · Σ rms + α_t · Σ |Δt|`; the step reuses the last computed guided prediction when the score is at
  most `epsilon` and fewer than `max_reuse` steps in a row were reused, and runs (resetting the sums)
  otherwise. A step-level cache: it applies to every denoiser, UNet included.

  Published defaults (MaxDiffusion): `epsilon=0.1`, `max_reuse=3`, warm-up 1, no-cache zones the first
  30 % and the last 10 %, uniform weights. MaxDiffusion also forces a step at Wan 2.2's expert switch,
  and so does md's loop for every step cache: `md_schedulers.sample` runs each expert's first step
  whatever the cache decides (its cached prediction is the other expert's) and that step becomes this
  cache's new reference.

  Args:
    epsilon: the tolerance (traced).
    max_reuse: most consecutive reused steps (traced).
    warmup_steps: leading steps that always run (traced).
    nocache_start_ratio: the leading fraction of steps that always runs (traced).
    nocache_end_ratio: the trailing fraction of steps that always runs (traced).
    alpha_x: the sample's sensitivity weight (traced).
    alpha_t: the timestep's sensitivity weight (traced).

  Returns:
    A step-level `md_schedulers.StepCache`.

  Raises:
    ValueError: a negative `max_reuse` or a ratio outside [0, 1].
  """
  if int(max_reuse) < 0:
    raise ValueError(f"sencache: max_reuse={max_reuse} must be at least 0")
  for name, r in (
    ("nocache_start_ratio", nocache_start_ratio),
    ("nocache_end_ratio", nocache_end_ratio),
  ):
    if not 0.0 <= float(r) <= 1.0:
      raise ValueError(f"sencache: {name}={r} must lie in [0, 1]")
  values = dict(
    epsilon=float(epsilon), max_reuse=int(max_reuse), warmup_steps=int(warmup_steps),
    start=float(nocache_start_ratio), end=float(nocache_end_ratio),
    alphas=(float(alpha_x), float(alpha_t)),
  )  # fmt: skip
  return _policy()._replace(init=c._Init("sencache", (), _init, values))


def _init(values, latents, num_steps: int) -> SenCacheState:
  start = max(values["warmup_steps"], int(num_steps * values["start"]))
  end = int(num_steps * (1.0 - values["end"]))
  zeros = jax.tree.map(jnp.zeros_like, latents)
  return SenCacheState(
    epsilon=jnp.float32(values["epsilon"]),
    max_reuse=jnp.int32(values["max_reuse"]),
    start_step=jnp.int32(start),
    end_step=jnp.int32(end),
    alphas=jnp.asarray(values["alphas"], jnp.float32),
    accumulated=jnp.zeros((2,), jnp.float32),
    reuse_count=jnp.int32(0),
    valid=jnp.zeros((), bool),
    computed=jnp.zeros((num_steps,), bool),
    ref_t=jnp.float32(0.0),
    ref_sample=zeros,
    ref_prediction=zeros,
  )


def _rms(a: Any, b: Any) -> jax.Array:
  sq = [jnp.sum(jnp.square(x.astype(jnp.float32) - y.astype(jnp.float32))) for x, y in
        zip(jax.tree.leaves(a), jax.tree.leaves(b))]  # fmt: skip
  n = sum(x.size for x in jax.tree.leaves(a))
  return jnp.sqrt(sum(sq) / n)


def _score(st: SenCacheState, step, t, sample):
  step = jnp.asarray(step, jnp.int32)
  t = jnp.asarray(t, jnp.float32) / 1000.0
  acc = st.accumulated + jnp.stack([_rms(sample, st.ref_sample), jnp.abs(t - st.ref_t)])
  forced = (step < st.start_step) | (step >= st.end_step) | ~st.valid
  reuse = ~forced & (jnp.dot(st.alphas, acc) <= st.epsilon) & (st.reuse_count < st.max_reuse)
  return reuse, acc, t


@functools.cache
def _policy() -> mdsch.StepCache:
  def decide(st: SenCacheState, step, t, sample):
    reuse, _, _ = _score(st, step, t, sample)
    return reuse, st.ref_prediction

  def update(st: SenCacheState, step, t, sample, prediction, reused):
    _, acc, t = _score(st, step, t, sample)

    def refresh():
      return st._replace(
        accumulated=jnp.zeros((2,), jnp.float32), reuse_count=jnp.int32(0),
        valid=jnp.ones((), bool), computed=st.computed.at[step].set(True), ref_t=t,
        ref_sample=jax.tree.map(lambda r, x: x.astype(r.dtype), st.ref_sample, sample),
        ref_prediction=jax.tree.map(lambda r, p: p.astype(r.dtype), st.ref_prediction, prediction),
      )  # fmt: skip

    def keep():
      return st._replace(accumulated=acc, reuse_count=st.reuse_count + 1)

    return jax.lax.cond(reused, keep, refresh)

  return mdsch.StepCache(init=None, decide=decide, update=update)
