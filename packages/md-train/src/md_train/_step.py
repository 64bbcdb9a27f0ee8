"""The train state and the jitted, donated training step."""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from md_train._optim import Optimizer

# loss_fn(params, batch, key) -> (loss: () float32, aux: dict of arrays)
LossFn = Callable[[Any, Any, jax.Array], tuple[jax.Array, dict[str, jax.Array]]]


class TrainState(NamedTuple):
  """Everything a training step reads and writes (a pytree; the step donates it).

  Attributes:
    step: (), int32: micro-batches taken so far.
    params: the trainable NNX state (`nnx.State` of `nnx.Param`s), dtypes as the model holds them.
    opt_state: the optimizer's state over `params` (Adam moments, float32 like the params; the EMA).
    rng: a PRNG key (uint32 [2] or a typed key), split once per step for the loss's random draws.
  """

  step: jax.Array
  params: Any
  opt_state: Any
  rng: jax.Array


class Frozen(NamedTuple):
  """The part of a split module that does not train: its graph definition and non-trainable state."""

  graphdef: Any
  rest: tuple[Any, ...]

  def merge(self, params: Any) -> nnx.Module:
    """The module with trainable state `params` (a traced copy inside jit)."""
    return nnx.merge(self.graphdef, params, *self.rest)


def split_trainable(module: nnx.Module, wrt: Any = nnx.Param) -> tuple[Frozen, Any]:
  """Splits `module` once into (its frozen part, the trainable state selected by the filter `wrt`)."""
  graphdef, params, *rest = nnx.split(module, wrt, ...)
  return Frozen(graphdef, tuple(rest)), params


def init_state(params: Any, optimizer: Optimizer, rng: jax.Array | int = 0) -> TrainState:
  """A fresh train state: step 0, the optimizer initialised on `params`.

  The optimizer state is built by one jitted `init`, so moments follow the parameters' shardings; when
  the parameters live on a mesh, `step` and `rng` are replicated on it.
  """
  if isinstance(rng, int):
    rng = jax.random.key(rng)
  step = jnp.zeros((), jnp.int32)
  mesh = _mesh_of(params)
  if mesh is None:
    return TrainState(step, params, jax.jit(optimizer.tx.init)(params), rng)
  replicated = NamedSharding(mesh, PartitionSpec())
  # Placed from host copies: device_put refuses a device array for a mesh that spans processes.
  step = jax.device_put(np.zeros((), np.int32), replicated)
  rng = jax.random.wrap_key_data(
    jax.device_put(np.asarray(jax.random.key_data(rng)), replicated), impl=jax.random.key_impl(rng)
  )
  # Moments (and the EMA) shard like their parameters; counters are replicated.
  shardings = optax.tree_map_params(
    optimizer.tx,
    lambda _, param: param.sharding,
    jax.eval_shape(optimizer.tx.init, params),
    params,
    transform_non_params=lambda _: replicated,
  )
  opt_state = jax.jit(optimizer.tx.init, out_shardings=shardings)(params)
  return TrainState(step, params, opt_state, rng)


def _mesh_of(tree: Any) -> jax.sharding.Mesh | None:
  for leaf in jax.tree.leaves(tree):
    sharding = getattr(leaf, "sharding", None)
    if isinstance(sharding, NamedSharding):
      return sharding.mesh
  return None


def state_shardings(state: TrainState) -> TrainState:
  """The shardings the arrays of `state` have (a `TrainState` of `Sharding`s), e.g. for `make_train_step`."""
  return jax.tree.map(lambda a: a.sharding, state)


def _step(state, batch, loss_fn, optimizer):
  rng, key = jax.random.split(state.rng)
  (loss, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params, batch, key)
  updates, opt_state = optimizer.tx.update(grads, state.opt_state, state.params)
  params = optax.apply_updates(state.params, updates)
  metrics = {
    "loss": loss,
    "grad_norm": optax.tree.norm(grads),
    "lr": jnp.asarray(optimizer.learning_rate_at(state.step), jnp.float32),
    **aux,
  }
  return TrainState(state.step + 1, params, opt_state, rng), metrics


def make_train_step(
  loss_fn: LossFn,
  optimizer: Optimizer,
  *,
  state_sharding: TrainState | None = None,
  batch_sharding: Any = None,
) -> Callable[[TrainState, Any], tuple[TrainState, dict[str, jax.Array]]]:
  """`train_step` for one `loss_fn` and `optimizer`, jitted with pinned shardings and the state donated.

  Args:
    loss_fn: `loss_fn(params, batch, key) -> (loss, aux)`.
    optimizer: from `make_optimizer`.
    state_sharding: the state's shardings in and out (`state_shardings(state)` of a state built by
      `init_state` on parameters placed by a family loader under a mesh); None: follow the inputs.
    batch_sharding: the batch's shardings (a sharding or a pytree of them); None: follow the inputs.

  Returns:
    `step(state, batch) -> (state, metrics)`; metrics come back replicated.
  """
  fn = functools.partial(_step, loss_fn=loss_fn, optimizer=optimizer)
  if state_sharding is None:
    return jax.jit(fn, donate_argnums=0)
  mesh = _mesh_of(state_sharding.params) if state_sharding is not None else None
  metrics_sharding = None if mesh is None else NamedSharding(mesh, PartitionSpec())
  return jax.jit(
    fn,
    in_shardings=(state_sharding, batch_sharding),
    out_shardings=(state_sharding, metrics_sharding),
    donate_argnums=0,
  )


@functools.partial(jax.jit, static_argnames=("loss_fn", "optimizer"), donate_argnames=("state",))
def train_step(
  state: TrainState, batch: Any, loss_fn: LossFn, optimizer: Optimizer
) -> tuple[TrainState, dict[str, jax.Array]]:
  """One training step: loss and gradients, the optimizer's update, the new state.

  Compiled once per (batch shapes, `loss_fn`, `optimizer`): build both once and reuse them. `state` is
  donated: use the returned one.

  Args:
    state: the current state.
    batch: the loss's inputs (a pytree of arrays).
    loss_fn: `loss_fn(params, batch, key) -> (loss, aux)`.
    optimizer: from `make_optimizer`.

  Returns:
    (the new state, metrics: `loss`, `grad_norm` (global norm before clipping), `lr` (this step's learning
    rate), and `loss_fn`'s aux values).
  """
  return _step(state, batch, loss_fn, optimizer)


def with_master_weights(params: Any, loss_fn: LossFn) -> tuple[Any, LossFn]:
  """Float32 master weights for a model held in lower precision (e.g. loaded with `dtype=bfloat16`, the
  reference's float32 tables kept): returns (float32 copies of `params`, a loss that casts each leaf back
  to its model dtype before calling `loss_fn`). The optimizer then updates the float32 copies, and the
  gradients reach them through the casts in float32.
  """
  dtypes = jax.tree.map(lambda a: a.dtype, params)
  master = jax.tree.map(lambda a: jnp.array(a, jnp.float32, copy=True), params)

  def cast_loss(master_params, batch, key):
    model_params = jax.tree.map(lambda a, d: a.astype(d), master_params, dtypes)
    return loss_fn(model_params, batch, key)

  return master, cast_loss


def mixed_precision(loss_fn: LossFn, params: Any, dtype: Any, keep_f32: Any = ()) -> LossFn:
  """A loss that runs the model in `dtype` (e.g. bfloat16) while the optimizer keeps `params` in float32.

  Each floating leaf of the parameters is cast to `dtype` inside the loss (models that compute in their
  weights' dtype then run their matmuls in it), except the leaves whose '/'-joined path matches a
  regular expression of `keep_f32` (a family's `KEEP_F32`: the tables its reference keeps in float32);
  the gradients reach the float32 parameters through the casts. `params` gives the tree's paths only.
  """
  dtype = jnp.dtype(dtype)
  if not jnp.issubdtype(dtype, jnp.floating):
    raise ValueError(f"mixed_precision: dtype={dtype} is not a floating dtype")
  patterns = [re.compile(p) for p in keep_f32]

  def target(path, leaf):
    if not jnp.issubdtype(leaf.dtype, jnp.floating):
      return leaf.dtype
    text = "/".join(_key_name(k) for k in path)
    return leaf.dtype if any(p.search(text) for p in patterns) else dtype

  dtypes = jax.tree_util.tree_map_with_path(target, params)

  def cast_loss(master_params, batch, key):
    model_params = jax.tree.map(lambda a, d: a.astype(d), master_params, dtypes)
    return loss_fn(model_params, batch, key)

  return cast_loss


def _key_name(key: Any) -> str:
  for attr in ("key", "idx", "name"):
    if hasattr(key, attr):
      return str(getattr(key, attr))
  return str(key)


def loss_and_grads(loss_fn: LossFn, params: Any, batch: Any, key: jax.Array | None = None):
  """`(loss, aux), grads` of one batch, jitted (for checks against a reference; `train_step` trains)."""
  key = jax.random.key(0) if key is None else key
  return _loss_and_grads(loss_fn, params, batch, key)


@functools.partial(jax.jit, static_argnames=("loss_fn",))
def _loss_and_grads(loss_fn, params, batch, key):
  return jax.value_and_grad(loss_fn, has_aux=True)(params, batch, key)
