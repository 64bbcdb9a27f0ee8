"""Few-step distilled samplers on the alphā schedule: LCM (Luo et al. 2023) and TCD (Zheng et al. 2024)."""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np

from md_schedulers import _base

LCM_DEFAULTS: dict[str, Any] = {
  **_base.ALPHA_BAR_DEFAULTS,
  **_base.THRESHOLD_DEFAULTS,
  "beta_start": 0.00085,
  "beta_end": 0.012,
  "beta_schedule": "scaled_linear",
  "original_inference_steps": 50,
  "clip_sample": False,
  "set_alpha_to_one": True,
  "timestep_scaling": 10.0,
}
TCD_DEFAULTS: dict[str, Any] = dict(LCM_DEFAULTS)


def _skip_timesteps(origin: np.ndarray, n: int, name: str) -> np.ndarray:
  """`n` timesteps picked evenly (by index) from the descending distillation schedule `origin`."""
  if len(origin) // n < 1:
    raise ValueError(
      f"{name}: num_inference_steps={n} exceeds the {len(origin)} timesteps of the "
      "distillation schedule (original_inference_steps x strength)"
    )
  origin = origin[::-1].copy()
  idx = np.floor(np.linspace(0, len(origin), num=n, endpoint=False)).astype(np.int64)
  return origin[idx]


def _custom(timesteps, n_train: int, strength: float, name: str) -> np.ndarray:
  ts = np.asarray(timesteps, np.int64)
  if np.any(np.diff(ts) >= 0):
    raise ValueError(f"{name}: custom timesteps must descend, got {ts.tolist()}")
  if ts[0] >= n_train:
    raise ValueError(
      f"{name}: timesteps must start below num_train_timesteps={n_train}, got {ts[0]}"
    )
  keep = min(int(len(ts) * strength), len(ts))
  return ts[max(len(ts) - keep, 0) :]


def lcm(**config: Any) -> _base.Scheduler:
  """LCMScheduler: each step predicts the consistency-model output, then re-noises to the next timestep.

  `init(num_inference_steps=None, *, timesteps=None, original_inference_steps=None, strength=1.0)`.
  """
  name = "LCMScheduler"
  cfg = _base.merge_config(name, LCM_DEFAULTS, config)
  _base.check_choice(
    name, "prediction_type", cfg["prediction_type"], ("epsilon", "sample", "v_prediction")
  )
  acp = _base.train_alphas_cumprod(cfg)
  final = np.float32(1.0) if cfg["set_alpha_to_one"] else acp[0]
  n_train = int(cfg["num_train_timesteps"])

  def init(
    num_inference_steps=None,
    *,
    timesteps=None,
    original_inference_steps=None,
    strength=1.0,
    shape=None,
    dtype=jnp.float32,
  ):
    del shape, dtype
    orig = original_inference_steps or cfg["original_inference_steps"]
    if orig > n_train:
      raise ValueError(
        f"{name}: original_inference_steps={orig} exceeds num_train_timesteps={n_train}"
      )
    k = n_train // orig
    origin = np.asarray(list(range(1, int(orig * strength) + 1))) * k - 1
    if (num_inference_steps is None) == (timesteps is None):
      raise ValueError(f"{name}.init: pass exactly one of num_inference_steps or timesteps")
    if timesteps is not None:
      ts = _custom(timesteps, n_train, strength, name)
    else:
      n = _base.check_steps(num_inference_steps, n_train, name)
      if n > orig:
        raise ValueError(f"{name}: num_inference_steps={n} exceeds original_inference_steps={orig}")
      ts = _skip_timesteps(origin, n, name)
    return _make(ts)

  def _make(ts):
    one = np.float32(1)
    prev = np.concatenate([ts[1:], ts[-1:]])
    a_t = acp[ts]
    a_prev = np.where(prev >= 0, acp[np.clip(prev, 0, None)], final).astype(np.float32)
    scaled = ts.astype(np.float32) * np.float32(cfg["timestep_scaling"])
    sd2 = np.float32(0.25)
    last = np.arange(len(ts)) == len(ts) - 1
    tables = {
      "sqrt_a": a_t ** np.float32(0.5),
      "sqrt_b": (one - a_t) ** np.float32(0.5),
      "c_skip": sd2 / (scaled**2 + sd2),
      "c_out": scaled / (scaled**2 + sd2) ** np.float32(0.5),
      "sqrt_a_prev": np.where(last, 1, a_prev ** np.float32(0.5)),
      "noise_coef": np.where(last, 0, (one - a_prev) ** np.float32(0.5)),
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
    denoised = tb["c_out"] * x0 + tb["c_skip"] * sample
    eps = _base.draw_noise(key, noise, sample, name)
    prev = tb["sqrt_a_prev"] * denoised + tb["noise_coef"] * eps
    return prev.astype(sample.dtype), state._replace(step=i + 1)

  return _base.Scheduler(name, cfg, init, step, _base.identity_scale, True, acp)


def tcd(*, eta: float = 0.3, **config: Any) -> _base.Scheduler:
  """TCDScheduler (trajectory consistency distillation).

  Args:
    eta: the stochasticity `gamma` in [0, 1] (a step argument in the reference; 0.3 by default there).
    **config: the reference's options.
  """
  name = "TCDScheduler"
  cfg = _base.merge_config(name, TCD_DEFAULTS, config)
  _base.check_choice(
    name, "prediction_type", cfg["prediction_type"], ("epsilon", "sample", "v_prediction")
  )
  if not 0.0 <= eta <= 1.0:
    raise ValueError(f"{name}: eta must lie in [0, 1], got {eta}")
  acp = _base.train_alphas_cumprod(cfg)
  final = np.float32(1.0) if cfg["set_alpha_to_one"] else acp[0]
  n_train = int(cfg["num_train_timesteps"])
  stochastic = eta > 0

  def init(
    num_inference_steps=None,
    *,
    timesteps=None,
    original_inference_steps=None,
    strength=1.0,
    shape=None,
    dtype=jnp.float32,
  ):
    del shape, dtype
    orig = original_inference_steps or cfg["original_inference_steps"]
    if original_inference_steps is None:
      if orig > n_train:
        raise ValueError(
          f"{name}: original_inference_steps={orig} exceeds num_train_timesteps={n_train}"
        )
      origin = np.asarray(list(range(1, int(orig * strength) + 1))) * (n_train // orig) - 1
    else:
      # As the reference does: an explicit original_inference_steps samples the full training range.
      origin = np.asarray(list(range(0, int(n_train * strength))))
    if (num_inference_steps is None) == (timesteps is None):
      raise ValueError(f"{name}.init: pass exactly one of num_inference_steps or timesteps")
    if timesteps is not None:
      ts = _custom(timesteps, n_train, strength, name)
    else:
      n = _base.check_steps(num_inference_steps, n_train, name)
      if n > orig:
        raise ValueError(f"{name}: num_inference_steps={n} exceeds original_inference_steps={orig}")
      ts = _skip_timesteps(origin, n, name)
    one = np.float32(1)
    prev = np.concatenate([ts[1:], [0]])
    s = np.floor(np.float32(1 - eta) * prev.astype(np.float32)).astype(np.int64)
    a_t, a_s = acp[ts], acp[s]
    a_prev = np.where(prev >= 0, acp[np.clip(prev, 0, None)], final).astype(np.float32)
    last = np.arange(len(ts)) == len(ts) - 1
    ratio = a_prev / a_s
    renoise = stochastic & ~last
    tables = {
      "sqrt_a": a_t ** np.float32(0.5),
      "sqrt_b": (one - a_t) ** np.float32(0.5),
      "sqrt_a_s": a_s ** np.float32(0.5),
      "sqrt_b_s": (one - a_s) ** np.float32(0.5),
      "keep": np.where(renoise, ratio ** np.float32(0.5), 1),
      "noise_coef": np.where(renoise, np.maximum(one - ratio, 0) ** np.float32(0.5), 0),
    }
    sig = np.concatenate([_base.train_sigmas(acp)[ts], np.zeros(1, np.float32)])
    return _base.make_state(timesteps=ts, sigmas=sig, tables=tables)

  def step(state, model_output, sample, key=None, *, noise=None):
    i = state.step
    tb = {k: v[i] for k, v in state.tables.items()}
    x0, eps = _base.split_prediction(
      cfg["prediction_type"], sample, model_output, tb["sqrt_a"], tb["sqrt_b"]
    )
    noised = tb["sqrt_a_s"] * x0 + tb["sqrt_b_s"] * eps
    prev = tb["keep"] * noised
    if stochastic:
      prev = prev + tb["noise_coef"] * _base.draw_noise(key, noise, sample, name)
    return prev.astype(sample.dtype), state._replace(step=i + 1)

  return _base.Scheduler(name, cfg, init, step, _base.identity_scale, stochastic, acp)
