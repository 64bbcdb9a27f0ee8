"""Heun's second-order method in the k-diffusion parametrisation (HeunDiscreteScheduler)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from md_schedulers import _base, _euler

HEUN_DEFAULTS: dict[str, Any] = {
  **_euler.K_DEFAULTS,
  "beta_start": 0.00085,
  "beta_end": 0.012,
  "use_karras_sigmas": False,
  "use_exponential_sigmas": False,
  "use_beta_sigmas": False,
  "clip_sample": False,
  "clip_sample_range": 1.0,
}


def heun(**config: Any) -> _base.Scheduler:
  """HeunDiscreteScheduler: n steps make 2n - 1 model calls (the last step is a plain Euler step).

  `init(num_inference_steps=None, *, timesteps=None)`.
  """
  name = "HeunDiscreteScheduler"
  cfg = _base.merge_config(name, HEUN_DEFAULTS, config)
  _base.check_choice(
    name, "prediction_type", cfg["prediction_type"], ("epsilon", "v_prediction", "sample")
  )
  _base.convert_sigmas(cfg, np.ones(2), 2)
  acp = _base.train_alphas_cumprod(
    cfg, allowed=("linear", "scaled_linear", "squaredcos_cap_v2", "exp")
  )
  n_train = int(cfg["num_train_timesteps"])

  def init(num_inference_steps=None, *, timesteps=None, shape=None, dtype=jnp.float32):
    if (num_inference_steps is None) == (timesteps is None):
      raise ValueError(f"{name}.init: pass exactly one of num_inference_steps or timesteps")
    n = _base.check_steps(num_inference_steps or len(timesteps), n_train, name)
    ts, s = _euler.k_schedule(cfg, acp, n, timesteps=timesteps)
    s = np.concatenate([s, [0.0]]).astype(np.float32)
    s = np.concatenate([s[:1], np.repeat(s[1:-1], 2), s[-1:]])
    ts = np.asarray(ts)
    ts = np.concatenate([ts[:1], np.repeat(ts[1:], 2)]).astype(np.float32)
    memory = _base.zeros_memory(shape, dtype, name, derivative=0, sample=0)
    return _base.make_state(
      timesteps=ts, sigmas=s, memory=memory, init_noise_sigma=_euler.init_noise_sigma(cfg, s)
    )

  def step(state, model_output, sample, key=None, *, noise=None):
    del key, noise
    i = state.step
    pred = cfg["prediction_type"]
    d_dtype, x_dtype = state.memory["derivative"].dtype, state.memory["sample"].dtype

    def x0_at(sigma):
      x0 = _euler.k_x0(pred, sample, model_output, sigma)
      if cfg["clip_sample"]:
        x0 = jnp.clip(x0, -cfg["clip_sample_range"], cfg["clip_sample_range"])
      return x0

    def predictor(_):
      sigma, sigma_next = state.sigmas[i], state.sigmas[i + 1]
      derivative = (sample - x0_at(sigma)) / sigma
      prev = sample + derivative * (sigma_next - sigma)
      return prev.astype(jnp.float32), derivative.astype(d_dtype), sample.astype(x_dtype)

    def corrector(_):
      sigma, sigma_next = state.sigmas[i - 1], state.sigmas[i]
      derivative = (sample - x0_at(sigma_next)) / sigma_next
      derivative = (state.memory["derivative"] + derivative) / 2
      prev = state.memory["sample"] + derivative * (sigma_next - sigma)
      return prev.astype(jnp.float32), state.memory["derivative"], state.memory["sample"]

    prev, d, x = jax.lax.cond(i % 2 == 0, predictor, corrector, None)
    memory = {
      "derivative": d.astype(state.memory["derivative"].dtype),
      "sample": x.astype(state.memory["sample"].dtype),
    }
    return prev.astype(sample.dtype), state._replace(step=i + 1, memory=memory)

  def scale_model_input(state, sample):
    return _base.sigma_scale(state, sample)

  return _base.Scheduler(name, cfg, init, step, scale_model_input, False, acp)
