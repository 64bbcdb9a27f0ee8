"""md_core.stack_layers / remat: stacked blocks equal the same blocks built one by one."""

import functools

import chex
import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import md_core
from md_core import nn


def test_stacked_layers_match_separate_blocks_and_carry_layers_axis():
  make = lambda r: nn.Dense(4, 4, axes=("embed", "mlp"), rngs=r)  # noqa: E731
  stacked = md_core.stack_layers(make, 3, nnx.Rngs(0))
  chex.assert_shape(stacked.kernel[...], (3, 4, 4))
  assert md_core.logical_axes(stacked.kernel) == ("layers", "embed", "mlp")
  # Layer i is the block built from the i-th split key.
  keys = jax.random.split(nnx.Rngs(0).params(), 3)
  for i in range(3):
    chex.assert_trees_all_equal(stacked.kernel[...][i], make(nnx.Rngs(keys[i])).kernel[...])

  graphdef, params = nnx.split(stacked)
  x = jnp.ones((2, 4))

  def body(h, p):
    return nnx.merge(graphdef, p)(h), None

  loop = x
  for i in range(3):
    loop = loop @ stacked.kernel[...][i] + stacked.bias[...][i].reshape(1, 4)
  for policy in md_core.REMAT_POLICIES:
    step = md_core.remat(body, policy)
    out, _ = jax.jit(functools.partial(jax.lax.scan, step))(x, params)
    chex.assert_trees_all_close(out, loop, atol=1e-6, rtol=0)


def test_unknown_remat_policy():
  with pytest.raises(ValueError, match=r"unknown remat policy 'most'; expected one of \('none'"):
    md_core.remat(lambda x: x, "most")
