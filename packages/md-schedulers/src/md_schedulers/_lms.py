"""Linear multistep (LMSDiscreteScheduler): Adams-type steps on sigma with Lagrange-integrated weights."""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np

from md_schedulers import _base, _euler

LMS_DEFAULTS: dict[str, Any] = {
  **_euler.K_DEFAULTS,
  "use_karras_sigmas": False,
  "use_exponential_sigmas": False,
  "use_beta_sigmas": False,
}
ORDER = 4


def _lms_weights(sigmas: np.ndarray, i: int, order: int) -> np.ndarray:
  """Integral over [sigma_i, sigma_{i+1}] of each Lagrange basis polynomial on the last `order` sigmas.

  Returns [order] weights; weight k multiplies the derivative from `k` calls ago.
  """
  s = sigmas.astype(np.float64)
  out = np.zeros(order)
  for k in range(order):
    poly = np.poly1d([1.0])
    for j in range(order):
      if j != k:
        poly *= np.poly1d([1.0, -s[i - j]]) / (s[i - k] - s[i - j])
    antider = poly.integ()
    out[k] = antider(s[i + 1]) - antider(s[i])
  return out


def lms(**config: Any) -> _base.Scheduler:
  """LMSDiscreteScheduler of order 4 (its default), warming up from order 1."""
  name = "LMSDiscreteScheduler"
  cfg = _base.merge_config(name, LMS_DEFAULTS, config)
  _base.check_choice(
    name, "prediction_type", cfg["prediction_type"], ("epsilon", "v_prediction", "sample")
  )
  _base.convert_sigmas(cfg, np.ones(2), 2)
  acp = _base.train_alphas_cumprod(cfg)
  n_train = int(cfg["num_train_timesteps"])

  def init(num_inference_steps=None, *, shape=None, dtype=jnp.float32):
    n = _base.check_steps(num_inference_steps, n_train, name)
    ts, s = _euler.k_schedule(cfg, acp, n)
    s = np.concatenate([s, [0.0]]).astype(np.float32)
    weights = np.zeros((n, ORDER), np.float64)
    for i in range(n):
      order = min(i + 1, ORDER)
      # History slot ORDER - 1 holds the newest derivative.
      weights[i, ORDER - order :] = _lms_weights(s, i, order)[::-1]
    memory = _base.zeros_memory(shape, dtype, name, derivatives=ORDER)
    return _base.make_state(
      timesteps=np.asarray(ts, np.float32),
      sigmas=s,
      tables={"weights": weights},
      memory=memory,
      init_noise_sigma=_euler.init_noise_sigma(cfg, s),
    )

  def step(state, model_output, sample, key=None, *, noise=None):
    del key, noise
    i = state.step
    sigma = state.sigmas[i]
    x0 = _euler.k_x0(cfg["prediction_type"], sample, model_output, sigma)
    derivative = (sample - x0) / sigma
    hist = state.memory["derivatives"]
    hist = jnp.concatenate([hist[1:], derivative[None].astype(hist.dtype)])
    w = state.tables["weights"][i].reshape((ORDER,) + (1,) * sample.ndim)
    prev = sample + jnp.sum(w * hist, axis=0)
    return prev.astype(sample.dtype), state._replace(step=i + 1, memory={"derivatives": hist})

  return _base.Scheduler(name, cfg, init, step, _base.sigma_scale, False, acp)
