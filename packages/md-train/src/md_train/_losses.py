"""Diffusion training losses: the noisy input and target for each prediction type, the weighted MSE, timestep
samplers and Min-SNR-γ weights, on md-schedulers' noising helpers.

The loss is diffusers' (train_text_to_image.py, train_dreambooth_flux.py): the squared error averaged over
every non-batch axis, times a per-example weight, averaged over the batch; with no weights, the plain MSE.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

import md_schedulers as mdsch

PREDICTION_TYPES = ("epsilon", "v_prediction", "flow")
FLOW_SAMPLERS = ("uniform", "logit_normal", "mode", "shifted")


def diffusion_loss(
  prediction: jax.Array, target: jax.Array, weights: jax.Array | None = None
) -> jax.Array:
  """Weighted MSE: `mean_b(w_b * mean((prediction_b - target_b)²))`, in float32.

  Args:
    prediction: `[B, ...]` model output.
    target: `[B, ...]`, the same shape.
    weights: `[B]` per-example weights (None: all 1, the plain MSE).

  Returns:
    A float32 scalar.
  """
  if prediction.shape != target.shape:
    raise ValueError(f"prediction has shape {prediction.shape}, target {target.shape}")
  err = jnp.square(prediction.astype(jnp.float32) - target.astype(jnp.float32))
  per_example = err.reshape(err.shape[0], -1).mean(axis=1)  # [B]
  if weights is None:
    return per_example.mean()
  if weights.shape != per_example.shape:
    raise ValueError(
      f"weights have shape {weights.shape}, expected {per_example.shape} (one per example)"
    )
  return (weights.astype(jnp.float32) * per_example).mean()


class NoisedBatch(NamedTuple):
  """A model input and what the model should predict."""

  noisy: jax.Array  # [B, ...] like the latents
  target: jax.Array  # [B, ...] like the latents


def diffusion_inputs(
  prediction_type: str,
  latents: jax.Array,
  noise: jax.Array,
  timesteps: jax.Array,
  *,
  alphas_cumprod=None,
) -> NoisedBatch:
  """The noisy latents and the target for one prediction type.

  Args:
    prediction_type: `epsilon` (target: the noise), `v_prediction` (sqrt(ᾱ) noise - sqrt(1-ᾱ) x0) or
      `flow` (rectified flow: x = (1-σ) x0 + σ noise, target noise - x0).
    latents: `[B, ...]` clean latents x0.
    noise: `[B, ...]` standard normal noise.
    timesteps: `[B]` integer timesteps for `epsilon` / `v_prediction`; sigmas in [0, 1] for `flow`.
    alphas_cumprod: the training schedule ᾱ (`Scheduler.alphas_cumprod`), for `epsilon` / `v_prediction`.
  """
  if prediction_type == "flow":
    return NoisedBatch(
      mdsch.flow_noise(latents, noise, timesteps), mdsch.flow_target(latents, noise)
    )
  if prediction_type not in PREDICTION_TYPES:
    raise ValueError(f"prediction_type={prediction_type!r}; expected one of {PREDICTION_TYPES}")
  if alphas_cumprod is None:
    raise ValueError(
      f"prediction_type={prediction_type!r} needs alphas_cumprod (the training schedule)"
    )
  noisy = mdsch.add_noise(alphas_cumprod, latents, noise, timesteps)
  if prediction_type == "epsilon":
    return NoisedBatch(noisy, noise)
  return NoisedBatch(noisy, mdsch.velocity(alphas_cumprod, latents, noise, timesteps))


def uniform_timesteps(key: jax.Array, batch: int, num_train_timesteps: int = 1000) -> jax.Array:
  """`[B]` int32 timesteps uniform in [0, num_train_timesteps), as diffusers' scripts draw them."""
  return jax.random.randint(key, (batch,), 0, num_train_timesteps, jnp.int32)


def flow_sigmas(
  key: jax.Array,
  batch: int,
  *,
  sampler: str = "logit_normal",
  logit_mean: float = 0.0,
  logit_std: float = 1.0,
  mode_scale: float = 1.29,
  shift: float = 1.0,
) -> jax.Array:
  """`[B]` float32 flow-matching sigmas in (0, 1] (the model's timestep is 1000 σ).

  Args:
    sampler: `uniform`; `logit_normal` (sigmoid of N(logit_mean, logit_std²): SD3 and Flux training);
      `mode` (SD3's mode sampling); `shifted` (uniform, then σ → shift σ / (1 + (shift - 1) σ), as Wan
      trains with shift 5 and SD3 with 3).
  """
  if sampler not in FLOW_SAMPLERS:
    raise ValueError(f"sampler={sampler!r}; expected one of {FLOW_SAMPLERS}")
  sigmas, _ = mdsch.sample_timesteps(
    key, batch, kind=sampler, logit_mean=logit_mean, logit_std=logit_std, mode_scale=mode_scale,
    shift=shift,
  )  # fmt: skip
  return sigmas


def min_snr_weights(
  alphas_cumprod, timesteps: jax.Array, gamma: float = 5.0, prediction_type: str = "epsilon"
) -> jax.Array:
  """`[B]` Min-SNR-γ loss weights (Hang et al. 2023) as train_text_to_image.py's `--snr_gamma`:
  min(SNR, γ) / SNR for epsilon, min(SNR, γ) / (SNR + 1) for v-prediction."""
  return mdsch.min_snr_weight(mdsch.snr(alphas_cumprod, timesteps), gamma, prediction_type)
