"""Trajectories of every scheduler and option against the diffusers reference (tools/fixtures/schedulers.py).

Each case replays the reference's fake model (0.4 * initial noise + 0.2 * bank output + 0.5 * scaled
model input) and its step
noises inside one jitted `lax.scan`, and compares timesteps, sigmas and every intermediate sample.
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import md_schedulers as mdsch
from md_core import testing

FIXTURES = testing.fixture_path("schedulers")
CASES = json.loads((FIXTURES / "cases.json").read_text())
BANK = testing.load_arrays(FIXTURES / "bank.npz")
ATOL = 1e-5


def _scheduler(case):
  # The reference's step arguments (DDIM/TCD eta, Euler churn) are factory options in md.
  return mdsch.from_config(case["config"], **case["step"])


def _trajectory(sched, state):
  calls = mdsch.num_calls(state)
  outputs = jnp.asarray(BANK["outputs"][:calls])
  noises = jnp.asarray(BANK["noises"][:calls])
  init = jnp.asarray(BANK["init"])

  @jax.jit
  def run(state, init, outputs, noises):
    x = init * state.init_noise_sigma

    def body(carry, xs):
      x, st = carry
      out, noise = xs
      model_in = sched.scale_model_input(st, x)
      model_output = 0.4 * init + 0.2 * out + 0.5 * model_in
      x, st = sched.step(st, model_output, x, noise=noise if sched.stochastic else None)
      return (x, st), x

    (_, final_state), xs = jax.lax.scan(body, (x, state), (outputs, noises))
    return jnp.concatenate([x[None], xs]), final_state.step

  return run(state, init, outputs, noises)


@pytest.mark.parametrize("case_id", sorted(CASES))
def test_trajectory_matches_reference(case_id):
  case = CASES[case_id]
  ref = testing.load_arrays(FIXTURES / f"{case_id}.npz")
  sched = _scheduler(case)
  assert sched.name == case["config"]["_class_name"]
  state = sched.init(**case["init"], shape=BANK["init"].shape)

  ts = np.asarray(state.timesteps)
  if case["timesteps_dtype"].startswith("int"):
    assert ts.dtype == np.int32, ts.dtype
    np.testing.assert_array_equal(ts, ref["timesteps"])
  else:
    assert ts.dtype == np.float32, ts.dtype
    np.testing.assert_allclose(ts, ref["timesteps"], rtol=1e-6, atol=1e-4)
  if "sigmas" in ref:
    # LTX Euler ancestral pads one sigma so its final (no-op) call can index sigma_next.
    sigmas = np.asarray(state.sigmas)[: len(ref["sigmas"])]
    # rtol 2e-6: the zero-SNR rescaling amplifies float32 rounding of the training betas.
    np.testing.assert_allclose(sigmas, ref["sigmas"], rtol=2e-6, atol=1e-7)
  np.testing.assert_allclose(
    float(state.init_noise_sigma), float(ref["init_noise_sigma"]), rtol=1e-6
  )

  samples, steps = _trajectory(sched, state)
  assert int(steps) == len(ref["timesteps"])
  samples = np.asarray(samples)
  assert np.all(np.isfinite(samples))
  # Absolute 1e-5 wherever samples are O(1); relative beyond (zero-SNR schedules start at sigma 4096,
  # where one float32 ulp is 1e-3).
  scale = np.maximum(1.0, np.abs(ref["samples"]).max(axis=(1, 2, 3, 4)))
  err = np.abs(samples - ref["samples"]).max(axis=(1, 2, 3, 4)) / scale
  assert err.max() <= ATOL, f"{case_id}: max error {err.max():.3g} (scaled) at call {err.argmax()}"
