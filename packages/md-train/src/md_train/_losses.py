"""Diffusion training losses: the noisy input and target for each prediction type, the weighted MSE, timestep
samplers and Min-SNR-γ weights, on md-schedulers' noising helpers.

The loss is diffusers' (train_text_to_image.py, train_dreambooth_flux.py): the squared error averaged over
every non-batch axis, times a per-example weight, averaged over the batch; with no weights, the plain MSE.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

import md_schedulers as mdsch

PREDICTION_TYPES = ("epsilon", "v_prediction", "flow")
FLOW_SAMPLERS = ("uniform", "logit_normal", "mode", "shifted")


def diffusion_loss(
  prediction: jax.Array,
  target: jax.Array,
  weights: jax.Array | None = None,
  element_weights: jax.Array | None = None,
) -> jax.Array:
  """Weighted MSE: `mean_b(w_b * mean(m_b * (prediction_b - target_b)²))`, in float32.

  Args:
    prediction: `[B, ...]` model output.
    target: `[B, ...]`, the same shape.
    weights: `[B]` per-example weights (None: all 1, the plain MSE).
    element_weights: `m`, weights of single elements that broadcast against the prediction (e.g.
      `[B, F, H, W, 1]` over channels-last video latents), so some regions count more; None: all 1.

  Returns:
    A float32 scalar.
  """
  if prediction.shape != target.shape:
    raise ValueError(f"prediction has shape {prediction.shape}, target {target.shape}")
  err = jnp.square(prediction.astype(jnp.float32) - target.astype(jnp.float32))
  if element_weights is not None:
    if element_weights.ndim != err.ndim or any(
      w not in (1, e) for w, e in zip(element_weights.shape, err.shape)
    ):
      raise ValueError(
        f"element_weights have shape {element_weights.shape}, which does not broadcast against the"
        f" prediction's {err.shape} (same rank, each axis 1 or equal)"
      )
    err = err * element_weights.astype(jnp.float32)
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


def uniform_timesteps(
  key: jax.Array,
  batch: int,
  num_train_timesteps: int = 1000,
  *,
  bias: str = "none",
  **bias_options: Any,
) -> jax.Array:
  """`[B]` int32 timesteps in [0, num_train_timesteps).

  Args:
    bias: `none` draws uniformly, as diffusers' scripts do; `earlier`, `later` or `range` draw a portion
      of the batch from a biased range (MaxDiffusion's `timestep_bias` strategies; `bias_options`:
      `bias_portion`, `bias_begin`, `bias_end`, `bias_multiplier`, see
      `md_schedulers.sample_timesteps`).
  """
  if bias == "none":
    if bias_options:
      raise ValueError(f"bias options {sorted(bias_options)} need a bias other than 'none'")
    return jax.random.randint(key, (batch,), 0, num_train_timesteps, jnp.int32)
  sigmas, _ = mdsch.sample_timesteps(
    key, batch, num_train_timesteps=num_train_timesteps, bias=bias, **bias_options
  )
  return mdsch.discrete_timesteps(sigmas, num_train_timesteps)


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


class FlowTable(NamedTuple):
  """A discrete flow-matching training schedule (DiffSynth / MaxDiffusion's Wan training)."""

  sigmas: jax.Array  # [N] float32, descending from sigma_max, shifted
  timesteps: jax.Array  # [N] float32, 1000-scaled sigmas
  weights: jax.Array  # [N] float32 Gaussian-bell loss weights, summing to N


def flow_training_table(
  num_train_timesteps: int = 1000,
  *,
  shift: float = 3.0,
  sigma_max: float = 1.0,
  sigma_min: float = 0.003 / 1.002,
) -> FlowTable:
  """The training table Wan trainers draw from: N sigmas evenly spaced from `sigma_max` to `sigma_min`,
  shifted (σ → shift σ / (1 + (shift - 1) σ)), and bell weights exp(-2 ((t - N/2) / N)²) over their
  timesteps t = 1000 σ, less their minimum and scaled to sum to N (mean weight 1 over the table)."""
  n = int(num_train_timesteps)
  sigmas = mdsch.shift_sigmas(jnp.linspace(sigma_max, sigma_min, n, dtype=jnp.float32), shift)
  timesteps = sigmas * n
  bell = jnp.exp(-2 * ((timesteps - n / 2) / n) ** 2)
  bell = bell - bell.min()
  return FlowTable(sigmas, timesteps, bell * (n / bell.sum()))


WAN22_EXPERTS = ("high", "low")


def expert_range(table: FlowTable, boundary_ratio: float, expert: str) -> tuple[int, int]:
  """The entries `[lo, hi)` of `table` a Wan 2.2 expert trains on: the high-noise expert (`transformer`)
  those whose timestep is at least `boundary_ratio` x N (where the pipeline samples with it), the
  low-noise expert (`transformer_2`) the rest. DiffSynth's Wan 2.2 scripts give the same split as a
  fraction of the table (`--max_timestep_boundary` / `--min_timestep_boundary`).

  Raises:
    ValueError: an unknown expert, or a ratio that leaves an expert no entry.
  """
  if expert not in WAN22_EXPERTS:
    raise ValueError(f"expert={expert!r}; expected one of {WAN22_EXPERTS} (Wan 2.2's two experts)")
  n = int(table.timesteps.shape[0])
  k = int(np.sum(np.asarray(table.timesteps) >= float(boundary_ratio) * n))
  if not 0 < k < n:
    raise ValueError(
      f"boundary_ratio={boundary_ratio} leaves an expert no training timestep (the table's "
      f"timesteps run from {float(table.timesteps[0]):.1f} down to {float(table.timesteps[-1]):.1f})"
    )
  return (0, k) if expert == "high" else (k, n)


def table_lookup(table: FlowTable, timesteps: jax.Array) -> tuple[jax.Array, jax.Array]:
  """`(sigmas [B], weights [B])` of the table entries whose timestep is nearest each of `timesteps`."""
  idx = jnp.argmin(
    jnp.abs(table.timesteps[None, :] - jnp.asarray(timesteps, jnp.float32)[:, None]), 1
  )
  return table.sigmas[idx], table.weights[idx]


def batch_bell_weights(timesteps: jax.Array, num_train_timesteps: int = 1000) -> jax.Array:
  """`[B]` float32 loss weights relative to the batch, as MaxDiffusion's Wan trainer weights its loss.

  MaxDiffusion (AI-Hypercomputer/maxdiffusion, src/maxdiffusion/schedulers/scheduling_flow_match_flax.py
  at commit 3cb44556538edab9f667e74bf037eebcd58dc121, `_calculate_training_weights` as
  `apply_flow_match` calls it on the drawn timesteps): the bell y = exp(-2 ((t - N/2) / N)²) of each
  example's timestep t = 1000 σ, less the batch's minimum, scaled so the batch's weights sum to N
  (`num_train_timesteps`; the example nearest an end of the schedule gets weight 0).

  Where that is undefined, a batch of 1 or every timestep equal (no spread: 0 / 0 in MaxDiffusion), every
  weight is 1 (the plain MSE).
  """
  n = float(num_train_timesteps)
  t = jnp.asarray(timesteps, jnp.float32)
  if t.ndim != 1:
    raise ValueError(f"timesteps have shape {t.shape}, expected [B]")
  bell = jnp.exp(-2 * ((t - n / 2) / n) ** 2)
  shifted = bell - bell.min()
  total = shifted.sum()
  spread = total > 0
  return jnp.where(spread, shifted * (n / jnp.where(spread, total, 1.0)), jnp.ones_like(t))
