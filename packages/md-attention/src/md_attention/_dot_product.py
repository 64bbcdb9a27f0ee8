"""XLA dot-product attention: the reference every other implementation is tested against."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def normalize_window(window, causal: bool):
  """`window` as `(left, right)` (None: no limit on that side) with causal masking folded in, or None.

  An int `w` is the causal local window of Gemma 3 / Mistral: query `i` sees keys `j` with
  `i - w < j <= i`, i.e. `(w - 1, 0)`. A pair `(left, right)` lets query `i` see keys
  `i - left <= j <= i + right`. With `causal=True` the right side is at most 0.
  """
  if window is None:
    return None
  if isinstance(window, bool):
    raise TypeError(f"window must be an int or a (left, right) pair, got {window!r}")
  if isinstance(window, int):
    if window < 1:
      raise ValueError(
        f"window={window} must be a positive int (the keys a query sees, itself incl.)"
      )
    left, right = window - 1, 0
  else:
    try:
      left, right = window
    except (TypeError, ValueError):
      raise TypeError(f"window must be an int or a (left, right) pair, got {window!r}") from None
    for side in (left, right):
      if side is not None and (isinstance(side, bool) or not isinstance(side, int)):
        raise TypeError(f"window sides must be ints or None, got {window!r}")
    if left is not None and right is not None and left + right < 0:
      raise ValueError(f"window={window!r} is empty: left + right must be >= 0")
  if causal:
    right = 0 if right is None else min(right, 0)
  if left is None and right is None:
    return None
  return (left, right)


def keep_mask(kv_valid, q_pos, k_pos, causal: bool, window=None):
  """Which scores take part in the softmax.

  Args:
    kv_valid: `[B, S_kv]` bool, False for padded keys.
    q_pos: `[S_q]` int, global position of each query (for causal masking).
    k_pos: `[S_kv]` int, global position of each key.
    causal: whether a query may only see keys at positions not after its own.
    window: optional `(left, right)` from `normalize_window`: query at `i` sees keys at
      `i - left .. i + right` (None: unbounded side).

  Returns:
    `[B, 1, S_q, S_kv]` bool (the 1 broadcasts over heads).
  """
  keep = kv_valid[:, None, None, :]
  kp, qp = k_pos[None, None, None, :], q_pos[None, None, :, None]
  if causal:
    keep = keep & (kp <= qp)
  if window is not None:
    left, right = window
    if left is not None:
      keep = keep & (kp >= qp - left)
    if right is not None:
      keep = keep & (kp <= qp + right)
  return keep


def dot_product_attention(
  q, k, v, kv_valid, q_pos, k_pos, *, causal: bool, scale: float, window=None, masked: bool = True
):
  """Materialises the `[B, H, S_q, S_kv]` scores; softmax in float32.

  Grouped-query attention: k and v may have `H_kv` heads with `H % H_kv == 0`; query head `h` uses
  key/value head `h // (H // H_kv)` (transformers' `repeat_kv` order), through a grouped einsum, so K/V
  are never repeated.

  Args:
    q: `[B, S_q, H, D]`.
    k: `[B, S_kv, H_kv, D]`.
    v: `[B, S_kv, H_kv, D]`.
    kv_valid: `[B, S_kv]` bool.
    q_pos: `[S_q]` int positions (causal only).
    k_pos: `[S_kv]` int positions (causal only).
    causal: causal masking by position.
    scale: multiplies the scores.
    window: optional `(left, right)` local window by position (`normalize_window`).
    masked: False when every query sees every key (no padding mask, not causal, no window): the
      softmax then runs without the two masking passes over the scores (`kv_valid` is not read), which
      on CPU saves two of the few memory-bound passes over the score matrix, forward and backward.

  Returns:
    `[B, S_q, H, D]` in q's dtype. Queries that see no key get zeros (and zero gradients).
  """
  if not masked and (causal or window is not None):
    raise ValueError("dot_product_attention: masked=False needs causal=False and window=None")
  b, s_q, h, d = q.shape
  h_kv = k.shape[2]
  qg = q.reshape(b, s_q, h_kv, h // h_kv, d)
  scores = jnp.einsum("bqkgd,bskd->bkgqs", qg, k, preferred_element_type=jnp.float32) * scale
  if masked:
    keep = keep_mask(kv_valid, q_pos, k_pos, causal, window)[:, :, None]  # [B, 1, 1, S_q, S_kv]
    # A finite fill keeps fully masked rows free of NaN; they are zeroed below.
    scores = jnp.where(keep, scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1)
    probs = jnp.where(jnp.any(keep, axis=-1, keepdims=True), probs, 0.0)
  else:
    probs = jax.nn.softmax(scores, axis=-1)
  out = jnp.einsum(
    "bkgqs,bskd->bqkgd", probs.astype(v.dtype), v, preferred_element_type=jnp.float32
  )
  return out.reshape(b, s_q, h, d).astype(q.dtype)
