"""One scan over stacked blocks for every transformer and text encoder, one remat table, a block hook.

`scan_layers(stack, body, carry, *xs)` runs `body(block, carry, layer_input, *xs) -> (carry, out)` over a
module whose parameters are stacked on a leading `layers` axis (`stack_layers`), compiling one block.
The remat policy names mean the same everywhere (`REMAT_POLICIES`).

A *block hook* lets code outside a model change how its block stack runs without touching the model:
inside `with block_hook(hook):`, every hookable `scan_layers` traced calls
`hook(run, carry, num_layers=..., index=...)` instead of scanning all blocks itself. `run(carry, start,
stop)` runs blocks `[start, stop)` (static ints) and returns the carry, so a hook can compute the first
block, decide (with `lax.cond`, on device) whether the rest is recomputed, and return a cached residual
otherwise — what first-block caches and TeaCache need. `index` counts the hookable stacks traced since
the hook was entered (Flux's double blocks are 0, its single blocks 1). A hook may keep traced values on
itself between the call and the end of the `with` block: both run in the same trace. `run.probe` is
None, or, where the model passes `scan_layers(..., probe=)`, `run.probe(carry)`: what the model says a
cache should measure for this stack (TeaCache's "modulated input" of the first block).

*Layer views* (`layer_views(state)`): on one CPU device XLA copies every layer's weights out of a stacked
parameter before its matmuls (a `dynamic-slice` fusion inside the loop: 0.19 GB per Wan 1.3B block, about a
fifth of a 2-block step), since its CPU matmuls read only whole buffers. `layer_views` turns each stacked
parameter of a state into a `LayerViews`: one array per layer aliasing the stacked buffer (no copy where a
layer starts 64-byte aligned), so they reach a jitted program as separate arguments. `scan_layers` runs
such a stack as a Python loop over the blocks (one block compiled per layer instead of one for all) with the
same body, remat, hooks and per-layer inputs. Pipelines pass `Split.jit_state()`, which does this on one CPU
device and nowhere else.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from md_core.hooks import active_hook

REMAT_POLICIES = ("none", "full", "dots", "dots_no_batch")


def remat(fn: Callable, policy: str) -> Callable:
  """`fn` rematerialised by policy name.

  "none" keeps every activation; "full" recomputes everything in the backward pass; "dots" keeps every
  matmul output; "dots_no_batch" keeps the matmul outputs that have no batch dimension (the weights'
  products with activations that are not batched, e.g. projections of a shared input).
  """
  if policy == "none":
    return fn
  policies = {
    "full": None,
    "dots": jax.checkpoint_policies.dots_saveable,
    "dots_no_batch": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
  }
  if policy not in policies:
    raise ValueError(f"unknown remat policy {policy!r}; expected one of {REMAT_POLICIES}")
  return jax.checkpoint(fn, policy=policies[policy])


_checkpoint = remat  # `scan_layers` takes a `remat=` argument that shadows the name


@jax.tree_util.register_pytree_node_class
class LayerViews:
  """A stacked `[layers, ...]` parameter as one array per layer (a pytree whose children are the layers).

  `shape`, `dtype` and `ndim` describe the stacked parameter; `views[i]` is layer `i`, `views[a:b]` the
  layers `a..b-1` as a `LayerViews`; any other index (`views[...]`) indexes the stacked array.
  """

  def __init__(self, parts):
    self.parts = tuple(parts)
    if not self.parts:
      raise ValueError("LayerViews needs at least one layer")

  def tree_flatten(self):
    return self.parts, None

  @classmethod
  def tree_unflatten(cls, aux, parts):
    del aux
    return cls(parts)

  @property
  def shape(self) -> tuple[int, ...]:
    return (len(self.parts), *self.parts[0].shape)

  @property
  def dtype(self):
    return self.parts[0].dtype

  @property
  def ndim(self) -> int:
    return self.parts[0].ndim + 1

  def __len__(self) -> int:
    return len(self.parts)

  def __getitem__(self, index):
    if isinstance(index, slice):
      return LayerViews(self.parts[index])
    if isinstance(index, int):
      return self.parts[index]
    # Anything else (`views[...]`, a tuple index) reads the stacked array: built from the layers (under
    # jit only if the result is used; reading its dtype or shape costs nothing).
    return jnp.stack(self.parts)[index]

  def __repr__(self) -> str:
    return f"LayerViews({len(self.parts)} x {self.parts[0].shape} {self.dtype})"


_TRACER = getattr(jax.core, "Tracer", ())  # views are made of concrete arrays only


def _is_views(x: Any) -> bool:
  return isinstance(x, LayerViews)


def _stacked(var: Any) -> bool:
  axes = var.get_metadata().get("logical_axes") if isinstance(var, nnx.Variable) else None
  return bool(axes) and axes[0] == "layers"


def layer_views(state: Any, *, min_bytes: int = 4 << 20) -> Any:
  """`state` (an `nnx.State`) with every stacked parameter (logical axes starting with `layers`, as
  `stack_layers` makes them) placed on one CPU device and holding at least `min_bytes` per layer as a
  `LayerViews` of per-layer arrays; anything else is returned unchanged (`state` itself when nothing is
  converted: no stacks, small layers, accelerators, arrays spread over several devices).

  The threshold keeps small models scanned: their per-layer copies cost next to nothing, while a stack
  with views compiles each block separately (the 4-layer default video model: 3.3 -> 5.6 s to compile).
  A Wan 1.3B block's matrices are 9.4-55 MB each.

  A layer whose bytes start 64-byte aligned in the stacked buffer aliases it (no copy); others are copied
  (small tensors, e.g. an odd bias). The views keep the stacked arrays alive; they must not outlive a
  `delete()` of them.
  """
  found = False

  def convert(var):
    nonlocal found
    if not _stacked(var):
      return var
    value = var.get_value()
    if not isinstance(value, jax.Array) or isinstance(value, _TRACER) or value.ndim == 0:
      return var
    devices = value.devices()
    device = next(iter(devices))
    if len(devices) != 1 or device.platform != "cpu" or value.nbytes // value.shape[0] < min_bytes:
      return var
    found = True
    host = np.asarray(value)  # on a CPU device: the device buffer itself, read-only
    parts = [jax.device_put(host[i], device, may_alias=True) for i in range(host.shape[0])]
    return var.replace(value=LayerViews(parts))

  out = jax.tree.map(convert, state, is_leaf=lambda x: isinstance(x, nnx.Variable))
  return out if found else state


def num_layers_of(stack: nnx.Module) -> int:
  """The length of the leading `layers` axis of a stacked module."""
  leaves = jax.tree.leaves(nnx.state(stack), is_leaf=_is_views)
  if not leaves:
    raise ValueError("scan_layers: the stack has no parameters")
  return int(leaves[0].shape[0])


def _layer(tree: Any, i: int) -> Any:
  return jax.tree.map(lambda a: a[i], tree, is_leaf=_is_views)


def _loop(step: Callable, carry: Any, state: Any, per_layer: Any, start: int, stop: int):
  """`jax.lax.scan(step, carry, (state, per_layer))` over layers `[start, stop)` as a Python loop."""
  outs = []
  for i in range(start, stop):
    carry, out = step(carry, _layer((state, per_layer), i))
    outs.append(out)
  return carry, jax.tree.map(lambda *o: jnp.stack(o), *outs)


def scan_layers(
  stack: nnx.Module,
  body: Callable[..., tuple[Any, Any]],
  carry: Any,
  *xs: Any,
  per_layer: Any = None,
  remat: str = "none",
  hookable: bool = True,
  probe: Callable[..., Any] | None = None,
) -> tuple[Any, Any]:
  """Runs `body(block, carry, layer_input, *xs) -> (carry, out)` over every block of `stack`.

  Args:
    stack: a module built by `stack_layers` (parameters with a leading layers axis).
    body: one block's step; `block` is the merged module of that layer, `layer_input` the layer's slice
      of `per_layer` (None when `per_layer` is None), `xs` the same for every layer.
    carry: the hidden state(s) threaded through the blocks.
    *xs: inputs shared by every block (closed over, never sliced).
    per_layer: a pytree with a leading layers axis (e.g. per-layer skip flags), or None.
    remat: a name from `REMAT_POLICIES`.
    hookable: whether an active `block_hook` may take over this stack (denoiser stacks: yes; text
      encoders that return per-layer outputs pass False).
    probe: `probe(block, carry, layer_input, *xs)` on the first block, handed to a block hook as
      `run.probe(carry)` (e.g. the first block's modulated input, which TeaCache measures); never run
      without a hook.

  Returns:
    `(carry, outs)`, `outs` stacked over layers as `jax.lax.scan` returns them (None when a hook ran).
  """
  graphdef, state = nnx.split(stack)
  n = num_layers_of(stack)

  def step(c, layer):
    layer_state, layer_input = layer
    return body(nnx.merge(graphdef, layer_state), c, layer_input, *xs)

  step = _checkpoint(step, remat)
  unrolled = any(_is_views(leaf) for leaf in jax.tree.leaves(state, is_leaf=_is_views))

  def scan(c, start, stop):
    if unrolled:
      return _loop(step, c, state, per_layer, start, stop)
    part = (state, per_layer)
    if (start, stop) != (0, n):
      part = jax.tree.map(lambda a: a[start:stop], part)
    return jax.lax.scan(step, c, part)

  active = active_hook() if hookable else None
  if active is None:
    return scan(carry, 0, n)

  def run(c, start: int, stop: int):
    if not 0 <= start <= stop <= n:
      raise ValueError(f"block hook: blocks [{start}, {stop}) outside the stack of {n}")
    if start == stop:
      return c
    c, outs = scan(c, start, stop)
    del outs
    return c

  run.probe = None
  if probe is not None:

    def first_probe(c):
      first = _layer((state, per_layer), 0)
      return probe(nnx.merge(graphdef, first[0]), c, first[1], *xs)

    run.probe = first_probe
  index = active.count
  active.count += 1
  return active.hook(run, carry, num_layers=n, index=index), None


def deep_branch(run: Callable[[Any], Any], carry: Any) -> Any:
  """A UNet's deep branch (everything between its first down block and its last up block) as one
  hookable unit: an active `block_hook` whose hook has a `deep_branch(run, carry)` method takes it
  over (DeepCache reuses its output on cheap steps); otherwise, and for hooks without that method (the
  block caches of transformer stacks), `run(carry)`."""
  active = active_hook()
  take = getattr(None if active is None else active.hook, "deep_branch", None)
  return run(carry) if take is None else take(run, carry)
