"""What every md-cache policy shares: stable function identity, block-level slots sized by a probe.

Thresholds live in the policy's state (traced values), never in its functions: a policy factory returns
`StepCache(init, decide, update, hook)` whose `decide` / `update` / `hook` are built once per policy kind
and static settings (`functools.lru_cache`), and whose `init` compares equal for equal static settings
(`_Init`), so pipelines that key their jit memo on the cache object reuse the compiled loop when only a
threshold changes.

Block-level policies keep residuals shaped like a model's hidden states, which the loop's carry must hold
from the first step, yet `init(latents, num_steps)` never sees the model. Their state starts with
`slots=None`; `prepare(run, carry)` traces one chunk abstractly, where the policy's hook records the
carry of every block stack it took over and raises `_Sized` with them, and returns the carry with zeroed
slots of those shapes (the policy's `valid` flag says no step has filled them yet).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class _Init:
  """A policy's `init(latents, num_steps)`: equal (and hashing equal) for equal `kind` and `static`;
  `make(values, latents, num_steps)` builds the state from the traced `values` (left out of the key)."""

  kind: str
  static: tuple
  make: Callable[..., Any] = dataclasses.field(compare=False)
  values: dict = dataclasses.field(compare=False, hash=False)

  def __call__(self, latents: Any, num_steps: int) -> Any:
    return self.make(self.values, latents, int(num_steps))


class _Sized(Exception):
  """Raised by a block-level hook traced with unsized slots: the avals every stack's carry has."""

  def __init__(self, fill: Callable[[Any], Any]):
    super().__init__("md-cache: slot probe (caught by md_cache.prepare)")
    self.fill = fill


def no_stacks_error(policy: str) -> ValueError:
  return ValueError(
    f"{policy} is a block-level cache: it needs a denoiser whose transformer blocks run through "
    "md_core.scan_layers (Flux.1, Flux.2, Wan, LTX-Video, LTX-2), and this one has no hookable block "
    "stack (e.g. md-sd's UNet). For a UNet, md_cache.deepcache applies; "
    "these work with any denoiser: md_cache.taylorseer, md_cache.sencache (step-level) and "
    "md_cache.faster_cache (the CFG cache, with classifier-free guidance)."
  )


def outside(state: Any, step) -> Any:
  """A block-level state after a step whose model call ran outside the block hook (a program of its
  own, as the Klein KV edit's step 0): the step counts as computed, and nothing is cached from it."""
  return state._replace(computed=state.computed.at[step].set(True))


def prepare(run: Callable[[Any], Any], carry: Any) -> Any:
  """The loop carry with a block-level cache's slots sized (a no-op for other caches).

  Args:
    run: `run(carry) -> carry`, one step of the loop (e.g. the pipeline's jitted chunk over
      `[start, start + 1)`); traced abstractly, never run.
    carry: an `md_schedulers.SampleState` from `init_state`.

  Returns:
    `carry` with its cache state's slots zeroed at the shapes the model's block stacks carry.
  """
  state = carry.cache
  if getattr(state, "slots", 0) is not None:
    return carry
  try:
    jax.eval_shape(run, carry)
  except _Sized as probe:
    return carry._replace(cache=probe.fill(state))
  raise AssertionError("md-cache: the slot probe traced no block hook")


def zeros(avals: Any) -> Any:
  return jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), avals)


def avals(tree: Any) -> Any:
  return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), tree)


def first(tree: Any) -> jax.Array:
  """The hidden states of a block stack's carry: its first leaf (Flux's image stream, LTX-2's video)."""
  return jax.tree.leaves(tree)[0]


def add(a: Any, b: Any) -> Any:
  return jax.tree.map(lambda x, y: x + y.astype(x.dtype), a, b)


def sub(a: Any, b: Any) -> Any:
  return jax.tree.map(lambda x, y: x - y, a, b)


def per_row(flags: jax.Array, rows: int) -> jax.Array:
  """Per-group flags `[G]` repeated over each group's rows: `[G * (rows // G)]`."""
  return jnp.repeat(flags, rows // flags.shape[0])


def select_rows(rows: jax.Array, a: Any, b: Any) -> Any:
  """`a` on the rows where `rows` (`[R]` bool) holds, else `b`, for every leaf (leading axis R)."""

  def pick(x, y):
    return jnp.where(rows.reshape((-1,) + (1,) * (x.ndim - 1)), x, y)

  return jax.tree.map(pick, a, b)


def rows_for(rows: jax.Array, any_row: jax.Array, carry: Any) -> jax.Array:
  """The per-row flags for a block stack's carry: `rows` when it has the decided rows; otherwise (a
  second model call in the same step with other rows, as LTX-2's isolated-modality call) the step's
  any-branch decision on each of its rows."""
  n = first(carry).shape[0]
  return rows if n == rows.shape[0] else jnp.broadcast_to(any_row, (n,))


def groups_of(rows: int, sample: Any, joint: bool = False) -> int:
  """The groups of rows that decide together: each guidance branch stacked on the batch axis (the
  model's rows over the sample's batch), or one group for all rows when `joint` (the reference runs the
  branches in one batched call and measures them together)."""
  b = jax.tree.leaves(sample)[0].shape[0]
  if rows % b:
    raise ValueError(f"md-cache: the block stack carries {rows} rows, not a multiple of batch {b}")
  return 1 if joint else rows // b


@functools.cache
def block_policy(make_hook: Callable[..., Any]) -> Any:
  """The `StepCache` of a block-level policy: its hook object made by `make_hook(state, step, sample)`,
  never a step-level reuse, slots sized by `prepare`. Cached per hook maker, so every policy of one kind
  is the same object (the pipelines' jit memo reuses its programs)."""
  import md_schedulers as mdsch  # noqa: PLC0415

  def hook(state, step, t, sample, joint=False):
    del t
    return make_hook(state, step, sample, joint=joint)

  return mdsch.StepCache(init=None, decide=never, update=keep, hook=hook, prepare=prepare)


def never(state, step, t, sample):
  """`decide` of block-level policies: the loop calls their hook instead."""
  del state, step, t, sample
  return jnp.zeros((), bool), None


def keep(state, step, t, sample, prediction, reused):
  """`update` of block-level policies: their hook already updated the state."""
  del step, t, sample, prediction, reused
  return state
