"""Training helpers against the reference's add_noise / get_velocity / scale_noise and closed forms."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import md_schedulers as mdsch
from md_core import testing

REF = testing.load_arrays(testing.fixture_path("schedulers") / "training.npz")


def test_add_noise_and_velocity_match_the_reference():
  sched = mdsch.ddpm(
    beta_schedule="scaled_linear",
    beta_start=0.00085,
    beta_end=0.012,
    prediction_type="v_prediction",
  )
  np.testing.assert_allclose(sched.alphas_cumprod, REF["alphas_cumprod"], rtol=1e-6, atol=0)
  t = jnp.asarray(REF["timesteps"])
  noisy = mdsch.add_noise(sched.alphas_cumprod, REF["x0"], REF["noise"], t)
  np.testing.assert_allclose(np.asarray(noisy), REF["noisy"], rtol=0, atol=1e-6)
  v = mdsch.velocity(sched.alphas_cumprod, REF["x0"], REF["noise"], t)
  np.testing.assert_allclose(np.asarray(v), REF["velocity"], rtol=0, atol=1e-6)


def test_flow_noise_matches_scale_noise():
  noisy = mdsch.flow_noise(REF["x0"], REF["noise"], jnp.asarray(REF["flow_sigmas"]))
  np.testing.assert_allclose(np.asarray(noisy), REF["flow_noisy"], rtol=0, atol=1e-6)
  np.testing.assert_allclose(
    np.asarray(mdsch.flow_target(REF["x0"], REF["noise"])), REF["noise"] - REF["x0"]
  )


def test_snr_and_min_snr_weights():
  acp = REF["alphas_cumprod"]
  t = jnp.asarray([0, 500, 999])
  snr = np.asarray(mdsch.snr(acp, t))
  want = acp[[0, 500, 999]] / (1 - acp[[0, 500, 999]])
  np.testing.assert_allclose(snr, want, rtol=1e-5)
  w = np.asarray(mdsch.min_snr_weight(jnp.asarray(snr), 5.0, "epsilon"))
  np.testing.assert_allclose(w, np.minimum(want, 5.0) / want, rtol=1e-5)
  w = np.asarray(mdsch.min_snr_weight(jnp.asarray(snr), 5.0, "v_prediction"))
  np.testing.assert_allclose(w, np.minimum(want, 5.0) / (want + 1), rtol=1e-5)
  with pytest.raises(ValueError, match="prediction_type"):
    mdsch.min_snr_weight(jnp.asarray(snr), 5.0, "flow")


def test_timestep_samplers():
  key = jax.random.key(0)
  n = 8000
  u, t = mdsch.sample_timesteps(key, n)
  assert u.shape == (n,) and t.shape == (n,)
  assert float(u.min()) >= 1e-3 and float(u.max()) <= 1.0
  np.testing.assert_allclose(np.asarray(t), np.asarray(u) * 1000, rtol=1e-6)
  assert abs(float(u.mean()) - 0.5) < 0.01
  ln, _ = mdsch.sample_timesteps(key, n, kind="logit_normal", logit_mean=0.0, logit_std=1.0)
  logits = np.log(np.asarray(ln) / (1 - np.asarray(ln)))
  assert abs(logits.mean()) < 0.03 and abs(logits.std() - 1.0) < 0.03
  sh, _ = mdsch.sample_timesteps(key, n, kind="shifted", shift=3.0)
  keep = np.asarray(u) > 0.01  # away from the 1/1000 floor both are clipped to
  np.testing.assert_allclose(
    np.asarray(sh)[keep], np.asarray(mdsch.shift_sigmas(u, 3.0))[keep], rtol=1e-6
  )
  mode, _ = mdsch.sample_timesteps(key, n, kind="mode", mode_scale=0.0)
  inner = keep & (np.asarray(u) < 0.99)
  np.testing.assert_allclose(np.asarray(mode)[inner], 1 - np.asarray(u)[inner], atol=1e-6)
  late, _ = mdsch.sample_timesteps(key, n, bias="later", bias_portion=1.0)
  assert float(late.min()) >= 0.75
  early, _ = mdsch.sample_timesteps(
    key, n, bias="range", bias_portion=1.0, bias_begin=100, bias_end=200
  )
  assert 0.1 <= float(early.min()) and float(early.max()) <= 0.2
  d = mdsch.discrete_timesteps(jnp.asarray([0.0005, 0.5, 1.0]))
  np.testing.assert_array_equal(np.asarray(d), [0, 500, 999])
  with pytest.raises(ValueError, match="timestep sampler"):
    mdsch.sample_timesteps(key, 2, kind="cosine")
