"""md-cache policies on a toy denoiser through md_schedulers.sample: errors, identity, JSON ratios."""

import jax.numpy as jnp
import numpy as np
import pytest

import md_cache
import md_schedulers as mdsch


def _plain(params, x, t, cond, *, step):
  del params, t, cond, step
  return -x  # no md_core.scan_layers stack: nothing for a block hook to take over


def _sample(cache):
  sched = mdsch.flow_match_euler()
  st = sched.init(4)
  x = jnp.ones((1, 3, 2))
  carry = mdsch.init_state(x, st, cache=cache)

  def one(c):
    return mdsch.run_steps(_plain, sched, c, 0, 1, None, cache=cache)

  return md_cache.prepare(one, carry)


@pytest.mark.parametrize(
  "cache", [md_cache.first_block_cache(), md_cache.magcache([1.0, 1.0])], ids=["fbc", "mag"]
)
def test_block_policy_without_hookable_stacks_names_what_applies(cache):
  with pytest.raises(ValueError, match="no hookable block stack.*md_cache.deepcache applies"):
    _sample(cache)


def test_magcache_without_ratios_says_how_to_calibrate():
  with pytest.raises(ValueError, match="calibrate=True"):
    md_cache.magcache()


def test_equal_settings_give_equal_caches():
  assert md_cache.first_block_cache(0.1) == md_cache.first_block_cache(0.5)
  assert hash(md_cache.magcache([1.0], threshold=0.1)) == hash(md_cache.magcache([2.0, 1.0]))
  assert md_cache.magcache([1.0]) != md_cache.magcache(calibrate=True)
  assert md_cache.first_block_cache() != md_cache.magcache([1.0])


def test_thresholds_are_state_values():
  st = md_cache.magcache([1.0, 1.1], threshold=0.1, max_skip_steps=2, retention_ratio=0.5).init(
    jnp.zeros((1, 2)), 6
  )
  assert float(st.threshold) == pytest.approx(0.1) and int(st.max_skip_steps) == 2
  assert int(st.retention_step) == 3 and st.mag_ratios.shape == (6,)
  assert float(md_cache.first_block_cache(0.3).init(jnp.zeros((1, 2)), 4).threshold) == (
    pytest.approx(0.3)
  )


def test_resample_ratios_nearest():
  r = np.arange(28, dtype=np.float32)
  np.testing.assert_array_equal(md_cache.resample_ratios(r, 8), [0, 4, 8, 12, 15, 19, 23, 27])
  np.testing.assert_array_equal(md_cache.resample_ratios(r, 1), [27])
  np.testing.assert_array_equal(md_cache.resample_ratios(r[:5], 5), r[:5])


def test_mag_ratios_json_round_trip(tmp_path):
  path = tmp_path / "ratios.json"
  md_cache.save_mag_ratios(path, np.array([1.0, 0.9, 1.05]), model="toy", num_steps=3)
  np.testing.assert_allclose(md_cache.load_mag_ratios(path), [1.0, 0.9, 1.05], rtol=1e-7)
  st = md_cache.magcache(path).init(jnp.zeros((1,)), 3)
  np.testing.assert_allclose(st.mag_ratios, [1.0, 0.9, 1.05], rtol=1e-7)


def test_taylorseer_and_teacache_identity_and_errors():
  assert md_cache.taylorseer(5) == md_cache.taylorseer(2, warmup_steps=1, stop_step=3)
  assert md_cache.taylorseer(max_order=1) != md_cache.taylorseer(max_order=2)
  assert md_cache.teacache(0.1, "flux") == md_cache.teacache(0.6, "ltx-video")
  with pytest.raises(ValueError, match="interval=0 must be at least 1"):
    md_cache.taylorseer(0)
  with pytest.raises(ValueError, match="factors_dtype='int8'"):
    md_cache.taylorseer(factors_dtype="int8")
  st = md_cache.taylorseer(3, max_order=2).init({"v": jnp.zeros((1, 4)), "a": jnp.zeros((1, 2))}, 6)
  assert st.factors["v"].shape == (3, 1, 4) and st.factors["a"].shape == (3, 1, 2)


def test_taylorseer_default_interval_follows_the_schedule():
  from md_cache import _taylorseer

  lat = jnp.zeros((1, 4))
  # The published 5 from 35 steps on; about one step in 7 below (20 steps: 3), never under 2.
  got = {n: int(md_cache.taylorseer().init(lat, n).interval) for n in (4, 14, 20, 28, 35, 50, 100)}
  assert got == {4: 2, 14: 2, 20: 3, 28: 4, 35: 5, 50: 5, 100: 5}
  assert all(_taylorseer.default_interval(n) == v for n, v in got.items())
  # A given interval is kept whatever the step count, and the default is one compiled policy.
  assert int(md_cache.taylorseer(5).init(lat, 20).interval) == 5
  assert md_cache.taylorseer() == md_cache.taylorseer(5)

  # 20 steps at the default: warm-up 0-2, then steps warm-up + 1 + k·3 (diffusers' schedule), and the
  # last quarter (15-19) in full; stop_step=None keeps diffusers' schedule to the end.
  def computed(policy, n):
    st = policy.init(lat, n)._replace(orders=jnp.int32(1))
    return [i for i in range(n) if not bool(policy.decide(st, i, 0.0, lat)[0])]

  assert computed(md_cache.taylorseer(), 20) == [0, 1, 2, 4, 7, 10, 13, 15, 16, 17, 18, 19]
  assert computed(md_cache.taylorseer(stop_step=None), 20) == [0, 1, 2, *range(4, 20, 3)]
  want = [0, 1, 2, 4, 7, 10, 13, 16, 17, 18, 19]
  assert computed(md_cache.taylorseer(3, stop_step=17), 20) == want
  # From 35 steps on the published schedule is untouched: every 5th step, no full tail.
  assert computed(md_cache.taylorseer(), 40) == [0, 1, 2, *range(4, 40, 5)]


def test_taylorseer_default_stop_step_follows_the_schedule():
  from md_cache import _taylorseer

  lat = jnp.zeros((1, 4))
  got = {
    n: int(md_cache.taylorseer().init(lat, n).stop_step) for n in (4, 8, 14, 20, 28, 34, 35, 50)
  }
  # The last quarter of a schedule shorter than 35 steps (rounded down), none from 35 on (-1).
  assert got == {4: 3, 8: 6, 14: 11, 20: 15, 28: 21, 34: 26, 35: -1, 50: -1}
  assert all(_taylorseer.default_stop_step(n) == (v if v >= 0 else None) for n, v in got.items())
  assert int(md_cache.taylorseer(stop_step=None).init(lat, 20).stop_step) == -1
  assert int(md_cache.taylorseer(stop_step=7).init(lat, 20).stop_step) == 7
  assert int(md_cache.taylorseer(stop_step=np.int64(9)).init(lat, 20).stop_step) == 9
  for bad in (-1, "last", 1.5, True):
    with pytest.raises(ValueError, match=r"stop_step=.* must be a step index >= 0, 'auto' or None"):
      md_cache.taylorseer(stop_step=bad)


def test_teacache_polynomial_is_horner_clamped():
  from md_cache import _teacache

  coeffs = jnp.asarray(md_cache.TEACACHE_COEFFICIENTS["flux"], jnp.float32)
  x = jnp.asarray([0.0, 0.05, 0.1, 0.3], jnp.float32)
  want = np.maximum(
    np.polyval(np.asarray(md_cache.TEACACHE_COEFFICIENTS["flux"]), np.asarray(x)), 0
  )
  np.testing.assert_allclose(_teacache.rescaled(coeffs, x), want, rtol=1e-5)
  assert float(_teacache.rescaled(jnp.asarray([-1.0]), jnp.float32(0.2))) == 0.0


def test_teacache_default_threshold_depends_on_the_polynomial():
  lat = jnp.zeros((1, 4))
  threshold = lambda policy: float(policy.init(lat, 20).threshold)  # noqa: E731
  # The raw relative L1 change ("identity") skips more readily than a fitted polynomial's: 0.15 there,
  # the published 0.25 with a polynomial (named or the caller's); a given threshold is kept.
  assert threshold(md_cache.teacache()) == pytest.approx(0.15)
  assert threshold(md_cache.teacache(coefficients="identity")) == pytest.approx(0.15)
  assert threshold(md_cache.teacache(coefficients="flux")) == pytest.approx(0.25)
  assert threshold(md_cache.teacache(coefficients=[2.0, 0.0])) == pytest.approx(0.25)
  assert threshold(md_cache.teacache(0.4)) == pytest.approx(0.4)
  assert md_cache.teacache() == md_cache.teacache(0.25)  # one compiled policy


def test_published_mag_ratios_need_no_calibration():
  """The MagCache authors' ratios for real checkpoints (Zehong-Ma/MagCache; Flux.1 dev as diffusers ships
  them): the Wan lists split from the interleaved per-step publication, resampled to other step counts as
  the authors' `nearest_interp`, and usable by name from magcache() and from an app's config."""
  assert set(md_cache.PUBLISHED_MAG_RATIOS) == {
    "wan2.1-t2v-14b", "wan2.1-t2v-1.3b", "wan2.1-i2v-14b-480p", "wan2.1-i2v-14b-720p", "flux.1-dev"
  }  # fmt: skip
  t2v = md_cache.published_mag_ratios("wan2.1-t2v-1.3b")
  assert t2v.shape == (50,) and t2v[0] == 1.0
  # The publication's first entries after its padding: positive 1.0124, negative 1.02213; the last pair.
  np.testing.assert_allclose(t2v[[1, -1]], [1.0124, 0.81838], rtol=1e-6)
  neg = md_cache.published_mag_ratios("wan2.1-t2v-1.3b", "negative")
  np.testing.assert_allclose(neg[[1, -1]], [1.02213, 0.81939], rtol=1e-6)
  assert md_cache.published_mag_ratios("wan2.1-i2v-14b-720p").shape == (40,)
  flux = md_cache.published_mag_ratios("flux.1-dev")
  assert flux.shape == (28,) and flux[1] == np.float32(1.21094)
  with pytest.raises(ValueError, match="one branch"):
    md_cache.published_mag_ratios("flux.1-dev", "negative")
  with pytest.raises(ValueError, match="no published MagCache ratios named 'wan2.2'"):
    md_cache.published_mag_ratios("wan2.2")

  st = md_cache.magcache("wan2.1-t2v-14b").init(jnp.zeros((1,)), 20)
  want = md_cache.published_mag_ratios("wan2.1-t2v-14b")
  index = np.round(np.arange(20) * ((len(want) - 1) / 19)).astype(
    int
  )  # the authors' nearest_interp
  np.testing.assert_array_equal(np.asarray(st.mag_ratios), want[index])

  import types

  import ml_collections

  from md_cache import settings

  config = settings.add_cache_config(ml_collections.ConfigDict())
  config.cache, config.cache_options.mag_ratios = "magcache", "wan2.1-t2v-1.3b"
  wan = types.SimpleNamespace(family="wan", block_stacks=("blocks",), cache_defaults={})
  made = settings.make_cache(config, wan)
  assert made == md_cache.magcache(md_cache.published_mag_ratios("wan2.1-t2v-1.3b"))
