"""Blockwise (flash) attention in pure JAX: online softmax over key blocks, one query block at a time.

Neither pass materialises more than one `[B, H, block_q, block_kv]` score tile, and the custom VJP
saves only q, k, v, the output and the per-row log-sum-exp, so memory is O(S) in forward and
backward. The two passes are also the per-step kernels of ring attention (`_ring.py`), which is why
they take global positions and return the log-sum-exp.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

from md_attention._dot_product import keep_mask

# Log-sum-exp of a row that sees no key. Finite so that merging two such rows stays finite; any real
# log-sum-exp is far above it, so its weight in a merge underflows to exactly zero.
EMPTY_LSE = -1e30


def _round_up(n: int, m: int) -> int:
  return -(-n // m) * m


def _pad_axis(x, axis: int, size: int, value):
  extra = size - x.shape[axis]
  if extra == 0:
    return x
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, extra)
  return jnp.pad(x, widths, constant_values=value)


def _pad_positions(pos, size: int):
  # Repeating the last position keeps each block's min/max (used to skip causal blocks) honest.
  extra = size - pos.shape[0]
  if extra == 0:
    return pos
  return jnp.concatenate([pos, jnp.broadcast_to(pos[-1:], (extra,))])


def _to_blocks(x, axis: int, block: int):
  """Splits `axis` into `[n, block]` and moves n to the front (the axis scans run over)."""
  shape = x.shape[:axis] + (x.shape[axis] // block, block) + x.shape[axis + 1 :]
  return jnp.moveaxis(x.reshape(shape), axis, 0)


def _from_blocks(x, axis: int):
  x = jnp.moveaxis(x, 0, axis)
  return x.reshape(x.shape[:axis] + (x.shape[axis] * x.shape[axis + 1],) + x.shape[axis + 2 :])


def _visible(q_pos, k_pos, causal: bool, window=None):
  """False when causal or window masking hides the whole tile, so its work can be skipped."""
  visible = jnp.bool_(True)
  if causal:
    visible = visible & (jnp.min(k_pos) <= jnp.max(q_pos))
  if window is not None:
    left, right = window
    if left is not None:
      visible = visible & (jnp.max(k_pos) >= jnp.min(q_pos) - left)
    if right is not None:
      visible = visible & (jnp.min(k_pos) <= jnp.max(q_pos) + right)
  return visible


def block_sizes(s_q: int, s_kv: int, block_q: int, block_kv: int) -> tuple[int, int]:
  """Block sizes actually used: at most the (unpadded) lengths."""
  return min(block_q, s_q), min(block_kv, s_kv)


def flash_forward(
  q, k, v, kv_valid, q_pos, k_pos, *, causal, scale, block_q, block_kv, window=None
):
  """Attention of q over one set of keys, with the statistics needed to merge or differentiate it.

  Args:
    q: `[B, S_q, H, D]`.
    k: `[B, S_kv, H, D]`.
    v: `[B, S_kv, H, D]`.
    kv_valid: `[B, S_kv]` bool.
    q_pos: `[S_q]` int global query positions.
    k_pos: `[S_kv]` int global key positions.
    causal: mask keys after the query's position.
    scale: score multiplier.
    block_q: query block.
    block_kv: key block.
    window: optional `(left, right)` local window by position; tiles wholly outside it are skipped.

  Returns:
    out: `[B, S_q, H, D]` float32, normalised (zeros where no key is visible).
    lse: `[B, H, S_q]` float32 log-sum-exp of the scaled scores (`EMPTY_LSE` where no key is visible).
  """
  b, s_q, h, d = q.shape
  s_kv = k.shape[1]
  bq, bk = block_sizes(s_q, s_kv, block_q, block_kv)
  if bk == s_kv:
    return _one_key_block_forward(q, k, v, kv_valid, q_pos, k_pos, causal, scale, bq, window)
  sq_pad, skv_pad = _round_up(s_q, bq), _round_up(s_kv, bk)
  q_blocks = _to_blocks(_pad_axis(q, 1, sq_pad, 0), 1, bq)  # [nq, B, bq, H, D]
  qpos_blocks = _to_blocks(_pad_positions(q_pos, sq_pad), 0, bq)  # [nq, bq]
  k_blocks = _to_blocks(_pad_axis(k, 1, skv_pad, 0), 1, bk)  # [nk, B, bk, H, D]
  v_blocks = _to_blocks(_pad_axis(v, 1, skv_pad, 0), 1, bk)
  valid_blocks = _to_blocks(_pad_axis(kv_valid, 1, skv_pad, False), 1, bk)  # [nk, B, bk]
  kpos_blocks = _to_blocks(_pad_positions(k_pos, skv_pad), 0, bk)  # [nk, bk]

  def one_query_block(args):
    q_i, qpos_i = args

    def tile(carry, kv):
      acc, m, l = carry  # [B, H, bq, D], [B, H, bq], [B, H, bq]
      k_j, v_j, valid_j, kpos_j = kv

      def compute():
        s = jnp.einsum("bqhd,bkhd->bhqk", q_i, k_j, preferred_element_type=jnp.float32) * scale
        keep = keep_mask(valid_j, qpos_i, kpos_j, causal, window)
        m_new = jnp.maximum(m, jnp.max(jnp.where(keep, s, -jnp.inf), axis=-1))
        # Rows that have seen no key yet keep m = -inf; shift them by 0 instead so nothing is NaN.
        m_safe = jnp.where(jnp.isneginf(m_new), 0.0, m_new)
        p = jnp.where(keep, jnp.exp(s - m_safe[..., None]), 0.0)
        alpha = jnp.exp(m - m_safe)
        pv = jnp.einsum(
          "bhqk,bkhd->bhqd", p.astype(v_j.dtype), v_j, preferred_element_type=jnp.float32
        )
        return acc * alpha[..., None] + pv, m_new, l * alpha + jnp.sum(p, axis=-1)

      carry = lax.cond(_visible(qpos_i, kpos_j, causal, window), compute, lambda: carry)
      return carry, None

    init = (
      jnp.zeros((b, h, bq, d), jnp.float32),
      jnp.full((b, h, bq), -jnp.inf, jnp.float32),
      jnp.zeros((b, h, bq), jnp.float32),
    )
    (acc, m, l), _ = lax.scan(tile, init, (k_blocks, v_blocks, valid_blocks, kpos_blocks))
    seen = l > 0
    out = jnp.where(seen[..., None], acc / jnp.where(seen, l, 1.0)[..., None], 0.0)
    lse = jnp.where(seen, m + jnp.log(jnp.where(seen, l, 1.0)), EMPTY_LSE)
    return jnp.transpose(out, (0, 2, 1, 3)), lse

  out, lse = lax.map(one_query_block, (q_blocks, qpos_blocks))  # [nq, B, bq, H, D], [nq, B, H, bq]
  out = _from_blocks(out, 1)[:, :s_q]
  lse = _from_blocks(lse, 2)[..., :s_q]
  return out, lse


def _heads_major_blocks(x, sq_pad: int, bq: int):
  """`[B, S, H, D]` padded to `sq_pad` rows and cut into `[n, B, H, bq, D]` query chunks."""
  return _to_blocks(jnp.transpose(_pad_axis(x, 1, sq_pad, 0), (0, 2, 1, 3)), 2, bq)


def _one_key_block_forward(q, k, v, kv_valid, q_pos, k_pos, causal, scale, bq, window):
  """`flash_forward` when all keys fit one block (CPU's query chunks over all keys).

  The same softmax as the online merge starting from an empty carry, without its bookkeeping passes:
  each chunk's scores, max, exponentials and sum, normalised once on the `[bq, D]` output. Heads-major:
  K and V are transposed once, not once per chunk. The scale multiplies q (a `[bq, D]` pass) instead
  of the `[bq, S_kv]` scores when that rounds no worse: in float32, or when it is a power of two (exact
  in any dtype); a bfloat16 q keeps it on the float32 scores. Measured on a 2-core x86 CPU, float32, 8
  heads x 64 (2026-12-07): 1664 tokens 55 -> 45 ms, 3328 tokens 277 -> 204 ms.
  """
  b, s_q, h, d = q.shape
  fold = q.dtype == jnp.float32 or math.frexp(scale)[0] == 0.5
  sq_pad = _round_up(s_q, bq)
  q_blocks = _heads_major_blocks(q, sq_pad, bq)  # [nq, B, H, bq, D]
  qpos_blocks = _to_blocks(_pad_positions(q_pos, sq_pad), 0, bq)  # [nq, bq]
  k_t, v_t = jnp.transpose(k, (0, 2, 1, 3)), jnp.transpose(v, (0, 2, 1, 3))  # [B, H, S_kv, D]

  def one_query_block(args):
    q_i, qpos_i = args  # [B, H, bq, D], [bq]
    if not causal and window is None:
      return attend(q_i, qpos_i)
    # A chunk that sees none of these keys (a causal ring step) is skipped, as the tiles are below.
    empty = lambda: (jnp.zeros((b, h, bq, d), jnp.float32), jnp.full((b, h, bq), EMPTY_LSE))  # noqa: E731
    visible = _visible(qpos_i, k_pos, causal, window)
    return lax.cond(visible, lambda: attend(q_i, qpos_i), empty)

  def attend(q_i, qpos_i):
    s = jnp.einsum(
      "bhqd,bhkd->bhqk", q_i * scale if fold else q_i, k_t, preferred_element_type=jnp.float32
    )
    s = s if fold else s * scale
    keep = keep_mask(kv_valid, qpos_i, k_pos, causal, window)
    m = jnp.max(jnp.where(keep, s, -jnp.inf), axis=-1)
    m_safe = jnp.where(jnp.isneginf(m), 0.0, m)
    p = jnp.where(keep, jnp.exp(s - m_safe[..., None]), 0.0)
    l = jnp.sum(p, axis=-1)
    acc = jnp.einsum("bhqk,bhkd->bhqd", p.astype(v.dtype), v_t, preferred_element_type=jnp.float32)
    seen = l > 0
    out = jnp.where(seen[..., None], acc / jnp.where(seen, l, 1.0)[..., None], 0.0)
    lse = jnp.where(seen, m + jnp.log(jnp.where(seen, l, 1.0)), EMPTY_LSE)
    return out, lse

  out, lse = lax.map(one_query_block, (q_blocks, qpos_blocks))  # [nq, B, H, bq, D], [nq, B, H, bq]
  out = jnp.transpose(_from_blocks(out, 2), (0, 2, 1, 3))[:, :s_q]
  lse = _from_blocks(lse, 2)[..., :s_q]
  return out, lse


def flash_backward(q, k, v, kv_valid, q_pos, k_pos, d_out, lse, delta, *, causal, scale, block_q,
                   block_kv, window=None):  # fmt: skip
  """Gradients of `flash_forward`'s output given the row statistics of the full softmax.

  Args:
    q, k, v, kv_valid, q_pos, k_pos: as in `flash_forward`.
    d_out: `[B, S_q, H, D]` cotangent of the (global) output.
    lse: `[B, H, S_q]` log-sum-exp of the full softmax the output was normalised by.
    delta: `[B, H, S_q]` float32 `sum(d_out * out, -1)` of the full output.
    causal, scale, block_q, block_kv, window: as in `flash_forward`.

  Returns:
    dq `[B, S_q, H, D]`, dk and dv `[B, S_kv, H, D]`, all float32: this key set's share of the gradients.
  """
  b, s_q, h, d = q.shape
  s_kv = k.shape[1]
  bq, bk = block_sizes(s_q, s_kv, block_q, block_kv)
  if bk == s_kv and q.dtype == jnp.float32:
    # Heads-major only in float32: in bfloat16 it measured slower than the tiles below (8 heads x 1664
    # tokens: 171 against 121 ms), the forward's heads-major path faster (53 -> 39 ms).
    return _one_key_block_backward(
      q, k, v, kv_valid, q_pos, k_pos, d_out, lse, delta, causal, scale, bq, window
    )
  sq_pad, skv_pad = _round_up(s_q, bq), _round_up(s_kv, bk)
  q_blocks = _to_blocks(_pad_axis(q, 1, sq_pad, 0), 1, bq)
  do_blocks = _to_blocks(_pad_axis(d_out, 1, sq_pad, 0), 1, bq)
  # +inf log-sum-exp makes every probability of a padded query row exactly zero.
  lse_blocks = _to_blocks(_pad_axis(lse, 2, sq_pad, jnp.inf), 2, bq)  # [nq, B, H, bq]
  delta_blocks = _to_blocks(_pad_axis(delta, 2, sq_pad, 0), 2, bq)
  qpos_blocks = _to_blocks(_pad_positions(q_pos, sq_pad), 0, bq)
  k_blocks = _to_blocks(_pad_axis(k, 1, skv_pad, 0), 1, bk)
  v_blocks = _to_blocks(_pad_axis(v, 1, skv_pad, 0), 1, bk)
  valid_blocks = _to_blocks(_pad_axis(kv_valid, 1, skv_pad, False), 1, bk)
  kpos_blocks = _to_blocks(_pad_positions(k_pos, skv_pad), 0, bk)

  def one_key_block(dq_blocks, kv):
    k_j, v_j, valid_j, kpos_j = kv

    def tile(carry, xs):
      dk, dv = carry  # [B, bk, H, D] float32
      q_i, do_i, lse_i, delta_i, qpos_i, dq_i = xs

      def compute():
        s = jnp.einsum("bqhd,bkhd->bhqk", q_i, k_j, preferred_element_type=jnp.float32) * scale
        keep = keep_mask(valid_j, qpos_i, kpos_j, causal, window)
        p = jnp.where(keep, jnp.exp(s - lse_i[..., None]), 0.0)
        dv_new = dv + jnp.einsum(
          "bhqk,bqhd->bkhd", p.astype(do_i.dtype), do_i, preferred_element_type=jnp.float32
        )
        dp = jnp.einsum("bqhd,bkhd->bhqk", do_i, v_j, preferred_element_type=jnp.float32)
        ds = p * (dp - delta_i[..., None]) * scale
        dq_new = dq_i + jnp.einsum(
          "bhqk,bkhd->bqhd", ds.astype(k_j.dtype), k_j, preferred_element_type=jnp.float32
        )
        dk_new = dk + jnp.einsum(
          "bhqk,bqhd->bkhd", ds.astype(q_i.dtype), q_i, preferred_element_type=jnp.float32
        )
        return (dk_new, dv_new), dq_new

      return lax.cond(_visible(qpos_i, kpos_j, causal, window), compute, lambda: ((dk, dv), dq_i))

    zeros = jnp.zeros((b, bk, h, d), jnp.float32)
    (dk, dv), dq_blocks = lax.scan(
      tile, (zeros, zeros), (q_blocks, do_blocks, lse_blocks, delta_blocks, qpos_blocks, dq_blocks)
    )
    return dq_blocks, (dk, dv)

  dq0 = jnp.zeros(q_blocks.shape, jnp.float32)
  dq_blocks, (dk_blocks, dv_blocks) = lax.scan(
    one_key_block, dq0, (k_blocks, v_blocks, valid_blocks, kpos_blocks)
  )
  dq = _from_blocks(dq_blocks, 1)[:, :s_q]
  dk = _from_blocks(dk_blocks, 1)[:, :s_kv]
  dv = _from_blocks(dv_blocks, 1)[:, :s_kv]
  return dq, dk, dv


def _one_key_block_backward(
  q, k, v, kv_valid, q_pos, k_pos, d_out, lse, delta, causal, scale, bq, window
):
  """`flash_backward` when all keys fit one block, for float32 inputs: heads-major as
  `_one_key_block_forward`, one scan over the query chunks carrying dK and dV. With the scale folded
  into q (as that forward does in float32) dK needs no pass over the scores for it, and dQ takes it on
  its `[bq, D]` chunk. Forward + gradient, float32, 2-core x86 (2026-12-07), this against the tiles below
  (the heads-major forward in both): 8 heads x 640 tokens 36.4 -> 29.5 ms, 2 x 8 heads x 1664 tokens
  416 -> 370 ms, 12 heads x 128 at 1024 tokens 260 -> 198 ms.
  """
  b, s_q, h, d = q.shape
  sq_pad = _round_up(s_q, bq)
  q_blocks = _heads_major_blocks(q * scale, sq_pad, bq)  # [nq, B, H, bq, D], scaled
  do_blocks = _heads_major_blocks(d_out, sq_pad, bq)
  lse_blocks = _to_blocks(_pad_axis(lse, 2, sq_pad, jnp.inf), 2, bq)  # [nq, B, H, bq]
  delta_blocks = _to_blocks(_pad_axis(delta, 2, sq_pad, 0), 2, bq)
  qpos_blocks = _to_blocks(_pad_positions(q_pos, sq_pad), 0, bq)
  k_t, v_t = jnp.transpose(k, (0, 2, 1, 3)), jnp.transpose(v, (0, 2, 1, 3))  # [B, H, S_kv, D]

  def chunk(carry, xs):
    dk, dv = carry  # [B, H, S_kv, D] float32
    q_i, do_i, lse_i, delta_i, qpos_i = xs

    def compute():
      s = jnp.einsum("bhqd,bhkd->bhqk", q_i, k_t, preferred_element_type=jnp.float32)
      keep = keep_mask(kv_valid, qpos_i, k_pos, causal, window)
      p = jnp.where(keep, jnp.exp(s - lse_i[..., None]), 0.0)
      dv_new = dv + jnp.einsum("bhqk,bhqd->bhkd", p, do_i, preferred_element_type=jnp.float32)
      dp = jnp.einsum("bhqd,bhkd->bhqk", do_i, v_t, preferred_element_type=jnp.float32)
      ds = p * (dp - delta_i[..., None])  # d loss / d s, s the scores of the scaled q
      dq_i = jnp.einsum("bhqk,bhkd->bhqd", ds, k_t, preferred_element_type=jnp.float32)
      dk_new = dk + jnp.einsum("bhqk,bhqd->bhkd", ds, q_i, preferred_element_type=jnp.float32)
      return (dk_new, dv_new), dq_i * scale

    if not causal and window is None:
      return compute()
    skip = lambda: ((dk, dv), jnp.zeros((b, h, bq, d), jnp.float32))  # noqa: E731
    return lax.cond(_visible(qpos_i, k_pos, causal, window), compute, skip)

  zeros = jnp.zeros(k_t.shape, jnp.float32)
  (dk, dv), dq = lax.scan(
    chunk, (zeros, zeros), (q_blocks, do_blocks, lse_blocks, delta_blocks, qpos_blocks)
  )
  dq = jnp.transpose(_from_blocks(dq, 2), (0, 2, 1, 3))[:, :s_q]
  return dq, jnp.transpose(dk, (0, 2, 1, 3)), jnp.transpose(dv, (0, 2, 1, 3))


def output_delta(d_out, out):
  """`sum(d_out * out, -1)` as `[B, H, S]` float32: the softmax-gradient correction per row."""
  delta = jnp.sum(d_out.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)
  return jnp.transpose(delta, (0, 2, 1))


def fold_groups(q, q_pos, h_kv: int):
  """Grouped-query attention as plain attention over `H_kv` heads: `[B, S, H, D]` queries become
  `[B, S * G, H_kv, D]` (the `G = H / H_kv` query heads of one key/value head as extra rows, each with
  its query's position), so K/V are used as they are, never repeated."""
  b, s, h, d = q.shape
  g = h // h_kv
  q = jnp.transpose(q.reshape(b, s, h_kv, g, d), (0, 1, 3, 2, 4)).reshape(b, s * g, h_kv, d)
  return q, jnp.repeat(q_pos, g)


def unfold_groups(out, h: int):
  """Inverse of `fold_groups` for the output: `[B, S * G, H_kv, D]` -> `[B, S, H, D]`."""
  b, sg, h_kv, d = out.shape
  g = h // h_kv
  return jnp.transpose(out.reshape(b, sg // g, g, h_kv, d), (0, 1, 3, 2, 4)).reshape(b, -1, h, d)


def blockwise_attention(
  q, k, v, kv_valid, q_pos, k_pos, causal, scale, block_q, block_kv, window=None
):
  """Flash attention with O(S) memory in both passes; arguments as in `flash_forward`.

  k and v may have fewer heads than q (grouped-query attention, `H % H_kv == 0`): the query heads of
  each key/value head are folded into the query rows (`fold_groups`), so K/V are not repeated.

  Returns:
    `[B, S_q, H, D]` in q's dtype.
  """
  h, h_kv = q.shape[2], k.shape[2]
  if h == h_kv:
    return _blockwise(q, k, v, kv_valid, q_pos, k_pos, causal, scale, block_q, block_kv, window)
  g = h // h_kv
  q_folded, pos_folded = fold_groups(q, q_pos, h_kv)
  out = _blockwise(
    q_folded, k, v, kv_valid, pos_folded, k_pos, causal, scale, block_q * g, block_kv, window
  )
  return unfold_groups(out, h)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8, 9, 10))
def _blockwise(q, k, v, kv_valid, q_pos, k_pos, causal, scale, block_q, block_kv, window):
  out, _ = flash_forward(
    q, k, v, kv_valid, q_pos, k_pos, causal=causal, scale=scale, block_q=block_q,
    block_kv=block_kv, window=window,
  )  # fmt: skip
  return out.astype(q.dtype)


def _blockwise_fwd(q, k, v, kv_valid, q_pos, k_pos, causal, scale, block_q, block_kv, window):
  out, lse = flash_forward(
    q, k, v, kv_valid, q_pos, k_pos, causal=causal, scale=scale, block_q=block_q,
    block_kv=block_kv, window=window,
  )  # fmt: skip
  out = out.astype(q.dtype)
  return out, (q, k, v, kv_valid, q_pos, k_pos, out, lse)


def _blockwise_bwd(causal, scale, block_q, block_kv, window, residuals, d_out):
  q, k, v, kv_valid, q_pos, k_pos, out, lse = residuals
  dq, dk, dv = flash_backward(
    q, k, v, kv_valid, q_pos, k_pos, d_out, lse, output_delta(d_out, out),
    causal=causal, scale=scale, block_q=block_q, block_kv=block_kv, window=window,
  )  # fmt: skip
  return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None, None


# optimize_remat: under `jax.checkpoint` a policy such as `dots_saveable` would otherwise look inside the
# forward rule and save every query x key tile's logits (the S^2 memory this kernel exists to avoid); with
# it the forward rule is one opaque step whose only residuals are the ones it returns.
_blockwise.defvjp(_blockwise_fwd, _blockwise_bwd, optimize_remat=True)
