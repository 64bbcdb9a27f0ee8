"""LTX rectified-flow schedules and the LTX Euler-ancestral sampler.

LTX-Video and LTX-2 sample with flow-match Euler: uniform sigmas linspace(1, 1/n, n) shifted by a `mu` that
grows with the video's token count (`calculate_shift` with the config's 1024/4096/0.95/2.05), then stretched
so the last sigma is `shift_terminal`. LTX-Video's conditioning pipeline uses the linear-quadratic schedule
instead, and the distilled LTX-2 checkpoints fixed sigma lists.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np

from md_schedulers import _base, _flow_match

# Sigmas of the distilled LTX-2 checkpoints (stage 1 and the stage-2 refinement), as published.
LTX2_DISTILLED_SIGMAS = (1.0, 0.99375, 0.9875, 0.98125, 0.975, 0.909375, 0.725, 0.421875)
LTX2_STAGE2_DISTILLED_SIGMAS = (0.909375, 0.725, 0.421875)

LTX_EULER_ANCESTRAL_RF_DEFAULTS: dict[str, Any] = {
  "num_train_timesteps": 1000,
  "eta": 1.0,
  "s_noise": 1.0,
}


def linear_quadratic_sigmas(
  num_steps: int, threshold_noise: float = 0.025, linear_steps: int | None = None
) -> np.ndarray:
  """LTX-Video's linear-quadratic schedule: [num_steps] float32 sigmas from 1 down.

  The first half of the steps lowers the noise linearly to `1 - threshold_noise`; the rest follow a
  quadratic that reaches 0 after the last step (the trailing 0 is not included).
  """
  if num_steps < 1:
    raise ValueError(f"linear_quadratic_sigmas: num_steps must be >= 1, got {num_steps}")
  if num_steps < 2:
    return np.ones(1, np.float32)
  if linear_steps is None:
    linear_steps = num_steps // 2
  lin = [i * threshold_noise / linear_steps for i in range(linear_steps)]
  gap = linear_steps - threshold_noise * num_steps
  quad_steps = num_steps - linear_steps
  qa = gap / (linear_steps * quad_steps**2)
  qb = threshold_noise / linear_steps - 2 * gap / quad_steps**2
  qc = qa * linear_steps**2
  quad = [qa * i**2 + qb * i + qc for i in range(linear_steps, num_steps)]
  noise_done = lin + quad
  return np.asarray([1.0 - x for x in noise_done], np.float32)


def ltx_uniform_sigmas(num_steps: int) -> np.ndarray:
  """The sigmas LTX / Flux pipelines pass before shifting: linspace(1, 1/n, n), float64."""
  return np.linspace(1.0, 1 / num_steps, num_steps)


def ltx_mu(num_tokens: int, config: dict[str, Any] | None = None) -> float:
  """The token-count shift `mu` LTX-Video / LTX-2 pipelines compute from the scheduler config."""
  c = config or {}
  return _flow_match.calculate_shift(
    num_tokens,
    c.get("base_image_seq_len", 1024),
    c.get("max_image_seq_len", 4096),
    c.get("base_shift", 0.95),
    c.get("max_shift", 2.05),
  )


def ltx_euler_ancestral_rf(**config: Any) -> _base.Scheduler:
  """Euler-ancestral sampling on a rectified flow (LTXEulerAncestralRFScheduler).

  Each step jumps to a lower noise level `sigma_down` with the denoised estimate, then re-noises to
  `sigma_next`; `eta` scales the ancestral part (0 gives plain Euler in x0 form).

  `init(num_inference_steps=None, *, sigmas=None, timesteps=None, mu=None)`: with explicit `sigmas`
  (including the final 0, as ComfyUI schedules do) they are used as given; otherwise the flow-match Euler
  default schedule of the same config.
  """
  name = "LTXEulerAncestralRFScheduler"
  cfg = _base.merge_config(name, LTX_EULER_ANCESTRAL_RF_DEFAULTS, config)
  eta, s_noise = float(cfg["eta"]), float(cfg["s_noise"])
  stochastic = eta > 0.0 and s_noise > 0.0

  def init(
    num_inference_steps=None, *, sigmas=None, timesteps=None, mu=None, shape=None, dtype=jnp.float32
  ):
    del shape, dtype
    n_train = float(cfg["num_train_timesteps"])
    if sigmas is None and timesteps is None:
      if num_inference_steps is None:
        raise ValueError(f"{name}.init needs num_inference_steps or explicit sigmas")
      base = dict(_flow_match.FLOW_MATCH_EULER_DEFAULTS)
      base["num_train_timesteps"] = cfg["num_train_timesteps"]
      ts, s = _flow_match.flow_sigmas(base, num_inference_steps, mu=mu)
      return _base.make_state(
        timesteps=ts, sigmas=s, tables=_tables(s, np.ones(len(ts), np.float32))
      )
    s = np.asarray(sigmas if sigmas is not None else timesteps, np.float32)
    if s.ndim != 1:
      raise ValueError(f"{name}: sigmas must be 1-D, got shape {s.shape}")
    ts = (s * np.float32(n_train)).astype(np.float32)
    # As in the reference, every sigma (the final one too) is a timestep; the call at the last one
    # returns the sample unchanged. `intervals` marks the calls that move.
    padded = np.concatenate([s, s[-1:]])
    moves = (np.arange(len(s)) < len(s) - 1).astype(np.float32)
    return _base.make_state(timesteps=ts, sigmas=padded, tables=_tables(padded, moves))

  def _tables(sig, moves):
    # Per-call scalars in float32 with the reference's operation order (they are cancellation-prone).
    f = np.float32
    sigma, sigma_next = sig[:-1], sig[1:]
    with np.errstate(divide="ignore", invalid="ignore"):
      ratio = f(1.0) + (sigma_next / sigma - f(1.0)) * f(eta)
      sigma_down = sigma_next * ratio
      alpha_next, alpha_down = f(1.0) - sigma_next, f(1.0) - sigma_down
      r = sigma_down / sigma
      renoise = np.sqrt(
        np.maximum(sigma_next**2 - sigma_down**2 * alpha_next**2 / (alpha_down**2 + f(1e-12)), f(0))
      )
      scale = alpha_next / (alpha_down + f(1e-12))
    final = np.abs(sigma_next) < 1e-8
    return {
      "moves": moves,
      "r": np.where(final, 0, r),
      "keep": np.where(final, 1, f(1.0) - r),
      "scale": np.where(final, 1, scale),
      "renoise": np.where(final, 0, renoise),
    }

  def step(state, model_output, sample, key=None, *, noise=None):
    i = state.step
    tb = {k: v[i] for k, v in state.tables.items()}
    x = sample.astype(jnp.float32)
    denoised = x - state.sigmas[i] * model_output.astype(jnp.float32)
    out = tb["r"] * x + tb["keep"] * denoised
    if stochastic:
      eps = _base.draw_noise(key, noise, x, name)
      out = tb["scale"] * out + eps * tb["renoise"] * s_noise
    out = jnp.where(tb["moves"] > 0, out, x)
    return out.astype(sample.dtype), state._replace(step=i + 1)

  return _base.Scheduler(name, cfg, init, step, _base.identity_scale, stochastic, None)
