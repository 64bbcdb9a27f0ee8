"""DDPM (Ho et al. 2020): ancestral sampling on the alphā schedule, with the reference's step skipping."""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np

from md_schedulers import _base

DDPM_DEFAULTS: dict[str, Any] = {
  **_base.ALPHA_BAR_DEFAULTS,
  **_base.THRESHOLD_DEFAULTS,
  "variance_type": "fixed_small",
}

_VARIANCES = ("fixed_small", "fixed_small_log", "fixed_large")


def ddpm(**config: Any) -> _base.Scheduler:
  """DDPMScheduler (variance types `fixed_small`, `fixed_small_log`, `fixed_large`).

  `init(num_inference_steps=None, *, timesteps=None)`: custom timesteps must descend.
  """
  name = "DDPMScheduler"
  cfg = _base.merge_config(name, DDPM_DEFAULTS, config)
  _base.check_choice(name, "variance_type", cfg["variance_type"], _VARIANCES)
  _base.check_choice(
    name, "prediction_type", cfg["prediction_type"], ("epsilon", "sample", "v_prediction")
  )
  acp = _base.train_alphas_cumprod(cfg)
  n_train = int(cfg["num_train_timesteps"])

  def init(num_inference_steps=None, *, timesteps=None, shape=None, dtype=jnp.float32):
    del shape, dtype
    if timesteps is not None:
      if num_inference_steps is not None:
        raise ValueError(f"{name}.init: pass num_inference_steps or timesteps, not both")
      ts = np.asarray(timesteps, np.int64)
      if np.any(np.diff(ts) >= 0):
        raise ValueError(f"{name}: custom timesteps must descend, got {ts.tolist()}")
      if ts[0] >= n_train:
        raise ValueError(
          f"{name}: timesteps must start below num_train_timesteps={n_train}, got {ts[0]}"
        )
    else:
      n = _base.check_steps(num_inference_steps, n_train, name)
      ts = _base.spaced_timesteps(cfg["timestep_spacing"], n_train, n, cfg["steps_offset"])
    prev = np.concatenate([ts[1:], [-1]])
    one = np.float32(1)
    a_t = acp[ts]
    a_prev = np.where(prev >= 0, acp[np.clip(prev, 0, None)], one).astype(np.float32)
    b_t, b_prev = one - a_t, one - a_prev
    cur_a = a_t / a_prev
    cur_b = one - cur_a
    variance = np.maximum(b_prev / b_t * cur_b, np.float32(1e-20))
    if cfg["variance_type"] == "fixed_small":
      std = variance ** np.float32(0.5)
    elif cfg["variance_type"] == "fixed_small_log":
      std = np.exp(np.float32(0.5) * np.log(variance))
    else:
      std = cur_b ** np.float32(0.5)
    std = np.where(ts > 0, std, 0).astype(np.float32)
    tables = {
      "sqrt_a": a_t ** np.float32(0.5),
      "sqrt_b": b_t ** np.float32(0.5),
      "x0_coef": a_prev ** np.float32(0.5) * cur_b / b_t,
      "sample_coef": cur_a ** np.float32(0.5) * b_prev / b_t,
      "std": std,
    }
    sig = np.concatenate([_base.train_sigmas(acp)[ts], np.zeros(1, np.float32)])
    return _base.make_state(timesteps=ts, sigmas=sig, tables=tables)

  def step(state, model_output, sample, key=None, *, noise=None):
    i = state.step
    tb = {k: v[i] for k, v in state.tables.items()}
    x0, _ = _base.split_prediction(
      cfg["prediction_type"], sample, model_output, tb["sqrt_a"], tb["sqrt_b"]
    )
    x0 = _base.postprocess_x0(cfg, x0)
    prev = tb["x0_coef"] * x0 + tb["sample_coef"] * sample
    prev = prev + tb["std"] * _base.draw_noise(key, noise, sample, name)
    return prev.astype(sample.dtype), state._replace(step=i + 1)

  return _base.Scheduler(name, cfg, init, step, _base.identity_scale, True, acp)
