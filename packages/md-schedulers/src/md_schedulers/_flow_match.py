"""Rectified-flow schedulers: flow-match Euler (SD3, Flux, Flux.2, LTX, Wan-style shifts) and Heun.

The sample moves along x_sigma = (1 - sigma) x0 + sigma noise; the model predicts the velocity
noise - x0, so an Euler step is x + (sigma_next - sigma) v.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from md_schedulers import _base

FLOW_MATCH_EULER_DEFAULTS: dict[str, Any] = {
  "num_train_timesteps": 1000,
  "shift": 1.0,
  "use_dynamic_shifting": False,
  "base_shift": 0.5,
  "max_shift": 1.15,
  "base_image_seq_len": 256,
  "max_image_seq_len": 4096,
  "invert_sigmas": False,
  "shift_terminal": None,
  "use_karras_sigmas": False,
  "use_exponential_sigmas": False,
  "use_beta_sigmas": False,
  "time_shift_type": "exponential",
  "stochastic_sampling": False,
}

FLOW_MATCH_HEUN_DEFAULTS: dict[str, Any] = {"num_train_timesteps": 1000, "shift": 1.0}


def _train_flow_sigmas(n_train: int, shift: float, dynamic: bool) -> np.ndarray:
  """The training-time flow sigmas (float32, descending), shifted unless shifting is dynamic."""
  t = np.linspace(1, n_train, n_train, dtype=np.float32)[::-1].copy()
  s = t / np.float32(n_train)
  if not dynamic:
    s = (np.float32(shift) * s / (1 + (np.float32(shift) - 1) * s)).astype(np.float32)
  return s


def flow_sigmas(
  cfg: dict[str, Any],
  num_inference_steps: int | None = None,
  *,
  sigmas: Any = None,
  timesteps: Any = None,
  mu: float | None = None,
) -> tuple[np.ndarray, np.ndarray]:
  """Flow-match Euler's schedule: (timesteps [n] float32, sigmas [n + 1] float32).

  Args:
    cfg: a resolved flow-match Euler config.
    num_inference_steps: number of steps (may be omitted when `sigmas` or `timesteps` are given).
    sigmas: custom descending sigmas (before shifting), e.g. Flux's linspace(1, 1/n, n).
    timesteps: custom timesteps fed to the model as given.
    mu: the dynamic shift (log of the shift), required with `use_dynamic_shifting`.
  """
  name = "FlowMatchEulerDiscreteScheduler"
  n_train = int(cfg["num_train_timesteps"])
  if cfg["use_dynamic_shifting"] and mu is None:
    raise ValueError(f"{name}: use_dynamic_shifting=True needs init(..., mu=...)")
  if sigmas is not None and timesteps is not None and len(sigmas) != len(timesteps):
    raise ValueError(
      f"{name}: sigmas ({len(sigmas)}) and timesteps ({len(timesteps)}) differ in length"
    )
  if num_inference_steps is not None:
    for given, what in ((sigmas, "sigmas"), (timesteps, "timesteps")):
      if given is not None and len(given) != num_inference_steps:
        raise ValueError(
          f"{name}: {len(given)} {what} given for num_inference_steps={num_inference_steps}"
        )
  elif sigmas is None and timesteps is None:
    raise ValueError(f"{name}.init needs num_inference_steps, sigmas or timesteps")
  else:
    num_inference_steps = len(sigmas) if sigmas is not None else len(timesteps)
  train = _train_flow_sigmas(n_train, cfg["shift"], cfg["use_dynamic_shifting"])
  sigma_max, sigma_min = float(train[0]), float(train[-1])
  custom_t = None if timesteps is None else np.asarray(timesteps).astype(np.float32)
  if sigmas is None:
    ts = custom_t
    if ts is None:
      ts = np.linspace(sigma_max * n_train, sigma_min * n_train, num_inference_steps)
    s = ts / n_train
  else:
    s = np.asarray(sigmas).astype(np.float32)
    num_inference_steps = len(s)
  if cfg["use_dynamic_shifting"]:
    s = _base.time_shift(cfg["time_shift_type"], mu, s)
  else:
    shift = cfg["shift"]
    s = shift * s / (1 + (shift - 1) * s)
  if cfg["shift_terminal"]:
    s = _base.stretch_to_terminal(s, cfg["shift_terminal"])
  s, _ = _base.convert_sigmas(cfg, s, num_inference_steps)
  s = np.asarray(s).astype(np.float32)
  ts = custom_t if custom_t is not None else (s * np.float32(n_train)).astype(np.float32)
  if cfg["invert_sigmas"]:
    s = (np.float32(1.0) - s).astype(np.float32)
    ts = (s * np.float32(n_train)).astype(np.float32)
    s = np.concatenate([s, np.ones(1, np.float32)])
  else:
    s = np.concatenate([s, np.zeros(1, np.float32)])
  return ts, s


def calculate_shift(
  image_seq_len: int,
  base_seq_len: int = 256,
  max_seq_len: int = 4096,
  base_shift: float = 0.5,
  max_shift: float = 1.15,
) -> float:
  """The dynamic shift `mu` for a token count: linear from (base_seq_len, base_shift) to the max point.

  Flux uses the defaults; LTX-Video and LTX-2 use (1024, 4096, 0.95, 2.05) from their configs.
  """
  m = (max_shift - base_shift) / (max_seq_len - base_seq_len)
  b = base_shift - m * base_seq_len
  return image_seq_len * m + b


def flux2_empirical_mu(image_seq_len: int, num_steps: int) -> float:
  """Flux.2's `mu` for a token count and step count (a fit published with the model)."""
  a1, b1 = 8.73809524e-05, 1.89833333
  a2, b2 = 0.00016927, 0.45666666
  if image_seq_len > 4300:
    return float(a2 * image_seq_len + b2)
  m_200 = a2 * image_seq_len + b2
  m_10 = a1 * image_seq_len + b1
  a = (m_200 - m_10) / 190.0
  return float(a * num_steps + (m_200 - 200.0 * a))


def flow_match_euler(**config: Any) -> _base.Scheduler:
  """Euler steps along a rectified-flow path (FlowMatchEulerDiscreteScheduler).

  Args:
    **config: the reference's options: `shift`, `use_dynamic_shifting` (then `init` takes `mu`),
      `shift_terminal`, `invert_sigmas`, `time_shift_type`, `use_karras_sigmas`/`use_exponential_sigmas`/
      `use_beta_sigmas`, `stochastic_sampling`, the `*_shift`/`*_image_seq_len` that pipelines read to
      compute `mu`.

  Returns:
    A Scheduler; `init(num_inference_steps=None, *, sigmas=None, timesteps=None, mu=None)`.
  """
  name = "FlowMatchEulerDiscreteScheduler"
  cfg = _base.merge_config(name, FLOW_MATCH_EULER_DEFAULTS, config)
  _base.check_choice(name, "time_shift_type", cfg["time_shift_type"], ("exponential", "linear"))
  _base.convert_sigmas(cfg, np.ones(2), 2)  # validates that at most one conversion is set
  stochastic = bool(cfg["stochastic_sampling"])

  def init(
    num_inference_steps=None, *, sigmas=None, timesteps=None, mu=None, shape=None, dtype=jnp.float32
  ):
    del shape, dtype
    ts, s = flow_sigmas(cfg, num_inference_steps, sigmas=sigmas, timesteps=timesteps, mu=mu)
    return _base.make_state(timesteps=ts, sigmas=s)

  def step(state, model_output, sample, key=None, *, noise=None):
    i = state.step
    sigma, sigma_next = state.sigmas[i], state.sigmas[i + 1]
    dtype = sample.dtype
    sample = sample.astype(jnp.float32)
    if stochastic:
      eps = _base.draw_noise(key, noise, sample, name)
      x0 = sample - sigma * model_output
      prev = (1.0 - sigma_next) * x0 + sigma_next * eps
    else:
      prev = sample + (sigma_next - sigma) * model_output
    return prev.astype(dtype), state._replace(step=i + 1)

  return _base.Scheduler(name, cfg, init, step, _base.identity_scale, stochastic, None)


def flow_match_heun(**config: Any) -> _base.Scheduler:
  """Heun's method along a rectified-flow path (FlowMatchHeunDiscreteScheduler): two calls a step.

  The state's `timesteps` hold 2n - 1 entries (every step but the first is evaluated twice).
  """
  name = "FlowMatchHeunDiscreteScheduler"
  cfg = _base.merge_config(name, FLOW_MATCH_HEUN_DEFAULTS, config)

  def init(num_inference_steps=None, *, shape=None, dtype=jnp.float32):
    n_train = int(cfg["num_train_timesteps"])
    n = _base.check_steps(num_inference_steps, n_train, name)
    train = _train_flow_sigmas(n_train, cfg["shift"], False)
    sigma_max, sigma_min = float(train[0]), float(train[-1])
    ts = np.linspace(sigma_max * n_train, sigma_min * n_train, n)
    s = ts / n_train
    shift = cfg["shift"]
    s = (shift * s / (1 + (shift - 1) * s)).astype(np.float32)
    ts = (s * np.float32(n_train)).astype(np.float32)
    ts = np.concatenate([ts[:1], np.repeat(ts[1:], 2)])
    s = np.concatenate([s, np.zeros(1, np.float32)])
    s = np.concatenate([s[:1], np.repeat(s[1:-1], 2), s[-1:]])
    memory = _base.zeros_memory(shape, dtype, name, derivative=0, sample=0)
    return _base.make_state(timesteps=ts, sigmas=s, memory=memory)

  def step(state, model_output, sample, key=None, *, noise=None):
    del key, noise
    i = state.step
    dtype = sample.dtype
    sample = sample.astype(jnp.float32)
    # Even calls predict (Euler to the next sigma); odd calls correct with the averaged slope.
    first = i % 2 == 0

    def predictor(_):
      sigma, sigma_next = state.sigmas[i], state.sigmas[i + 1]
      derivative = (sample - (sample - model_output * sigma)) / sigma
      prev = sample + derivative * (sigma_next - sigma)
      return prev, derivative, sample

    def corrector(_):
      sigma, sigma_next = state.sigmas[i - 1], state.sigmas[i]
      derivative = (sample - (sample - model_output * sigma_next)) / sigma_next
      derivative = 0.5 * (state.memory["derivative"] + derivative)
      prev = state.memory["sample"] + derivative * (sigma_next - sigma)
      return prev, state.memory["derivative"], state.memory["sample"]

    prev, d, x = jax.lax.cond(first, predictor, corrector, None)
    memory = {
      "derivative": d.astype(state.memory["derivative"].dtype),
      "sample": x.astype(state.memory["sample"].dtype),
    }
    return prev.astype(dtype), state._replace(step=i + 1, memory=memory)

  return _base.Scheduler(name, cfg, init, step, _base.identity_scale, False, None)
