"""Ring attention: K/V blocks travel around a mesh axis while each device keeps its queries.

Runs inside `shard_map`. Device `r` of an `n`-device ring holds sequence block `r` of q, k and v. At
step `t` it attends to the key block that started on device `r - t` and merges the result into its
running output through the log-sum-exp. The backward pass sends the key blocks around again, with
their dK/dV accumulators riding along, so every step's gradients use the global softmax statistics
and nothing of size S x S (or n x the local output) is saved.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from md_attention._blockwise import flash_backward, flash_forward, output_delta


def _shift(tree, axis_name: str, n: int, stride: int):
  """Sends every leaf to the next device of its ring.

  The axis holds `n * stride` devices: `stride` interleaved rings of `n`, device `i` in ring `i % stride`
  at position `i // stride` (Ulysses groups of `stride` neighbours sit inside each ring position).
  """
  perm = [(i, (i + stride) % (n * stride)) for i in range(n * stride)]
  return jax.tree.map(lambda x: lax.ppermute(x, axis_name, perm), tree)


def _positions(block_index, length: int):
  return block_index * length + jnp.arange(length, dtype=jnp.int32)


def _merge(out_a, lse_a, out_b, lse_b):
  """Combines two partial softmax results over disjoint key sets."""
  lse = jnp.logaddexp(lse_a, lse_b)  # [B, H, S]
  w_a = jnp.transpose(jnp.exp(lse_a - lse), (0, 2, 1))[..., None]  # [B, S, H, 1]
  w_b = jnp.transpose(jnp.exp(lse_b - lse), (0, 2, 1))[..., None]
  return out_a * w_a + out_b * w_b, lse


def _query_positions(r, rows: int, groups: int):
  # Folded grouped-query rows (`fold_groups`): `groups` consecutive rows share one position.
  return jnp.repeat(_positions(r, rows // groups), groups)


def _ring_forward(
  q, k, v, kv_valid, axis_name, n, stride, causal, scale, block_q, block_kv, groups, window
):
  r = lax.axis_index(axis_name) // stride
  s_local = k.shape[1]
  q_pos = _query_positions(r, q.shape[1], groups)
  kw = dict(causal=causal, scale=scale, block_q=block_q, block_kv=block_kv, window=window)

  def attend(kv, t):
    k_t, v_t, valid_t = kv
    source = (r - t) % n
    return flash_forward(q, k_t, v_t, valid_t, q_pos, _positions(source, s_local), **kw)

  out, lse = attend((k, v, kv_valid), 0)

  def step(carry, t):
    out, lse, kv = carry
    kv = _shift(kv, axis_name, n, stride)
    out_t, lse_t = attend(kv, t)
    out, lse = _merge(out, lse, out_t, lse_t)
    return (out, lse, kv), None

  (out, lse, _), _ = lax.scan(step, (out, lse, (k, v, kv_valid)), jnp.arange(1, n))
  return out.astype(q.dtype), lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7, 8, 9, 10, 11, 12))
def ring_attention(
  q, k, v, kv_valid, axis_name, n, stride, causal, scale, block_q, block_kv, groups=1, window=None
):
  """Self-attention over a sequence split in `n` blocks along `axis_name` (call inside shard_map).

  Args:
    q, k, v: `[B, S/n, H, D]` local blocks; block `i` lives on ring position `i`.
    kv_valid: `[B, S/n]` bool local key mask.
    axis_name: the ring's mesh axis.
    n: the ring size.
    stride: devices between ring neighbours on the axis (the Ulysses degree; 1 for a plain ring).
    causal, scale, block_q, block_kv: as in `blockwise_attention`.
    groups: query rows per position: q holds grouped-query heads folded into its rows
      (`md_attention._blockwise.fold_groups`, `[B, S/n * groups, H_kv, D]`) when > 1.
    window: optional `(left, right)` local window by global position; every step masks by the
      positions its key block came from, and skips tiles outside the window.

  Returns:
    `[B, S/n, H, D]` in q's dtype (rows as q's).
  """
  return _ring_forward(
    q, k, v, kv_valid, axis_name, n, stride, causal, scale, block_q, block_kv, groups, window
  )[0]


def _ring_fwd(
  q, k, v, kv_valid, axis_name, n, stride, causal, scale, block_q, block_kv, groups, window
):
  out, lse = _ring_forward(
    q, k, v, kv_valid, axis_name, n, stride, causal, scale, block_q, block_kv, groups, window
  )
  return out, (q, k, v, kv_valid, out, lse)


def _ring_bwd(
  axis_name, n, stride, causal, scale, block_q, block_kv, groups, window, residuals, d_out
):
  q, k, v, kv_valid, out, lse = residuals
  r = lax.axis_index(axis_name) // stride
  s_local = k.shape[1]
  q_pos = _query_positions(r, q.shape[1], groups)
  delta = output_delta(d_out, out)
  kw = dict(causal=causal, scale=scale, block_q=block_q, block_kv=block_kv, window=window)

  def grads(kv, t):
    k_t, v_t, valid_t = kv
    source = (r - t) % n
    k_pos = _positions(source, s_local)
    return flash_backward(q, k_t, v_t, valid_t, q_pos, k_pos, d_out, lse, delta, **kw)

  dq, dk, dv = grads((k, v, kv_valid), 0)

  def step(carry, t):
    dq, kv, dk, dv = carry
    kv, dk, dv = _shift((kv, dk, dv), axis_name, n, stride)
    dq_t, dk_t, dv_t = grads(kv, t)
    return (dq + dq_t, kv, dk + dk_t, dv + dv_t), None

  (dq, _, dk, dv), _ = lax.scan(step, (dq, (k, v, kv_valid), dk, dv), jnp.arange(1, n))
  # After n - 1 steps device r holds the accumulators of block r + 1: one more hop brings them home.
  dk, dv = _shift((dk, dv), axis_name, n, stride)
  return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None


ring_attention.defvjp(_ring_fwd, _ring_bwd, optimize_remat=True)  # as _blockwise's
