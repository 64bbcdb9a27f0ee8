"""DeepCache: a UNet's deep features change slowly between steps; compute the whole UNet every
`interval` steps and, in between, only its shallow branch on the deep branch's cached output."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

import md_schedulers as mdsch
from md_cache import _common as c


class DeepCacheState(NamedTuple):
  """DeepCache's loop state.

  Attributes:
    interval: (), int32. The whole UNet runs at every `interval`-th step (counted from `start`).
    start: (), int32. The first step the schedule counts from (steps before it always run).
    valid: (), bool. A full step has filled `slots`.
    computed: (num_steps,), bool. Steps where the deep branch ran.
    slots: the deep branch's output `[R, h, w, c]` at the last full step (R = branches × batch; None
      until `md_cache.prepare` sizes it).
  """

  interval: jax.Array
  start: jax.Array
  valid: jax.Array
  computed: jax.Array
  slots: Any


def deepcache(interval: int = 3, *, start: int = 2) -> mdsch.StepCache:
  """DeepCache (Ma et al. 2023) with its uniform schedule, for md-sd's UNets (SD, SDXL): the whole UNet
  runs at steps `start, start + interval, …` (and at every step before `start`); at the other steps
  only conv_in, the first down block and the last up block run, the last up block taking the deep
  branch's output (everything from the first down block's downsampler to the up block before the last)
  cached at the last full step. The denoiser is still called at every step; the cheap calls skip
  most of the UNet's FLOPs.

  Published setting: `interval=3` for SD 1.5 (N=3 to N=5 trade quality for speed), caching at the
  shallowest branch. md's default also runs the first two steps in full (`start=2`), where the layout
  forms: on md's default image model (models/shapes-sd, 20 DDIM steps) `start=0` lost 3.8 quality points
  and `start=2` 1.9 (md-cache's README).

  Args:
    interval: steps between full UNet calls (traced).
    start: steps before it always run in full (traced); 0 for the published uniform schedule.

  Returns:
    A block-level `md_schedulers.StepCache` (through `md_core.deep_branch`).

  Raises:
    ValueError: `interval` below 1, a negative `start`; on a transformer family, at the first call.
  """
  if int(interval) < 1:
    raise ValueError(f"deepcache: interval={interval} must be at least 1")
  if int(start) < 0:
    raise ValueError(f"deepcache: start={start} must be at least 0")
  values = dict(interval=int(interval), start=int(start))
  return c.block_policy(_Hook)._replace(init=c._Init("deepcache", (), _init, values))


def _init(values, latents, num_steps: int) -> DeepCacheState:
  del latents
  return DeepCacheState(
    interval=jnp.int32(values["interval"]),
    start=jnp.int32(values["start"]),
    valid=jnp.zeros((), bool),
    computed=jnp.zeros((num_steps,), bool),
    slots=None,
  )


def _no_unet_error() -> ValueError:
  return ValueError(
    "deepcache caches a UNet's deep branch (md-sd: SD, SDXL), and this denoiser has none; for "
    "transformer block stacks use md_cache.first_block_cache, magcache or teacache (block-level), or "
    "taylorseer, sencache, faster_cache"
  )


class _Hook:
  def __init__(self, state: DeepCacheState, step, sample, *, joint: bool = False):
    del sample, joint  # one decision for every row (a fixed schedule)
    self._st, self._step = state, jnp.asarray(step, jnp.int32)
    self._shape = None
    self._full = None

  def __call__(self, run, carry, *, num_layers: int, index: int):
    del index
    raise _no_unet_error()

  def deep_branch(self, run, carry):
    st = self._st
    if st.slots is None:  # the slot probe
      out = run(carry)
      self._shape = c.avals(out)
      return out
    if self._full is not None:
      raise ValueError("deepcache: the denoiser ran two deep branches in one step")
    offset = self._step - st.start
    full = ~st.valid | (offset < 0) | (offset % st.interval == 0)
    out = jax.lax.cond(full, lambda: run(carry), lambda: st.slots)
    self._full, self._out = full, out
    return out

  @property
  def state(self) -> DeepCacheState:
    st = self._st
    if st.slots is None:
      if self._shape is None:
        raise _no_unet_error()
      shape = self._shape
      raise c._Sized(lambda s: s._replace(slots=c.zeros(shape)))
    if self._full is None:
      raise _no_unet_error()
    return st._replace(
      valid=jnp.ones((), bool),
      computed=st.computed.at[self._step].set(self._full),
      slots=self._out,
    )
