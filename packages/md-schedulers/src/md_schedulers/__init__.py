"""md-schedulers: diffusion and flow-matching noise schedulers, optax style, matching diffusers, and the
one sampling loop every pipeline runs (`sample`, `drive`, `md_schedulers.guidance`)."""

from md_schedulers import guidance
from md_schedulers._base import (
  Scheduler,
  SchedulerState,
  current_timestep,
  num_calls,
)
from md_schedulers._config import SCHEDULERS, from_config, load, read_config
from md_schedulers._ddim import ddim
from md_schedulers._ddpm import ddpm
from md_schedulers._dpm import dpm_solver_multistep
from md_schedulers._dpm_single import dpm_solver_singlestep
from md_schedulers._euler import euler, euler_ancestral
from md_schedulers._flow_match import (
  calculate_shift,
  flow_match_euler,
  flow_match_heun,
  flux2_empirical_mu,
)
from md_schedulers._heun import heun
from md_schedulers._lcm import lcm, tcd
from md_schedulers._lms import lms
from md_schedulers._ltx import (
  LTX2_DISTILLED_SIGMAS,
  LTX2_STAGE2_DISTILLED_SIGMAS,
  linear_quadratic_sigmas,
  ltx_euler_ancestral_rf,
  ltx_mu,
  ltx_uniform_sigmas,
)
from md_schedulers._ltx_token import ltx_token_euler, ltx_token_noised, ltx_token_timesteps
from md_schedulers._pndm import pndm
from md_schedulers._sample import (
  Cancelled,
  Expert,
  SampleState,
  StepCache,
  drive,
  init_state,
  matmul_flops_per_second,
  run_steps,
  sample,
  step_flops,
)
from md_schedulers._shell import LoopHost, sample_pipeline
from md_schedulers._start import (
  add_noise_at,
  denoising_end_stop,
  denoising_start_index,
  scheduler_order,
  start_at,
  strength_start,
)
from md_schedulers._training import (
  add_noise,
  discrete_timesteps,
  flow_noise,
  flow_target,
  min_snr_weight,
  sample_timesteps,
  shift_sigmas,
  snr,
  velocity,
)
from md_schedulers._unipc import unipc_multistep

__all__ = [
  "Cancelled",
  "Expert",
  "LoopHost",
  "SampleState",
  "StepCache",
  "drive",
  "guidance",
  "init_state",
  "matmul_flops_per_second",
  "run_steps",
  "sample",
  "sample_pipeline",
  "step_flops",
  "LTX2_DISTILLED_SIGMAS",
  "LTX2_STAGE2_DISTILLED_SIGMAS",
  "SCHEDULERS",
  "Scheduler",
  "SchedulerState",
  "add_noise",
  "add_noise_at",
  "calculate_shift",
  "current_timestep",
  "ddim",
  "ddpm",
  "denoising_end_stop",
  "denoising_start_index",
  "discrete_timesteps",
  "dpm_solver_multistep",
  "dpm_solver_singlestep",
  "euler",
  "euler_ancestral",
  "flow_match_euler",
  "flow_match_heun",
  "flow_noise",
  "flow_target",
  "flux2_empirical_mu",
  "from_config",
  "heun",
  "lcm",
  "linear_quadratic_sigmas",
  "lms",
  "load",
  "ltx_euler_ancestral_rf",
  "ltx_mu",
  "ltx_token_euler",
  "ltx_token_noised",
  "ltx_token_timesteps",
  "ltx_uniform_sigmas",
  "min_snr_weight",
  "num_calls",
  "pndm",
  "read_config",
  "sample_timesteps",
  "scheduler_order",
  "shift_sigmas",
  "snr",
  "start_at",
  "strength_start",
  "tcd",
  "unipc_multistep",
  "velocity",
]
