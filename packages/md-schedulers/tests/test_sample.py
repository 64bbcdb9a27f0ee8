"""md_schedulers.sample / drive: the one loop equals a hand-written Python loop, with guidance, experts,
caches, chunks, callbacks and cancellation."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import md_schedulers as mdsch
from md_schedulers import guidance as G

B, SHAPE = 2, (2, 3, 3, 4)


def _sched():
  return mdsch.euler(beta_schedule="scaled_linear", beta_start=0.00085, beta_end=0.012)


def _denoise(params, x, t, cond, *, step):
  """A stand-in model: depends on the rows' conditioning, the timestep and the step."""
  del step
  c = cond.reshape(cond.shape + (1,) * (x.ndim - 1))
  return params * jnp.tanh(x) + 0.01 * c * (t.reshape(t.shape + (1,) * (x.ndim - 1)) / 1000.0)


def _python_loop(sched, st, x, combine, start=0, stop=None, reuse=lambda i: False):
  stop = mdsch.num_calls(st) if stop is None else stop
  prev = None
  calls = 0
  for i in range(start, stop):
    t = mdsch.current_timestep(st)
    if reuse(i) and prev is not None:
      pred = prev
    else:
      pred = combine(i, sched.scale_model_input(st, x), t)
      calls += 1
    prev = pred
    x, st = sched.step(st, pred, x)
  return x, calls


def _setup(steps=6):
  sched = _sched()
  st = sched.init(steps, shape=SHAPE)
  x = jax.random.normal(jax.random.key(0), SHAPE) * st.init_noise_sigma
  return sched, st, x


def test_no_guidance_equals_python_loop_and_counts_calls():
  sched, st, x = _setup()
  cond = jnp.asarray([1.0, 2.0])
  out = jax.jit(lambda x, st: mdsch.sample(_denoise, sched, x, st, cond, params=0.5))(x, st)
  want, calls = _python_loop(
    sched, st, x, lambda i, xin, t: _denoise(0.5, xin, jnp.full((B,), t), cond, step=i)
  )
  chex.assert_trees_all_close(out.latents, want, atol=1e-5, rtol=1e-6)
  assert int(out.calls) == calls == 6


def test_cfg_rows_are_negative_then_positive_with_per_step_scales_and_rescale():
  sched, st, x = _setup()
  spec = G.Guidance(cfg=True, rescale=True)
  cond = jnp.asarray([0.0, 0.0, 5.0, 7.0])  # [negative × B, positive × B]
  g = np.linspace(1.5, 7.0, 6).astype(np.float32)
  scales = G.per_step(6, {"guidance": g, "rescale": 0.7})

  def combine(i, xin, t):
    out = _denoise(0.5, jnp.concatenate([xin, xin]), jnp.full((2 * B,), t), cond, step=i)
    uncond, text = out[:B], out[B:]
    guided = uncond + g[i] * (text - uncond)
    axes = (1, 2, 3)
    std_t = jnp.std(text, axis=axes, keepdims=True, ddof=1)
    std_g = jnp.std(guided, axis=axes, keepdims=True, ddof=1)
    return 0.7 * guided * std_t / std_g + 0.3 * guided

  out = mdsch.sample(_denoise, sched, x, st, cond, params=0.5, guidance=spec, scales=scales)
  want, _ = _python_loop(sched, st, x, combine)
  chex.assert_trees_all_close(out.latents, want, atol=1e-5, rtol=0)


def test_per_row_scales_and_missing_scales():
  sched, st, x = _setup(3)
  spec = G.Guidance(cfg=True)
  cond = jnp.asarray([0.0, 0.0, 5.0, 7.0])
  scales = G.per_step(3, {"guidance": np.tile([[2.0, 1.0]], (3, 1))})
  out = mdsch.sample(_denoise, sched, x, st, cond, params=0.5, guidance=spec, scales=scales)
  # Row 1 has scale 1: plain conditional prediction, as running without guidance on its own row.
  alone = mdsch.sample(
    _denoise, sched, x[1:], sched.init(3, shape=(1,) + SHAPE[1:]), cond[3:], params=0.5
  )
  chex.assert_trees_all_close(out.latents[1:], alone.latents, atol=1e-5, rtol=1e-6)
  with pytest.raises(ValueError, match=r"needs per-step scales \['guidance'\]"):
    mdsch.sample(_denoise, sched, x, st, cond, params=0.5, guidance=spec)


def test_guidance_terms_closed_forms():
  u, c, p = (jnp.full((1, 2), v) for v in (1.0, 3.0, 2.0))
  spec = G.Guidance(cfg=True, stg=True)
  out = G.combine(spec, jnp.concatenate([u, c, p]), {"guidance": 2.0, "stg": 0.5})
  chex.assert_trees_all_close(out, (1 + 2 * (3 - 1)) + 0.5 * (3 - 2) * jnp.ones((1, 2)))
  gated = G.combine(G.Guidance(cfg=True, gate=True), jnp.concatenate([u, c]), {"guidance": 1.0})
  chex.assert_trees_all_close(gated, c)
  # x0 space: guidance on x - sigma * v, turned back into a velocity; linear terms agree.
  x = jnp.full((1, 2), 0.3)
  v = G.combine(
    G.Guidance(cfg=True, space="x0"), jnp.concatenate([u, c]), {"guidance": 2.0}, sample=x,
    sigma=0.5,
  )  # fmt: skip
  chex.assert_trees_all_close(v, jnp.full((1, 2), 5.0), atol=1e-6)
  star = G.cfg_star(jnp.asarray([[1.0, 0.0]]), jnp.asarray([[2.0, 2.0]]))
  chex.assert_trees_all_close(star, jnp.asarray([[2.0, 0.0]]))
  with pytest.raises(ValueError, match="Guidance.rescale needs cfg=True"):
    G.Guidance(rescale=True)
  with pytest.raises(ValueError, match="guidance has 3 values; give one, or one per step"):
    G.per_step(4, {"guidance": [1, 2, 3]})
  with pytest.raises(ValueError, match="must be a number"):
    G.per_step(4, {"guidance": "high"})
  assert G.per_step(3, {"stg": [1.0, 2.0]}, windows=[0, 1, 1])["stg"].tolist() == [1.0, 2.0, 2.0]


def test_two_experts_switch_at_their_step_with_their_own_scales():
  sched, st, x = _setup(6)
  spec = G.Guidance(cfg=True)
  cond = jnp.asarray([0.0, 0.0, 5.0, 7.0])
  s1, s2 = G.per_step(6, {"guidance": 4.0}), G.per_step(6, {"guidance": 2.0})
  experts = [mdsch.Expert(_denoise, 0.5, 4, s1), mdsch.Expert(_denoise, -0.25, 6, s2)]
  out = mdsch.sample(None, sched, x, st, cond, guidance=spec, experts=experts)

  def combine(i, xin, t):
    p, g = (0.5, 4.0) if i < 4 else (-0.25, 2.0)
    o = _denoise(p, jnp.concatenate([xin, xin]), jnp.full((2 * B,), t), cond, step=i)
    return o[:B] + g * (o[B:] - o[:B])

  want, _ = _python_loop(sched, st, x, combine)
  chex.assert_trees_all_close(out.latents, want, atol=1e-5, rtol=0)
  with pytest.raises(ValueError, match="either a denoiser or experts"):
    mdsch.sample(_denoise, sched, x, st, cond, guidance=spec, experts=experts)


def _reuse_odd_steps():
  """A toy step cache: on odd steps reuse the previous step's prediction."""

  def init(latents, num_steps):
    del num_steps
    return jnp.zeros_like(latents)

  def decide(state, step, t, x):
    return step % 2 == 1, state

  def update(state, step, t, x, pred, reused):
    return pred

  return mdsch.StepCache(init, decide, update)


def test_step_cache_hook_skips_the_denoiser_on_odd_steps():
  sched, st, x = _setup(6)
  cond = jnp.asarray([1.0, 2.0])
  out = jax.jit(
    lambda x, st: mdsch.sample(_denoise, sched, x, st, cond, params=0.5, cache=_reuse_odd_steps())
  )(x, st)
  want, calls = _python_loop(
    sched, st, x, lambda i, xin, t: _denoise(0.5, xin, jnp.full((B,), t), cond, step=i),
    reuse=lambda i: i % 2 == 1,
  )  # fmt: skip
  assert int(out.calls) == calls == 3
  chex.assert_trees_all_close(out.latents, want, atol=1e-5, rtol=1e-6)


def test_a_step_cache_never_reuses_across_an_expert_switch():
  """Experts switch at step 3, which the toy cache would reuse (odd): the loop runs the second
  expert there instead of taking the first expert's step-2 prediction; other odd steps are reused."""
  sched, st, x = _setup(6)
  cond = jnp.asarray([1.0, 2.0])
  experts = [mdsch.Expert(_denoise, 0.5, 3, None), mdsch.Expert(_denoise, -0.25, 6, None)]
  out = jax.jit(
    lambda x, st: mdsch.sample(None, sched, x, st, cond, experts=experts, cache=_reuse_odd_steps())
  )(x, st)
  want, calls = _python_loop(
    sched, st, x,
    lambda i, xin, t: _denoise(0.5 if i < 3 else -0.25, xin, jnp.full((B,), t), cond, step=i),
    reuse=lambda i: i % 2 == 1 and i != 3,
  )  # fmt: skip
  assert int(out.calls) == calls == 4  # steps 0, 2, 3, 4
  chex.assert_trees_all_close(out.latents, want, atol=1e-5, rtol=1e-6)


def test_part_way_start_and_stop():
  sched, st, x = _setup(8)
  cond = jnp.asarray([1.0, 2.0])
  st3 = mdsch.start_at(sched, st, 3)
  out = mdsch.sample(_denoise, sched, x, st3, cond, params=0.5, start=3, stop=6)
  want, calls = _python_loop(
    sched, st3, x, lambda i, xin, t: _denoise(0.5, xin, jnp.full((B,), t), cond, step=i), 3, 6
  )
  assert int(out.calls) == calls == 3
  chex.assert_trees_all_close(out.latents, want, atol=1e-5, rtol=1e-6)


def _chunked(sched, cond):
  traces = []

  @jax.jit
  def run(carry, lo, hi):
    traces.append(1)
    return mdsch.run_steps(_denoise, sched, carry, lo, hi, cond, params=0.5)

  return run, traces


def test_drive_in_chunks_equals_one_loop_compiles_once_and_reports_each_step():
  sched, st, x = _setup(6)
  cond = jnp.asarray([1.0, 2.0])
  whole = mdsch.sample(_denoise, sched, x, st, cond, params=0.5)
  run, traces = _chunked(sched, cond)
  for chunk in (1, 4, None, "auto"):
    out = mdsch.drive(run, mdsch.init_state(x, st), 0, 6, chunk=chunk)
    chex.assert_trees_all_close(out.latents, whole.latents, atol=1e-5, rtol=1e-6)
    assert int(out.calls) == 6
  assert len(traces) == 1
  seen = []
  mdsch.drive(
    run, mdsch.init_state(x, st), 0, 6, callback=lambda i, t, z: seen.append((i, float(t), z.shape))
  )
  assert [s[0] for s in seen] == list(range(6))
  assert [s[1] for s in seen] == [float(v) for v in np.asarray(st.timesteps)]
  assert all(s[2] == SHAPE for s in seen)


def test_drive_cancels_at_a_step_boundary():
  sched, st, x = _setup(6)
  cond = jnp.asarray([1.0, 2.0])
  run, _ = _chunked(sched, cond)
  polls = []
  with pytest.raises(mdsch.Cancelled, match="cancelled at step 2/6") as err:
    mdsch.drive(
      run, mdsch.init_state(x, st), 0, 6, cancel=lambda: polls.append(1) or len(polls) >= 2
    )
  assert err.value.step == 2 and int(err.value.state.calls) == 2
  partial = mdsch.sample(_denoise, sched, x, st, cond, params=0.5, stop=2)
  chex.assert_trees_all_close(err.value.state.latents, partial.latents, atol=1e-5, rtol=1e-6)
  with pytest.raises(mdsch.Cancelled):
    mdsch.drive(run, mdsch.init_state(x, st), 0, 6, callback=lambda i, t, z: i < 3)


def test_multi_modality_sample_steps_each_leaf():
  sched = mdsch.flow_match_euler(shift=3.0)
  st = sched.init(4)
  x = (jnp.ones((1, 2, 3)), jnp.full((1, 5), 0.5))
  den = lambda p, x, t, c, *, step: jax.tree.map(lambda a: -a * p, x)  # noqa: E731
  out = mdsch.sample(den, sched, x, st, None, params=1.0)
  sig = np.asarray(st.sigmas)
  factor = np.prod([1 - (sig[i + 1] - sig[i]) for i in range(4)])
  chex.assert_trees_all_close(out.latents[0], factor * x[0], atol=1e-6)
  chex.assert_trees_all_close(out.latents[1], factor * x[1], atol=1e-6)


def test_per_modality_scales_and_rescale_last():
  """A `(video, audio)` sample with one scale per modality, guidance in x0 space, the rescale applied
  after every term (LTX-2's order): equal to the same maths written out per leaf."""
  sched = mdsch.flow_match_euler(shift=1.0)
  st = sched.init(3)
  x = (jnp.linspace(-1, 1, 12).reshape(1, 3, 4), jnp.linspace(0, 2, 10).reshape(1, 5, 2))
  spec = G.Guidance(cfg=True, rescale=True, rescale_last=True, stg=True, space="x0")
  scales = G.per_step(3, {"guidance": (3.0, 7.0), "stg": (1.0, 0.5), "rescale": (0.7, 0.0)})
  assert isinstance(scales["guidance"], tuple) and scales["guidance"][1].tolist() == [7.0] * 3

  def den(p, x, t, c, *, step):
    del p, t, c
    k = jnp.asarray([1.0, 2.0, 0.5]).reshape(3, 1, 1)  # negative, positive, perturbed rows differ
    return tuple(jnp.tanh(a) * k + step * 0.1 for a in x)

  out = mdsch.sample(den, sched, x, st, None, guidance=spec, scales=scales)

  sig = np.asarray(st.sigmas)
  want = list(x)
  for i in range(3):
    new = []
    for j, a in enumerate(want):
      rows = jnp.concatenate([a] * 3)
      o = den(None, (rows,) * 2, None, None, step=i)[0]
      x0 = [a - o[r : r + 1] * sig[i] for r in range(3)]
      g = x0[0] + (3.0, 7.0)[j] * (x0[1] - x0[0])
      g = g + (1.0, 0.5)[j] * (x0[1] - x0[2])
      g = G.rescale(g, x0[1], (0.7, 0.0)[j])
      v = (a - g) / sig[i]
      new.append(a + (sig[i + 1] - sig[i]) * v)
    want = new
  for got, w in zip(out.latents, want):
    chex.assert_trees_all_close(got, w, atol=1e-5, rtol=1e-5)
  with pytest.raises(ValueError, match="rescale_last needs rescale=True"):
    G.Guidance(cfg=True, rescale_last=True)


def test_drive_reports_flops_compile_phase_and_warns_on_long_runs(capsys, monkeypatch):
  """With a progress bar: FLOPs per step from the lowered chunk before the run, and a warning when the
  steps left should take longer than MD_LONG_RUN_SECONDS (0 here, so any run warns)."""
  from md_core import progress as md_progress

  sched, st, x = _setup(6)
  cond = jnp.asarray([1.0, 2.0])

  @jax.jit
  def run(carry, lo, hi, params, cond):
    return mdsch.run_steps(_denoise, sched, carry, lo, hi, cond, params=params)

  assert mdsch.step_flops(run, mdsch.init_state(x, st), 0, (0.5, cond)) > 0
  assert mdsch.step_flops(lambda *a: None, mdsch.init_state(x, st), 0) is None
  monkeypatch.setenv("MD_LONG_RUN_SECONDS", "0")
  md_progress.set_progress(True)
  try:
    out = mdsch.drive(run, mdsch.init_state(x, st), 0, 6, args=(0.5, cond), progress=True)
  finally:
    md_progress.set_progress(None)
  err = capsys.readouterr().err
  assert "denoising: 6 steps on latents [2, 3, 3, 4]" in err and "GFLOP per step" in err
  assert "expected under a second" in err and err.count("warning: denoising needs about") == 1
  assert "compiling" in err and "warning: denoising needs about" in err
  whole = mdsch.sample(_denoise, sched, x, st, cond, params=0.5)
  chex.assert_trees_all_close(out.latents, whole.latents, atol=1e-5, rtol=1e-6)


def test_auto_chunks_grow_after_the_first_steps(monkeypatch):
  """chunk="auto": one step, one step, then chunks sized to AUTO_CHUNK_SECONDS of work (here: all
  the rest at once, as the steps are fast); the result equals one program."""
  from md_schedulers import _sample

  sched, st, x = _setup(12)
  cond = jnp.asarray([1.0, 2.0])
  run, _ = _chunked(sched, cond)
  seen = []

  def recorded(carry, lo, hi):
    seen.append((int(lo), int(hi)))
    return run(carry, lo, hi)

  monkeypatch.setattr(_sample, "AUTO_CHUNK_SECONDS", 10.0)
  out = mdsch.drive(recorded, mdsch.init_state(x, st), 0, 12)
  assert seen == [(0, 1), (1, 2), (2, 12)]
  whole = mdsch.sample(_denoise, sched, x, st, cond, params=0.5)
  chex.assert_trees_all_close(out.latents, whole.latents, atol=1e-5, rtol=1e-6)
  with pytest.raises(ValueError, match="chunk=0: expected a positive number of steps"):
    mdsch.drive(recorded, mdsch.init_state(x, st), 0, 12, chunk=0)
