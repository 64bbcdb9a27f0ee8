"""`implementation="auto"`: choose by backend, sequence length and mesh; log each choice once."""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp

from md_attention import _sharding as shd
from md_attention._config import AttentionConfig

logger = logging.getLogger("md_attention")
_logged: set[tuple] = set()

# On CPU, XLA writes a materialised score matrix to memory and reads it back in every softmax pass;
# past this size `auto` runs exact attention over chunks of queries instead (blockwise with one key
# block up to CPU_MAX_KV_BLOCK keys: no online-softmax merges). Measured on a 2-core x86 CPU, float32,
# 2026-12-05: Flux.2 edit shapes (8 heads x 64, 1664 tokens) 131 -> 45 ms; LTX-Video (32 heads x 64,
# 768 tokens) 112 -> 56 ms; 8 heads x 4096 tokens 288 (512 x 512 blocks) -> 277 ms.
CPU_SCORES_BYTES = 16 << 20
# ...and so does one head's score matrix past this size, whatever the batch and heads: over long rows the
# chunks win forward and backward (8 heads x 640 tokens, 12.5 MiB in all: forward 12.0 -> 8.9 ms, with the
# gradient 45.5 -> 35.6 ms; the Flux.1 bench step 230 -> 193 ms; 2026-12-07), while at 512 x 512 the
# chunked gradient was still slower (30.1 against 17.9 ms), so the line sits just above it.
CPU_HEAD_SCORES_BYTES = 1 << 20
CPU_QUERY_CHUNK = 128
CPU_MAX_KV_BLOCK = 4096


def cpu_blocks(s_q: int, s_kv: int, config: AttentionConfig) -> tuple[int, int]:
  """`(block_q, block_kv)` of `auto`'s blockwise choice on CPU: query chunks of `CPU_QUERY_CHUNK` over
  all keys when there are at most `CPU_MAX_KV_BLOCK`, else the config's blocks."""
  if s_kv > CPU_MAX_KV_BLOCK:
    return config.block_q, config.block_kv
  return min(CPU_QUERY_CHUNK, s_q), s_kv


def select_implementation(q_shape, kv_shape, dtype, mesh, config: AttentionConfig) -> str:
  """The implementation `auto` runs for these shapes, dtype and mesh.

  Order: the context axis first (if it has more than one device, the sequence is sharded: `ulysses`
  when the heads per device divide by it, else `ulysses_ring` with the largest Ulysses part that
  works, else `ring`); then the accelerator's flash kernel (`cudnn` on NVIDIA GPUs for bf16/fp16 and
  head dims up to 256, `splash` on TPU) from `min_seq_length` on; then `blockwise` from
  `min_seq_length` on, `dot_product` below — except on CPU, where a score matrix over
  `CPU_SCORES_BYTES` (float32), or one head's over `CPU_HEAD_SCORES_BYTES`, takes `blockwise` too, in
  the blocks `cpu_blocks` gives.
  """
  backend = jax.default_backend()
  b, s_q, h, d = q_shape
  s_kv = kv_shape[1]
  long = max(s_q, s_kv) >= config.min_seq_length
  context = shd.axis_size(mesh, config.context_axis)
  if context > 1:
    _, h_spec = shd.activation_specs(mesh, config.rules, (b, s_q, h, d))
    local_heads = h // shd.spec_size(mesh, h_spec)
    working = [u for u in shd.divisors(context) if local_heads % (u * config.ulysses_chunks) == 0]
    if working[-1] == context:
      choice, reason = "ulysses", f"context axis {context} divides {local_heads} heads per device"
    elif working[-1] > 1:
      choice, reason = "ulysses_ring", f"ulysses degree {working[-1]} of context axis {context}"
    else:
      choice, reason = (
        "ring",
        f"heads per device ({local_heads}) do not split over the context axis",
      )
  elif backend == "gpu" and long and dtype in (jnp.bfloat16, jnp.float16) and d <= 256:
    choice, reason = "cudnn", "NVIDIA GPU, bf16/fp16"
  elif backend == "tpu" and long:
    choice, reason = "splash", "TPU"
  elif long:
    choice, reason = "blockwise", f"sequence length >= min_seq_length={config.min_seq_length}"
  elif backend == "cpu" and (
    b * h * s_q * s_kv * 4 > CPU_SCORES_BYTES or s_q * s_kv * 4 > CPU_HEAD_SCORES_BYTES
  ):
    choice = "blockwise"
    reason = (
      f"CPU, query chunks: the scores would take {b * h * s_q * s_kv * 4 / 2**20:.1f} MiB, "
      f"{s_q * s_kv * 4 / 2**20:.2f} MiB a head"
    )
  else:
    choice, reason = "dot_product", f"sequence length < min_seq_length={config.min_seq_length}"
  key = (choice, backend, s_q, s_kv, context)
  if key not in _logged:
    _logged.add(key)
    logger.info(
      "attention auto -> %s (%s; backend %s, S_q=%d, S_kv=%d)", choice, reason, backend, s_q, s_kv
    )
  return choice
