"""Host-side facts of starting part-way through a schedule: where image-to-image and the SDXL ensemble
start and stop, how a multistep scheduler's tables restart, and the noise level at the first kept call (the
end-to-end parity against diffusers' img2img pipelines is in packages/md-sd/tests/test_pipeline_features.py)."""

import numpy as np
import pytest

import md_schedulers as mdsch

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
  assert mdsch.strength_start(4, 0.75) == 1
  assert mdsch.strength_start(4, 0.75, 2) == 2  # Heun: two calls per step
  assert mdsch.strength_start(50, 0.3, 1) == 35
  assert mdsch.strength_start(3, 1.0, 1) == 0
  assert mdsch.strength_start(3, 0.0, 1) == 3  # nothing left to run: == num_calls
  assert mdsch.scheduler_order(make("HeunDiscreteScheduler")) == 2
  assert mdsch.scheduler_order(mdsch.flow_match_heun()) == 2
  assert mdsch.scheduler_order(make("DPMSolverMultistepScheduler")) == 1
  with pytest.raises(ValueError, match="strength must be in"):
    mdsch.strength_start(3, 1.5, 1)


def test_denoising_start_and_end_split_the_schedule():
  sched = make("EulerDiscreteScheduler")
  state = sched.init(10, shape=SHAPE)
  ts = np.asarray(state.timesteps)
  stop = mdsch.denoising_end_stop(sched, state, 0, 0.8)
  start = mdsch.denoising_start_index(sched, state, 0.8)
  assert stop == start  # the base stops where the refiner starts
  assert (ts[:stop] >= 200).all() and (ts[start:] < 200).all()
  heun = make("HeunDiscreteScheduler")
  hstate = heun.init(10, shape=SHAPE)
  begin = mdsch.denoising_start_index(heun, hstate, 0.5)
  assert begin % 2 == 0  # starts on the first stage of a step
  with pytest.raises(ValueError, match=r"denoising_end must be a float in \(0, 1\)"):
    mdsch.denoising_end_stop(sched, state, 0, 1.0)


def test_start_at_makes_multistep_solvers_warm_up_again():
  dpm = make("DPMSolverMultistepScheduler")
  full = dpm.init(6, shape=SHAPE)
  w = np.asarray(full.tables["weights"])
  assert w[2, 1] != 0  # second order at step 2 of the full run: the older output is used
  again = np.asarray(mdsch.start_at(dpm, full, 2).tables["weights"])
  assert again[2, 1] == 0 and again[3, 1] != 0  # first order at the first kept step, then second
  np.testing.assert_array_equal(again[:2], w[:2])
  unipc = make("UniPCMultistepScheduler")
  full = unipc.init(6, shape=SHAPE)
  cw = np.asarray(mdsch.start_at(unipc, full, 2).tables["corrector"])
  np.testing.assert_array_equal(
    cw[2], np.eye(cw.shape[1])[0]
  )  # no corrector at the first kept step
  assert np.abs(cw[3, 1:]).sum() > 0
  state = mdsch.start_at(unipc, full, 2)
  assert int(state.step) == 2
  # At call 0 nothing changes but the (already zero) call index.
  same = mdsch.start_at(unipc, full, 0)
  for key, table in full.tables.items():
    np.testing.assert_array_equal(np.asarray(same.tables[key]), np.asarray(table))


def test_start_at_single_step_schedulers_only_move_the_index():
  euler = make("EulerDiscreteScheduler")
  full = euler.init(5, shape=SHAPE)
  state = mdsch.start_at(euler, full, 3)
  assert int(state.step) == 3
  for key, table in full.tables.items():
    np.testing.assert_array_equal(np.asarray(state.tables[key]), np.asarray(table))


def test_add_noise_at_uses_the_noise_level_of_the_first_kept_call():
  x0 = np.full(SHAPE, 0.5, np.float32)
  eps = np.full(SHAPE, -1.0, np.float32)
  euler = make("EulerDiscreteScheduler")
  state = euler.init(5, shape=SHAPE)
  sigma = float(np.asarray(state.sigmas)[2])
  np.testing.assert_allclose(mdsch.add_noise_at(euler, state, 2, x0, eps), 0.5 - sigma, rtol=1e-6)
  ddim = make("DDIMScheduler")
  state = ddim.init(5)
  t = int(np.asarray(state.timesteps)[2])
  acp = float(ddim.alphas_cumprod[t])
  want = acp**0.5 * 0.5 - (1 - acp) ** 0.5
  np.testing.assert_allclose(mdsch.add_noise_at(ddim, state, 2, x0, eps), want, rtol=1e-5)
  flow = mdsch.flow_match_euler(shift=3.0)
  state = flow.init(4)
  s = float(np.asarray(state.sigmas)[1])
  want = (1 - s) * 0.5 - s
  np.testing.assert_allclose(mdsch.add_noise_at(flow, state, 1, x0, eps), want, rtol=1e-5)


def test_start_call_outside_the_schedule_is_an_error():
  euler = make("EulerDiscreteScheduler")
  state = euler.init(4, shape=SHAPE)
  with pytest.raises(ValueError, match=r"start call 4 is outside the schedule's 4 calls"):
    mdsch.start_at(euler, state, 4)
  with pytest.raises(ValueError, match=r"start call -1 is outside"):
    mdsch.add_noise_at(euler, state, -1, np.zeros(SHAPE, np.float32), np.zeros(SHAPE, np.float32))
