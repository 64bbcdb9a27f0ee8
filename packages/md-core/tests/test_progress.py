"""Tests for md_core.progress: the on/off switch, host bars and progress inside jitted loops."""

import io
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from md_core import progress

NUM_STEPS = 6


@pytest.fixture(autouse=True)
def _follow_env(monkeypatch):
  """Each test starts with progress on and no override, and leaves no override behind."""
  monkeypatch.delenv("MD_PROGRESS", raising=False)
  progress.set_progress(None)
  yield
  progress.set_progress(None)


def _final_counts(text: str) -> list[str]:
  """The `n/total` counters that tqdm printed, in order."""
  return re.findall(r"(\d+)/(\d+)", text)


def _denoise(x, tick):
  """A stand-in denoising loop: a nonlinear update per step, with `tick(i)` in the body."""

  def body(i, x):
    tick(i)
    return x - 0.1 * jnp.tanh(x) * (i + 1).astype(x.dtype)

  return jax.lax.fori_loop(0, NUM_STEPS, body, x)


def test_switch_env_override_and_context():
  assert progress.progress_enabled()
  with pytest.MonkeyPatch.context() as mp:
    for value in ("0", "false", "OFF", " no "):
      mp.setenv("MD_PROGRESS", value)
      assert not progress.progress_enabled(), value
    mp.setenv("MD_PROGRESS", "1")
    assert progress.progress_enabled()
    mp.setenv("MD_PROGRESS", "0")
    progress.set_progress(True)  # the program's choice wins over the environment
    assert progress.progress_enabled()
    progress.set_progress(None)
    assert not progress.progress_enabled()
  progress.set_progress(True)
  with pytest.raises(RuntimeError), progress.progress_disabled():
    assert not progress.progress_enabled()
    raise RuntimeError("leaving the block by an exception still restores the setting")
  assert progress.progress_enabled()


def test_track_shows_bar_and_yields_items():
  out = io.StringIO()
  items = list(progress.track(iter(range(3)), total=3, desc="load", file=out))
  assert items == [0, 1, 2]
  assert "load" in out.getvalue()
  assert _final_counts(out.getvalue())[-1] == ("3", "3")


def test_track_disabled_returns_iterable_untouched():
  data = [1, 2, 3]
  out = io.StringIO()
  with progress.progress_disabled():
    tracked = progress.track(data, desc="load", file=out)
  assert tracked is data
  assert out.getvalue() == ""


def test_tick_in_jitted_fori_loop_keeps_values_and_reaches_total():
  x = jnp.linspace(-2.0, 2.0, 16, dtype=jnp.float32)
  out = io.StringIO()
  with_tick = jax.jit(
    lambda x: _denoise(x, progress.make_step_callback(NUM_STEPS, "denoise", file=out))
  )
  without = jax.jit(lambda x: _denoise(x, lambda i: None))
  got = with_tick(x)
  jax.effects_barrier()
  np.testing.assert_array_equal(np.asarray(got), np.asarray(without(x)))
  counts = _final_counts(out.getvalue())
  assert counts[-1] == (str(NUM_STEPS), str(NUM_STEPS))
  # A second call of the compiled program opens a fresh bar that also reaches the end.
  with_tick(x + 1.0)
  jax.effects_barrier()
  finished = [c for c in _final_counts(out.getvalue()) if c == (str(NUM_STEPS), str(NUM_STEPS))]
  assert len(finished) == 2


def test_tick_in_scan_counts_every_step():
  seen = []
  out = io.StringIO()

  def run(x):
    tick = progress.make_step_callback(NUM_STEPS, file=out)

    def body(carry, i):
      tick(i)
      return carry * 0.5 + i, carry

    return jax.lax.scan(body, x, jnp.arange(NUM_STEPS))

  # A host-side hook proves each step reached the host, in addition to the printed bar.
  original = progress._HostBar.__call__

  def spy(self, step):
    seen.append(int(step))
    return original(self, step)

  with pytest.MonkeyPatch.context() as mp:
    mp.setattr(progress._HostBar, "__call__", spy)
    carry, ys = jax.jit(run)(jnp.float32(1.0))
    jax.effects_barrier()
  assert sorted(seen) == list(range(NUM_STEPS))
  assert _final_counts(out.getvalue())[-1] == (str(NUM_STEPS), str(NUM_STEPS))
  plain = lambda x: jax.lax.scan(lambda c, i: (c * 0.5 + i, c), x, jnp.arange(NUM_STEPS))
  ref_carry, ref_ys = jax.jit(plain)(jnp.float32(1.0))
  np.testing.assert_array_equal(np.asarray(carry), np.asarray(ref_carry))
  np.testing.assert_array_equal(np.asarray(ys), np.asarray(ref_ys))


def test_disabled_tick_emits_nothing_and_adds_nothing():
  out = io.StringIO()
  x = jnp.ones(4, jnp.float32)

  def traced(x):
    return _denoise(x, progress.make_step_callback(NUM_STEPS, file=out))

  with progress.progress_disabled():
    jaxpr = str(jax.make_jaxpr(traced)(x))
    got = jax.jit(traced)(x)
    jax.effects_barrier()
  assert "callback" not in jaxpr
  assert out.getvalue() == ""
  # jax caches the trace of `traced`; a fresh function shows what tracing with progress on adds.
  assert "callback" in str(jax.make_jaxpr(lambda x: traced(x))(x))
  np.testing.assert_array_equal(np.asarray(got), np.asarray(_denoise(x, lambda i: None)))


def test_tick_with_eight_devices():
  assert jax.device_count() == 8
  mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))
  sharding = NamedSharding(mesh, P("data"))
  x = jax.device_put(jnp.linspace(-1.0, 1.0, 32, dtype=jnp.float32), sharding)
  out = io.StringIO()
  got = jax.jit(lambda x: _denoise(x, progress.make_step_callback(NUM_STEPS, file=out)))(x)
  jax.effects_barrier()
  want = jax.jit(lambda x: _denoise(x, lambda i: None))(x)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  assert got.sharding.spec == P("data")
  # One bar for the whole program, not one per device.
  finished = [c for c in _final_counts(out.getvalue()) if c == (str(NUM_STEPS), str(NUM_STEPS))]
  assert len(finished) == 1


def test_make_step_callback_rejects_empty_total():
  with pytest.raises(ValueError, match="total must be >= 1, got 0"):
    progress.make_step_callback(0)
