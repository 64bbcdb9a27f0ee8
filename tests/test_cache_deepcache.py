"""md_cache.deepcache's hook in md-sd's UNet (tiny SD fixture UNet): the split forward (shallow branch
around `md_core.deep_branch`) equals the plain one; a cheap call takes the cached deep features, costs
a fraction of the FLOPs and depends on them; deepcache on the loop is in tests/test_cache_families.py."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import md_cache
import md_core
from md_core import testing


class _Given:
  """A block hook whose deep branch records its output, or returns `features` instead."""

  def __init__(self, features=None):
    self.features, self.seen = features, None

  def __call__(self, run, carry, *, num_layers, index):
    return run(carry, 0, num_layers)

  def deep_branch(self, run, carry):
    if self.features is not None:
      return self.features
    self.seen = run(carry)
    return self.seen


@pytest.fixture(scope="module")
def unet():
  import md_sd

  return md_sd.load_unet(testing.fixture_path("sd_pipeline") / "sd")


def _inputs(seed):
  rng = np.random.RandomState(seed)
  x = jnp.asarray(rng.randn(2, 8, 8, 4), jnp.float32)
  text = jnp.asarray(rng.randn(2, 16, 16), jnp.float32)
  return x, jnp.asarray([700.0, 700.0]) - 200 * seed, text


def test_split_forward_and_cached_features(unet):
  x, t, text = _inputs(0)
  plain = unet(x, t, text)
  record = _Given()
  with md_core.block_hook(record):
    split = unet(x, t, text)
  np.testing.assert_array_equal(np.asarray(split), np.asarray(plain))
  deep = record.seen
  assert deep.shape[0] == 2 and deep.shape[1:3] == (8, 8)  # the last up block's input, full size
  # Given its own deep features back, a cheap call is the full call.
  with md_core.block_hook(_Given(deep)):
    np.testing.assert_allclose(np.asarray(unet(x, t, text)), np.asarray(plain), atol=1e-6)
  # At another step the cheap call runs the shallow branch on the new input around the old features:
  # neither the old output nor the new full one, and moved by the features.
  x2, t2, text2 = _inputs(1)
  with md_core.block_hook(_Given(deep)):
    cheap = np.asarray(unet(x2, t2, text2))
  with md_core.block_hook(_Given(deep * 1.5)):
    moved = np.asarray(unet(x2, t2, text2))
  full2 = np.asarray(unet(x2, t2, text2))
  assert np.abs(cheap - full2).max() > 1e-4 and np.abs(cheap - np.asarray(plain)).max() > 1e-4
  assert np.abs(moved - cheap).max() > 1e-4


def test_cheap_call_skips_most_flops(unet):
  x, t, text = _inputs(0)
  record = _Given()
  with md_core.block_hook(record):
    unet(x, t, text)
  deep = record.seen
  graph, state = nnx.split(unet)

  def flops(features):
    def f(state, x):
      with md_core.block_hook(_Given(features)):
        return nnx.merge(graph, state)(x, t, text)

    cost = jax.jit(f).lower(state, x).cost_analysis()
    return float((cost[0] if isinstance(cost, list | tuple) else cost)["flops"])

  full, cheap = flops(None), flops(deep)
  # This two-level UNet keeps most of its work at full resolution (0.67 of it in the shallow branch);
  # SD's four levels leave far less there.
  assert cheap < 0.75 * full, (cheap, full)


def test_errors():
  with pytest.raises(ValueError, match="interval=0 must be at least 1"):
    md_cache.deepcache(0)
  with pytest.raises(ValueError, match="start=-1"):
    md_cache.deepcache(start=-1)
  assert md_cache.deepcache(2) == md_cache.deepcache(5, start=3)
