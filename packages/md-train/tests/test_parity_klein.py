"""One training step of the tiny Flux.2 Klein transformer against PyTorch autograd
(tools/fixtures/train_step_klein.py): the loss of diffusers' Klein training within 1e-5, the gradients of
ten parameters and their global norm within 1e-4."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import md_core
import md_flux
import md_train as mdt
import md_train.families as mtf
from md_core.testing import fixture_path, load_arrays

LOSS_TOL, GRAD_TOL = 1e-5, 1e-4


@pytest.fixture(scope="module")
def ref():
  return load_arrays(fixture_path("train_step_klein") / "klein.npz")


@pytest.fixture(scope="module")
def split():
  return mdt.split_trainable(md_flux.load_flux2(fixture_path("flux2_transformer") / "klein"))


def _nhwc(x):
  return jnp.asarray(x).transpose(0, 2, 3, 1)


def test_klein_ids_are_the_pipelines(ref):
  b, _, h, w = ref["latents"].shape
  for i in range(b):
    np.testing.assert_array_equal(ref["img_ids"][i], md_flux.image_ids(h, w, axes=4))
    np.testing.assert_array_equal(ref["txt_ids"][i], md_flux.text_ids(ref["txt_ids"].shape[1]))


def test_klein_loss_and_grads_match_torch(ref, split):
  frozen, params = split
  batch = {
    "latents": _nhwc(ref["latents"]),
    "noise": _nhwc(ref["noise"]),
    "sigmas": jnp.asarray(ref["sigmas"]),
    "encoder_hidden_states": jnp.asarray(ref["encoder_hidden_states"]),
  }
  (loss, _), grads = mdt.loss_and_grads(mtf.klein_loss(frozen), params, batch)
  loss_err = abs(float(loss) - float(ref["loss"]))
  np.testing.assert_allclose(float(loss), ref["loss"], atol=LOSS_TOL, rtol=0)
  np.testing.assert_allclose(float(optax.tree.norm(grads)), ref["grad_norm"], atol=GRAD_TOL)
  flat = {
    tuple(p): np.asarray(v[...] if isinstance(v, nnx.Variable) else v)
    for p, v in nnx.to_flat_state(grads)
  }
  names, worst = [k for k in ref if k.startswith("grad/")], 0.0
  assert len(names) == 10
  for key in names:
    targets = md_flux.convert_key_flux2(key[len("grad/") :])
    for target in [targets] if isinstance(targets, md_core.Target) else targets:
      got = flat[target.path]
      got = got if target.layer is None else got[target.layer]
      want = md_core.convert(ref[key], target)
      assert np.abs(want).max() > 0, key
      chex.assert_trees_all_close(got, want, atol=GRAD_TOL, rtol=0, custom_message=key)
      worst = max(worst, float(np.abs(got - want).max()))
  print(f"klein: loss error {loss_err:.1e}, max gradient error {worst:.1e}")


def test_klein_loss_refuses_flat_latents(split):
  frozen, params = split
  batch = {"latents": jnp.zeros((2, 16, 16)), "encoder_hidden_states": jnp.zeros((2, 6, 24))}
  with pytest.raises(ValueError, match=r"\[B, h, w, C\], got shape \(2, 16, 16\)"):
    mtf.klein_loss(frozen)(params, batch, jax.random.key(0))
