"""Run-time LoRA slots in `md_core.nn.Dense` and `md_core.nn.Conv`: adapters that travel as jit
arguments, swapped without recompiling.

`add_lora_slots(model, rank)` gives the chosen Dense layers two extra variables, `lora_a` `[..., in, R]`
and `lora_b` `[..., R, out]` (`...` is the `layers` axis of a scanned stack), zero-initialised, of type
`LoRASlot` (not `nnx.Param`: checkpoints never hold them and loaders ignore them). A Dense with slots
computes `x @ W + b + (x @ lora_a) @ lora_b` (a Conv: `conv(x, W) + b + conv(x, lora_a) @ lora_b`). Because the slots are ordinary leaves of the module's state,
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


class LoRASlotWeight(NamedTuple):
  """What `set_lora` puts in one layer's run-time slots: `delta W = scale · a @ b` (md layout: kernel
  `(in, out)`, conv `(*k, in, out)`). A loaded adapter's own weights are `md_lora.LoRAWeight`;
  `md_lora.to_slots` turns them into these.

  Attributes:
    a: `[in, r]` (or `[layers, in, r]` for every layer of a scanned stack); a conv's `[*k, in, r]`.
    b: `[r, out]` (or `[layers, r, out]`).
    scale: multiplies the delta (alpha / r times the user's adapter scale).
    layer: the layer of a scanned stack this adapter is for (None: `a`/`b` carry a layers axis, or the
      Dense is not stacked).
  """

  a: Any
  b: Any
  scale: float = 1.0
  layer: int | None = None
  # DoRA: this adapter's factor `g` `[out]` (or `[layers, out]`) on the layer's base output, `x @ W · g`
  # (its `b` already scaled by it); adapters together give the base output `1 + sum(g_i - 1)`. Needs the
  # layer's gain slot (`add_lora_slots(..., gain=True)`).
  gain: Any = None


def _path_str(path: Sequence[Any]) -> str:
  return ".".join(str(p) for p in path)


def dense_layers(model: nnx.Module) -> dict[str, nnx.Module]:
  """Every `md_core.nn.Dense` of `model` by its dotted attribute path (e.g. `blocks.attn1.to_q`)."""
  from md_core.nn import Dense  # noqa: PLC0415 - nn imports this module

  return {_path_str(p): node for p, node in nnx.iter_graph(model) if isinstance(node, Dense)}


def lora_layers(model: nnx.Module) -> dict[str, nnx.Module]:
  """Every layer of `model` that can hold LoRA slots: each `md_core.nn.Dense`, and each `md_core.nn.Conv`
  without feature groups, by its dotted attribute path."""
  from md_core.nn import Conv, Dense  # noqa: PLC0415 - nn imports this module

  return {
    _path_str(p): node
    for p, node in nnx.iter_graph(model)
    if isinstance(node, Dense) or (isinstance(node, Conv) and node.groups == 1)
  }


def add_lora_slots(
  model: nnx.Module,
  rank: int,
  *,
  targets: Callable[[str], bool] | Iterable[str] | None = None,
  dtype: Any = jnp.float32,
  gain: bool = False,
) -> list[str]:
  """Adds zero LoRA slots of rank `rank` to the Dense and Conv layers of `model` that `targets` selects.

  A Dense gets `lora_a` `[..., in, R]` and `lora_b` `[..., R, out]`; a Conv with kernel `(*k, in, out)`
  gets `lora_a` `[*k, in, R]` (a conv with the layer's stride, padding and dilation) and `lora_b` `[R, out]`
  (a 1x1 conv), as PEFT's conv LoRA (`lora_A` a conv like the base, `lora_B` 1x1).

  Args:
    model: any md module.
    rank: the slot size; adapters of any rank up to it (summed over adapters used at once) fit.
    targets: a predicate on the dotted path, or a collection of paths / path suffixes (e.g.
      `("to_q", "to_k", "to_v", "to_out.0")`); None: every Dense and Conv.
    dtype: the slots' dtype (adapters stay f32 or bf16 beside a quantized or bf16 weight).
    gain: also a per-output gain slot `lora_gain` `[..., out]` (ones), which multiplies the layer's base
      output: what DoRA adapters need at run time (`LoRASlotWeight.gain`).

  Returns:
    The paths that got slots, sorted.

  Raises:
    ValueError: a rank below 1, or targets that select no layer (naming a few paths that exist).
  """
  if int(rank) < 1:
    raise ValueError(f"add_lora_slots: rank must be >= 1, got {rank}")
  layers = lora_layers(model)
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
    layer = layers[path]
    kernel = layer.kernel
    shape = kernel.get_value().shape
    window = len(getattr(layer, "kernel_size", ()))  # 0 for a Dense
    *lead, n_in, n_out = shape
    lead = lead[: len(lead) - window]
    axes = getattr(kernel, "logical_axes", None) or (None,) * len(shape)
    a = jnp.zeros((*shape[:-1], rank), dtype)
    b = jnp.zeros((*lead, rank, n_out), dtype)
    a, b = _placed_like(kernel.get_value(), a, b, len(lead))
    layer.lora_a = LoRASlot(a, logical_axes=tuple(axes[:-1]) + (None,))
    layer.lora_b = LoRASlot(b, logical_axes=tuple(axes[: len(lead)]) + (None, axes[-1]))
    if gain:
      g = jnp.ones((*lead, n_out), jnp.float32)
      sharding = getattr(b, "sharding", None)
      if isinstance(sharding, jax.sharding.NamedSharding):
        spec = tuple(sharding.spec) + (None,) * (b.ndim - len(sharding.spec))
        g = jax.device_put(
          g,
          jax.sharding.NamedSharding(
            sharding.mesh, jax.sharding.PartitionSpec(*spec[:-2], spec[-1])
          ),
        )
      elif sharding is not None:
        g = jax.device_put(g, sharding)
      layer.lora_gain = LoRASlot(g, logical_axes=tuple(axes[: len(lead)]) + (axes[-1],))
  return chosen


def _placed_like(
  kernel: Any, a: jax.Array, b: jax.Array, n_lead: int
) -> tuple[jax.Array, jax.Array]:
  """The slots placed where the kernel is: on a mesh, `a` split like the kernel's input axis and `b` like
  its output axis (the rank axis whole); on one device, committed to it, as loaded weights are (a jit
  argument's placement is part of its compiled program's key, so every later `set_lora` matches)."""
  sharding = getattr(kernel, "sharding", None)
  if isinstance(sharding, jax.sharding.NamedSharding):
    spec = tuple(sharding.spec) + (None,) * (kernel.ndim - len(sharding.spec))
    named = jax.sharding.NamedSharding
    pspec = jax.sharding.PartitionSpec
    a = jax.device_put(a, named(sharding.mesh, pspec(*spec[:-1], None)))
    b = jax.device_put(b, named(sharding.mesh, pspec(*spec[:n_lead], None, spec[-1])))
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


def _gain_leaves(state: Any) -> dict[str, Any]:
  """`{dense path: lora_gain key}` of the layers with a gain slot."""
  return {_path_str(k[:-1]): k for k, _ in nnx.to_flat_state(state) if k and k[-1] == "lora_gain"}


def lora_gains(state_or_model: Any) -> bool:
  """Whether the model's LoRA slots have gain slots (`add_lora_slots(..., gain=True)`)."""
  state = state_or_model if isinstance(state_or_model, nnx.State) else nnx.state(state_or_model)
  return bool(_gain_leaves(state))


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
  state: nnx.State,
  adapters: Sequence[Mapping[str, LoRASlotWeight | Sequence[LoRASlotWeight]]]
  | Mapping[str, LoRASlotWeight | Sequence[LoRASlotWeight]],
) -> nnx.State:
  """A copy of `state` whose LoRA slots hold `adapters` (every other slot zero).

  The slots are filled on the host and placed where the old ones were: no program is compiled, whatever
  the adapters' ranks (the compiled model takes the new state as it took the old one).

  Args:
    state: a module state with slots (`nnx.state(model)` after `add_lora_slots`, or a pipeline's split
      state).
    adapters: one adapter or several, applied together. An adapter maps a layer path to a `LoRASlotWeight`,
      or to several (one per `layer` of a scanned stack: they share the adapter's rank range). The
      adapters' ranks are concatenated in the slot, each scale folded into its `b`.

  Returns:
    The new state (same tree, shapes, dtypes and placements).

  Raises:
    ValueError: a path without a slot, shapes that do not fit the layer, a `layer` outside the stack, or
      more total rank than the slot.
  """
  if isinstance(adapters, Mapping):
    adapters = [adapters]
  slots = _slot_leaves(state)
  gains = _gain_leaves(state)
  flat = dict(nnx.to_flat_state(state))
  for adapter in adapters:
    for path in adapter:
      if path not in slots:
        near = sorted(slots, key=lambda p: -len(set(p.split(".")) & set(path.split("."))))[:3]
        raise ValueError(f"set_lora: {path!r} has no LoRA slot; slots nearest by name: {near}")
  new = {}
  for path, (ka, kb) in slots.items():
    a_slot, b_slot = flat[ka].get_value(), flat[kb].get_value()
    lead = tuple(b_slot.shape[:-2])
    in_dims, rank, n_out = tuple(a_slot.shape[len(lead) : -1]), a_slot.shape[-1], b_slot.shape[-1]
    a_new = np.zeros(a_slot.shape, np.float32)
    b_new = np.zeros(b_slot.shape, np.float32)
    g_new = np.ones((*lead, n_out), np.float32)
    used = 0
    for adapter in adapters:
      ws = adapter.get(path)
      if ws is None:
        continue
      ws = [ws] if isinstance(ws, LoRASlotWeight) else list(ws)
      r_max = 0
      for w in ws:
        a, b = np.asarray(w.a, np.float32), np.asarray(w.b, np.float32)
        r = a.shape[-1]
        body = tuple(a.shape[-1 - len(in_dims) : -1])
        if body != in_dims or b.shape[-1] != n_out or b.shape[-2] != r:
          raise ValueError(
            f"set_lora: {path!r} takes a [.., {', '.join(map(str, in_dims))}, r] and b [.., r, "
            f"{n_out}]; got a {tuple(a.shape)}, b {tuple(b.shape)}"
          )
        lo, hi = used, used + r
        r_max = max(r_max, r)
        if hi > rank:
          continue  # reported below with the total
        b = b * np.float32(w.scale)
        if w.gain is not None:
          if path not in gains:
            raise ValueError(
              f"set_lora: {path!r} has no gain slot for a DoRA adapter; add the slots with gain=True"
            )
          g = np.asarray(w.gain, np.float32)
          if g.shape[-1] != n_out:
            raise ValueError(f"set_lora: {path!r} takes a gain [.., {n_out}]; got {tuple(g.shape)}")
          if w.layer is not None:
            g_new[int(w.layer)] += g.reshape(n_out) - 1.0
          else:
            g_new += g - 1.0
        if w.layer is not None:
          if not lead:
            raise ValueError(f"set_lora: {path!r} is not a stacked layer; layer={w.layer} given")
          if not 0 <= int(w.layer) < lead[0]:
            raise ValueError(f"set_lora: {path!r} has {lead[0]} layers; layer={w.layer} given")
          a_new[int(w.layer), ..., lo:hi] = a.reshape(a.shape[-1 - len(in_dims) :])
          b_new[int(w.layer), ..., lo:hi, :] = b.reshape(b.shape[-2:])
        else:
          a_new[..., lo:hi] = a  # broadcast over the stack when `a` has no layers axis
          b_new[..., lo:hi, :] = b
      used += r_max
    if used > rank:
      raise ValueError(
        f"set_lora: {path!r} needs rank {used} (adapters together) but its slot holds {rank}; add "
        "slots with a larger rank"
      )
    # Several adapters at once: (x @ [A1 A2]) @ [B1; B2] = x A1 B1 + x A2 B2; the rest stays zero.
    new[ka] = (a_new.astype(a_slot.dtype), a_slot.sharding)
    new[kb] = (b_new.astype(b_slot.dtype), b_slot.sharding)
    if path in gains:
      g_slot = flat[gains[path]].get_value()
      new[gains[path]] = (g_new.astype(g_slot.dtype), g_slot.sharding)
  keys = list(new)
  placed = jax.device_put([new[k][0] for k in keys], [new[k][1] for k in keys])  # one transfer
  new = dict(zip(keys, placed))
  out = jax.tree.map(lambda x: x, state)  # a copy of the tree
  flat_out = dict(nnx.to_flat_state(out))
  for key, value in new.items():
    flat_out[key].set_value(value)
  return out


def clear_lora(state: nnx.State) -> nnx.State:
  """`state` with every LoRA slot zero (the base model's outputs)."""
  return set_lora(state, [])
