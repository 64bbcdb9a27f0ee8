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


class _Stacked(nnx.Module):
  """A stacked Dense, a norm and a table drawn straight from the rngs (as md's modulation tables are)."""

  def __init__(self, rngs):
    self.blocks = md_core.stack_layers(lambda r: nn.Dense(4, 6, rngs=r), 3, rngs)
    self.norm = nn.LayerNorm(6, rngs=rngs)
    self.table = nnx.Param(jax.random.normal(md_core.param_key(rngs), (2, 6)))


def _tree(module):
  return {
    tuple(p): (tuple(v.get_value().shape), v.get_value().dtype, md_core.logical_axes(v))
    for p, v in nnx.to_flat_state(nnx.state(module))
  }


def test_shapes_only_builds_the_same_abstract_model_without_drawing_keys():
  """Inside `shapes_only()` (md's loaders build their abstract models there) parameters take a constant key:
  the abstract model has the same paths, shapes, dtypes and logical axes as one built by drawing from the
  rngs, and the rngs are not advanced; outside it `param_key` is `rngs.params()`, so random inits keep
  their values."""
  drawn = nnx.eval_shape(lambda: _Stacked(nnx.Rngs(0)))
  rngs = nnx.Rngs(0)
  with md_core.shapes_only():
    constant = nnx.eval_shape(lambda: _Stacked(rngs))
    chex.assert_trees_all_equal(md_core.param_key(rngs), jax.random.key(0))
  assert _tree(constant) == _tree(drawn)
  assert int(rngs.params.count[...]) == 0  # nothing drawn
  abstract = md_core._loading.abstract_model(lambda: _Stacked(nnx.Rngs(0)))
  assert _tree(abstract) == _tree(drawn)
  twin = nnx.Rngs(5)
  chex.assert_trees_all_equal(md_core.param_key(nnx.Rngs(5)), twin.params())
  # Outside, the draws are the rngs' own, in order: the table equals the one drawn with `rngs.params()`
  # after the same modules.
  real, rngs = _Stacked(nnx.Rngs(1)), nnx.Rngs(1)
  md_core.stack_layers(lambda r: nn.Dense(4, 6, rngs=r), 3, rngs)
  nn.LayerNorm(6, rngs=rngs)
  chex.assert_trees_all_equal(real.table.get_value(), jax.random.normal(rngs.params(), (2, 6)))
  assert float(jnp.abs(real.table.get_value()).max()) > 0.1
