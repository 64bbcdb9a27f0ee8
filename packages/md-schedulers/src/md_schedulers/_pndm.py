"""PNDM / PLMS (Liu et al. 2022): linear multistep on the alphā schedule (Stable Diffusion 1.x default).

Only the PLMS part is implemented (`skip_prk_steps=True`, what every Stable Diffusion config ships): n steps
make n + 1 model calls, the second call re-evaluating the first step with the averaged slope.
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


def pndm(**config: Any) -> _base.Scheduler:
  """PNDMScheduler with `skip_prk_steps=True` (PLMS); the state holds n + 1 timesteps for n steps."""
  name = "PNDMScheduler"
  cfg = _base.merge_config(name, PNDM_DEFAULTS, config)
  if not cfg["skip_prk_steps"]:
    raise ValueError(
      f"{name}: skip_prk_steps=False (Runge–Kutta warm-up) is not supported; set "
      "skip_prk_steps=True as the Stable Diffusion configs do"
    )
  _base.check_choice(name, "prediction_type", cfg["prediction_type"], ("epsilon", "v_prediction"))
  acp = _base.train_alphas_cumprod(cfg)
  final = np.float32(1.0) if cfg["set_alpha_to_one"] else acp[0]
  n_train = int(cfg["num_train_timesteps"])

  def init(num_inference_steps=None, *, shape=None, dtype=jnp.float32):
    n = _base.check_steps(num_inference_steps, n_train, name)
    if n < 2:
      raise ValueError(f"{name}: PLMS needs at least 2 steps, got {n}")
    asc = _ascending_timesteps(cfg, n)
    ts = np.concatenate([asc[:-1], asc[-2:-1], asc[-1:]])[::-1].copy().astype(np.int64)
    ratio = n_train // n
    calls = len(ts)
    t_used = ts.copy()
    t_prev = ts - ratio
    # The second call redoes the first step: from the first timestep down to the second.
    t_used[1], t_prev[1] = ts[1] + ratio, ts[1]
    one = np.float32(1)
    a_t = acp[t_used]
    a_prev = np.where(t_prev >= 0, acp[np.clip(t_prev, 0, None)], final).astype(np.float32)
    b_t, b_prev = one - a_t, one - a_prev
    denom = a_t * b_prev ** np.float32(0.5) + (a_t * b_t * a_prev) ** np.float32(0.5)
    weights = np.zeros((calls, 4), np.float32)
    out_w = np.zeros((calls,), np.float32)
    weights[0] = _AB[1]
    weights[1], out_w[1] = (0, 0, 0, 0.5), 0.5
    for c in range(2, calls):
      weights[c] = _AB[min(c, 4)]
    tables = {
      "sqrt_a": a_t ** np.float32(0.5),
      "sqrt_b": b_t ** np.float32(0.5),
      "sample_coef": (a_prev / a_t) ** np.float32(0.5),
      "output_coef": (a_prev - a_t) / denom,
      "weights": weights,
      "output_weight": out_w,
      "append": (np.arange(calls) != 1).astype(np.float32),
      "use_first": (np.arange(calls) == 1).astype(np.float32),
    }
    memory = _base.zeros_memory(shape, dtype, name, outputs=4, first_sample=0)
    sig = np.concatenate([_base.train_sigmas(acp)[ts], np.zeros(1, np.float32)])
    return _base.make_state(timesteps=ts, sigmas=sig, tables=tables, memory=memory)

  def step(state, model_output, sample, key=None, *, noise=None):
    del key, noise
    i = state.step
    tb = {k: v[i] for k, v in state.tables.items()}
    ets = state.memory["outputs"]
    rolled = jnp.concatenate([ets[1:], model_output[None].astype(ets.dtype)])
    ets = jnp.where(tb["append"] > 0, rolled, ets)
    w = tb["weights"].reshape((4,) + (1,) * sample.ndim)
    combined = jnp.sum(w * ets, axis=0) + tb["output_weight"] * model_output
    first = jnp.where(i == 0, sample, state.memory["first_sample"])
    x = jnp.where(tb["use_first"] > 0, state.memory["first_sample"], sample)
    if cfg["prediction_type"] == "v_prediction":
      combined = tb["sqrt_a"] * combined + tb["sqrt_b"] * x
    prev = tb["sample_coef"] * x - tb["output_coef"] * combined
    memory = {"outputs": ets, "first_sample": first.astype(state.memory["first_sample"].dtype)}
    return prev.astype(sample.dtype), state._replace(step=i + 1, memory=memory)

  return _base.Scheduler(name, cfg, init, step, _base.identity_scale, False, acp)
