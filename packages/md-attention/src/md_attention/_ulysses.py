"""Ulysses sequence parallelism: all-to-all from sequence shards to head shards and back.

Inside `shard_map`, each device of the Ulysses axis trades its sequence block of every head for the
whole (ring-local) sequence of `1/U` of the heads, attends, and trades back. With `chunks > 1` the
heads go in groups, each with its own pair of all-to-alls, so XLA's scheduler can overlap one
group's communication with another group's attention.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax


def _to_heads(x, axis_name: str, groups):
  # [B, S/U, h, D] -> [B, S, h/U, D]: split heads, gather sequence.
  return lax.all_to_all(
    x, axis_name, split_axis=2, concat_axis=1, tiled=True, axis_index_groups=groups
  )


def _to_sequence(x, axis_name: str, groups):
  # [B, S, h/U, D] -> [B, S/U, h, D]
  return lax.all_to_all(
    x, axis_name, split_axis=1, concat_axis=2, tiled=True, axis_index_groups=groups
  )


def _gather_mask(kv_valid, axis_name: str, degree: int, groups):
  # [B, S/U] -> [B, S] through the same all-to-all as the activations (all_gather with groups is
  # not available on every backend): each device sends its block to every group member.
  tiled = jnp.broadcast_to(kv_valid[:, :, None], kv_valid.shape + (degree,))
  return _to_heads(tiled[..., None], axis_name, groups)[:, :, 0, 0]


def ulysses_attention(
  q, k, v, kv_valid, attend, *, axis_name: str, degree: int, chunks: int, groups=None
):
  """Runs `attend` on whole sequences and a slice of the heads (call inside shard_map).

  Args:
    q: `[B, S/U, H, D]` local sequence blocks (block `i` on Ulysses position `i`).
    k, v: `[B, S/U, H_kv, D]`, `H_kv` dividing H (grouped-query) and divisible by `degree * chunks`.
    kv_valid: `[B, S/U]` bool local key mask.
    attend: `(q, k, v, kv_valid) -> out` over `[B, S, H/(U*chunks), D]` inputs and `[B, S]` mask.
    axis_name: the Ulysses mesh axis.
    degree: its size U.
    chunks: head groups processed with separate all-to-alls.
    groups: the Ulysses groups of `degree` neighbouring devices on the axis when the axis is larger
      (Ulysses x ring); None when the whole axis is one group.

  Returns:
    `[B, S/U, H, D]`.
  """
  if degree == 1:
    return attend(q, k, v, kv_valid)
  kv_valid = _gather_mask(kv_valid, axis_name, degree, groups)
  group, kv_group = q.shape[2] // chunks, k.shape[2] // chunks
  outs = []
  for g in range(chunks):
    heads, kv_heads = slice(g * group, (g + 1) * group), slice(g * kv_group, (g + 1) * kv_group)
    q_g = _to_heads(q[:, :, heads], axis_name, groups)
    k_g, v_g = (_to_heads(x[:, :, kv_heads], axis_name, groups) for x in (k, v))
    outs.append(_to_sequence(attend(q_g, k_g, v_g, kv_valid), axis_name, groups))
  return outs[0] if chunks == 1 else jnp.concatenate(outs, axis=2)
