"""Host-side facts of md_sd._schedule: where image-to-image and the SDXL ensemble start and stop, and how a
multistep scheduler's tables restart part-way (the end-to-end parity is in test_pipeline_features.py)."""

import numpy as np
import pytest

import md_schedulers as mdsch
from md_sd import _schedule

CONFIG = dict(
  num_train_timesteps=1000,
  beta_start=0.00085,
  beta_end=0.012,
  beta_schedule="scaled_linear",
  steps_offset=1,
  timestep_spacing="leading",
)
SHAPE = (1, 2, 2, 4)


def make(name, **options):
  return mdsch.from_config(dict(CONFIG, _class_name=name), **options)


def test_strength_start_counts_whole_steps_times_order():
  assert _schedule.strength_start(4, 0.75, 1) == 1
  assert _schedule.strength_start(4, 0.75, 2) == 2  # Heun: two calls per step
  assert _schedule.strength_start(50, 0.3, 1) == 35
  assert _schedule.strength_start(3, 1.0, 1) == 0
  with pytest.raises(ValueError, match="strength must be in"):
    _schedule.strength_start(3, 1.5, 1)


def test_denoising_start_and_end_split_the_schedule():
  sched = make("EulerDiscreteScheduler")
  state = sched.init(10, shape=SHAPE)
  ts = np.asarray(state.timesteps)
  stop = _schedule.denoising_end_stop(sched, state, 0, 0.8)
  start = _schedule.denoising_start_index(sched, state, 0.8)
  assert stop == start  # the base stops where the refiner starts
  assert (ts[:stop] >= 200).all() and (ts[start:] < 200).all()
  heun = make("HeunDiscreteScheduler")
  hstate = heun.init(10, shape=SHAPE)
  begin = _schedule.denoising_start_index(heun, hstate, 0.5)
  assert begin % 2 == 0  # starts on the first stage of a step
  with pytest.raises(ValueError, match=r"denoising_end must be a float in \(0, 1\)"):
    _schedule.denoising_end_stop(sched, state, 0, 1.0)


def test_restart_makes_multistep_solvers_warm_up_again():
  dpm = make("DPMSolverMultistepScheduler")
  full = dpm.init(6, shape=SHAPE)
  w = np.asarray(full.tables["weights"])
  assert w[2, 1] != 0  # second order at step 2 of the full run: the older output is used
  again = np.asarray(_schedule.restart(dpm, full, 2).tables["weights"])
  assert again[2, 1] == 0 and again[3, 1] != 0  # first order at the first kept step, then second
  np.testing.assert_array_equal(again[:2], w[:2])
  unipc = make("UniPCMultistepScheduler")
  full = unipc.init(6, shape=SHAPE)
  cw = np.asarray(_schedule.restart(unipc, full, 2).tables["corrector"])
  np.testing.assert_array_equal(
    cw[2], np.eye(cw.shape[1])[0]
  )  # no corrector at the first kept step
  assert np.abs(cw[3, 1:]).sum() > 0
  state = _schedule.restart(unipc, full, 2)
  assert int(state.step) == 2
