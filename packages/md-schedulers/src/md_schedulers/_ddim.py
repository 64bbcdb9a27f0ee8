"""DDIM (Song et al. 2021): deterministic (eta = 0) or partly stochastic steps on the alphā schedule."""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np

from md_schedulers import _base

DDIM_DEFAULTS: dict[str, Any] = {
  **_base.ALPHA_BAR_DEFAULTS,
  **_base.THRESHOLD_DEFAULTS,
  "set_alpha_to_one": True,
}


def ddim(
  *, eta: float = 0.0, use_clipped_model_output: bool = False, **config: Any
) -> _base.Scheduler:
  """DDIMScheduler.

  Args:
    eta: weight of the fresh noise (0: deterministic DDIM, 1: DDPM-like); a step argument in the reference.
    use_clipped_model_output: recompute epsilon from the clipped x0 before the update.
    **config: the reference's options (beta schedule, `timestep_spacing`, `steps_offset`,
      `prediction_type`, `clip_sample`, `thresholding`, `set_alpha_to_one`, `rescale_betas_zero_snr`).
  """
  name = "DDIMScheduler"
  cfg = _base.merge_config(name, DDIM_DEFAULTS, config)
  _base.check_choice(
    name, "prediction_type", cfg["prediction_type"], ("epsilon", "sample", "v_prediction")
  )
  acp = _base.train_alphas_cumprod(cfg)
  final = np.float32(1.0) if cfg["set_alpha_to_one"] else acp[0]
  n_train = int(cfg["num_train_timesteps"])
  stochastic = eta > 0

  def init(num_inference_steps=None, *, shape=None, dtype=jnp.float32):
    del shape, dtype
    n = _base.check_steps(num_inference_steps, n_train, name)
    ts = _base.spaced_timesteps(cfg["timestep_spacing"], n_train, n, cfg["steps_offset"])
    prev = ts - n_train // n
    a_t = acp[ts]
    a_prev = np.where(prev >= 0, acp[np.clip(prev, 0, None)], final).astype(np.float32)
    b_t, b_prev = np.float32(1) - a_t, np.float32(1) - a_prev
    variance = b_prev / b_t * (np.float32(1) - a_t / a_prev)
    std = np.float32(eta) * variance ** np.float32(0.5)
    tables = {
      "sqrt_a": a_t ** np.float32(0.5),
      "sqrt_b": b_t ** np.float32(0.5),
      "sqrt_a_prev": a_prev ** np.float32(0.5),
      "direction": (np.float32(1) - a_prev - std**2) ** np.float32(0.5),
      "std": std,
    }
    return _base.make_state(timesteps=ts, sigmas=_sigmas_at(acp, ts), tables=tables)

  def step(state, model_output, sample, key=None, *, noise=None):
    i = state.step
    tb = {k: v[i] for k, v in state.tables.items()}
    x0, eps = _base.split_prediction(
      cfg["prediction_type"], sample, model_output, tb["sqrt_a"], tb["sqrt_b"]
    )
    x0 = _base.postprocess_x0(cfg, x0)
    if use_clipped_model_output:
      eps = (sample - tb["sqrt_a"] * x0) / tb["sqrt_b"]
    prev = tb["sqrt_a_prev"] * x0 + tb["direction"] * eps
    if stochastic:
      prev = prev + tb["std"] * _base.draw_noise(key, noise, sample, name)
    return prev.astype(sample.dtype), state._replace(step=i + 1)

  return _base.Scheduler(name, cfg, init, step, _base.identity_scale, stochastic, acp)


def _sigmas_at(acp: np.ndarray, ts: np.ndarray) -> np.ndarray:
  """sqrt((1 - alphā) / alphā) at the timesteps, then 0: the noise level of each call, for reference."""
  s = _base.train_sigmas(acp)[ts]
  return np.concatenate([s, np.zeros(1, np.float32)])
