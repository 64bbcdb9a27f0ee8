"""Sampling loops compile once: the step is traced once for a 50-step `fori_loop` under `jax.jit`."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import md_schedulers as mdsch

SHAPE = (1, 4, 4, 4)


def _loop(sched, counter):
  def traced_step(state, model_output, sample, key):
    counter.append(1)  # runs once per trace, never per iteration
    return sched.step(state, model_output, sample, key if sched.stochastic else None)

  @jax.jit
  def sample(state, x, key):
    def body(i, carry):
      x, st = carry
      model_in = sched.scale_model_input(st, x)
      model_output = 0.5 * model_in - 0.1 * jnp.tanh(x)  # a stand-in denoiser
      x, st = traced_step(st, model_output, x, jax.random.fold_in(key, i))
      return x, st

    return jax.lax.fori_loop(0, mdsch.num_calls(state), body, (x * state.init_noise_sigma, state))

  return sample


@pytest.mark.parametrize(
  "make",
  [
    lambda: mdsch.unipc_multistep(
      use_flow_sigmas=True, prediction_type="flow_prediction", flow_shift=3.0
    ),
    lambda: mdsch.euler(beta_schedule="scaled_linear", beta_start=0.00085, beta_end=0.012),
    lambda: mdsch.dpm_solver_multistep(algorithm_type="sde-dpmsolver++", use_karras_sigmas=True),
    lambda: mdsch.flow_match_euler(shift=3.0),
  ],
  ids=["unipc_flow", "euler", "dpmpp_sde_karras", "flow_match"],
)
def test_fifty_step_loop_traces_the_step_once(make):
  sched = make()
  counter = []
  run = _loop(sched, counter)
  x = jax.random.normal(jax.random.key(0), SHAPE)
  state = (
    sched.init(50, shape=SHAPE)
    if sched.name != "FlowMatchEulerDiscreteScheduler"
    else sched.init(50)
  )
  out, final = run(state, x, jax.random.key(1))
  assert len(counter) == 1
  assert int(final.step) == 50
  assert np.all(np.isfinite(np.asarray(out)))
  # A new state with the same shapes (other noise) reuses the compiled loop.
  out2, _ = run(state, x + 1.0, jax.random.key(2))
  assert len(counter) == 1
  assert not np.allclose(np.asarray(out), np.asarray(out2))


def test_fori_loop_equals_python_loop():
  sched = mdsch.dpm_solver_multistep(solver_order=3)
  state = sched.init(12, shape=SHAPE)
  x = jax.random.normal(jax.random.key(0), SHAPE)
  step = jax.jit(sched.step)
  st, y = state, x
  for _ in range(mdsch.num_calls(state)):
    y, st = step(st, 0.3 * y, y)

  def body(_, carry):
    y, st = carry
    return sched.step(st, 0.3 * y, y)

  z, _ = jax.jit(lambda s, v: jax.lax.fori_loop(0, 12, body, (v, s)))(state, x)
  np.testing.assert_allclose(np.asarray(z), np.asarray(y), rtol=1e-6, atol=1e-6)


def test_stochastic_step_needs_a_key_or_noise():
  sched = mdsch.euler_ancestral()
  state = sched.init(10)
  x = jnp.zeros(SHAPE)
  with pytest.raises(ValueError, match="stochastic"):
    sched.step(state, x, x)
  with pytest.raises(ValueError, match="noise has shape"):
    sched.step(state, x, x, noise=jnp.zeros((1, 4)))
  a, _ = sched.step(state, x, x, jax.random.key(0))
  b, _ = sched.step(state, x, x, jax.random.key(0))
  np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_state_is_a_pytree_with_the_documented_fields():
  state = mdsch.heun().init(5, shape=SHAPE)
  assert state.timesteps.shape == (9,) and state.sigmas.shape == (10,)
  assert state.step.dtype == jnp.int32 and state.step.shape == ()
  assert mdsch.current_timestep(state) == state.timesteps[0]
  leaves = jax.tree_util.tree_leaves(state)
  assert all(isinstance(v, jax.Array) for v in leaves)


@pytest.mark.parametrize("name", sorted(mdsch.SCHEDULERS))
def test_step_keeps_the_sample_dtype(name):
  # A loop carry must keep its dtype: f32 latents stay f32 with a bf16 model output, bf16 stays bf16.
  sched = mdsch.from_config({"_class_name": name})
  state = sched.init(6, shape=SHAPE)
  key = jax.random.key(0) if sched.stochastic else None
  for sample_dtype in (jnp.float32, jnp.bfloat16):
    x = jnp.ones(SHAPE, sample_dtype)
    out, new_state = sched.step(state, jnp.full(SHAPE, 0.1, jnp.bfloat16), x, key)
    assert out.dtype == sample_dtype
    assert int(new_state.step) == 1
    assert jax.tree_util.tree_structure(new_state) == jax.tree_util.tree_structure(state)
    for a, b in zip(jax.tree_util.tree_leaves(new_state), jax.tree_util.tree_leaves(state)):
      assert a.dtype == b.dtype and a.shape == b.shape
