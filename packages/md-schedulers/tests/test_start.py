"""Host-side facts of starting part-way through a schedule: where image-to-image and the SDXL ensemble
start and stop, how a multistep scheduler's tables restart, and the noise level at the first kept call;
then every scheduler run from its first kept call against the diffusers reference
(tools/fixtures/scheduler_start.py). The end-to-end parity of diffusers' img2img pipelines is in
packages/md-sd/tests/test_pipeline_features.py."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import md_schedulers as mdsch
from md_core import testing

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


FIXTURES = testing.fixture_path("scheduler_start")
CASES = json.loads((FIXTURES / "cases.json").read_text())
BANK = testing.load_arrays(FIXTURES / "bank.npz")


def _run_from(sched, state, begin, stop, x):
  """Calls begin … stop - 1 with the reference's fake model; the k-th kept call uses bank row k."""
  kept = stop - begin
  outputs = jnp.asarray(BANK["outputs"][:kept])
  noises = jnp.asarray(BANK["noises"][:kept])
  noise = jnp.asarray(BANK["noise"])

  @jax.jit
  def run(state, x, outputs, noises):
    def body(carry, xs):
      x, st = carry
      out, step_noise = xs
      model_output = 0.4 * noise + 0.2 * out + 0.5 * sched.scale_model_input(st, x)
      x, st = sched.step(st, model_output, x, noise=step_noise if sched.stochastic else None)
      return (x, st), x

    _, xs = jax.lax.scan(body, (x, state), (outputs, noises))
    return jnp.concatenate([x[None], xs])

  return np.asarray(run(state, x, outputs, noises))


@pytest.mark.parametrize("case_id", sorted(CASES))
def test_run_from_the_first_kept_call_matches_reference(case_id):
  case = CASES[case_id]
  ref = testing.load_arrays(FIXTURES / f"{case_id}.npz")
  sched = mdsch.from_config(case["config"])
  state = sched.init(case["steps"], shape=BANK["x0"].shape)
  total = mdsch.num_calls(state)
  x0, noise = jnp.asarray(BANK["x0"]), jnp.asarray(BANK["noise"])
  begin, stop = 0, total
  if "strength" in case:
    begin = mdsch.strength_start(case["steps"], case["strength"], mdsch.scheduler_order(sched))
    x = mdsch.add_noise_at(sched, state, begin, x0, noise)
  elif "denoising_start" in case:
    begin = mdsch.denoising_start_index(sched, state, case["denoising_start"])
    x = x0
  else:
    stop = mdsch.denoising_end_stop(sched, state, 0, case["denoising_end"])
    x = noise * state.init_noise_sigma
  assert (begin, stop) == (int(ref["begin"]), int(ref["stop"]))
  np.testing.assert_allclose(
    np.asarray(state.timesteps)[begin:stop], ref["timesteps"], rtol=1e-6, atol=1e-4
  )
  state = mdsch.start_at(sched, state, begin)
  samples = _run_from(sched, state, begin, stop, x)
  assert np.all(np.isfinite(samples))
  err = np.abs(samples - ref["samples"]).max(axis=(1, 2, 3, 4))
  assert err.max() <= 1e-5, f"{case_id}: max error {err.max():.3g} at kept call {err.argmax() - 1}"
