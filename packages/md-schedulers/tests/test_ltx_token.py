"""ltx_token_euler against the LTX pipelines' inline Euler steps (written out here as Python loops)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import md_schedulers as mdsch

CONFIG = dict(
  use_dynamic_shifting=True, base_shift=0.95, max_shift=2.05, base_image_seq_len=1024,
  max_image_seq_len=4096, shift_terminal=0.1,
)  # fmt: skip


def _velocity(i, x):  # a deterministic stand-in for the model
  return jnp.sin(x * (i + 1.0)) + 0.1 * i


def _run(sched, state, x, steps):
  def body(i, carry):
    x, st = carry
    return sched.step(st, _velocity(i, x), x)

  return jax.lax.fori_loop(0, steps, body, (x, state))[0]


def test_without_conditioning_equals_flow_match_euler():
  x = jax.random.normal(jax.random.key(0), (2, 6, 3))
  ref = mdsch.flow_match_euler(**CONFIG)
  sched = mdsch.ltx_token_euler(**CONFIG)
  kw = dict(sigmas=mdsch.ltx_uniform_sigmas(4), mu=1.3)
  want = _run(ref, ref.init(**kw), x, 4)
  got = _run(sched, sched.init(**kw), x, 4)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_keep_rule_equals_masked_euler():
  """LTX-2 / LTX-Video i2v: `where(c > 0.5, x, x + (sigma_next - sigma) v)` every step."""
  x = jax.random.normal(jax.random.key(1), (2, 6, 3))
  c = np.zeros((2, 6), np.float32)
  c[:, :2] = 1.0
  sched = mdsch.ltx_token_euler(**CONFIG)
  st = sched.init(sigmas=mdsch.ltx_uniform_sigmas(3), mu=0.7, conditioning=c)
  got = _run(sched, st, x, 3)
  want, sig = x, np.asarray(st.sigmas)
  for i in range(3):
    moved = want + (sig[i + 1] - sig[i]) * _velocity(i, want)
    want = jnp.where(jnp.asarray(c)[..., None] > 0.5, want, moved)
  # (eager vs jitted sin in the stand-in model: a few ulps)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-6, rtol=0)
  np.testing.assert_array_equal(np.asarray(got)[:, :2], np.asarray(x)[:, :2])
  assert np.abs(np.asarray(got)[:, 2:] - np.asarray(x)[:, 2:]).min() > 0


def _per_token_reference(x, c, ts, sig, steps):
  """LTX-Video's condition-mode step, in numpy (float32)."""
  x, c = np.asarray(x, np.float32), np.asarray(c, np.float32)
  for i in range(steps):
    t = np.float32(ts[i])
    timestep = np.minimum(t, (1 - c) * np.float32(1000.0))
    current = timestep / np.float32(1000.0)
    lower = sig[:, None, None] < current[None] - np.float32(1e-6)
    nxt = np.max(lower * sig[:, None, None], axis=0)
    out = np.asarray(_velocity(i, jnp.asarray(x)))
    moved = x + (current - nxt)[..., None] * (-out)
    keep = (t / np.float32(1000.0) - np.float32(1e-6) < (1 - c))[..., None]
    x = np.where(keep, moved, x)
  return x


def test_per_token_rule_equals_ltx_video_condition_step():
  """Fractional conditioning strengths: each token at its own level, waiting until the schedule reaches
  it; zeros give the reference's unconditioned path."""
  x = jax.random.normal(jax.random.key(2), (1, 8, 4))
  c = np.asarray([[1.0, 0.9, 0.5, 0.2, 0.0, 0.0, 0.7, 0.0]], np.float32)
  sched = mdsch.ltx_token_euler(rule="per_token", **CONFIG)
  for mask in (c, np.zeros_like(c)):
    st = sched.init(sigmas=mdsch.ltx_uniform_sigmas(5), mu=1.0, conditioning=mask)
    got = _run(sched, st, x, 5)
    want = _per_token_reference(x, mask, np.asarray(st.timesteps), np.asarray(st.sigmas), 5)
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-5, rtol=0)
    if mask is c:  # the fully conditioned token never moves
      np.testing.assert_array_equal(np.asarray(got)[:, 0], np.asarray(x)[:, 0])


def test_token_timesteps():
  t = jnp.asarray([800.0, 200.0])
  c = jnp.asarray([[1.0, 0.5, 0.0], [1.0, 0.5, 0.0]])
  np.testing.assert_allclose(
    np.asarray(mdsch.ltx_token_timesteps(t, c)), [[0, 400, 800], [0, 100, 200]]
  )
  np.testing.assert_allclose(
    np.asarray(mdsch.ltx_token_timesteps(t, c, rule="per_token")), [[0, 500, 800], [0, 200, 200]]
  )


def test_two_modalities_in_run_steps():
  """A (video [B, f, h, w, C], audio [B, L, D]) sample: the mask [B, f, h, w] holds the video's first
  frame; the audio (same token count) takes the plain step."""
  video = jax.random.normal(jax.random.key(3), (2, 2, 2, 1, 3))
  audio = jax.random.normal(jax.random.key(4), (2, 4, 3))
  c = np.zeros((2, 2, 2, 1), np.float32)
  c[:, 0] = 1.0
  sched = mdsch.ltx_token_euler(**CONFIG)
  kw = dict(sigmas=mdsch.ltx_uniform_sigmas(2), mu=0.5)
  st = sched.init(**kw, conditioning=c, shape=(video.shape, audio.shape))

  def denoise(params, x, t, cond, *, step):
    del params, t, cond
    return jax.tree.map(lambda a: _velocity(step, a), x)

  out = mdsch.sample(denoise, sched, (video, audio), st, None).latents
  ref = mdsch.flow_match_euler(**CONFIG)
  plain = mdsch.sample(denoise, ref, (video, audio), ref.init(**kw), None).latents
  np.testing.assert_array_equal(np.asarray(out[1]), np.asarray(plain[1]))
  np.testing.assert_array_equal(np.asarray(out[0])[:, 1:], np.asarray(plain[0])[:, 1:])
  np.testing.assert_array_equal(np.asarray(out[0])[:, :1], np.asarray(video)[:, :1])


def test_errors():
  sched = mdsch.ltx_token_euler(**CONFIG)
  kw = dict(sigmas=mdsch.ltx_uniform_sigmas(2), mu=0.5)
  with pytest.raises(ValueError, match="exactly one sample leaf"):
    sched.init(**kw, conditioning=np.zeros((2, 4)), shape=((2, 4, 3), (2, 4, 5)))
  with pytest.raises(ValueError, match="exactly one sample leaf"):
    sched.init(**kw, conditioning=np.zeros((2, 4)), shape=(2, 5, 3))
  sched.init(**kw, conditioning=np.zeros((2, 4)), shape=(2, 4, 3))
  with pytest.raises(ValueError, match="rule="):
    mdsch.ltx_token_euler(rule="soft")
  with pytest.raises(ValueError, match="stochastic_sampling"):
    mdsch.ltx_token_euler(stochastic_sampling=True)
  with pytest.raises(TypeError, match="unknown options"):
    mdsch.ltx_token_euler(eta=1.0)


def test_conditioning_noise_equals_ltx_video_reinjection():
  """LTX-Video's `image_cond_noise_scale`: before each model call the hard-conditioned tokens become
  `clean + s * eps_i * (t_i / 1000)^2`. The scheduler does it at the end of the previous call (and
  `ltx_token_noised` before the first), which is the inline loop's order exactly."""
  x = jax.random.normal(jax.random.key(5), (2, 6, 3))
  clean = jax.random.normal(jax.random.key(6), (2, 6, 3))
  c = np.asarray([[1.0, 1.0, 0.6, 0.0, 0.0, 0.0]] * 2, np.float32)
  eps = jax.random.normal(jax.random.key(7), (4, 2, 6, 3))
  sched = mdsch.ltx_token_euler(rule="per_token", **CONFIG)
  st = sched.init(
    sigmas=mdsch.ltx_uniform_sigmas(4), mu=1.0, conditioning=c, cond_latents=clean, cond_noise=eps,
    cond_noise_scale=0.15,
  )  # fmt: skip

  def denoise(params, x, t, cond, *, step):
    del params, t, cond
    return _velocity(step, x)

  got = mdsch.sample(denoise, sched, mdsch.ltx_token_noised(st, x), st, None).latents

  # The inline loop (the pipeline before the shared loop).
  ts, sig = st.timesteps, st.sigmas
  cm = jnp.asarray(c)

  def body(i, x):
    t = ts[i]
    hard = (cm > 1.0 - 1e-6)[..., None]
    x = jnp.where(hard, clean + jnp.float32(0.15) * eps[i] * (t / 1000.0) ** 2, x)
    timestep = jnp.minimum(jnp.broadcast_to(t, (2, 1)), (1 - cm) * 1000.0)
    out = _velocity(i, x)
    current = timestep / 1000.0
    lower = sig[:, None, None] < current[None] - 1e-6
    nxt = jnp.max(lower * sig[:, None, None], axis=0)
    moved = x + (current - nxt)[..., None] * (-out)
    keep = (t / 1000.0 - 1e-6 < (1.0 - cm))[..., None]
    return jnp.where(keep, moved, x)

  want = jax.jit(lambda x: jax.lax.fori_loop(0, 4, body, x))(x)
  # The same arithmetic in two programs: XLA may fuse them differently (an ulp apart at its backend
  # optimisation level 0, the tests' setting); a wrong order of the reinjection would be off by ~0.1.
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-6, rtol=0)
  last = clean + 0.15 * eps[3] * (float(ts[3]) / 1000.0) ** 2
  np.testing.assert_allclose(np.asarray(got)[:, :2], np.asarray(last)[:, :2], atol=1e-6)
  # Without conditioning noise the first call sees the sample as given.
  plain = sched.init(sigmas=mdsch.ltx_uniform_sigmas(4), mu=1.0, conditioning=c)
  assert mdsch.ltx_token_noised(plain, x) is x
  with pytest.raises(ValueError, match="needs both cond_latents and cond_noise"):
    sched.init(sigmas=mdsch.ltx_uniform_sigmas(4), mu=1.0, conditioning=c, cond_noise=eps)
  with pytest.raises(ValueError, match=r"cond_noise must be \[num_calls, B, \*tokens, C\]"):
    sched.init(
      sigmas=mdsch.ltx_uniform_sigmas(4), mu=1.0, conditioning=c, cond_latents=clean,
      cond_noise=eps[:3],
    )  # fmt: skip
