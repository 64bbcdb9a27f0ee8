"""Splash attention (the Pallas TPU flash kernel) behind the `[B, S, H, D]` interface.

The kernel works on `[H, S, D]` per batch element, wants sequence lengths that are multiples of its
blocks and a lane-aligned head dim, does not scale the scores, and expresses key padding as segment
ids. This wrapper does all of that. The kernel is imported only when called, so nothing here needs a
TPU until then; `interpret=True` runs it through the Pallas interpreter on any backend (slow; for
tests).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

_LANES = 128


def _round_up(n: int, m: int) -> int:
  return -(-n // m) * m


def _pad(x, axis: int, size: int, value=0):
  extra = size - x.shape[axis]
  if extra == 0:
    return x
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, extra)
  return jnp.pad(x, widths, constant_values=value)


def _splash_module():
  try:
    from jax.experimental.pallas.ops.tpu import splash_attention
  except ImportError as e:  # pragma: no cover - depends on the installed jax
    raise ImportError(
      "splash attention needs jax.experimental.pallas.ops.tpu.splash_attention (jax with Pallas TPU)"
    ) from e
  return splash_attention


def splash_attention(
  q,
  k,
  v,
  kv_valid=None,
  *,
  causal: bool = False,
  scale: float | None = None,
  window=None,
  block_q: int = 512,
  block_kv: int = 512,
  interpret: bool = False,
):
  """Splash attention over `[B, S, H, D]` with an optional `[B, S_kv]` key padding mask.

  Args:
    q: `[B, S_q, H, D]`.
    k, v: `[B, S_kv, H_kv, D]` with `H % H_kv == 0`; grouped K/V are repeated to H heads here
      (`make_splash_mha` takes equal head counts).
    kv_valid: optional `[B, S_kv]` bool, False for padded keys.
    causal: causal masking (query i sees keys 0..i).
    scale: score multiplier; defaults to `1/sqrt(D)` of the unpadded head dim.
    window: optional local window, an int or `(left, right)` as in `md_attention.attention`
      (the kernel's `LocalMask`, which skips blocks outside it).
    block_q: query block (rounded to a multiple of 128, at most the padded length).
    block_kv: key block (likewise).
    interpret: run the kernel in the Pallas interpreter (any backend).

  Returns:
    `[B, S_q, H, D]` in q's dtype; queries that see no key get zeros.
  """
  from md_attention._dot_product import normalize_window

  sa = _splash_module()
  b, s_q, h, d = q.shape
  window = normalize_window(window, causal)
  if k.shape[2] != h:
    k, v = (jnp.repeat(x, h // k.shape[2], axis=2) for x in (k, v))
  s_kv = k.shape[1]
  scale = d**-0.5 if scale is None else scale
  bq = min(_round_up(block_q, _LANES), _round_up(s_q, _LANES))
  bk = min(_round_up(block_kv, _LANES), _round_up(s_kv, _LANES))
  sq_pad, skv_pad, d_pad = _round_up(s_q, bq), _round_up(s_kv, bk), _round_up(d, _LANES)
  if kv_valid is None:
    kv_valid = jnp.ones((b, s_kv), bool)
  # The kernel does not scale; scaling q first (in f32) is exact up to one rounding.
  q = (q.astype(jnp.float32) * scale).astype(q.dtype)
  # [B, S, H, D] -> [B, H, S_pad, D_pad]; zero head-dim columns change no score.
  q, k, v = (
    jnp.transpose(_pad(_pad(x, 3, d_pad), 1, size), (0, 2, 1, 3))
    for x, size in ((q, sq_pad), (k, skv_pad), (v, skv_pad))
  )
  # Segment ids: every query is in segment 1; valid keys in 1, padded ones in 0, so they are never seen.
  q_segments = jnp.ones((b, sq_pad), jnp.int32)
  kv_segments = _pad(kv_valid.astype(jnp.int32), 1, skv_pad)
  shape = (sq_pad, skv_pad)
  if window is not None:
    mask = sa.LocalMask(shape, window, offset=0)
  else:
    mask = sa.CausalMask(shape) if causal else sa.FullMask(shape)
  kernel = sa.make_splash_mha(
    sa.MultiHeadMask([mask] * h),
    block_sizes=sa.BlockSizes(
      block_q=bq,
      block_kv=bk,
      block_kv_compute=bk,
      block_q_dkv=bq,
      block_kv_dkv=bk,
      block_kv_dkv_compute=bk,
      block_q_dq=bq,
      block_kv_dq=bk,
    ),
    head_shards=1,
    q_seq_shards=1,
    interpret=interpret,
  )
  out = jax.vmap(lambda q, k, v, qs, ks: kernel(q, k, v, segment_ids=sa.SegmentIds(qs, ks)))(
    q, k, v, q_segments, kv_segments
  )
  out = jnp.transpose(out, (0, 2, 1, 3))[:, :s_q, :, :d]
  seen = jnp.any(kv_valid, axis=1)[:, None, None, None]
  return jnp.where(seen, out, 0).astype(q.dtype)
