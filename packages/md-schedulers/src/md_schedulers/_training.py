"""Training-side helpers: noising, prediction targets, SNR weighting and timestep samplers.

Diffusion (alphā) schedules use integer timesteps into `Scheduler.alphas_cumprod`; flow matching uses
sigma in [0, 1] with x_sigma = (1 - sigma) x0 + sigma noise (timestep = 1000 sigma).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np


def _per_example(values: jax.Array, like: jax.Array) -> jax.Array:
  """[B] values broadcast against a [B, ...] array."""
  return values.reshape(values.shape + (1,) * (like.ndim - values.ndim))


def add_noise(alphas_cumprod, x0: jax.Array, noise: jax.Array, timesteps: jax.Array) -> jax.Array:
  """sqrt(alphā_t) x0 + sqrt(1 - alphā_t) noise, per example ([B] integer timesteps)."""
  acp = jnp.asarray(alphas_cumprod, jnp.float32)[timesteps]
  a = _per_example(acp**0.5, x0)
  b = _per_example((1 - acp) ** 0.5, x0)
  return a * x0 + b * noise


def velocity(alphas_cumprod, x0: jax.Array, noise: jax.Array, timesteps: jax.Array) -> jax.Array:
  """The v-prediction target sqrt(alphā_t) noise - sqrt(1 - alphā_t) x0."""
  acp = jnp.asarray(alphas_cumprod, jnp.float32)[timesteps]
  a = _per_example(acp**0.5, x0)
  b = _per_example((1 - acp) ** 0.5, x0)
  return a * noise - b * x0


def snr(alphas_cumprod, timesteps: jax.Array) -> jax.Array:
  """Signal-to-noise ratio alphā_t / (1 - alphā_t) at integer timesteps."""
  acp = jnp.asarray(alphas_cumprod, jnp.float32)[timesteps]
  return acp / (1 - acp)


def min_snr_weight(snr_values: jax.Array, gamma: float = 5.0, prediction_type: str = "epsilon"):
  """Min-SNR-gamma loss weights (Hang et al. 2023) for epsilon, v or x0 targets."""
  clipped = jnp.minimum(snr_values, gamma)
  if prediction_type == "epsilon":
    return clipped / snr_values
  if prediction_type == "v_prediction":
    return clipped / (snr_values + 1)
  if prediction_type == "sample":
    return clipped
  raise ValueError(
    f"prediction_type={prediction_type!r}; expected 'epsilon', 'v_prediction' or 'sample'"
  )


def flow_noise(x0: jax.Array, noise: jax.Array, sigmas: jax.Array) -> jax.Array:
  """The flow-matching noisy sample (1 - sigma) x0 + sigma noise for [B] sigmas."""
  s = _per_example(sigmas, x0)
  return (1 - s) * x0 + s * noise


def flow_target(x0: jax.Array, noise: jax.Array) -> jax.Array:
  """The flow-matching velocity target noise - x0."""
  return noise - x0


def shift_sigmas(sigmas: jax.Array, shift: float) -> jax.Array:
  """Static timestep shift shift s / (1 + (shift - 1) s) (SD3, Wan training)."""
  return shift * sigmas / (1 + (shift - 1) * sigmas)


def sample_timesteps(
  key: jax.Array,
  batch: int,
  *,
  kind: str = "uniform",
  num_train_timesteps=1000,
  logit_mean: float = 0.0,
  logit_std: float = 1.0,
  mode_scale: float = 1.29,
  shift: float = 1.0,
  bias: str = "none",
  bias_portion: float = 0.25,
  bias_begin: int = 0,
  bias_end: int = 1000,
  bias_multiplier: float = 5.0,
):
  """Draws training noise levels: returns (sigmas [B] float32 in (0, 1], timesteps [B] float32 = 1000 σ).

  Args:
    key: PRNG key.
    batch: number of examples.
    kind: `uniform`; `logit_normal` (SD3: sigmoid of N(mean, std)); `mode` (SD3's mode sampling with
      `mode_scale`); `shifted` (Wan / SD3 style: uniform, then shifted by `shift`).
    num_train_timesteps: the discrete timestep count (timesteps = sigma * this).
    logit_mean, logit_std, mode_scale, shift: the samplers' parameters.
    bias: `none`, `earlier`, `later`, `range` (kohya-style bias strategies on the discrete timesteps:
      `earlier`/`later` draw a `bias_portion` of the batch from the first/last quarter, `range` draws
      that portion from [bias_begin, bias_end)).
    bias_portion, bias_begin, bias_end, bias_multiplier: the bias parameters (`bias_multiplier` skews
      `earlier`/`later` further when > 1).
  """
  k1, k2, k3 = jax.random.split(key, 3)
  if kind == "uniform":
    u = jax.random.uniform(k1, (batch,))
  elif kind == "logit_normal":
    u = jax.nn.sigmoid(logit_mean + logit_std * jax.random.normal(k1, (batch,)))
  elif kind == "mode":
    u = jax.random.uniform(k1, (batch,))
    u = 1 - u - mode_scale * (jnp.cos(math.pi * u / 2) ** 2 - 1 + u)
  elif kind == "shifted":
    u = shift_sigmas(jax.random.uniform(k1, (batch,)), shift)
  else:
    raise ValueError(
      f"timestep sampler {kind!r} not supported; expected uniform, logit_normal, mode or shifted"
    )
  if bias != "none":
    n = num_train_timesteps
    portion = jax.random.uniform(k2, (batch,)) < bias_portion
    v = jax.random.uniform(k3, (batch,))
    if bias == "earlier":
      alt = (v**bias_multiplier) * 0.25
    elif bias == "later":
      alt = 1 - (v**bias_multiplier) * 0.25
    elif bias == "range":
      alt = (bias_begin + v * (bias_end - bias_begin)) / n
    else:
      raise ValueError(
        f"timestep bias {bias!r} not supported; expected none, earlier, later or range"
      )
    u = jnp.where(portion, alt, u)
  sigmas = jnp.clip(u.astype(jnp.float32), 1.0 / num_train_timesteps, 1.0)
  return sigmas, sigmas * num_train_timesteps


def discrete_timesteps(sigmas: jax.Array, num_train_timesteps: int = 1000) -> jax.Array:
  """Integer timesteps in [0, num_train_timesteps) for alphā schedules from sampled sigmas."""
  t = jnp.floor(sigmas * num_train_timesteps).astype(jnp.int32)
  return jnp.clip(t, 0, num_train_timesteps - 1)


def snr_from_alphas(alphas_cumprod) -> np.ndarray:
  """SNR of every training timestep (host numpy)."""
  a = np.asarray(alphas_cumprod, np.float64)
  return a / (1 - a)
