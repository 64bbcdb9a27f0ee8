"""PNDM / PLMS (Liu et al. 2022): linear multistep on the alphā schedule (Stable Diffusion 1.x default).

Every call combines stored outputs with fixed weights, so `init` writes a per-call plan (which outputs to
keep, how to weight them, which sample to start from) and `step` follows it.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np

from md_schedulers import _base

PNDM_DEFAULTS: dict[str, Any] = {
  **_base.ALPHA_BAR_DEFAULTS,
  "skip_prk_steps": False,
  "set_alpha_to_one": False,
}
PNDM_DEFAULTS.pop("rescale_betas_zero_snr")

# Adams–Bashforth weights on the stored outputs (oldest first) for 1 … 4 stored outputs.
_AB = {
  1: (0, 0, 0, 1.0),
  2: (0, 0, -0.5, 1.5),
  3: (0, 5 / 12, -16 / 12, 23 / 12),
  4: (-9 / 24, 37 / 24, -59 / 24, 55 / 24),
}


def _ascending_timesteps(cfg: dict[str, Any], n: int) -> np.ndarray:
  n_train = int(cfg["num_train_timesteps"])
  spacing = cfg["timestep_spacing"]
  if spacing == "linspace":
    return np.linspace(0, n_train - 1, n).round().astype(np.int64)
  if spacing == "leading":
    ts = (np.arange(0, n) * (n_train // n)).round()
    return (ts + cfg["steps_offset"]).astype(np.int64)
  if spacing == "trailing":
    ts = np.round(np.arange(n_train, 0, -n_train / n))[::-1].astype(np.int64)
    return ts - 1
  raise ValueError(
    f"timestep_spacing={spacing!r} is not supported; expected 'linspace', 'leading' or 'trailing'"
  )


def _plms_only(asc: np.ndarray, ratio: int):
  """Calls of the PLMS-only schedule: (timesteps, timestep used, previous timestep, per-call plan)."""
  ts = np.concatenate([asc[:-1], asc[-2:-1], asc[-1:]])[::-1].copy().astype(np.int64)
  calls = len(ts)
  t_used, t_prev = ts.copy(), ts - ratio
  # The second call redoes the first step: from the first timestep down to the second.
  t_used[1], t_prev[1] = ts[1] + ratio, ts[1]
  plan = _empty_plan(calls)
  plan["weights"][0] = _AB[1]
  plan["weights"][1], plan["output_weight"][1] = (0, 0, 0, 0.5), 0.5
  for c in range(2, calls):
    plan["weights"][c] = _AB[min(c, 4)]
  plan["append"][:] = np.arange(calls) != 1
  plan["set_first"][0] = 1
  plan["use_first"][1] = 1
  return ts, t_used, t_prev, plan


def _with_prk(asc: np.ndarray, n_train: int, n: int):
  """Calls of the schedule with the 4-stage Runge–Kutta warm-up over the first three steps."""
  half = n_train // n // 2
  prk = np.repeat(asc[-4:], 2) + np.tile(np.array([0, half]), 4)
  prk = np.repeat(prk[:-1], 2)[1:-1][::-1].copy()
  plms = asc[:-3][::-1].copy()
  ts = np.concatenate([prk, plms]).astype(np.int64)
  calls = len(ts)
  plan = _empty_plan(calls)
  t_used, t_prev = ts.copy(), ts - n_train // n
  for c in range(len(prk)):
    stage = c % 4
    t_used[c] = prk[c // 4 * 4]
    t_prev[c] = prk[c] - (0 if c % 2 else half)
    if stage == 0:
      plan["append"][c], plan["set_first"][c] = 1, 1
      plan["output_weight"][c], plan["acc_add"][c] = 1, 1 / 6
    elif stage in (1, 2):
      plan["output_weight"][c], plan["acc_add"][c] = 1, 1 / 3
    else:
      plan["acc_weight"][c], plan["output_weight"][c], plan["acc_keep"][c] = 1, 1 / 6, 0
    plan["use_first"][c] = 1
  for c in range(len(prk), calls):
    plan["append"][c] = 1
    plan["weights"][c] = _AB[4]
  return ts, t_used, t_prev, plan


def _empty_plan(calls: int) -> dict[str, np.ndarray]:
  plan = {
    k: np.zeros((calls,), np.float32)
    for k in ("output_weight", "acc_weight", "acc_add", "append", "set_first", "use_first")
  }
  plan["weights"] = np.zeros((calls, 4), np.float32)
  plan["acc_keep"] = np.ones((calls,), np.float32)
  return plan


def pndm(**config: Any) -> _base.Scheduler:
  """PNDMScheduler: PLMS steps, after a 4-stage Runge–Kutta warm-up unless `skip_prk_steps`.

  With `skip_prk_steps=True` (the Stable Diffusion configs) n steps make n + 1 model calls; without, the
  first three steps take four calls each (n + 9 calls).
  """
  name = "PNDMScheduler"
  cfg = _base.merge_config(name, PNDM_DEFAULTS, config)
  _base.check_choice(name, "prediction_type", cfg["prediction_type"], ("epsilon", "v_prediction"))
  acp = _base.train_alphas_cumprod(cfg)
  final = np.float32(1.0) if cfg["set_alpha_to_one"] else acp[0]
  n_train = int(cfg["num_train_timesteps"])

  def init(num_inference_steps=None, *, shape=None, dtype=jnp.float32):
    n = _base.check_steps(num_inference_steps, n_train, name)
    minimum = 2 if cfg["skip_prk_steps"] else 4
    if n < minimum:
      raise ValueError(f"{name}: needs at least {minimum} steps, got {n}")
    asc = _ascending_timesteps(cfg, n)
    if cfg["skip_prk_steps"]:
      ts, t_used, t_prev, plan = _plms_only(asc, n_train // n)
    else:
      ts, t_used, t_prev, plan = _with_prk(asc, n_train, n)
    one = np.float32(1)
    a_t = acp[t_used]
    a_prev = np.where(t_prev >= 0, acp[np.clip(t_prev, 0, None)], final).astype(np.float32)
    b_t, b_prev = one - a_t, one - a_prev
    denom = a_t * b_prev ** np.float32(0.5) + (a_t * b_t * a_prev) ** np.float32(0.5)
    tables = {
      "sqrt_a": a_t ** np.float32(0.5),
      "sqrt_b": b_t ** np.float32(0.5),
      "sample_coef": (a_prev / a_t) ** np.float32(0.5),
      "output_coef": (a_prev - a_t) / denom,
      **plan,
    }
    memory = _base.zeros_memory(shape, dtype, name, outputs=4, first_sample=0, accumulated=0)
    sig = np.concatenate([_base.train_sigmas(acp)[ts], np.zeros(1, np.float32)])
    return _base.make_state(timesteps=ts, sigmas=sig, tables=tables, memory=memory)

  def step(state, model_output, sample, key=None, *, noise=None):
    del key, noise
    i = state.step
    tb = {k: v[i] for k, v in state.tables.items()}
    mem = state.memory
    ets = mem["outputs"]
    rolled = jnp.concatenate([ets[1:], model_output[None].astype(ets.dtype)])
    ets = jnp.where(tb["append"] > 0, rolled, ets)
    w = tb["weights"].reshape((4,) + (1,) * sample.ndim)
    acc = mem["accumulated"]
    combined = (
      jnp.sum(w * ets, axis=0) + tb["output_weight"] * model_output + tb["acc_weight"] * acc
    )
    first = jnp.where(tb["set_first"] > 0, sample, mem["first_sample"])
    x = jnp.where(tb["use_first"] > 0, first, sample)
    if cfg["prediction_type"] == "v_prediction":
      combined = tb["sqrt_a"] * combined + tb["sqrt_b"] * x
    prev = tb["sample_coef"] * x - tb["output_coef"] * combined
    memory = {
      "outputs": ets,
      "first_sample": first.astype(mem["first_sample"].dtype),
      "accumulated": (tb["acc_keep"] * acc + tb["acc_add"] * model_output).astype(acc.dtype),
    }
    return prev.astype(sample.dtype), state._replace(step=i + 1, memory=memory)

  return _base.Scheduler(name, cfg, init, step, _base.identity_scale, False, acp)
