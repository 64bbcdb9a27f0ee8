"""DPM-Solver / DPM-Solver++ multistep (Lu et al. 2022), ODE and SDE variants, orders 1-3.

Every update is linear in the current sample, the stored converted model outputs and the fresh noise, so
`init` folds the solver's formulas (including the lower-order warm-up and final steps) into one row of
weights per step, computed in float64 on the host; `step` is a weighted sum of fixed-size buffers.
"""

from __future__ import annotations

import math
from typing import Any

import jax.numpy as jnp
import numpy as np

from md_schedulers import _base

DPM_DEFAULTS: dict[str, Any] = {
  "num_train_timesteps": 1000,
  "beta_start": 0.0001,
  "beta_end": 0.02,
  "beta_schedule": "linear",
  "trained_betas": None,
  "solver_order": 2,
  "prediction_type": "epsilon",
  "thresholding": False,
  "dynamic_thresholding_ratio": 0.995,
  "sample_max_value": 1.0,
  "algorithm_type": "dpmsolver++",
  "solver_type": "midpoint",
  "lower_order_final": True,
  "euler_at_final": False,
  "use_karras_sigmas": False,
  "use_exponential_sigmas": False,
  "use_beta_sigmas": False,
  "use_lu_lambdas": False,
  "use_flow_sigmas": False,
  "flow_shift": 1.0,
  "final_sigmas_type": "zero",
  "lambda_min_clipped": -float("inf"),
  "variance_type": None,
  "timestep_spacing": "linspace",
  "steps_offset": 0,
  "rescale_betas_zero_snr": False,
  "use_dynamic_shifting": False,
  "time_shift_type": "exponential",
}

_ALGORITHMS = ("dpmsolver", "dpmsolver++", "sde-dpmsolver", "sde-dpmsolver++")


def alpha_sigma(sigmas: np.ndarray, flow: bool) -> tuple[np.ndarray, np.ndarray]:
  """(alpha_t, sigma_t) of each noise level: 1 - s and s on a flow path, else VP scaling, float64."""
  s = np.asarray(sigmas, np.float64)
  if flow:
    return 1 - s, s
  alpha = 1 / (s**2 + 1) ** 0.5
  return alpha, s * alpha


def log_snr(alpha: np.ndarray, sigma: np.ndarray) -> np.ndarray:
  """lambda = log(alpha) - log(sigma); +inf where sigma is 0."""
  with np.errstate(divide="ignore"):
    return np.log(alpha) - np.log(sigma)


def _lambda_t_f32(acp: np.ndarray) -> np.ndarray:
  a = np.sqrt(acp)
  s = np.sqrt(np.float32(1) - acp)
  with np.errstate(divide="ignore"):
    return np.log(a) - np.log(s)


def dpm_schedule(
  cfg: dict[str, Any], acp: np.ndarray, n: int, *, timesteps=None, flow_shift: float
) -> tuple[np.ndarray, np.ndarray]:
  """DPMSolverMultistep's (timesteps [n'] int64, sigmas [n' + 1] float32)."""
  n_train = int(cfg["num_train_timesteps"])
  if timesteps is not None:
    ts = np.asarray(timesteps).astype(np.int64)
  else:
    lam = _lambda_t_f32(acp)
    clipped = int(np.searchsorted(lam[::-1], cfg["lambda_min_clipped"]))
    last = n_train - clipped
    spacing = cfg["timestep_spacing"]
    if spacing == "linspace":
      ts = np.linspace(0, last - 1, n + 1).round()[::-1][:-1].copy().astype(np.int64)
    elif spacing == "leading":
      ratio = last // (n + 1)
      ts = (np.arange(0, n + 1) * ratio).round()[::-1][:-1].copy().astype(np.int64)
      ts += cfg["steps_offset"]
    elif spacing == "trailing":
      ts = np.arange(last, 0, -n_train / n).round().copy().astype(np.int64)
      ts -= 1
    else:
      raise ValueError(
        f"timestep_spacing={spacing!r} is not supported; expected 'linspace', 'leading' "
        "or 'trailing'"
      )
  train = _base.train_sigmas(acp)
  log_train = np.log(train)
  rounded = cfg["beta_schedule"] != "squaredcos_cap_v2"
  if cfg["use_karras_sigmas"]:
    s = _base.karras_sigmas(*_range(cfg, train[::-1]), n)
    ts = _base.sigma_to_t(s, log_train)
    ts = ts.round() if rounded else ts
  elif cfg["use_lu_lambdas"]:
    lam = log_train[::-1].copy()
    lam = lam[0] + np.linspace(0, 1, n) * (lam[-1] - lam[0])
    s = np.exp(lam)
    ts = _base.sigma_to_t(s, log_train)
    ts = ts.round() if rounded else ts
  elif cfg["use_exponential_sigmas"]:
    s = _base.exponential_sigmas(*_range(cfg, train[::-1]), n)
    ts = _base.sigma_to_t(s, log_train)
  elif cfg["use_beta_sigmas"]:
    s = _base.beta_sigmas(*_range(cfg, train[::-1]), n)
    ts = _base.sigma_to_t(s, log_train)
  elif cfg["use_flow_sigmas"]:
    alphas = np.linspace(1, 1 / n_train, n + 1)
    s = 1.0 - alphas
    s = np.flip(flow_shift * s / (1 + (flow_shift - 1) * s))[:-1].copy()
    ts = (s * n_train).copy()
  else:
    s = np.interp(ts, np.arange(0, len(train)), train)
  last_sigma = train[0] if cfg["final_sigmas_type"] == "sigma_min" else 0.0
  s = np.concatenate([s, [last_sigma]]).astype(np.float32)
  return np.asarray(ts).astype(np.int64), s


def _range(cfg, descending):
  lo = cfg.get("sigma_min")
  hi = cfg.get("sigma_max")
  return (float(descending[-1]) if lo is None else lo, float(descending[0]) if hi is None else hi)


def dpm_multistep_weights(cfg: dict[str, Any], sigmas: np.ndarray) -> np.ndarray:
  """[n, 2 + K] weights of (sample, stored outputs oldest → newest, noise) for each step."""
  n = len(sigmas) - 1
  k = int(cfg["solver_order"])
  algo, solver = cfg["algorithm_type"], cfg["solver_type"]
  alpha, sig = alpha_sigma(sigmas, cfg["use_flow_sigmas"])
  lam = log_snr(alpha, sig)
  width = 2 + k
  x = np.eye(width)[0]
  m = [np.eye(width)[1 + k - 1 - j] for j in range(k)]  # m[0] newest
  noise = np.eye(width)[-1]
  rows = np.zeros((n, width))
  with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
    for i in range(n):
      final = i == n - 1 and (
        cfg["euler_at_final"]
        or (cfg["lower_order_final"] and n < 15)
        or cfg["final_sigmas_type"] == "zero"
      )
      second = i == n - 2 and cfg["lower_order_final"] and n < 15
      warm = min(i, k)
      if k == 1 or warm < 1 or final:
        order = 1
      elif k == 2 or warm < 2 or second:
        order = 2
      else:
        order = 3
      at, st, lt = alpha[i + 1], sig[i + 1], lam[i + 1]
      as0, ss0, l0 = alpha[i], sig[i], lam[i]
      h = lt - l0
      if order == 1:
        d0 = m[0]
        d1 = d2 = 0 * x
      elif order == 2:
        r0 = (l0 - lam[i - 1]) / h
        d0, d1, d2 = m[0], (1.0 / r0) * (m[0] - m[1]), 0 * x
      else:
        r0, r1 = (l0 - lam[i - 1]) / h, (lam[i - 1] - lam[i - 2]) / h
        d10, d11 = (1.0 / r0) * (m[0] - m[1]), (1.0 / r1) * (m[1] - m[2])
        d0 = m[0]
        d1 = d10 + (r0 / (r0 + r1)) * (d10 - d11)
        d2 = (1.0 / (r0 + r1)) * (d10 - d11)
      rows[i] = _update(algo, solver, order, x, noise, d0, d1, d2, at, st, as0, ss0, h)
  return rows


def _update(algo, solver, order, x, noise, d0, d1, d2, at, st, as0, ss0, h):
  """One DPM-Solver update from level s0 to t as a weight vector.

  `x`, `noise` and the differences `d0`/`d1`/`d2` are vectors over the step's inputs (basis vectors and
  their combinations), so the result holds each input's weight. `at`/`st` and `as0`/`ss0` are alpha and
  sigma at t and s0, `h` the log-SNR step (infinite when t is the final sigma 0).
  """
  em, ep = math.exp(-h), (math.exp(h) if h < 700 else math.inf)
  if algo == "dpmsolver++":
    out = (st / ss0) * x - (at * (em - 1.0)) * d0
    if order == 2:
      out = (
        out - (0.5 * at * (em - 1.0)) * d1
        if solver == "midpoint"
        else out + (at * ((em - 1.0) / h + 1.0)) * d1
      )
    elif order == 3:
      out = out + (at * ((em - 1.0) / h + 1.0)) * d1 - (at * ((em - 1.0 + h) / h**2 - 0.5)) * d2
    return out
  if algo == "dpmsolver":
    out = (at / as0) * x - (st * (ep - 1.0)) * d0
    if order == 2:
      out = (
        out - (0.5 * st * (ep - 1.0)) * d1
        if solver == "midpoint"
        else out - (st * ((ep - 1.0) / h - 1.0)) * d1
      )
    elif order == 3:
      out = out - (st * ((ep - 1.0) / h - 1.0)) * d1 - (st * ((ep - 1.0 - h) / h**2 - 0.5)) * d2
    return out
  e2 = math.exp(-2.0 * h)
  if algo == "sde-dpmsolver++":
    out = (st / ss0 * em) * x + (at * (1 - e2)) * d0 + (st * math.sqrt(1.0 - e2)) * noise
    if order == 2:
      out = (
        out + (0.5 * at * (1 - e2)) * d1
        if solver == "midpoint"
        else out + (at * ((1.0 - e2) / (-2.0 * h) + 1.0)) * d1
      )
    elif order == 3:
      out = (
        out
        + (at * ((1.0 - e2) / (-2.0 * h) + 1.0)) * d1
        + (at * ((1.0 - e2 - 2.0 * h) / (2.0 * h) ** 2 - 0.5)) * d2
      )
    return out
  # sde-dpmsolver
  out = (
    (at / as0) * x - (2.0 * st * (ep - 1.0)) * d0 + (st * math.sqrt(math.exp(2 * h) - 1.0)) * noise
  )
  if order == 2:
    out = (
      out - (st * (ep - 1.0)) * d1
      if solver == "midpoint"
      else out - (2.0 * st * ((ep - 1.0) / h - 1.0)) * d1
    )
  elif order == 3:
    raise ValueError("sde-dpmsolver has no third-order update; use solver_order <= 2")
  return out


def dpm_solver_multistep(**config: Any) -> _base.Scheduler:
  """DPMSolverMultistepScheduler.

  Args:
    **config: the reference's options: `solver_order` 1-3, `algorithm_type` (`dpmsolver++`,
      `sde-dpmsolver++`, `dpmsolver`, `sde-dpmsolver`), `solver_type`, `use_karras_sigmas`,
      `use_lu_lambdas`, `use_flow_sigmas` + `flow_shift`, `final_sigmas_type`, `lower_order_final`,
      `euler_at_final`, `thresholding`, `timestep_spacing`, `lambda_min_clipped`, ...

  Returns:
    A Scheduler; `init(num_inference_steps=None, *, timesteps=None, mu=None, shape=...)`; the sample
    shape is required (the solver keeps its last outputs).
  """
  name = "DPMSolverMultistepScheduler"
  cfg = _base.merge_config(name, DPM_DEFAULTS, config)
  return _build(name, cfg, dpm_schedule, dpm_multistep_weights)


def _validate(name: str, cfg: dict[str, Any]) -> None:
  if cfg["algorithm_type"] == "deis":
    cfg["algorithm_type"] = "dpmsolver++"
  if cfg["solver_type"] in ("logrho", "bh1", "bh2"):
    cfg["solver_type"] = "midpoint"
  _base.check_choice(name, "algorithm_type", cfg["algorithm_type"], _ALGORITHMS)
  _base.check_choice(name, "solver_type", cfg["solver_type"], ("midpoint", "heun"))
  _base.check_choice(name, "solver_order", cfg["solver_order"], (1, 2, 3))
  _base.check_choice(
    name,
    "prediction_type",
    cfg["prediction_type"],
    ("epsilon", "sample", "v_prediction", "flow_prediction"),
  )
  _base.check_choice(name, "final_sigmas_type", cfg["final_sigmas_type"], ("zero", "sigma_min"))
  if cfg["variance_type"] is not None:
    raise ValueError(
      f"{name}: variance_type={cfg['variance_type']!r} (learned variance) is not supported"
    )
  if cfg["algorithm_type"] in ("dpmsolver", "sde-dpmsolver") and cfg["final_sigmas_type"] == "zero":
    raise ValueError(
      f"{name}: final_sigmas_type='zero' needs algorithm_type dpmsolver++ or "
      "sde-dpmsolver++; use final_sigmas_type='sigma_min'"
    )
  if cfg["prediction_type"] == "flow_prediction" and cfg["algorithm_type"] in (
    "dpmsolver",
    "sde-dpmsolver",
  ):
    raise ValueError(f"{name}: flow_prediction needs algorithm_type dpmsolver++ or sde-dpmsolver++")
  _base.convert_sigmas(cfg, np.ones(2), 2)


def _build(name, cfg, schedule_fn, weights_fn) -> _base.Scheduler:
  _validate(name, cfg)
  acp = _base.train_alphas_cumprod(cfg, zero_snr_floor=True)
  n_train = int(cfg["num_train_timesteps"])
  k = int(cfg["solver_order"])
  flow = bool(cfg["use_flow_sigmas"])
  predicts_x0 = cfg["algorithm_type"] in ("dpmsolver++", "sde-dpmsolver++")
  stochastic = cfg["algorithm_type"].startswith("sde-")

  def init(num_inference_steps=None, *, timesteps=None, mu=None, shape=None, dtype=jnp.float32):
    flow_shift = cfg["flow_shift"]
    if mu is not None:
      if not (cfg["use_dynamic_shifting"] and cfg["time_shift_type"] == "exponential"):
        raise ValueError(
          f"{name}: mu needs use_dynamic_shifting=True and time_shift_type='exponential'"
        )
      flow_shift = float(np.exp(mu))
    if (num_inference_steps is None) == (timesteps is None):
      raise ValueError(f"{name}.init: pass exactly one of num_inference_steps or timesteps")
    if timesteps is not None and any(
      cfg[o]
      for o in ("use_karras_sigmas", "use_lu_lambdas", "use_exponential_sigmas", "use_beta_sigmas")
    ):
      raise ValueError(f"{name}: custom timesteps cannot be combined with converted sigmas")
    n = _base.check_steps(num_inference_steps or len(timesteps), n_train, name)
    ts, s = schedule_fn(cfg, acp, n, timesteps=timesteps, flow_shift=flow_shift)
    alpha, sig = alpha_sigma(s, flow)
    tables = {
      "weights": weights_fn(cfg, s),
      "alpha": alpha[:-1],
      "sigma_t": sig[:-1],
      "sigma": s[:-1],
    }
    memory = _base.zeros_memory(shape, dtype, name, outputs=k)
    return _base.make_state(timesteps=ts, sigmas=s, tables=tables, memory=memory)

  def convert(tb, model_output, sample):
    pred = cfg["prediction_type"]
    a, s = tb["alpha"], tb["sigma_t"]
    if predicts_x0:
      if pred == "epsilon":
        x0 = (sample - s * model_output) / a
      elif pred == "sample":
        x0 = model_output
      elif pred == "v_prediction":
        x0 = a * sample - s * model_output
      else:
        x0 = sample - tb["sigma"] * model_output
      if cfg["thresholding"]:
        x0 = _base.threshold(x0, cfg["dynamic_thresholding_ratio"], cfg["sample_max_value"])
      return x0
    if pred == "epsilon":
      eps = model_output
    elif pred == "sample":
      eps = (sample - a * model_output) / s
    else:
      eps = a * model_output + s * sample
    if cfg["thresholding"]:
      x0 = _base.threshold(
        (sample - s * eps) / a, cfg["dynamic_thresholding_ratio"], cfg["sample_max_value"]
      )
      eps = (sample - a * x0) / s
    return eps

  def step(state, model_output, sample, key=None, *, noise=None):
    i = state.step
    tb = {k_: v[i] for k_, v in state.tables.items()}
    converted = convert(tb, model_output, sample)
    hist = state.memory["outputs"]
    hist = jnp.concatenate([hist[1:], converted[None].astype(hist.dtype)])
    w = tb["weights"]
    x = sample.astype(jnp.float32)
    prev = w[0] * x + jnp.tensordot(w[1 : 1 + k], hist.astype(jnp.float32), axes=1)
    if stochastic:
      prev = prev + w[-1] * _base.draw_noise(key, noise, x, name)
    return prev.astype(sample.dtype), state._replace(step=i + 1, memory={"outputs": hist})

  return _base.Scheduler(name, cfg, init, step, _base.identity_scale, stochastic, acp)
