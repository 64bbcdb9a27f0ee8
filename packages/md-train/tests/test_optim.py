"""The optimizer chain against closed forms: schedules, accumulation, EMA, config errors; train_step's state
and metrics on a toy quadratic."""

import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import md_train as mdt


def test_warmup_cosine_schedule_is_diffusers_closed_form():
  """diffusers' get_cosine_schedule_with_warmup: step / warmup, then 0.5 (1 + cos(π progress))."""
  opt = mdt.make_optimizer(learning_rate=2e-4, schedule="cosine", warmup_steps=10, total_steps=110)
  for step in (0, 3, 10, 35, 60, 109, 110):
    if step < 10:
      want = 2e-4 * step / 10
    else:
      want = 2e-4 * 0.5 * (1 + math.cos(math.pi * (step - 10) / 100))
    assert float(opt.learning_rate(step)) == pytest.approx(
      want, rel=1e-5, abs=1e-9
    )  # float32 near 0


def test_constant_schedule_with_warmup():
  opt = mdt.make_optimizer(learning_rate=1e-3, warmup_steps=4)
  got = [float(opt.learning_rate(s)) for s in range(7)]
  np.testing.assert_allclose(got, [0, 2.5e-4, 5e-4, 7.5e-4, 1e-3, 1e-3, 1e-3], rtol=1e-6, atol=0)
  assert float(mdt.make_optimizer(learning_rate=3e-5).learning_rate(0)) == pytest.approx(3e-5)


def _quadratic():
  params = {"w": jnp.asarray([1.0, -2.0, 0.5]), "b": jnp.asarray(0.3)}

  def loss_fn(params, batch, key):
    del key
    pred = batch["x"] @ params["w"] + params["b"]
    return jnp.mean((pred - batch["y"]) ** 2), {"pred_mean": pred.mean()}

  x = jax.random.normal(jax.random.key(0), (8, 3))
  y = x @ jnp.asarray([0.5, 1.0, -1.0]) - 0.2
  return params, loss_fn, {"x": x, "y": y}


def test_gradient_accumulation_equals_the_mean_gradient():
  """Two micro-batches under accumulation 2 make one AdamW step on their mean gradient."""
  params, loss_fn, batch = _quadratic()
  halves = [jax.tree.map(lambda a, i=i: a[4 * i : 4 * i + 4], batch) for i in range(2)]
  grads = [jax.grad(lambda p, b: loss_fn(p, b, None)[0])(params, h) for h in halves]
  mean = jax.tree.map(lambda a, b: (a + b) / 2, *grads)
  one = mdt.make_optimizer(learning_rate=1e-2, max_grad_norm=None)
  updates, _ = one.tx.update(mean, one.tx.init(params), params)
  want = optax.apply_updates(params, updates)

  acc = mdt.make_optimizer(learning_rate=1e-2, max_grad_norm=None, gradient_accumulation_steps=2)
  state = acc.tx.init(params)
  p = params
  for i, g in enumerate(grads):
    updates, state = acc.tx.update(g, state, p)
    p = optax.apply_updates(p, updates)
    if i == 0:
      chex.assert_trees_all_close(p, params)  # nothing applied before the last micro-batch
  chex.assert_trees_all_close(p, want, atol=1e-7, rtol=0)
  assert float(acc.learning_rate_at(jnp.asarray(3))) == pytest.approx(1e-2)


def test_ema_follows_its_recurrence():
  params, loss_fn, batch = _quadratic()
  opt = mdt.make_optimizer(learning_rate=1e-2, ema_decay=0.9)
  ema = jax.tree.map(np.asarray, params)  # a host copy: train_step donates the state
  state = mdt.init_state(params, opt, rng=0)
  for _ in range(3):
    state, _ = mdt.train_step(state, batch, loss_fn, opt)
    ema = jax.tree.map(lambda e, p: 0.9 * e + 0.1 * p, ema, state.params)
  chex.assert_trees_all_close(mdt.ema_of(state.opt_state), ema, atol=1e-6, rtol=0)
  with pytest.raises(ValueError, match="no EMA"):
    mdt.ema_of(mdt.make_optimizer().tx.init(params))


def test_train_step_state_and_metrics():
  params, loss_fn, batch = _quadratic()
  opt = mdt.make_optimizer(learning_rate=1e-1, warmup_steps=2, max_grad_norm=1.0)
  state = mdt.init_state(jax.tree.map(jnp.copy, params), opt, rng=7)
  losses, lrs = [], []
  for _ in range(5):
    rng = state.rng
    (loss, _), grads = mdt.loss_and_grads(loss_fn, state.params, batch)
    state, metrics = mdt.train_step(state, batch, loss_fn, opt)
    assert not np.array_equal(jax.random.key_data(state.rng), jax.random.key_data(rng))
    np.testing.assert_allclose(float(metrics["loss"]), float(loss), rtol=1e-6)
    np.testing.assert_allclose(
      float(metrics["grad_norm"]), float(optax.tree.norm(grads)), rtol=1e-6
    )
    assert "pred_mean" in metrics
    losses.append(float(metrics["loss"]))
    lrs.append(float(metrics["lr"]))
  assert int(state.step) == 5
  np.testing.assert_allclose(lrs, [0.0, 0.05, 0.1, 0.1, 0.1], rtol=1e-6)
  assert losses[-1] < losses[1]


@pytest.mark.parametrize(
  "overrides,match",
  [
    (dict(schedule="linear"), "schedule"),
    (dict(schedule="cosine"), "total_steps"),
    (dict(total_steps=5, warmup_steps=5), "must exceed"),
    (dict(gradient_accumulation_steps=0), "gradient_accumulation_steps"),
    (dict(max_grad_norm=0.0), "max_grad_norm"),
    (dict(ema_decay=1.0), "ema_decay"),
    (dict(warmup_steps=-1), "warmup_steps"),
  ],
)
def test_bad_configs(overrides, match):
  with pytest.raises(ValueError, match=match):
    mdt.OptimizerConfig(**overrides)
