"""md_core.scan_layers and block hooks: equal to the blocks run one by one, in any split."""

import chex
import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import md_core
from md_core import nn


def _stack(n=4):
  make = lambda r: nn.Dense(4, 4, axes=("embed", "mlp"), rngs=r)  # noqa: E731
  return md_core.stack_layers(make, n, nnx.Rngs(0))


def _by_hand(stack, x, start=0, stop=None):
  k, b = stack.kernel[...], stack.bias[...]
  for i in range(start, k.shape[0] if stop is None else stop):
    x = jnp.tanh(x @ k[i] + b[i].reshape(1, 4))
  return x


def _body(block, h, layer_input, scale):
  del layer_input
  return jnp.tanh(block(h)) * scale, None


@pytest.mark.parametrize("policy", md_core.REMAT_POLICIES)
def test_scan_layers_equals_a_python_loop_forward_and_backward(policy):
  stack, x = _stack(), jnp.linspace(-1, 1, 8).reshape(2, 4)

  def f(x):
    return md_core.scan_layers(stack, _body, x, 1.0, remat=policy)[0]

  chex.assert_trees_all_close(jax.jit(f)(x), _by_hand(stack, x), atol=1e-6, rtol=0)
  g = jax.grad(lambda x: jnp.sum(f(x) ** 2))(x)
  g_ref = jax.grad(lambda x: jnp.sum(_by_hand(stack, x) ** 2))(x)
  chex.assert_trees_all_close(g, g_ref, atol=1e-6, rtol=0)


def test_per_layer_inputs_are_sliced_and_outputs_stacked():
  stack, x = _stack(3), jnp.ones((1, 4))
  flags = jnp.asarray([1.0, 0.0, 1.0])

  def body(block, h, flag):
    out = jnp.where(flag > 0, block(h), h)
    return out, jnp.sum(out)

  h, sums = md_core.scan_layers(stack, body, x, per_layer=flags)
  k, b = stack.kernel[...], stack.bias[...]
  want = x @ k[0] + b[0].reshape(1, 4)
  want = want @ k[2] + b[2].reshape(1, 4)
  chex.assert_trees_all_close(h, want, atol=1e-6, rtol=0)
  chex.assert_shape(sums, (3,))


def test_block_hook_runs_any_split_and_counts_stacks():
  stack, x = _stack(4), jnp.linspace(-1, 1, 8).reshape(2, 4)
  seen = []

  def first_only(run, carry, *, num_layers, index):
    seen.append((num_layers, index))
    return run(carry, 0, 1)

  with md_core.block_hook(first_only):
    h1 = md_core.scan_layers(stack, _body, x, 1.0)[0]
    h2 = md_core.scan_layers(stack, _body, h1, 1.0)[0]
  assert seen == [(4, 0), (4, 1)]
  chex.assert_trees_all_close(h1, _by_hand(stack, x, 0, 1), atol=1e-6, rtol=0)
  chex.assert_trees_all_close(h2, _by_hand(stack, h1, 0, 1), atol=1e-6, rtol=0)

  def split(run, carry, *, num_layers, index):
    return run(run(carry, 0, 1), 1, num_layers)

  with md_core.block_hook(split):
    h = jax.jit(lambda x: md_core.scan_layers(stack, _body, x, 1.0)[0])(x)
  chex.assert_trees_all_close(h, _by_hand(stack, x), atol=1e-6, rtol=0)
  # Outside the block, and for stacks that are not hookable, the hook is not used.
  seen.clear()
  with md_core.block_hook(first_only):
    h = md_core.scan_layers(stack, _body, x, 1.0, hookable=False)[0]
  assert seen == []
  chex.assert_trees_all_close(h, _by_hand(stack, x), atol=1e-6, rtol=0)


def test_probe_is_the_first_block_on_the_carry_and_none_without_one():
  """`run.probe(carry)` = `probe(block 0, carry, layer input 0, *xs)`; never run without a hook."""
  stack, x = _stack(3), jnp.linspace(-1, 1, 8).reshape(2, 4)
  seen = {}

  def hook(run, carry, *, num_layers, index):
    seen[index] = None if run.probe is None else run.probe(carry)
    return run(carry, 0, num_layers)

  probe = lambda block, h, layer_input, scale: block(h) * scale + layer_input  # noqa: E731
  flags = jnp.asarray([5.0, 6.0, 7.0])
  body = lambda block, h, f, scale: (jnp.tanh(block(h)) * scale, None)  # noqa: E731
  with md_core.block_hook(hook):
    md_core.scan_layers(stack, body, x, 2.0, per_layer=flags, probe=probe)
    md_core.scan_layers(stack, body, x, 2.0, per_layer=flags)
  k, b = stack.kernel[...], stack.bias[...]
  chex.assert_trees_all_close(seen[0], (x @ k[0] + b[0].reshape(1, 4)) * 2.0 + 5.0, atol=1e-6)
  assert seen[1] is None
  calls = []
  md_core.scan_layers(stack, body, x, 2.0, per_layer=flags, probe=lambda *a: calls.append(a))
  assert calls == []


def test_block_hook_bad_range_and_bad_policy():
  stack, x = _stack(2), jnp.ones((1, 4))
  with md_core.block_hook(lambda run, c, **kw: run(c, 1, 5)):
    with pytest.raises(ValueError, match=r"blocks \[1, 5\) outside the stack of 2"):
      md_core.scan_layers(stack, _body, x, 1.0)
  with pytest.raises(ValueError, match="unknown remat policy 'dot'"):
    md_core.scan_layers(stack, _body, x, 1.0, remat="dot")
