"""Euler and Euler-ancestral samplers in the k-diffusion parametrisation x = x0 + sigma eps.

The shared `k_schedule` builds the sigma schedule of the k-diffusion style schedulers (Euler, Euler
ancestral, Heun, LMS): timesteps by `timestep_spacing`, sigmas interpolated from the training schedule,
optionally converted to Karras / exponential / beta spacing and mapped back to fractional timesteps.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np

from md_schedulers import _base

K_DEFAULTS: dict[str, Any] = {
  "num_train_timesteps": 1000,
  "beta_start": 0.0001,
  "beta_end": 0.02,
  "beta_schedule": "linear",
  "trained_betas": None,
  "prediction_type": "epsilon",
  "timestep_spacing": "linspace",
  "steps_offset": 0,
}
EULER_DEFAULTS: dict[str, Any] = {
  **K_DEFAULTS,
  "interpolation_type": "linear",
  "use_karras_sigmas": False,
  "use_exponential_sigmas": False,
  "use_beta_sigmas": False,
  "sigma_min": None,
  "sigma_max": None,
  "timestep_type": "discrete",
  "rescale_betas_zero_snr": False,
  "final_sigmas_type": "zero",
}
EULER_ANCESTRAL_DEFAULTS: dict[str, Any] = {**K_DEFAULTS, "rescale_betas_zero_snr": False}


def k_schedule(
  cfg: dict[str, Any], acp: np.ndarray, n: int, *, convert: bool = True, timesteps=None, sigmas=None
) -> tuple[np.ndarray, np.ndarray]:
  """(timesteps [n] float, sigmas [n] float64 before the final sigma) of a k-diffusion scheduler."""
  n_train = int(cfg["num_train_timesteps"])
  train = _base.train_sigmas(acp)
  log_train = np.log(train)
  if sigmas is not None:
    s = np.asarray(sigmas).astype(np.float32)
    return _base.sigma_to_t(s[:-1], log_train), s
  if timesteps is not None:
    ts = np.asarray(timesteps).astype(np.float32)
  else:
    ts = _base.spaced_timesteps(
      cfg["timestep_spacing"], n_train, n, cfg["steps_offset"], dtype=np.float32
    )
  s = np.interp(ts, np.arange(0, len(train)), train)
  if convert:
    s, changed = _base.convert_sigmas(cfg, s, n)
    if changed:
      ts = _base.sigma_to_t(s, log_train)
  return ts, s


def init_noise_sigma(cfg: dict[str, Any], sigmas: np.ndarray) -> np.float32:
  """The reference's initial noise scale: max sigma, or sqrt(max² + 1) for `leading` spacing."""
  top = np.float32(sigmas.max())
  if cfg["timestep_spacing"] in ("linspace", "trailing"):
    return top
  return (top**2 + np.float32(1)) ** np.float32(0.5)


def k_x0(pred: str, sample, model_output, sigma):
  """The denoised estimate from a model output at noise level `sigma` (sample is unscaled)."""
  if pred == "epsilon":
    return sample - sigma * model_output
  if pred == "v_prediction":
    return model_output * (-sigma / (sigma**2 + 1) ** 0.5) + sample / (sigma**2 + 1)
  if pred in ("sample", "original_sample"):
    return model_output
  raise ValueError(
    f"prediction_type={pred!r} is not supported; expected 'epsilon', 'v_prediction' or 'sample'"
  )


def euler(
  *,
  s_churn: float = 0.0,
  s_tmin: float = 0.0,
  s_tmax: float = float("inf"),
  s_noise: float = 1.0,
  **config: Any,
) -> _base.Scheduler:
  """EulerDiscreteScheduler.

  Args:
    s_churn, s_tmin, s_tmax, s_noise: Karras et al.'s stochastic "churn" (step arguments in the
      reference): calls whose sigma lies in [s_tmin, s_tmax] first raise the noise level by a factor
      1 + min(s_churn / n, sqrt(2) - 1) with fresh noise scaled by `s_noise`. 0 churn is deterministic.
    **config: the reference's options.

  Returns:
    A Scheduler; `init(num_inference_steps=None, *, timesteps=None, sigmas=None)` (custom `sigmas`
    include the final one).
  """
  name = "EulerDiscreteScheduler"
  cfg = _base.merge_config(name, EULER_DEFAULTS, config)
  _base.check_choice(name, "interpolation_type", cfg["interpolation_type"], ("linear",))
  _base.check_choice(name, "final_sigmas_type", cfg["final_sigmas_type"], ("zero", "sigma_min"))
  _base.check_choice(name, "timestep_type", cfg["timestep_type"], ("discrete", "continuous"))
  _base.check_choice(
    name,
    "prediction_type",
    cfg["prediction_type"],
    ("epsilon", "v_prediction", "sample", "original_sample"),
  )
  _base.convert_sigmas(cfg, np.ones(2), 2)
  acp = _base.train_alphas_cumprod(cfg, zero_snr_floor=True)
  n_train = int(cfg["num_train_timesteps"])
  continuous = cfg["timestep_type"] == "continuous" and cfg["prediction_type"] == "v_prediction"
  stochastic = s_churn > 0

  def init(num_inference_steps=None, *, timesteps=None, sigmas=None, shape=None, dtype=jnp.float32):
    del shape, dtype
    given = [x is not None for x in (num_inference_steps, timesteps, sigmas)]
    if sum(given) != 1:
      raise ValueError(f"{name}.init: pass exactly one of num_inference_steps, timesteps, sigmas")
    if timesteps is not None and any(
      cfg[k] for k in ("use_karras_sigmas", "use_exponential_sigmas", "use_beta_sigmas")
    ):
      raise ValueError(
        f"{name}: custom timesteps cannot be combined with Karras/exponential/beta sigmas"
      )
    if num_inference_steps is None:
      num_inference_steps = len(timesteps) if timesteps is not None else len(sigmas) - 1
    n = _base.check_steps(num_inference_steps, n_train, name)
    ts, s = k_schedule(cfg, acp, n, timesteps=timesteps, sigmas=sigmas)
    if sigmas is None:
      last = 0.0
      if cfg["final_sigmas_type"] == "sigma_min":
        last = _base.train_sigmas(acp)[0]
      s = np.concatenate([s, [last]]).astype(np.float32)
    s = np.asarray(s, np.float32)
    if continuous:
      ts = (np.float32(0.25) * np.log(s[:-1])).astype(np.float32)
    ts = np.asarray(ts).astype(np.float32)
    gamma = min(s_churn / (len(s) - 1), 2**0.5 - 1)
    churn = np.where((s_tmin <= s[:-1]) & (s[:-1] <= s_tmax), gamma, 0.0)
    tables = {"churn": np.float32(1) + churn.astype(np.float32)}
    return _base.make_state(
      timesteps=ts, sigmas=s, tables=tables, init_noise_sigma=init_noise_sigma(cfg, s)
    )

  def step(state, model_output, sample, key=None, *, noise=None):
    i = state.step
    sigma, sigma_next = state.sigmas[i], state.sigmas[i + 1]
    x = sample.astype(jnp.float32)
    sigma_hat = sigma
    if stochastic:
      sigma_hat = sigma * state.tables["churn"][i]
      eps = _base.draw_noise(key, noise, x, name) * s_noise
      # Only churned calls get noise: without churn the difference is 0, but a fused multiply-add
      # may round it to a tiny value whose square root is not small.
      lift = jnp.where(state.tables["churn"][i] > 1, jnp.maximum(sigma_hat**2 - sigma**2, 0.0), 0.0)
      x = x + eps * lift**0.5
    if cfg["prediction_type"] == "epsilon":
      x0 = x - sigma_hat * model_output
    else:
      x0 = k_x0(cfg["prediction_type"], x, model_output, sigma)
    derivative = (x - x0) / sigma_hat
    prev = x + derivative * (sigma_next - sigma_hat)
    return prev.astype(sample.dtype), state._replace(step=i + 1)

  return _base.Scheduler(name, cfg, init, step, _base.sigma_scale, stochastic, acp)


def euler_ancestral(**config: Any) -> _base.Scheduler:
  """EulerAncestralDiscreteScheduler: Euler to `sigma_down`, then fresh noise of size `sigma_up`."""
  name = "EulerAncestralDiscreteScheduler"
  cfg = _base.merge_config(name, EULER_ANCESTRAL_DEFAULTS, config)
  _base.check_choice(name, "prediction_type", cfg["prediction_type"], ("epsilon", "v_prediction"))
  acp = _base.train_alphas_cumprod(cfg, zero_snr_floor=True)
  n_train = int(cfg["num_train_timesteps"])

  def init(num_inference_steps=None, *, shape=None, dtype=jnp.float32):
    del shape, dtype
    n = _base.check_steps(num_inference_steps, n_train, name)
    ts, s = k_schedule(cfg, acp, n, convert=False)
    s = np.concatenate([s, [0.0]]).astype(np.float32)
    return _base.make_state(
      timesteps=np.asarray(ts, np.float32), sigmas=s, init_noise_sigma=init_noise_sigma(cfg, s)
    )

  def step(state, model_output, sample, key=None, *, noise=None):
    i = state.step
    sigma, sigma_to = state.sigmas[i], state.sigmas[i + 1]
    x = sample.astype(jnp.float32)
    x0 = k_x0(cfg["prediction_type"], x, model_output, sigma)
    sigma_up = (sigma_to**2 * (sigma**2 - sigma_to**2) / sigma**2) ** 0.5
    sigma_down = (sigma_to**2 - sigma_up**2) ** 0.5
    derivative = (x - x0) / sigma
    prev = x + derivative * (sigma_down - sigma)
    prev = prev + _base.draw_noise(key, noise, x, name) * sigma_up
    return prev.astype(sample.dtype), state._replace(step=i + 1)

  return _base.Scheduler(name, cfg, init, step, _base.sigma_scale, True, acp)
