"""Newer MaxDiffusion's batch-relative Wan loss weights (`families.wan_loss(weighting="batch_bell")`)
against a NumPy computation written from MaxDiffusion's formula (AI-Hypercomputer/maxdiffusion,
src/maxdiffusion/schedulers/scheduling_flow_match_flax.py at 3cb44556538edab9f667e74bf037eebcd58dc121,
`_calculate_training_weights` on the batch's timesteps, and the weighted mean of trainers/wan_trainer.py),
and its guard where that formula divides 0 by 0 (a batch of 1, equal timesteps)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import md_train as mdt
import md_train.families as mtf

N = 1000


def _reference_weights(timesteps, n=N):
  """MaxDiffusion's formula in float64: the bell less its batch minimum, summing to n over the batch."""
  t = np.asarray(timesteps, np.float64)
  y = np.exp(-2 * ((t - n / 2) / n) ** 2)
  y = y - y.min()
  return y * (n / y.sum())


class _Toy:
  """Stands in for a split Wan transformer: `merge(params)` gives `pred = a · noisy + b · t / 1000`."""

  def merge(self, params):
    def model(noisy, timesteps, encoder_hidden_states, _, layout):
      assert layout == "BFHWC" and encoder_hidden_states.shape[0] == noisy.shape[0]
      return params["a"] * noisy + params["b"] * (timesteps / 1000)[:, None, None, None, None]

    return model


PARAMS = {"a": jnp.float32(0.7), "b": jnp.float32(-0.3)}


def _batch(b, sigmas):
  rng = np.random.default_rng(b)
  return {
    "latents": rng.standard_normal((b, 2, 3, 3, 4), np.float32),  # [B, F, H, W, C]
    "noise": rng.standard_normal((b, 2, 3, 3, 4), np.float32),
    "encoder_hidden_states": rng.standard_normal((b, 5, 8), np.float32),
    "sigmas": np.asarray(sigmas, np.float32),
  }


def _reference_loss(batch, weights):
  x0, noise = batch["latents"].astype(np.float64), batch["noise"].astype(np.float64)
  s = batch["sigmas"].astype(np.float64)[:, None, None, None, None]
  pred = 0.7 * ((1 - s) * x0 + s * noise) - 0.3 * s
  err = (
    noise - x0 - pred
  ) ** 2  # MaxDiffusion: mean over everything of err · w (broadcast per example)
  return float(np.mean(err * np.asarray(weights, np.float64)[:, None, None, None, None]))


def test_weights_match_maxdiffusion_formula():
  t = np.random.default_rng(0).uniform(0, N, 16).astype(np.float32)
  got = np.asarray(mtf.batch_bell_weights(jnp.asarray(t), N))
  want = _reference_weights(t)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(got.sum(), N, rtol=1e-5)
  assert (
    got[np.argmax(np.abs(t - N / 2))] == 0
  )  # the example farthest from the middle weighs nothing


@pytest.mark.parametrize("sigmas", [[0.9, 0.2, 0.55, 0.05], [0.31, 0.97]], ids=["b4", "b2"])
def test_wan_loss_weighted_like_maxdiffusion(sigmas):
  batch = _batch(len(sigmas), sigmas)
  loss, _ = jax.jit(mtf.wan_loss(_Toy(), weighting="batch_bell"))(PARAMS, batch, jax.random.key(0))
  want = _reference_loss(batch, _reference_weights(np.asarray(sigmas, np.float64) * 1000))
  np.testing.assert_allclose(float(loss), want, rtol=1e-5, atol=1e-5)
  plain, _ = mtf.wan_loss(_Toy())(PARAMS, batch, jax.random.key(0))
  np.testing.assert_allclose(float(plain), _reference_loss(batch, np.ones(len(sigmas))), rtol=1e-5)


def test_loss_map_weighs_latent_pixels():
  """`loss_map [B, F, H, W, 1]` multiplies each latent pixel's squared error before the mean."""
  batch = _batch(3, [0.2, 0.5, 0.8])
  m = np.random.default_rng(7).uniform(0, 5, (3, 2, 3, 3, 1)).astype(np.float32)
  loss, _ = mtf.wan_loss(_Toy())(PARAMS, batch | {"loss_map": m}, jax.random.key(0))
  x0, noise = batch["latents"].astype(np.float64), batch["noise"].astype(np.float64)
  s = batch["sigmas"].astype(np.float64)[:, None, None, None, None]
  err = (noise - x0 - (0.7 * ((1 - s) * x0 + s * noise) - 0.3 * s)) ** 2
  np.testing.assert_allclose(float(loss), float(np.mean(err * m)), rtol=1e-5)
  with pytest.raises(ValueError, match="element_weights"):
    mtf.wan_loss(_Toy())(PARAMS, batch | {"loss_map": m[:, :, :2]}, jax.random.key(0))


@pytest.mark.parametrize("sigmas", [[0.4], [0.6, 0.6, 0.6]], ids=["batch1", "equal"])
def test_no_spread_falls_back_to_plain_mse(sigmas):
  """MaxDiffusion's formula is 0 / 0 here; md weights every example 1, and the gradient stays finite."""
  batch = _batch(len(sigmas), sigmas)
  np.testing.assert_array_equal(
    np.asarray(mtf.batch_bell_weights(jnp.asarray(batch["sigmas"]) * 1000)), np.ones(len(sigmas))
  )
  loss_fn = mtf.wan_loss(_Toy(), weighting="batch_bell")
  (loss, _), grads = jax.value_and_grad(loss_fn, has_aux=True)(PARAMS, batch, jax.random.key(0))
  np.testing.assert_allclose(float(loss), _reference_loss(batch, np.ones(len(sigmas))), rtol=1e-5)
  assert all(np.isfinite(np.asarray(g)) for g in jax.tree.leaves(grads))


def test_drawn_sigmas_are_weighted():
  """Without given sigmas the drawn ones are weighted: the loss is the reference's on them."""
  batch = _batch(6, np.zeros(6))
  del batch["sigmas"]
  key = jax.random.key(3)
  loss, _ = mtf.wan_loss(_Toy(), weighting="batch_bell")(PARAMS, batch, key)
  sigmas = np.asarray(mdt.flow_sigmas(jax.random.split(key)[1], 6, sampler="shifted", shift=5.0))
  batch["sigmas"] = sigmas
  want = _reference_loss(batch, _reference_weights(sigmas.astype(np.float64) * 1000))
  np.testing.assert_allclose(float(loss), want, rtol=1e-5, atol=1e-5)


def test_bad_options_are_named():
  with pytest.raises(ValueError, match="weighting='bell'"):
    mtf.wan_loss(_Toy(), weighting="bell")
  with pytest.raises(ValueError, match="exclude each other"):
    mtf.wan_loss(_Toy(), weighting="batch_bell", table=mdt.flow_training_table(10))
  with pytest.raises(ValueError, match=r"timesteps have shape \(2, 2\)"):
    mtf.batch_bell_weights(jnp.ones((2, 2)))
