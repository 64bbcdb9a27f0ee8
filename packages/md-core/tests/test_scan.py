"""md_core.scan_layers and block hooks: equal to the blocks run one by one, in any split."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
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


def _views_of(stack):
  graphdef, state = nnx.split(stack)
  return graphdef, state, md_core.layer_views(state, min_bytes=0)


def test_layer_views_alias_the_stacked_buffer_and_copy_only_unaligned_layers():
  make = lambda r: nn.Dense(64, 48, axes=("embed", "mlp"), rngs=r)  # noqa: E731
  stack = md_core.stack_layers(make, 3, nnx.Rngs(0))
  _, state, views = _views_of(stack)
  kernel, kviews = state["kernel"].get_value(), views["kernel"].get_value()
  assert isinstance(kviews, md_core.LayerViews)
  assert kviews.shape == (3, 64, 48) and kviews.dtype == jnp.float32 and kviews.ndim == 3
  assert len(kviews[1:]) == 2 and "3 x (64, 48)" in repr(kviews)
  chex.assert_trees_all_equal(kviews[...], kernel)  # model code reading the whole stack still can
  chex.assert_trees_all_equal(kviews[1, 2], kernel[1, 2])
  base = kernel.unsafe_buffer_pointer()
  for i in range(3):
    # 64 * 48 * 4 bytes per layer: every layer starts aligned, so each view is the stack's own memory.
    assert kviews[i].unsafe_buffer_pointer() == base + i * 64 * 48 * 4
    chex.assert_trees_all_equal(kviews[i], kernel[i])
  # A 5-float bias is 20 bytes a layer: layers 1 and 2 start unaligned and are copied, with equal values.
  odd = md_core.stack_layers(
    lambda r: nn.Dense(4, 5, axes=("embed", "mlp"), rngs=r), 3, nnx.Rngs(1)
  )
  _, ostate, oviews = _views_of(odd)
  for i in range(3):
    chex.assert_trees_all_equal(oviews["bias"].get_value()[i], ostate["bias"].get_value()[i])
  # Layers under `min_bytes` (default 4 MiB) stay stacked; nothing converted: the same state back.
  assert md_core.layer_views(state) is state
  assert not isinstance(
    md_core.layer_views(state, min_bytes=48 * 4 + 1)["bias"].get_value(), md_core.LayerViews
  )
  assert isinstance(
    md_core.layer_views(state, min_bytes=48 * 4 + 1)["kernel"].get_value(), md_core.LayerViews
  )
  plain_state = nnx.state(nn.Dense(4, 4, axes=("embed", "mlp"), rngs=nnx.Rngs(0)))
  assert md_core.layer_views(plain_state) is plain_state


def test_layer_views_run_the_same_blocks_with_hooks_per_layer_inputs_and_gradients():
  stack, x = _stack(4), jnp.linspace(-1, 1, 8).reshape(2, 4)
  graphdef, state, views = _views_of(stack)
  flags = jnp.asarray([1.0, 0.0, 1.0, 1.0])

  def body(block, h, flag, scale):
    out = jnp.where(flag > 0, jnp.tanh(block(h)) * scale, h)
    return out, jnp.sum(out)

  def run(st, x):
    return md_core.scan_layers(nnx.merge(graphdef, st), body, x, 1.5, per_layer=flags)

  (h_views, sums_views), (h_scan, sums_scan) = jax.jit(run)(views, x), jax.jit(run)(state, x)
  chex.assert_trees_all_close(h_views, h_scan, atol=1e-6, rtol=0)
  chex.assert_trees_all_close(sums_views, sums_scan, atol=1e-6, rtol=0)
  chex.assert_shape(sums_views, (4,))
  # The per-layer program reads each layer's own arguments: no loop, no slice of a stacked weight (the
  # only slices are of the 1-D per-layer flags).
  eqns = jax.make_jaxpr(run)(views, x).jaxpr.eqns
  assert not {e.primitive.name for e in eqns} & {"scan", "while"}
  sliced = [e.invars[0].aval.shape for e in eqns if e.primitive.name in ("slice", "dynamic_slice")]
  assert sliced and all(shape == (4,) for shape in sliced), sliced

  loss = lambda st, x: jnp.sum(run(st, x)[0] ** 2)  # noqa: E731
  gx_views, gx_scan = jax.grad(loss, 1)(views, x), jax.grad(loss, 1)(state, x)
  chex.assert_trees_all_close(gx_views, gx_scan, atol=1e-6, rtol=0)

  def split(run_blocks, carry, *, num_layers, index):
    seen.append(run_blocks.probe(carry))
    return run_blocks(run_blocks(carry, 0, 1), 1, num_layers)

  probe = lambda block, h, flag, scale: block(h) * scale + flag  # noqa: E731
  for st in (views, state):
    seen = []
    with md_core.block_hook(split):
      h = md_core.scan_layers(nnx.merge(graphdef, st), body, x, 1.5, per_layer=flags, probe=probe)[
        0
      ]
    chex.assert_trees_all_close(h, h_scan, atol=1e-6, rtol=0)
    k, b = stack.kernel[...], stack.bias[...]
    chex.assert_trees_all_close(seen[0], (x @ k[0] + b[0].reshape(1, 4)) * 1.5 + 1.0, atol=1e-6)
  assert md_core.num_layers_of(nnx.merge(graphdef, views)) == 4


def test_layer_views_leave_arrays_spread_over_devices_alone():
  stack = _stack(4)
  mesh = jax.sharding.Mesh(jax.devices()[:2], ("x",))
  spec = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(None, "x"))
  state = nnx.state(stack)
  sharded = jax.tree.map(lambda a: jax.device_put(a, spec) if a.ndim == 3 else a, state)
  views = md_core.layer_views(sharded, min_bytes=0)
  assert not isinstance(views["kernel"].get_value(), md_core.LayerViews)
  assert isinstance(views["bias"].get_value(), md_core.LayerViews)  # on one device: viewed


def test_split_jit_state_is_cached_and_rebuilt_when_the_state_changes():
  from md_core.pipeline import Split

  # 1024 x 1024 float32 kernels: 4 MiB a layer, the default threshold.
  make = lambda r: nn.Dense(1024, 1024, axes=("embed", "mlp"), rngs=r)  # noqa: E731
  split = Split.of(md_core.stack_layers(make, 3, nnx.Rngs(0)))
  first = split.jit_state()
  assert split.jit_state() is first
  assert isinstance(first["kernel"].get_value(), md_core.LayerViews)
  assert not isinstance(
    first["bias"].get_value(), md_core.LayerViews
  )  # 4 KB a layer: stays stacked
  split.state = jax.tree.map(lambda a: a * 2, split.state)
  second = split.jit_state()
  assert second is not first
  chex.assert_trees_all_close(
    second["kernel"].get_value()[2], split.state["kernel"].get_value()[2], atol=0, rtol=0
  )
  assert jax.tree.structure(second) == jax.tree.structure(first)


def test_layer_views_keep_the_stacked_buffer_alive():
  """Views alias the stack's memory; dropping every other reference to the stacked arrays (module and
  state) must not free it under them."""
  import gc

  make = lambda r: nn.Dense(64, 48, axes=("embed", "mlp"), rngs=r)  # noqa: E731
  stack = md_core.stack_layers(make, 3, nnx.Rngs(0))
  want = np.asarray(stack.kernel[...]).copy()
  views = md_core.layer_views(nnx.state(stack), min_bytes=0)
  del stack
  gc.collect()
  junk = [jnp.full((64, 48), 7.0) + i for i in range(16)]  # reuse of freed memory would show here
  jax.block_until_ready(junk)
  for i in range(3):
    np.testing.assert_array_equal(np.asarray(views["kernel"].get_value()[i]), want[i])
