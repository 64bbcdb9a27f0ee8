"""Abstract (shapes-only) model builds: parameter keys that cost nothing to draw there."""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import jax
from flax import nnx

_SHAPES_ONLY = contextvars.ContextVar("md_shapes_only", default=False)


@contextlib.contextmanager
def shapes_only() -> Iterator[None]:
  """Inside, md's modules take a constant key for their parameters' initialisers instead of drawing one
  from their `nnx.Rngs`: for builds whose values are never used (`nnx.eval_shape`, as md's loaders build
  a model before filling it from a checkpoint). Under jax's abstract trace each draw from an `nnx.Rngs`
  costs milliseconds (nnx's bookkeeping asks the traced key for a sharding, and jax explains the refusal
  by printing the trace so far): 1.1 of the 1.7 s that loading the tiny Flux.1 pipeline took."""
  token = _SHAPES_ONLY.set(True)
  try:
    yield
  finally:
    _SHAPES_ONLY.reset(token)


def param_key(rngs: nnx.Rngs | None) -> jax.Array:
  """The key for one parameter's initialiser: `rngs.params()`, or a constant key without `rngs` and
  inside `shapes_only()`."""
  if rngs is None or _SHAPES_ONLY.get():
    return jax.random.key(0)
  return rngs.params()
