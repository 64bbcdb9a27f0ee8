"""Starting and stopping part-way through a schedule, as diffusers' pipelines do.

Image-to-image keeps the last `strength` share of the steps (the reference's `get_timesteps`: whole steps,
times the scheduler's `order`, so Heun's two calls per step stay paired); SDXL's ensemble of experts cuts the
schedule at a fraction of the training timesteps (`denoising_end` on the base, `denoising_start` on the
refiner). A run that starts part-way is a fresh run of the scheduler from that call (the reference's
`set_begin_index`): the multistep solvers begin with an empty history, so their warm-up (first-order steps,
no corrector) happens at the first kept step, not at step 0 of the full schedule. `start_at` rebuilds a
`SchedulerState`'s per-call tables that way; `add_noise_at` noises clean latents as the scheduler's
`add_noise` does at the first kept call.

  state = sched.init(n, shape=x0.shape)
  begin = mdsch.strength_start(n, strength, mdsch.scheduler_order(sched))
  x = mdsch.add_noise_at(sched, state, begin, x0, noise)
  state = mdsch.start_at(sched, state, begin)  # then loop calls begin … num_calls(state) - 1
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from md_schedulers import _dpm, _dpm_single, _pndm, _unipc
from md_schedulers._base import Scheduler, SchedulerState
from md_schedulers._training import add_noise

# diffusers' `scheduler.order`: 2 for the schedulers whose timesteps repeat (one model call per stage).
_ORDER_TWO = frozenset({"HeunDiscreteScheduler", "FlowMatchHeunDiscreteScheduler"})
# k-diffusion style: noisy = x0 + sigma · noise.
_SIGMA_NOISE = frozenset(
  {
    "EulerDiscreteScheduler",
    "EulerAncestralDiscreteScheduler",
    "LMSDiscreteScheduler",
    "HeunDiscreteScheduler",
  }
)
# The DPM-Solver family: noisy = alpha_t · x0 + sigma_t · noise from the sigma at the call.
_VP_SIGMA_NOISE = frozenset(
  {"DPMSolverMultistepScheduler", "DPMSolverSinglestepScheduler", "UniPCMultistepScheduler"}
)


def scheduler_order(sched: Scheduler) -> int:
  """The reference's `scheduler.order`: model calls per step (2 for Heun)."""
  return 2 if sched.name in _ORDER_TWO else 1


def strength_start(num_inference_steps: int, strength: float, order: int = 1) -> int:
  """The first kept call of an image-to-image run (the reference's `get_timesteps`).

  Args:
    num_inference_steps: the steps of the full schedule (`init`'s argument).
    strength: share of the steps kept, in [0, 1] (1 runs them all, from pure noise).
    order: `scheduler_order(sched)`; the start counts model calls, `order` per step.

  Returns:
    The call index to pass to `add_noise_at` and `start_at` (== `num_calls` when nothing is left).
  """
  if not 0.0 <= strength <= 1.0:
    raise ValueError(f"strength must be in [0, 1], got {strength}")
  n = int(num_inference_steps)
  init = min(int(n * strength), n)
  return max(n - init, 0) * order


def _check_begin(state: SchedulerState, begin: int) -> int:
  calls = int(state.timesteps.shape[0])
  if not 0 <= int(begin) < calls:
    raise ValueError(f"start call {begin} is outside the schedule's {calls} calls [0, {calls})")
  return int(begin)


def _cutoff(sched: Scheduler, frac: float, what: str) -> int:
  if not 0.0 < frac < 1.0:
    raise ValueError(f"{what} must be a float in (0, 1), got {frac}")
  n_train = int(sched.config.get("num_train_timesteps", 1000))
  return int(round(n_train - frac * n_train))


def denoising_start_index(sched: Scheduler, state: SchedulerState, frac: float) -> int:
  """The first call of a run that continues a base model stopped at `denoising_end=frac` (the timesteps
  below `(1 - frac) · num_train_timesteps`; a second-order scheduler starts on a step's first call)."""
  ts = np.asarray(state.timesteps)
  kept = int((ts < _cutoff(sched, frac, "denoising_start")).sum())
  if scheduler_order(sched) == 2 and kept % 2 == 0:
    kept += 1  # never start between the two calls of a second-order step
  return len(ts) - kept


def denoising_end_stop(sched: Scheduler, state: SchedulerState, start: int, frac: float) -> int:
  """One past the last call of a run cut at `denoising_end=frac` (the timesteps at or above the cutoff)."""
  ts = np.asarray(state.timesteps)[start:]
  return start + int((ts >= _cutoff(sched, frac, "denoising_end")).sum())


def start_at(sched: Scheduler, state: SchedulerState, begin: int) -> SchedulerState:
  """`state` positioned at call `begin` as a fresh run from there (empty solver history).

  Single-step schedulers only move the call index. The multistep ones get their per-call tables from
  `begin` on rebuilt for a run that starts there: DPM-Solver and UniPC warm up again (their orders and
  UniPC's corrector count from the first kept step; the `< 15 steps` rule still sees the whole schedule),
  DPM-Solver single-step lowers the order of a block cut by the start, and PNDM replays its counter-based
  start (the repeated first PLMS step, or the Runge–Kutta warm-up) on the kept timesteps. LMS and Heun
  need nothing: an LMS history of zeros drops the terms the reference has no derivative for, and Heun's
  kept calls start on a first stage. Host-side; `state` must be fresh from `init`.

  Args:
    sched: the scheduler that built `state`.
    state: a state from `sched.init` (step 0, empty memory).
    begin: the first call to run, 0 <= begin < num_calls(state).

  Returns:
    A state whose `step` is `begin`; loop the calls `begin … num_calls(state) - 1` on it.
  """
  begin = _check_begin(state, begin)
  state = state._replace(step=jnp.asarray(begin, jnp.int32))
  if begin == 0:
    return state
  name, cfg = sched.name, dict(sched.config)
  sig = np.asarray(state.sigmas)
  calls = len(np.asarray(state.timesteps))
  tables = {k: np.array(v) for k, v in state.tables.items()}
  if name == "DPMSolverMultistepScheduler":
    if calls >= 15:
      cfg["lower_order_final"] = False  # the reference's rule looks at the whole schedule's length
    tables["weights"][begin:] = _dpm.dpm_multistep_weights(cfg, sig[begin:])
  elif name == "UniPCMultistepScheduler":
    cfg["disable_corrector"] = [d - begin for d in (cfg["disable_corrector"] or []) if d >= begin]
    cw, pw = _unipc.unipc_weights(cfg, sig[begin:])
    tables["corrector"][begin:], tables["predictor"][begin:] = cw, pw
  elif name == "DPMSolverSinglestepScheduler":
    full = dict(_dpm.DPM_DEFAULTS)
    full.update(cfg)
    k = int(full["solver_order"])
    zero = full["final_sigmas_type"] == "zero"
    lof = bool(full["lower_order_final"]) or calls % k != 0 or zero
    orders = _dpm_single.order_list(calls, k, lof, zero)
    # The reference lowers an order while the history lacks the outputs it needs.
    orders = [o if i < begin else min(o, i - begin + 1) for i, o in enumerate(orders)]
    tables["weights"] = _dpm_single._weights(full, sig, orders)
    tables["block_start"] = (np.asarray(orders) == 1).astype(np.float32)
  elif name == "PNDMScheduler":
    tables.update(_pndm_tables(sched, np.asarray(state.timesteps), begin, tables))
  return state._replace(
    tables={k: jnp.asarray(np.asarray(v, np.float32)) for k, v in tables.items()}
  )


def _pndm_tables(sched: Scheduler, ts: np.ndarray, begin: int, tables: dict) -> dict:
  """PNDM's plan and coefficients for calls `begin …`. The reference counts its calls from the first kept
  one: PLMS-only runs redo their first kept step on the second call; with the Runge–Kutta warm-up, the first
  twelve calls follow the full schedule's warm-up plan (its stage timesteps, by call count) while stepping
  down from the timesteps actually kept."""
  cfg = sched.config
  n_train = int(cfg["num_train_timesteps"])
  kept = ts[begin:].astype(np.int64)
  calls = len(kept)
  c = np.arange(calls)
  if cfg["skip_prk_steps"]:
    ratio = n_train // (len(ts) - 1)  # n steps make n + 1 calls
    t_used, t_prev = kept.copy(), kept - ratio
    if calls > 1:
      t_used[1], t_prev[1] = kept[1] + ratio, kept[1]
    plan = _pndm._empty_plan(calls)
    plan["weights"][0] = _pndm._AB[1]
    if calls > 1:
      plan["weights"][1], plan["output_weight"][1] = (0, 0, 0, 0.5), 0.5
    for i in range(2, calls):
      plan["weights"][i] = _pndm._AB[min(i, 4)]
    plan["append"][:] = c != 1
    plan["set_first"][0] = 1
    if calls > 1:
      plan["use_first"][1] = 1
  else:
    n = len(ts) - 9  # n steps make n + 9 calls with the warm-up
    ratio, half = n_train // n, n_train // n // 2
    asc = _pndm._ascending_timesteps(dict(cfg), n)
    _, full_used, _, full_plan = _pndm._with_prk(asc, n_train, n)
    warm = 12  # three Runge–Kutta steps of four calls
    t_used = np.where(c < warm, full_used[:calls], kept)
    t_prev = np.where(c < warm, kept - np.where(c % 2 == 1, 0, half), kept - ratio)
    plan = {k: v[:calls] for k, v in full_plan.items()}
  acp = sched.alphas_cumprod
  final = np.float32(1.0) if cfg["set_alpha_to_one"] else acp[0]
  one = np.float32(1)
  a_t = acp[t_used]
  a_prev = np.where(t_prev >= 0, acp[np.clip(t_prev, 0, None)], final).astype(np.float32)
  b_t, b_prev = one - a_t, one - a_prev
  denom = a_t * b_prev ** np.float32(0.5) + (a_t * b_t * a_prev) ** np.float32(0.5)
  fresh = {
    "sqrt_a": a_t ** np.float32(0.5),
    "sqrt_b": b_t ** np.float32(0.5),
    "sample_coef": (a_prev / a_t) ** np.float32(0.5),
    "output_coef": (a_prev - a_t) / denom,
    **plan,
  }
  out = {}
  for key, rows in fresh.items():
    full = np.array(tables[key])
    full[begin:] = rows
    out[key] = full
  return out


def add_noise_at(
  sched: Scheduler,
  state: SchedulerState,
  begin: int,
  latents: jax.Array,
  noise: jax.Array,
) -> jax.Array:
  """Clean `latents` noised to the level of call `begin`, as the scheduler's `add_noise` (or flow
  matching's `scale_noise`) does there: x0 + sigma · noise for the k-diffusion schedulers, alpha_t · x0 +
  sigma_t · noise from the call's sigma for DPM-Solver / UniPC, (1 - sigma) · x0 + sigma · noise for
  flow matching, sqrt(alphā_t) · x0 + sqrt(1 - alphā_t) · noise at the call's timestep otherwise.
  """
  begin = _check_begin(state, begin)
  if sched.alphas_cumprod is None:  # flow matching
    sigma = state.sigmas[begin]
    return (1 - sigma) * latents + sigma * noise
  if sched.name in _SIGMA_NOISE:
    return latents + state.sigmas[begin] * noise
  if sched.name in _VP_SIGMA_NOISE:
    sigma = state.sigmas[begin]
    if sched.config.get("use_flow_sigmas"):
      alpha_t, sigma_t = 1 - sigma, sigma
    else:
      alpha_t = 1 / (sigma**2 + 1) ** 0.5
      sigma_t = sigma * alpha_t
    return alpha_t * latents + sigma_t * noise
  t = jnp.full((latents.shape[0],), state.timesteps[begin]).astype(jnp.int32)
  return add_noise(sched.alphas_cumprod, latents, noise, t)
