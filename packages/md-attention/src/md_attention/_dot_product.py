"""XLA dot-product attention: the reference every other implementation is tested against."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def keep_mask(kv_valid, q_pos, k_pos, causal: bool):
  """Which scores take part in the softmax.

  Args:
    kv_valid: `[B, S_kv]` bool, False for padded keys.
    q_pos: `[S_q]` int, global position of each query (for causal masking).
    k_pos: `[S_kv]` int, global position of each key.
    causal: whether a query may only see keys at positions not after its own.

  Returns:
    `[B, 1, S_q, S_kv]` bool (the 1 broadcasts over heads).
  """
  keep = kv_valid[:, None, None, :]
  if causal:
    keep = keep & (k_pos[None, None, None, :] <= q_pos[None, None, :, None])
  return keep


def dot_product_attention(q, k, v, kv_valid, q_pos, k_pos, *, causal: bool, scale: float):
  """Materialises the `[B, H, S_q, S_kv]` scores; softmax in float32.

  Args:
    q: `[B, S_q, H, D]`.
    k: `[B, S_kv, H, D]`.
    v: `[B, S_kv, H, D]`.
    kv_valid: `[B, S_kv]` bool.
    q_pos: `[S_q]` int positions (causal only).
    k_pos: `[S_kv]` int positions (causal only).
    causal: causal masking by position.
    scale: multiplies the scores.

  Returns:
    `[B, S_q, H, D]` in q's dtype. Queries that see no key get zeros (and zero gradients).
  """
  scores = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32) * scale
  keep = keep_mask(kv_valid, q_pos, k_pos, causal)
  # A finite fill keeps fully masked rows free of NaN; they are zeroed below.
  scores = jnp.where(keep, scores, jnp.finfo(jnp.float32).min)
  probs = jax.nn.softmax(scores, axis=-1)
  probs = jnp.where(jnp.any(keep, axis=-1, keepdims=True), probs, 0.0)
  out = jnp.einsum("bhqk,bkhd->bqhd", probs.astype(v.dtype), v, preferred_element_type=jnp.float32)
  return out.astype(q.dtype)
