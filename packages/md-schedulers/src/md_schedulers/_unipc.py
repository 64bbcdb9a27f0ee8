"""UniPC multistep (Zhao et al. 2023): a predictor and a corrector that reuse the same model calls.

Wan 2.1 / 2.2 sample with it on flow sigmas (`use_flow_sigmas=True`, `prediction_type="flow_prediction"`,
`flow_shift` 3-5). Like DPM-Solver, each update is linear in buffers the state carries (the sample before the
corrector, the last converted outputs), so `init` folds predictor and corrector into per-step weights.
"""

from __future__ import annotations

import math
from typing import Any

import jax.numpy as jnp
import numpy as np

from md_schedulers import _base, _dpm

UNIPC_DEFAULTS: dict[str, Any] = {
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
  "predict_x0": True,
  "solver_type": "bh2",
  "lower_order_final": True,
  "disable_corrector": [],
  "solver_p": None,
  "use_karras_sigmas": False,
  "use_exponential_sigmas": False,
  "use_beta_sigmas": False,
  "use_flow_sigmas": False,
  "flow_shift": 1.0,
  "timestep_spacing": "linspace",
  "steps_offset": 0,
  "final_sigmas_type": "zero",
  "rescale_betas_zero_snr": False,
  "use_dynamic_shifting": False,
  "time_shift_type": "exponential",
  "sigma_min": None,
  "sigma_max": None,
  "shift_terminal": None,
}


def unipc_schedule(
  cfg: dict[str, Any], acp: np.ndarray, n: int, *, sigmas=None, mu=None
) -> tuple[np.ndarray, np.ndarray]:
  """UniPCMultistep's (timesteps [n] int64, sigmas [n + 1] float32)."""
  n_train = int(cfg["num_train_timesteps"])
  ts = _base.spaced_timesteps(cfg["timestep_spacing"], n_train, n, cfg["steps_offset"], extra=True)
  flow = cfg["use_flow_sigmas"]
  train = _base.train_sigmas(acp)
  last_kind = cfg["final_sigmas_type"]
  chosen = [k for k in ("use_karras_sigmas", "use_exponential_sigmas", "use_beta_sigmas") if cfg[k]]
  if chosen:
    s = train if sigmas is None else np.asarray(sigmas)
    log_s = np.log(s)
    s = np.flip(s).copy()
    lo = float(s[-1]) if cfg["sigma_min"] is None else cfg["sigma_min"]
    hi = float(s[0]) if cfg["sigma_max"] is None else cfg["sigma_max"]
    if chosen[0] == "use_karras_sigmas":
      s = _base.karras_sigmas(lo, hi, n)
      if flow:
        s = s / (s + 1)
        ts = (s * n_train).copy()
      else:
        ts = _base.sigma_to_t(s, log_s).round()
    else:
      fn = _base.exponential_sigmas if chosen[0] == "use_exponential_sigmas" else _base.beta_sigmas
      s = fn(lo, hi, n)
      ts = _base.sigma_to_t(s, log_s)
    last = s[-1] if last_kind == "sigma_min" else 0
  elif flow:
    s = (
      np.linspace(1, 1 / n_train, n + 1)[:-1] if sigmas is None else np.asarray(sigmas, np.float64)
    )
    if cfg["use_dynamic_shifting"]:
      s = _base.time_shift(cfg["time_shift_type"], mu, s)
    else:
      shift = cfg["flow_shift"]
      s = shift * s / (1 + (shift - 1) * s)
    if cfg["shift_terminal"]:
      s = _base.stretch_to_terminal(s, cfg["shift_terminal"])
    s = np.array(s)
    # A first sigma of exactly 1 would make alpha = 0 and the log-SNR infinite.
    if abs(s[0] - 1) < 1e-6:
      s[0] -= 1e-6
    ts = (s * n_train).copy()
    last = s[-1] if last_kind == "sigma_min" else 0
  else:
    s = train if sigmas is None else np.asarray(sigmas)
    s = np.interp(ts, np.arange(0, len(s)), s)
    last = train[0] if last_kind == "sigma_min" else 0
  s = np.concatenate([s, [last]]).astype(np.float32)
  return np.asarray(ts).astype(np.int64), s


def _rhos(rks: list[float], hh: float, b_h: float, order: int, full: bool) -> np.ndarray:
  """Solves the UniPC order conditions: `full` for the corrector (order unknowns), else the predictor."""
  with np.errstate(divide="ignore", invalid="ignore"):
    h_phi_k = math.expm1(hh) / hh - 1 if math.isfinite(hh) else -1.0
  r = np.asarray(rks + [1.0])
  rows, b = [], []
  fact = 1
  for j in range(1, order + 1):
    rows.append(r ** (j - 1))
    b.append(h_phi_k * fact / b_h)
    fact *= j + 1
    h_phi_k = (h_phi_k / hh if math.isfinite(hh) else 0.0) - 1 / fact
  big_r, b = np.stack(rows), np.asarray(b)
  if full:
    return np.array([0.5]) if order == 1 else np.linalg.solve(big_r, b)
  if order == 2:
    return np.array([0.5])
  return np.linalg.solve(big_r[:-1, :-1], b[:-1])


def unipc_weights(cfg: dict[str, Any], sigmas: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """Per-step weights: corrector [n, 3 + K] over (sample, last sample, outputs oldest → newest, new
  output) and predictor [n, 1 + K] over (corrected sample, outputs oldest → newest after the append)."""
  n = len(sigmas) - 1
  k = int(cfg["solver_order"])
  x0_mode = cfg["predict_x0"]
  alpha, sig = _dpm.alpha_sigma(sigmas, cfg["use_flow_sigmas"])
  lam = _dpm.log_snr(alpha, sig)
  disabled = set(cfg["disable_corrector"] or [])

  def orders(i):
    this = min(k, n - i) if cfg["lower_order_final"] else k
    return min(this, min(i, k) + 1)

  def update(t, s0, m0, ms, sis, order, x, extra, full):
    """The UniPC update from level s0 to t as a weight vector (numpy basis vectors in, vector out)."""
    h = lam[t] - lam[s0]
    hh = -h if x0_mode else h
    h_phi_1 = math.expm1(hh) if hh < 700 else math.inf
    b_h = hh if cfg["solver_type"] == "bh1" else h_phi_1
    with np.errstate(divide="ignore", invalid="ignore"):
      rks = [(lam[si] - lam[s0]) / h for si in sis]
    d1s = [(mi - m0) * (1.0 / rk) for mi, rk in zip(ms, rks)]
    scale, out_scale = (sig[t] / sig[s0], alpha[t]) if x0_mode else (alpha[t] / alpha[s0], sig[t])
    out = scale * x - (out_scale * h_phi_1) * m0
    if full:
      rhos = _rhos(rks, hh, b_h, order, True)
      res = sum((rho * d for rho, d in zip(rhos[:-1], d1s)), 0 * x) + rhos[-1] * (extra - m0)
      return out - (out_scale * b_h) * res
    if order == 1:
      return out
    rhos = _rhos(rks, hh, b_h, order, False)
    res = sum((rho * d for rho, d in zip(rhos, d1s)), 0 * x)
    return out - (out_scale * b_h) * res

  cw = np.zeros((n, 3 + k))
  pw = np.zeros((n, 1 + k))
  with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
    for i in range(n):
      if i > 0 and (i - 1) not in disabled:
        e = np.eye(3 + k)
        x_last, hist, new = e[1], [e[2 + j] for j in range(k)], e[2 + k]
        order = orders(i - 1)
        ms = [hist[k - 1 - j] for j in range(1, order)]
        sis = [i - 1 - j for j in range(1, order)]
        cw[i] = update(i, i - 1, hist[k - 1], ms, sis, order, x_last, new, True)
      else:
        cw[i, 0] = 1.0
      e = np.eye(1 + k)
      x, hist = e[0], [e[1 + j] for j in range(k)]
      order = orders(i)
      ms = [hist[k - 1 - j] for j in range(1, order)]
      sis = [i - j for j in range(1, order)]
      pw[i] = update(i + 1, i, hist[k - 1], ms, sis, order, x, None, False)
  return cw, pw


def unipc_multistep(**config: Any) -> _base.Scheduler:
  """UniPCMultistepScheduler (bh1/bh2, orders 1-3, x0 or noise prediction, flow sigmas).

  Returns:
    A Scheduler; `init(num_inference_steps=None, *, sigmas=None, mu=None, shape=...)` (the sample shape
    is required: the solver keeps its last outputs and the sample before the corrector).
  """
  name = "UniPCMultistepScheduler"
  cfg = _base.merge_config(name, UNIPC_DEFAULTS, config)
  if cfg["solver_type"] in ("midpoint", "heun", "logrho"):
    cfg["solver_type"] = "bh2"
  _base.check_choice(name, "solver_type", cfg["solver_type"], ("bh1", "bh2"))
  _base.check_choice(name, "solver_order", cfg["solver_order"], (1, 2, 3))
  _base.check_choice(name, "final_sigmas_type", cfg["final_sigmas_type"], ("zero", "sigma_min"))
  _base.check_choice(
    name,
    "prediction_type",
    cfg["prediction_type"],
    ("epsilon", "sample", "v_prediction", "flow_prediction"),
  )
  if cfg["solver_p"] is not None:
    raise ValueError(f"{name}: solver_p (an external predictor scheduler) is not supported")
  if cfg["shift_terminal"] is not None and not cfg["use_flow_sigmas"]:
    raise ValueError(f"{name}: shift_terminal needs use_flow_sigmas=True")
  if not cfg["predict_x0"] and cfg["prediction_type"] == "flow_prediction":
    raise ValueError(f"{name}: flow_prediction needs predict_x0=True")
  _base.convert_sigmas(cfg, np.ones(2), 2)
  acp = _base.train_alphas_cumprod(cfg, zero_snr_floor=True)
  n_train = int(cfg["num_train_timesteps"])
  k = int(cfg["solver_order"])
  flow = bool(cfg["use_flow_sigmas"])

  def init(num_inference_steps=None, *, sigmas=None, mu=None, shape=None, dtype=jnp.float32):
    if cfg["use_dynamic_shifting"] and mu is None:
      raise ValueError(f"{name}: use_dynamic_shifting=True needs init(..., mu=...)")
    if sigmas is not None:
      if not flow:
        raise ValueError(f"{name}: custom sigmas need use_flow_sigmas=True")
      num_inference_steps = len(sigmas)
    n = _base.check_steps(num_inference_steps, n_train, name)
    ts, s = unipc_schedule(cfg, acp, n, sigmas=sigmas, mu=mu)
    alpha, sig = _dpm.alpha_sigma(s, flow)
    cw, pw = unipc_weights(cfg, s)
    tables = {
      "corrector": cw,
      "predictor": pw,
      "alpha": alpha[:-1],
      "sigma_t": sig[:-1],
      "sigma": s[:-1],
    }
    memory = _base.zeros_memory(shape, dtype, name, outputs=k, last_sample=0)
    return _base.make_state(timesteps=ts, sigmas=s, tables=tables, memory=memory)

  def convert(tb, model_output, sample):
    pred = cfg["prediction_type"]
    a, s = tb["alpha"], tb["sigma_t"]
    if cfg["predict_x0"]:
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
      return model_output
    if pred == "sample":
      return (sample - a * model_output) / s
    return a * model_output + s * sample

  def step(state, model_output, sample, key=None, *, noise=None):
    del key, noise
    i = state.step
    tb = {k_: v[i] for k_, v in state.tables.items()}
    x = sample.astype(jnp.float32)
    converted = convert(tb, model_output, x).astype(jnp.float32)
    hist = state.memory["outputs"].astype(jnp.float32)
    last = state.memory["last_sample"].astype(jnp.float32)
    cw, pw = tb["corrector"], tb["predictor"]
    corrected = (
      cw[0] * x + cw[1] * last + jnp.tensordot(cw[2 : 2 + k], hist, axes=1) + cw[-1] * converted
    )
    hist = jnp.concatenate([hist[1:], converted[None]])
    prev = pw[0] * corrected + jnp.tensordot(pw[1:], hist, axes=1)
    memory = {
      "outputs": hist.astype(state.memory["outputs"].dtype),
      "last_sample": corrected.astype(state.memory["last_sample"].dtype),
    }
    return prev.astype(sample.dtype), state._replace(step=i + 1, memory=memory)

  return _base.Scheduler(name, cfg, init, step, _base.identity_scale, False, acp)
