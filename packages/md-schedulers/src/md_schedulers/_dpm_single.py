"""DPM-Solver single-step (Lu et al. 2022): blocks of 1st/2nd/3rd-order updates from a block start.

Within a block of order k the model is called k times and every update starts from the sample at the
block's start, so the state carries that sample besides the last outputs.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np

from md_schedulers import _base, _dpm

DPM_SINGLE_DEFAULTS: dict[str, Any] = {
  k: v
  for k, v in _dpm.DPM_DEFAULTS.items()
  if k
  not in (
    "euler_at_final",
    "use_lu_lambdas",
    "timestep_spacing",
    "steps_offset",
    "rescale_betas_zero_snr",
  )
}
DPM_SINGLE_DEFAULTS["lower_order_final"] = False


def order_list(n: int, order: int, lower_order_final: bool, final_zero: bool) -> list[int]:
  """The order of each of the n steps (the reference's block pattern)."""
  if lower_order_final:
    if order == 3:
      tail = {0: [1, 2] + [1], 1: [1], 2: [1, 2]}[n % 3]
      reps = n // 3 - 1 if n % 3 == 0 else n // 3
      orders = [1, 2, 3] * reps + tail
    elif order == 2:
      orders = [1, 2] * (n // 2 - 1) + [1, 1] if n % 2 == 0 else [1, 2] * (n // 2) + [1]
    else:
      orders = [1] * n
  else:
    orders = {3: [1, 2, 3] * (n // 3), 2: [1, 2] * (n // 2), 1: [1] * n}[order]
  if final_zero:
    orders[-1] = 1
  return orders


def _weights(cfg: dict[str, Any], sigmas: np.ndarray, orders: list[int]) -> np.ndarray:
  n = len(sigmas) - 1
  k = int(cfg["solver_order"])
  algo, solver = cfg["algorithm_type"], cfg["solver_type"]
  alpha, sig = _dpm.alpha_sigma(sigmas, cfg["use_flow_sigmas"])
  lam = _dpm.log_snr(alpha, sig)
  width = 2 + k
  e = np.eye(width)
  x, noise = e[0], e[-1]
  m = [e[k - j] for j in range(k)]  # m[0] newest
  rows = np.zeros((n, width))
  with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
    for i in range(n):
      order = min(orders[i], i + 1)
      start = i - (order - 1)  # the block's first step: updates go from its sigma to sigmas[i + 1]
      at, st = alpha[i + 1], sig[i + 1]
      as_, ss_ = alpha[start], sig[start]
      h = lam[i + 1] - lam[start]
      zero = 0 * x
      if order == 1:
        d0, d1, d2, mid = m[0], zero, zero, False
      elif order == 2:
        r0 = (lam[i] - lam[start]) / h
        d0, d1, d2, mid = m[1], (1.0 / r0) * (m[0] - m[1]), zero, False
      else:
        r0, r1 = (lam[i] - lam[start]) / h, (lam[i - 1] - lam[start]) / h
        d10, d11 = (1.0 / r1) * (m[1] - m[2]), (1.0 / r0) * (m[0] - m[2])
        d0 = m[2]
        if solver == "midpoint":
          d1, d2, mid = d11, zero, True
        else:
          d1 = (r0 * d10 - r1 * d11) * (1.0 / (r0 - r1))
          d2 = (2.0 / (r0 - r1)) * (d11 - d10)
          mid = False
      if order == 3 and mid:
        # Third-order midpoint uses only the first-derivative term, with the heun coefficient.
        rows[i] = _dpm._update(algo, "heun", 2, x, noise, d0, d1, d2, at, st, as_, ss_, h)
      else:
        rows[i] = _dpm._update(algo, solver, order, x, noise, d0, d1, d2, at, st, as_, ss_, h)
  return rows


def dpm_solver_singlestep(**config: Any) -> _base.Scheduler:
  """DPMSolverSinglestepScheduler (`dpmsolver++`, `dpmsolver`, `sde-dpmsolver++`; orders 1-3).

  `init(num_inference_steps=None, *, timesteps=None, mu=None, shape=...)`.
  """
  name = "DPMSolverSinglestepScheduler"
  cfg = _base.merge_config(name, DPM_SINGLE_DEFAULTS, config)
  full = dict(_dpm.DPM_DEFAULTS)
  full.update(cfg)
  _dpm._validate(name, full)
  cfg.update({k: full[k] for k in cfg})
  if full["algorithm_type"] == "sde-dpmsolver":
    raise ValueError(f"{name}: algorithm_type='sde-dpmsolver' is not available single-step")
  acp = _base.train_alphas_cumprod(full)
  n_train = int(full["num_train_timesteps"])
  k = int(full["solver_order"])
  flow = bool(full["use_flow_sigmas"])
  predicts_x0 = full["algorithm_type"] in ("dpmsolver++", "sde-dpmsolver++")
  stochastic = full["algorithm_type"] == "sde-dpmsolver++"

  def init(num_inference_steps=None, *, timesteps=None, mu=None, shape=None, dtype=jnp.float32):
    flow_shift = full["flow_shift"]
    if mu is not None:
      if not full["use_dynamic_shifting"]:
        raise ValueError(f"{name}: mu needs use_dynamic_shifting=True")
      flow_shift = float(np.exp(mu))
    if (num_inference_steps is None) == (timesteps is None):
      raise ValueError(f"{name}.init: pass exactly one of num_inference_steps or timesteps")
    n = _base.check_steps(num_inference_steps or len(timesteps), n_train, name)
    ts, s = _dpm.dpm_schedule(full, acp, n, timesteps=timesteps, flow_shift=flow_shift)
    lof = bool(full["lower_order_final"])
    if not lof and (n % k != 0 or full["final_sigmas_type"] == "zero"):
      lof = True
    orders = order_list(n, k, lof, full["final_sigmas_type"] == "zero")
    if len(orders) != n:
      raise ValueError(
        f"{name}: {n} steps do not split into blocks of order {k}; set lower_order_final=True"
      )
    alpha, sig = _dpm.alpha_sigma(s, flow)
    tables = {
      "weights": _weights(full, s, orders),
      "alpha": alpha[:-1],
      "sigma_t": sig[:-1],
      "sigma": s[:-1],
      "block_start": (np.asarray(orders) == 1).astype(np.float32),
    }
    memory = _base.zeros_memory(shape, dtype, name, outputs=k, block_sample=0)
    return _base.make_state(timesteps=ts, sigmas=s, tables=tables, memory=memory)

  def convert(tb, model_output, sample):
    a, s = tb["alpha"], tb["sigma_t"]
    pred = full["prediction_type"]
    if predicts_x0:
      x0 = {
        "epsilon": lambda: (sample - s * model_output) / a,
        "sample": lambda: model_output,
        "v_prediction": lambda: a * sample - s * model_output,
        "flow_prediction": lambda: sample - tb["sigma"] * model_output,
      }[pred]()
      if full["thresholding"]:
        x0 = _base.threshold(x0, full["dynamic_thresholding_ratio"], full["sample_max_value"])
      return x0
    eps = {
      "epsilon": lambda: model_output,
      "sample": lambda: (sample - a * model_output) / s,
      "v_prediction": lambda: a * model_output + s * sample,
    }[pred]()
    if full["thresholding"]:
      x0 = _base.threshold(
        (sample - s * eps) / a, full["dynamic_thresholding_ratio"], full["sample_max_value"]
      )
      eps = (sample - a * x0) / s
    return eps

  def step(state, model_output, sample, key=None, *, noise=None):
    i = state.step
    tb = {k_: v[i] for k_, v in state.tables.items()}
    converted = convert(tb, model_output, sample)
    hist = state.memory["outputs"]
    hist = jnp.concatenate([hist[1:], converted[None].astype(hist.dtype)])
    start = jnp.where(tb["block_start"] > 0, sample, state.memory["block_sample"])
    w = tb["weights"]
    prev = w[0] * start + jnp.tensordot(w[1 : 1 + k], hist, axes=1)
    if stochastic:
      prev = prev + w[-1] * _base.draw_noise(key, noise, sample, name)
    memory = {"outputs": hist, "block_sample": start.astype(state.memory["block_sample"].dtype)}
    return prev.astype(sample.dtype), state._replace(step=i + 1, memory=memory)

  return _base.Scheduler(name, cfg, init, step, _base.identity_scale, stochastic, acp)
