"""cuDNN flash attention through `jax.nn.dot_product_attention(implementation="cudnn")`.

cuDNN wants bf16/fp16, a head dim that is a multiple of 8, and expresses key padding best as per-
batch key lengths. A key padding mask is not a prefix in general, but without causal masking the
order of keys does not matter: the valid keys are moved to the front (a stable gather, whose
transpose scatters the gradients back) and their count becomes `key_value_seq_lengths`. With causal
masking the order matters, so the mask is passed as a dense `[B, 1, S_q, S_kv]` mask instead (fine
for short text encoders); likewise with a local window, which goes to `local_window_size`.
Grouped-query K/V (fewer heads than q) are passed through: `jax.nn.dot_product_attention` takes them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

CUDNN_DTYPES = (jnp.bfloat16, jnp.float16)


def _pad_last(x, size: int):
  extra = size - x.shape[-1]
  return x if extra == 0 else jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, extra)])


def cudnn_attention(
  q, k, v, kv_valid=None, *, causal: bool = False, scale: float | None = None, window=None
):
  """cuDNN flash attention over `[B, S, H, D]` with an optional `[B, S_kv]` key padding mask.

  Args:
    q: `[B, S_q, H, D]` bf16 or fp16.
    k, v: `[B, S_kv, H_kv, D]`, same dtype (`H % H_kv == 0`).
    kv_valid: optional `[B, S_kv]` bool, False for padded keys.
    causal: causal masking (query i sees keys 0..i).
    window: optional local window, an int or `(left, right)` as in `md_attention.attention`.
    scale: score multiplier; defaults to `1/sqrt(D)` of the unpadded head dim.

  Returns:
    `[B, S_q, H, D]`; queries that see no key get zeros.

  Raises:
    TypeError: for dtypes cuDNN does not take.
  """
  if q.dtype not in CUDNN_DTYPES:
    raise TypeError(
      f"cudnn attention takes bfloat16 or float16 inputs, got {q.dtype}; cast them, or use "
      "implementation='blockwise' or 'dot_product' for float32"
    )
  from md_attention._dot_product import normalize_window

  d = q.shape[-1]
  scale = d**-0.5 if scale is None else scale
  window = normalize_window(window, causal)
  # Zero columns add nothing to q.k and give zero output columns, which are sliced off.
  d_pad = -(-d // 8) * 8
  q, k, v = (_pad_last(x, d_pad) for x in (q, k, v))
  kwargs = dict(scale=scale, is_causal=causal, implementation="cudnn")
  if window is not None:
    # jax takes (left, right) with no "unbounded": the sequence lengths bound both sides.
    left, right = window
    unbounded = q.shape[1] + k.shape[1]
    kwargs["local_window_size"] = (
      unbounded if left is None else left,
      unbounded if right is None else right,
    )
  if kv_valid is None:
    out = jax.nn.dot_product_attention(q, k, v, **kwargs)
  elif not causal and window is None:
    order = jnp.argsort(jnp.logical_not(kv_valid), axis=1, stable=True)  # valid keys first
    k, v = (jnp.take_along_axis(x, order[:, :, None, None], axis=1) for x in (k, v))
    lengths = jnp.sum(kv_valid, axis=1, dtype=jnp.int32)
    out = jax.nn.dot_product_attention(q, k, v, key_value_seq_lengths=lengths, **kwargs)
  else:
    b, s_q = q.shape[:2]
    mask = jnp.broadcast_to(kv_valid[:, None, None, :], (b, 1, s_q, kv_valid.shape[1]))
    out = jax.nn.dot_product_attention(q, k, v, mask=mask, **kwargs)
  if kv_valid is not None:
    out = jnp.where(jnp.any(kv_valid, axis=1)[:, None, None, None], out, 0)
  return out[..., :d]
