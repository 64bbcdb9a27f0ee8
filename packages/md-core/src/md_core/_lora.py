"""Run-time LoRA slots in `md_core.nn.Dense`: adapters that travel as jit arguments, swapped without
recompiling.

`add_lora_slots(model, rank)` gives the chosen Dense layers two extra variables, `lora_a` `[..., in, R]`
and `lora_b` `[..., R, out]` (`...` is the `layers` axis of a scanned stack), zero-initialised, of type
`LoRASlot` (not `nnx.Param`: checkpoints never hold them and loaders ignore them). A Dense with slots
computes `x @ W + b + (x @ lora_a) @ lora_b`. Because the slots are ordinary leaves of the module's state,
a pipeline passes them to its compiled programs with the rest of the state; `set_lora(state, adapters)`
returns a new state with other adapter values (any rank up to `R`, any subset of layers, several adapters
at once concatenated along the rank, each scale folded into its `B`) — same shapes, so the compiled
program is reused.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx


class LoRASlot(nnx.Variable):
  """Run-time adapter weights of a Dense layer (a state filter type; never loaded from a checkpoint)."""


class LoRAWeight(NamedTuple):
  """One adapter on one Dense layer: `delta W = scale · a @ b` (md layout: kernel `(in, out)`).

  Attributes:
    a: `[in, r]` (or `[layers, in, r]` for every layer of a scanned stack).
    b: `[r, out]` (or `[layers, r, out]`).
    scale: multiplies the delta (alpha / r times the user's adapter scale).
    layer: the layer of a scanned stack this adapter is for (None: `a`/`b` carry a layers axis, or the
      Dense is not stacked).
  """

  a: Any
  b: Any
  scale: float = 1.0
  layer: int | None = None


def _path_str(path: Sequence[Any]) -> str:
  return ".".join(str(p) for p in path)


def dense_layers(model: nnx.Module) -> dict[str, nnx.Module]:
  """Every `md_core.nn.Dense` of `model` by its dotted attribute path (e.g. `blocks.attn1.to_q`)."""
  from md_core.nn import Dense  # noqa: PLC0415 - nn imports this module

  return {_path_str(p): node for p, node in nnx.iter_graph(model) if isinstance(node, Dense)}


def add_lora_slots(
  model: nnx.Module,
  rank: int,
  *,
  targets: Callable[[str], bool] | Iterable[str] | None = None,
  dtype: Any = jnp.float32,
) -> list[str]:
  """Adds zero LoRA slots of rank `rank` to the Dense layers of `model` that `targets` selects.

  Args:
    model: any md module.
    rank: the slot size; adapters of any rank up to it (summed over adapters used at once) fit.
    targets: a predicate on the dotted path, or a collection of paths / path suffixes (e.g.
      `("to_q", "to_k", "to_v", "to_out.0")`); None: every Dense.
    dtype: the slots' dtype (adapters stay f32 or bf16 beside a quantized or bf16 weight).

  Returns:
    The paths that got slots, sorted.

  Raises:
    ValueError: a rank below 1, or targets that select no layer (naming a few paths that exist).
  """
  if int(rank) < 1:
    raise ValueError(f"add_lora_slots: rank must be >= 1, got {rank}")
  layers = dense_layers(model)
  if targets is None:
    chosen = sorted(layers)
  elif callable(targets):
    chosen = sorted(p for p in layers if targets(p))
  else:
    names = tuple(targets)
    chosen = sorted(p for p in layers if any(p == n or p.endswith("." + n) for n in names))
  if not chosen:
    sample = ", ".join(sorted(layers)[:6])
    raise ValueError(
      f"add_lora_slots: targets {targets!r} match no Dense layer; some are: {sample}"
    )
  for path in chosen:
    dense = layers[path]
    kernel = dense.kernel
    shape = kernel.get_value().shape
    *lead, n_in, n_out = shape
    axes = getattr(kernel, "logical_axes", None) or (None,) * len(shape)
    a = jnp.zeros((*lead, n_in, rank), dtype)
    b = jnp.zeros((*lead, rank, n_out), dtype)
    a, b = _placed_like(kernel.get_value(), a, b)
    dense.lora_a = LoRASlot(a, logical_axes=tuple(axes[:-1]) + (None,))
    dense.lora_b = LoRASlot(b, logical_axes=tuple(axes[:-2]) + (None, axes[-1]))
  return chosen


def _placed_like(kernel: Any, a: jax.Array, b: jax.Array) -> tuple[jax.Array, jax.Array]:
  """The slots placed where the kernel is: on a mesh, `a` split like the kernel's input axis and `b` like
  its output axis (the rank axis whole); on one device, committed to it, as loaded weights are (a jit
  argument's placement is part of its compiled program's key, so every later `set_lora` matches)."""
  sharding = getattr(kernel, "sharding", None)
  if isinstance(sharding, jax.sharding.NamedSharding):
    spec = tuple(sharding.spec) + (None,) * (kernel.ndim - len(sharding.spec))
    named = jax.sharding.NamedSharding
    pspec = jax.sharding.PartitionSpec
    a = jax.device_put(a, named(sharding.mesh, pspec(*spec[:-1], None)))
    b = jax.device_put(b, named(sharding.mesh, pspec(*spec[:-2], None, spec[-1])))
  elif sharding is not None:
    a, b = jax.device_put(a, sharding), jax.device_put(b, sharding)
  return a, b


def _slot_leaves(state: Any) -> dict[str, tuple[Any, Any]]:
  """`{dense path: (lora_a variable state, lora_b variable state)}` of a module state."""
  out = {}
  for key, _ in nnx.to_flat_state(state):
    if key and key[-1] == "lora_a":
      out[_path_str(key[:-1])] = (key, key[:-1] + ("lora_b",))
  return out


def lora_paths(state_or_model: Any) -> list[str]:
  """The Dense paths that have LoRA slots."""
  state = state_or_model if isinstance(state_or_model, nnx.State) else nnx.state(state_or_model)
  return sorted(_slot_leaves(state))


def lora_rank(state_or_model: Any) -> int:
  """The slot size of the model's LoRA slots (0 without slots)."""
  state = state_or_model if isinstance(state_or_model, nnx.State) else nnx.state(state_or_model)
  flat = dict(nnx.to_flat_state(state))
  for key, value in flat.items():
    if key and key[-1] == "lora_a":
      return int(value.get_value().shape[-1])
  return 0


def set_lora(
  state: nnx.State, adapters: Sequence[Mapping[str, LoRAWeight]] | Mapping[str, LoRAWeight]
) -> nnx.State:
  """A copy of `state` whose LoRA slots hold `adapters` (every other slot zero).

  Args:
    state: a module state with slots (`nnx.state(model)` after `add_lora_slots`, or a pipeline's split
      state).
    adapters: one adapter (`{dense path: LoRAWeight}`) or several, applied together: their ranks are
      concatenated in the slot, each scale folded into its `b`.

  Returns:
    The new state (same tree and shapes: programs compiled for `state` take it without recompiling).

  Raises:
    ValueError: a path without a slot, shapes that do not fit the layer, or more total rank than the slot.
  """
  if isinstance(adapters, Mapping):
    adapters = [adapters]
  slots = _slot_leaves(state)
  flat = dict(nnx.to_flat_state(state))

  def value_of(key):
    return flat[key].get_value()

  fills: dict[str, list[tuple[np.ndarray, np.ndarray]]] = {}
  for adapter in adapters:
    for path, w in adapter.items():
      if path not in slots:
        near = sorted(slots, key=lambda p: -len(set(p.split(".")) & set(path.split("."))))[:3]
        raise ValueError(f"set_lora: {path!r} has no LoRA slot; slots nearest by name: {near}")
      fills.setdefault(path, []).append(w)
  new = {}
  for path, (ka, kb) in slots.items():
    a_slot, b_slot = value_of(ka), value_of(kb)
    *lead, n_in, rank = a_slot.shape
    n_out = b_slot.shape[-1]
    a_parts, b_parts, used = [], [], 0
    for w in fills.get(path, []):
      a, b = jnp.asarray(w.a, a_slot.dtype), jnp.asarray(w.b, b_slot.dtype)
      r = a.shape[-1]
      if a.shape[-2] != n_in or b.shape[-1] != n_out or b.shape[-2] != r:
        raise ValueError(
          f"set_lora: {path!r} takes a [.., {n_in}, r] and b [.., r, {n_out}]; got a {tuple(a.shape)}, "
          f"b {tuple(b.shape)}"
        )
      if w.layer is not None:
        if not lead:
          raise ValueError(f"set_lora: {path!r} is not a stacked layer; layer={w.layer} given")
        za = jnp.zeros((*lead, n_in, r), a_slot.dtype).at[w.layer].set(a)
        zb = jnp.zeros((*lead, r, n_out), b_slot.dtype).at[w.layer].set(b)
        a, b = za, zb
      elif tuple(a.shape[:-2]) != tuple(lead):
        a = jnp.broadcast_to(a, (*lead, n_in, r))
        b = jnp.broadcast_to(b, (*lead, r, n_out))
      a_parts.append(a)
      b_parts.append(b * jnp.asarray(w.scale, b_slot.dtype))
      used += r
    if used > rank:
      raise ValueError(
        f"set_lora: {path!r} needs rank {used} (adapters together) but its slot holds {rank}; add "
        "slots with a larger rank"
      )
    if used == 0:
      a_new, b_new = jnp.zeros_like(a_slot), jnp.zeros_like(b_slot)
    else:
      # Several adapters at once: (x @ [A1 A2]) @ [B1; B2] = x A1 B1 + x A2 B2; the rest stays zero.
      pad_a = jnp.zeros((*lead, n_in, rank - used), a_slot.dtype)
      pad_b = jnp.zeros((*lead, rank - used, n_out), b_slot.dtype)
      a_new = jnp.concatenate([*a_parts, pad_a], axis=-1)
      b_new = jnp.concatenate([*b_parts, pad_b], axis=-2)
    a_new = jax.device_put(a_new, a_slot.sharding)
    b_new = jax.device_put(b_new, b_slot.sharding)
    new[ka], new[kb] = a_new, b_new
  out = jax.tree.map(lambda x: x, state)  # a copy of the tree
  flat_out = dict(nnx.to_flat_state(out))
  for key, value in new.items():
    flat_out[key].set_value(value)
  return out


def clear_lora(state: nnx.State) -> nnx.State:
  """`state` with every LoRA slot zero (the base model's outputs)."""
  return set_lora(state, [])
