"""FasterCache's CFG cache: on most steps the unconditional (negative) branch is not run; its output is
the conditional output shifted by the branches' difference at the last full step, split into low and
high spatial frequencies that are reweighted separately."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

import md_schedulers as mdsch
from md_cache import _common as c


class FasterCacheState(NamedTuple):
  """The CFG cache's loop state.

  Attributes:
    interval: (), int32. The negative branch runs at every `interval`-th denoiser call.
    timestep_range: (2,), float32. Open range of timesteps where it may be skipped.
    low_range: (2,), float32. Open range of timesteps where a skipped step scales the low-frequency
      difference by `alphas[0]`.
    high_range: (2,), float32. The same for the high frequencies and `alphas[1]`.
    alphas: (2,), float32. The low- and high-frequency weights.
    iteration: (), int32. Denoiser calls made so far.
    computed: (num_steps,), bool. Steps where the negative branch ran.
    low: like the latents, complex64: the negative minus the positive output's spectrum inside the
      low-frequency disc, as last computed and scaled since (each leaf's spatial axes transformed).
    high: the same outside the disc.
  """

  interval: jax.Array
  timestep_range: jax.Array
  low_range: jax.Array
  high_range: jax.Array
  alphas: jax.Array
  iteration: jax.Array
  computed: jax.Array
  low: Any
  high: Any


def faster_cache(
  interval: int = 5,
  *,
  timestep_range: Sequence[float] = (-1, 641),
  low_frequency_range: Sequence[float] = (99, 901),
  high_frequency_range: Sequence[float] = (-1, 301),
  alpha_low: float = 1.1,
  alpha_high: float = 1.1,
) -> mdsch.StepCache:
  """FasterCache's CFG cache (Lv et al. 2024, §3.3). The unconditional branch of classifier-free
  guidance runs at the first denoiser call, at every `interval`-th one and outside `timestep_range`;
  at the other calls the denoiser runs on the conditional rows only and the unconditional output is
  `IFFT(FFT(cond) + ΔL + ΔH)`, where `ΔL` / `ΔH` are the unconditional-minus-conditional spectrum at
  the last full call inside / outside a disc of radius `min(H, W) // 5` around the zero frequency.
  Each skipped call first multiplies `ΔL` by `alpha_low` when its timestep lies in
  `low_frequency_range` and `ΔH` by `alpha_high` in `high_frequency_range` (the scaling compounds over
  consecutive skipped calls, as in diffusers' FasterCache). Ranges are open intervals of the loop's
  timesteps (0–1000). The spatial axes of a channels-last sample are `[B, H, W, C]` → H, W;
  `[B, F, H, W, C]` → H, W per frame; token latents `[B, S, C]` → S (a 1-D transform).

  Defaults: diffusers' `FasterCacheConfig` (`unconditional_batch_skip_range=5`, skip range
  `(-1, 641)`, weight ranges `(99, 901)` / `(-1, 301)`, alphas 1.1). diffusers also extrapolates
  attention outputs inside the blocks on skipped calls; md-cache does only the CFG part.

  Args:
    interval: denoiser calls between full (both-branch) calls (traced).
    timestep_range: (lo, hi): the negative branch may be skipped where lo < t < hi (traced).
    low_frequency_range: where `alpha_low` applies (traced).
    high_frequency_range: where `alpha_high` applies (traced).
    alpha_low: the low-frequency weight (traced).
    alpha_high: the high-frequency weight (traced).

  Returns:
    An `md_schedulers.StepCache` with a `negative` branch cache; it needs classifier-free guidance.

  Raises:
    ValueError: `interval` below 1 or a range that is not two numbers.
  """
  if int(interval) < 1:
    raise ValueError(f"faster_cache: interval={interval} must be at least 1")
  ranges = {}
  for name, r in (
    ("timestep_range", timestep_range), ("low_frequency_range", low_frequency_range),
    ("high_frequency_range", high_frequency_range),
  ):  # fmt: skip
    r = tuple(float(v) for v in r)
    if len(r) != 2 or r[0] > r[1]:
      raise ValueError(f"faster_cache: {name}={r} must be (lo, hi) with lo <= hi")
    ranges[name] = r
  values = dict(interval=int(interval), alphas=(float(alpha_low), float(alpha_high)), **ranges)
  return _policy()._replace(init=c._Init("faster_cache", (), _init, values))


def _init(values, latents, num_steps: int) -> FasterCacheState:
  spectra = jax.tree.map(lambda a: jnp.zeros(a.shape, jnp.complex64), latents)
  return FasterCacheState(
    interval=jnp.int32(values["interval"]),
    timestep_range=jnp.asarray(values["timestep_range"], jnp.float32),
    low_range=jnp.asarray(values["low_frequency_range"], jnp.float32),
    high_range=jnp.asarray(values["high_frequency_range"], jnp.float32),
    alphas=jnp.asarray(values["alphas"], jnp.float32),
    iteration=jnp.int32(0),
    computed=jnp.zeros((num_steps,), bool),
    low=spectra,
    high=spectra,
  )


def spatial_axes(ndim: int) -> tuple[int, ...]:
  """The axes a channels-last leaf is transformed over (see `faster_cache`)."""
  if ndim == 5:
    return (2, 3)
  if ndim == 4:
    return (1, 2)
  if ndim == 3:
    return (1,)
  raise ValueError(f"faster_cache: a sample leaf of rank {ndim}; expected [B, S, C], [B, H, W, C] or "
                   "[B, F, H, W, C]")  # fmt: skip


def low_mask(shape: Sequence[int], axes: Sequence[int]) -> jax.Array:
  """True inside the disc of radius `min(sizes) // 5` around the zero frequency of an unshifted FFT
  over `axes` (the centred disc of the reference's shifted spectrum), broadcastable to `shape`."""
  sizes = [shape[a] for a in axes]
  radius = min(sizes) // 5
  dist = jnp.zeros([1] * len(shape), jnp.int32)
  for a, n in zip(axes, sizes):
    k = jnp.arange(n)
    d = (k + n // 2) % n - n // 2  # the signed frequency of FFT index k
    dist = dist + (d * d).reshape([n if i == a else 1 for i in range(len(shape))])
  return dist <= radius * radius


def _fft(x: jax.Array) -> jax.Array:
  return jnp.fft.fftn(x.astype(jnp.float32), axes=spatial_axes(x.ndim))


def _ifft(f: jax.Array) -> jax.Array:
  return jnp.fft.ifftn(f, axes=spatial_axes(f.ndim)).real


def _within(r: jax.Array, t) -> jax.Array:
  t = jnp.asarray(t, jnp.float32)
  return (r[0] < t) & (t < r[1])


@functools.cache
def _policy() -> mdsch.StepCache:
  def skip(st: FasterCacheState, step, t, sample):
    del step, sample
    return (st.iteration > 0) & _within(st.timestep_range, t) & (st.iteration % st.interval != 0)

  def fill(st: FasterCacheState, step, t, outs: dict, skipped: bool):
    pos = outs["positive"]
    if skipped:
      wl = jnp.where(_within(st.low_range, t), st.alphas[0], 1.0)
      wh = jnp.where(_within(st.high_range, t), st.alphas[1], 1.0)
      low = jax.tree.map(lambda d: d * wl, st.low)
      high = jax.tree.map(lambda d: d * wh, st.high)

      def approx(p, lo, hi):
        return _ifft(_fft(p) + lo + hi).astype(p.dtype)

      outs = {"negative": jax.tree.map(approx, pos, low, high), **outs}
    else:

      def split(neg, p):
        delta = _fft(neg) - _fft(p)
        m = low_mask(delta.shape, spatial_axes(delta.ndim))
        return jnp.where(m, delta, 0), jnp.where(m, 0, delta)

      parts = jax.tree.map(split, outs["negative"], pos)
      tree = jax.tree.structure(pos)
      pairs = tree.flatten_up_to(parts)
      low = jax.tree.unflatten(tree, [p[0] for p in pairs])
      high = jax.tree.unflatten(tree, [p[1] for p in pairs])
    st = st._replace(
      iteration=st.iteration + 1, computed=st.computed.at[step].set(not skipped), low=low, high=high
    )
    return outs, st

  return mdsch.StepCache(init=None, decide=c.never, update=c.keep, negative=(skip, fill))
