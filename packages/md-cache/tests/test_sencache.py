"""md_cache.sencache through md_schedulers.sample on a toy denoiser, against a NumPy re-implementation of
the rule (MaxDiffusion's Wan 2.2 SenCache loop): the same steps reused, the same samples."""

import jax.numpy as jnp
import numpy as np
import pytest

import md_cache
import md_schedulers as mdsch

STEPS = 12


def _denoise(params, x, t, cond, *, step):
  del params, cond, step
  return jnp.sin(3.0 * x) + t[:, None, None] / 1000.0  # a velocity that moves with x and t


def _md(cache):
  sched = mdsch.flow_match_euler(shift=3.0)
  st = sched.init(STEPS)
  x = jnp.asarray(np.random.RandomState(0).randn(2, 5, 3), jnp.float32)
  out = mdsch.sample(_denoise, sched, x, st, None, cache=cache)
  return np.asarray(out.latents), out, np.asarray(st.timesteps), np.asarray(st.sigmas)


def _reference(ts, sigmas, epsilon, max_reuse, warmup, start_ratio, end_ratio, ax, at):
  """The rule written out step by step (float64)."""
  x = np.random.RandomState(0).randn(2, 5, 3).astype(np.float32).astype(np.float64)
  start, end = max(warmup, int(STEPS * start_ratio)), int(STEPS * (1.0 - end_ratio))
  ref = ref_x = None
  ref_t = acc_x = acc_t = 0.0
  reuse = 0
  computed = []
  for i in range(STEPS):
    t = float(ts[i]) / 1000.0
    run = i < start or i >= end or ref is None
    if not run:
      acc_x += np.sqrt(np.mean((x - ref_x) ** 2))
      acc_t += abs(t - ref_t)
      run = not (ax * acc_x + at * acc_t <= epsilon and reuse < max_reuse)
    if run:
      ref = np.sin(3.0 * x) + float(ts[i]) / 1000.0
      ref_x, ref_t, acc_x, acc_t, reuse = x, t, 0.0, 0.0, 0
    else:
      reuse += 1
    computed.append(run)
    x = x + (float(sigmas[i + 1]) - float(sigmas[i])) * ref
  return x, np.array(computed)


CASES = {
  "defaults": dict(
    epsilon=0.1, max_reuse=3, warmup=1, start_ratio=0.3, end_ratio=0.1, ax=1.0, at=1.0
  ),
  "loose": dict(epsilon=0.6, max_reuse=2, warmup=2, start_ratio=0.0, end_ratio=0.2, ax=0.5, at=2.0),
  "wide": dict(epsilon=3.0, max_reuse=4, warmup=1, start_ratio=0.1, end_ratio=0.0, ax=1.0, at=1.0),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_matches_the_rule(case):
  kw = CASES[case]
  cache = md_cache.sencache(
    kw["epsilon"], max_reuse=kw["max_reuse"], warmup_steps=kw["warmup"],
    nocache_start_ratio=kw["start_ratio"], nocache_end_ratio=kw["end_ratio"], alpha_x=kw["ax"],
    alpha_t=kw["at"],
  )  # fmt: skip
  out, carry, ts, sigmas = _md(cache)
  want_x, want = _reference(ts, sigmas, **kw)
  got = md_cache.computed_steps(carry.cache)
  np.testing.assert_array_equal(got, want)
  assert 0 < want.sum() < STEPS, f"{case} tests nothing: computed {want.astype(int)}"
  assert int(carry.calls) == want.sum()
  np.testing.assert_allclose(out, want_x, atol=2e-5)


def test_zero_tolerance_is_uncached():
  plain, *_ = _md(None)
  out, carry, *_ = _md(md_cache.sencache(-1.0))
  assert md_cache.computed_steps(carry.cache).all()
  np.testing.assert_array_equal(out, plain)


def test_errors_and_identity():
  with pytest.raises(ValueError, match="max_reuse=-1"):
    md_cache.sencache(max_reuse=-1)
  with pytest.raises(ValueError, match="nocache_end_ratio=1.5"):
    md_cache.sencache(nocache_end_ratio=1.5)
  assert md_cache.sencache(0.1) == md_cache.sencache(0.3, max_reuse=1, alpha_t=0.0)


def test_new_settings_reuse_the_compiled_loop():
  import functools

  import jax

  sched = mdsch.flow_match_euler(shift=3.0)
  st = sched.init(STEPS)
  x = jnp.asarray(np.random.RandomState(0).randn(2, 5, 3), jnp.float32)
  traces = []

  @functools.partial(jax.jit, static_argnums=0)
  def run(cache, carry):
    traces.append(1)
    return mdsch.run_steps(_denoise, sched, carry, 0, STEPS, None, cache=cache)

  ts, sigmas = np.asarray(st.timesteps), np.asarray(st.sigmas)
  for case in ("defaults", "wide"):
    kw = CASES[case]
    cache = md_cache.sencache(
      kw["epsilon"], max_reuse=kw["max_reuse"], warmup_steps=kw["warmup"],
      nocache_start_ratio=kw["start_ratio"], nocache_end_ratio=kw["end_ratio"], alpha_x=kw["ax"],
      alpha_t=kw["at"],
    )  # fmt: skip
    out = run(cache, mdsch.init_state(x, st, cache=cache))
    _, want = _reference(ts, sigmas, **kw)
    np.testing.assert_array_equal(md_cache.computed_steps(out.cache), want)
  assert len(traces) == 1, "a new sencache setting retraced the loop"
