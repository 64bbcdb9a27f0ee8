"""Building schedulers from diffusers `scheduler_config.json` dicts, checkpoints, or by name."""

from __future__ import annotations

import json
import os
import pathlib
from collections.abc import Callable, Mapping
from typing import Any

import md_core
from md_schedulers import (
  _base,
  _ddim,
  _ddpm,
  _dpm,
  _dpm_single,
  _euler,
  _flow_match,
  _heun,
  _lcm,
  _lms,
  _ltx,
  _pndm,
  _unipc,
)

# class name -> (factory, the reference's options with their defaults, factory-only keyword arguments)
SCHEDULERS: dict[str, tuple[Callable[..., _base.Scheduler], dict[str, Any], tuple[str, ...]]] = {
  "DDPMScheduler": (_ddpm.ddpm, _ddpm.DDPM_DEFAULTS, ()),
  "DDIMScheduler": (_ddim.ddim, _ddim.DDIM_DEFAULTS, ("eta", "use_clipped_model_output")),
  "PNDMScheduler": (_pndm.pndm, _pndm.PNDM_DEFAULTS, ()),
  "LMSDiscreteScheduler": (_lms.lms, _lms.LMS_DEFAULTS, ()),
  "EulerDiscreteScheduler": (
    _euler.euler,
    _euler.EULER_DEFAULTS,
    ("s_churn", "s_tmin", "s_tmax", "s_noise"),
  ),
  "EulerAncestralDiscreteScheduler": (_euler.euler_ancestral, _euler.EULER_ANCESTRAL_DEFAULTS, ()),
  "HeunDiscreteScheduler": (_heun.heun, _heun.HEUN_DEFAULTS, ()),
  "DPMSolverMultistepScheduler": (_dpm.dpm_solver_multistep, _dpm.DPM_DEFAULTS, ()),
  "DPMSolverSinglestepScheduler": (
    _dpm_single.dpm_solver_singlestep,
    _dpm_single.DPM_SINGLE_DEFAULTS,
    (),
  ),
  "UniPCMultistepScheduler": (_unipc.unipc_multistep, _unipc.UNIPC_DEFAULTS, ()),
  "LCMScheduler": (_lcm.lcm, _lcm.LCM_DEFAULTS, ()),
  "TCDScheduler": (_lcm.tcd, _lcm.TCD_DEFAULTS, ("eta",)),
  "FlowMatchEulerDiscreteScheduler": (
    _flow_match.flow_match_euler,
    _flow_match.FLOW_MATCH_EULER_DEFAULTS,
    (),
  ),
  "FlowMatchHeunDiscreteScheduler": (
    _flow_match.flow_match_heun,
    _flow_match.FLOW_MATCH_HEUN_DEFAULTS,
    (),
  ),
  "LTXEulerAncestralRFScheduler": (
    _ltx.ltx_euler_ancestral_rf,
    _ltx.LTX_EULER_ANCESTRAL_RF_DEFAULTS,
    (),
  ),
}

# Options that only reference schedulers md does not implement have (EDM, DPM-SDE, consistency models…).
# Configs are shared between compatible schedulers and the reference ignores options a class lacks, so
# these are accepted and dropped; a key no scheduler knows is an error (most likely a typo).
_OTHER_REFERENCE_OPTIONS = frozenset(
  {
    "sigma_data",
    "rho",
    "noise_sampler_seed",
    "beta_min",
    "beta_max",
    "sigma_schedule",
    "use_sigmoid",
  }
)


def known_options() -> frozenset[str]:
  """Every option some reference scheduler understands (the ones md may meet in a config)."""
  names = set(_OTHER_REFERENCE_OPTIONS)
  for _, defaults, extra in SCHEDULERS.values():
    names.update(defaults)
    names.update(extra)
  return frozenset(names)


def from_config(
  config: Mapping[str, Any], /, *, name: str | None = None, **overrides: Any
) -> _base.Scheduler:
  """Builds the scheduler a diffusers `scheduler_config.json` describes.

  Args:
    config: the JSON dict; `_class_name` picks the scheduler unless `name` is given.
    name: switch to this scheduler class, keeping the options it shares with `config` (as diffusers'
      `OtherScheduler.from_config(pipe.scheduler.config)` does).
    **overrides: options that replace the config's (e.g. `timestep_spacing="trailing"` for SDXL
      Lightning), plus the factory's own arguments (`eta` for DDIM and TCD).

  Returns:
    The Scheduler.

  Raises:
    ValueError: unknown or missing class name, an option no scheduler knows (a typo would otherwise be
      silently dropped), or an option value md does not support.
  """
  cls = name or config.get("_class_name")
  if cls is None:
    raise ValueError("scheduler config has no '_class_name'; pass from_config(..., name='...')")
  if cls not in SCHEDULERS:
    raise ValueError(f"unknown scheduler {cls!r}; supported: {sorted(SCHEDULERS)}")
  factory, defaults, extra = SCHEDULERS[cls]
  known = known_options()
  merged = {k: v for k, v in config.items() if not k.startswith("_")}
  merged.update(overrides)
  unknown = sorted(k for k in merged if k not in known)
  if unknown:
    raise ValueError(
      f"{cls}: unknown options {unknown} (no scheduler understands them); known for "
      f"{cls}: {sorted(set(defaults) | set(extra))}"
    )
  kwargs = {k: v for k, v in merged.items() if k in defaults or k in extra}
  for k in overrides:
    if k not in defaults and k not in extra:
      raise ValueError(
        f"{cls} has no option {k!r}; its options: {sorted(set(defaults) | set(extra))}"
      )
  return factory(**kwargs)


def read_config(path: str | os.PathLike) -> dict[str, Any]:
  """Reads a `scheduler_config.json` file (or the one inside a folder)."""
  p = pathlib.Path(path)
  if p.is_dir():
    p = p / "scheduler_config.json"
  if not p.is_file():
    raise FileNotFoundError(f"no scheduler_config.json at {p}")
  with open(p) as f:
    return json.load(f)


def load(
  source: str | os.PathLike, *, subfolder: str | None = "scheduler", **overrides: Any
) -> _base.Scheduler:
  """Builds the scheduler of a checkpoint: a local diffusers folder or a hub id (through md-core).

  Args:
    source: the pipeline folder / hub id, or the scheduler folder itself with `subfolder=None`.
    subfolder: the component folder holding `scheduler_config.json`.
    **overrides: as in `from_config` (including `name=` to switch the scheduler class).
  """
  folder = md_core.resolve_source(source, subfolder=subfolder)
  return from_config(read_config(folder), **overrides)
