"""Stacks of identical blocks: building them with stacked parameters (run them with `scan_layers`)."""

from __future__ import annotations

from collections.abc import Callable

import jax
from flax import nnx

from md_core._abstract import param_key, shapes_only
from md_core._loading import logical_axes


def stack_layers(
  make: Callable[[nnx.Rngs], nnx.Module], num_layers: int, rngs: nnx.Rngs
) -> nnx.Module:
  """`num_layers` independently initialised `make(rngs)` modules as one module whose parameters are
  stacked on a leading axis.

  The modules are built under `jax.vmap` over split keys, so one block is traced whatever the depth
  (abstract builds of 40-layer models stay fast). Every stacked parameter gets the logical axis `layers`
  in front of its own, so the loader fills it with `Target(layer=i)` and md-sharding keeps that axis whole.
  """
  keys = jax.random.split(param_key(rngs), num_layers)
  with shapes_only():  # the graph only: no keys drawn under the abstract trace
    graphdef, _ = nnx.split(nnx.eval_shape(lambda: make(nnx.Rngs(0))))
  stacked = nnx.merge(graphdef, jax.vmap(lambda key: nnx.state(make(nnx.Rngs(key))))(keys))
  for _, var in nnx.to_flat_state(nnx.state(stacked)):
    axes = logical_axes(var)
    var.set_metadata("logical_axes", ("layers",) + (axes or (None,) * (var.get_value().ndim - 1)))
  return stacked
