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
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import jax
from flax import nnx

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


class BlockHook(Protocol):
  """What `block_hook` takes: called once per hookable block stack while a model is traced."""

  def __call__(
    self, run: Callable[[Any, int, int], Any], carry: Any, *, num_layers: int, index: int
  ) -> Any: ...


class _Active:
  def __init__(self, hook: BlockHook):
    self.hook = hook
    self.count = 0


_ACTIVE: contextvars.ContextVar[_Active | None] = contextvars.ContextVar(
  "md_block_hook", default=None
)


@contextlib.contextmanager
def block_hook(hook: BlockHook | None) -> Iterator[None]:
  """Routes every hookable `scan_layers` traced inside the block through `hook` (None: no hook)."""
  token = _ACTIVE.set(None if hook is None else _Active(hook))
  try:
    yield
  finally:
    _ACTIVE.reset(token)


def num_layers_of(stack: nnx.Module) -> int:
  """The length of the leading `layers` axis of a stacked module."""
  leaves = jax.tree.leaves(nnx.state(stack))
  if not leaves:
    raise ValueError("scan_layers: the stack has no parameters")
  return int(leaves[0].shape[0])


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

  active = _ACTIVE.get() if hookable else None
  if active is None:
    return jax.lax.scan(step, carry, (state, per_layer))

  def run(c, start: int, stop: int):
    if not 0 <= start <= stop <= n:
      raise ValueError(f"block hook: blocks [{start}, {stop}) outside the stack of {n}")
    if start == stop:
      return c
    part = jax.tree.map(lambda a: a[start:stop], (state, per_layer))
    c, outs = jax.lax.scan(step, c, part)
    del outs
    return c

  run.probe = None
  if probe is not None:

    def first_probe(c):
      first = jax.tree.map(lambda a: a[0], (state, per_layer))
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
  active = _ACTIVE.get()
  take = getattr(None if active is None else active.hook, "deep_branch", None)
  return run(carry) if take is None else take(run, carry)
