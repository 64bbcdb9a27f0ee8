"""`attention`: the one entry point; validates inputs and dispatches to an implementation."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from md_attention import _sharding as shd
from md_attention._blockwise import blockwise_attention
from md_attention._config import (
  CONTEXT_PARALLEL_IMPLEMENTATIONS,
  IMPLEMENTATIONS,
  AttentionConfig,
)
from md_attention._context_parallel import context_parallel_attention
from md_attention._cudnn import cudnn_attention
from md_attention._dot_product import dot_product_attention, normalize_window
from md_attention._select import cpu_blocks, select_implementation
from md_attention._splash import splash_attention
from md_attention._tuner import tuned_blocks


def _check_inputs(q, k, v, mask):
  for name, x in (("q", q), ("k", k), ("v", v)):
    if x.ndim != 4:
      raise ValueError(f"{name} must be [B, S, H, D], got shape {x.shape}")
  if k.shape != v.shape:
    raise ValueError(f"k and v must have the same shape, got k {k.shape} and v {v.shape}")
  b, _, h, d = q.shape
  if (k.shape[0], k.shape[3]) != (b, d) or k.shape[2] < 1 or h % k.shape[2]:
    raise ValueError(
      f"q {q.shape} and k/v {k.shape} must agree in batch, heads and head dim ([B, S, H, D]); k/v "
      "may have fewer heads than q if they divide q's (grouped-query attention)"
    )
  if not (q.dtype == k.dtype == v.dtype) or not jnp.issubdtype(q.dtype, jnp.floating):
    raise TypeError(f"q, k, v must share one floating dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
  if mask is not None and mask.shape != (b, k.shape[1]):
    raise ValueError(f"mask must be [B, S_kv] = {(b, k.shape[1])}, got {mask.shape}")


def _local(
  implementation, *, causal, scale, config, block_q, block_kv, s_kv, has_mask=True, window=None
):
  """Local attention as `(q, k, v, kv_valid, q_pos, k_pos) -> out`."""
  if implementation == "auto":
    implementation = "blockwise" if s_kv >= config.min_seq_length else "dot_product"
  if implementation == "dot_product":
    masked = has_mask or causal or window is not None
    return functools.partial(
      dot_product_attention, causal=causal, scale=scale, window=window, masked=masked
    )
  if implementation == "blockwise":
    return lambda q, k, v, valid, q_pos, k_pos: blockwise_attention(
      q, k, v, valid, q_pos, k_pos, causal, scale, block_q, block_kv, window
    )
  # cuDNN and splash mask causally by index from 0, which is what the local (unsharded) call needs;
  # without a mask they skip the key-padding machinery.
  if implementation == "cudnn":
    return lambda q, k, v, valid, q_pos, k_pos: cudnn_attention(
      q, k, v, valid if has_mask else None, causal=causal, scale=scale, window=window
    )
  if implementation == "splash":
    return lambda q, k, v, valid, q_pos, k_pos: splash_attention(
      q, k, v, valid if has_mask else None, causal=causal, scale=scale, window=window,
      block_q=block_q, block_kv=block_kv,
    )  # fmt: skip
  raise AssertionError(implementation)


def attention(
  q,
  k,
  v,
  *,
  mask=None,
  causal: bool = False,
  scale: float | None = None,
  implementation: str | None = None,
  mesh: Mesh | None = None,
  config: AttentionConfig | None = None,
  window: int | tuple[int | None, int | None] | None = None,
):
  """Multi-head attention over `[B, S, H, D]` tensors, by the implementation the config names.

  Scores and softmax accumulate in float32 whatever the input dtype. Queries that see no key (all
  keys masked) get zeros. Under a mesh the output is sharded `(batch, context, heads, None)`: batch and
  heads as md-sharding's rules (`config.rules`) place the logical names `ACTIVATION_AXES`, the
  sequence over `config.context_axis` (when the context axis divides it).

  Grouped-query / multi-query attention: k and v may have `H_kv` heads with `H % H_kv == 0`; query
  head `h` then uses key/value head `h // (H // H_kv)` (transformers' `repeat_kv` order). `dot_product`,
  `blockwise`, `cudnn`, `ring`, `ulysses` and `ulysses_ring` use the smaller K/V as they are; `splash`
  repeats them to `H` heads, and under a mesh K/V are repeated just enough for the devices their heads
  are split over (tensor axis, Ulysses degree x chunks).

  Args:
    q: `[B, S_q, H, D]` queries.
    k: `[B, S_kv, H_kv, D]` keys (`S_kv != S_q` for cross-attention; `H % H_kv == 0`).
    v: `[B, S_kv, H_kv, D]` values.
    mask: optional `[B, S_kv]` key padding mask, True (or nonzero) for keys to attend to.
    causal: query `i` sees keys `0..i` only (text encoders).
    scale: score multiplier (a Python number); `1/sqrt(D)` by default.
    implementation: overrides `config.implementation`; one of `IMPLEMENTATIONS`.
    mesh: the device mesh for sharded implementations; defaults to the context mesh
      (`jax.set_mesh` / `with mesh:`), if any.
    config: an `AttentionConfig`; defaults to `AttentionConfig()`.
    window: local (sliding-window) attention by position. An int `w` is Gemma 3's causal window:
      query `i` sees keys `j` with `i - w < j <= i`. A pair `(left, right)` lets query `i` see keys
      `i - left <= j <= i + right` (None: no limit on that side). Combines with `mask` and `causal`
      (causal caps `right` at 0).

  Returns:
    `[B, S_q, H, D]` in q's dtype.

  Raises:
    ValueError: for mismatched shapes, an unknown implementation, a context-parallel implementation
      without a mesh, heads that the Ulysses degree does not divide, or a bad window.
    TypeError: for non-float or mixed dtypes, or dtypes the chosen kernel does not take.
    RuntimeError: for `cudnn` off NVIDIA GPUs and `splash` off TPU.
  """
  config = AttentionConfig() if config is None else config
  implementation = config.implementation if implementation is None else implementation
  if implementation not in IMPLEMENTATIONS:
    raise ValueError(
      f"implementation={implementation!r} is not one of {', '.join(IMPLEMENTATIONS)}"
    )
  q, k, v = (jnp.asarray(x) for x in (q, k, v))
  mask = None if mask is None else jnp.asarray(mask)
  _check_inputs(q, k, v, mask)
  b, s_q, h, d = q.shape
  s_kv = k.shape[1]
  # A static Python float: kernels take it as a compile-time constant.
  scale = float(d) ** -0.5 if scale is None else float(scale)
  window = normalize_window(window, causal)
  mesh = shd.context_mesh() if mesh is None else mesh
  auto = implementation == "auto"
  if auto:
    implementation = select_implementation(q.shape, k.shape, q.dtype, mesh, config)

  backend = jax.default_backend()
  if implementation == "cudnn" and backend != "gpu":
    raise RuntimeError(
      f"implementation='cudnn' needs an NVIDIA GPU, but the backend is {backend!r}"
    )
  if implementation == "splash" and backend != "tpu":
    raise RuntimeError(
      f"implementation='splash' needs a TPU, but the backend is {backend!r} "
      "(md_attention.splash_attention(..., interpret=True) runs the kernel anywhere, slowly)"
    )

  block_q, block_kv = config.block_q, config.block_kv
  if auto and implementation == "blockwise" and backend == "cpu" and not config.tune:
    block_q, block_kv = cpu_blocks(s_q, s_kv, config)
  if config.tune and implementation != "dot_product" and implementation != "cudnn":
    # Under a trace a cache lookup only (a miss warns); eagerly a miss is measured.
    block_q, block_kv = tuned_blocks(
      q, k, implementation=implementation, causal=causal, window=window, mesh=mesh, config=config
    )

  kv_valid = jnp.ones((b, s_kv), bool) if mask is None else mask.astype(bool)

  if implementation in CONTEXT_PARALLEL_IMPLEMENTATIONS:
    if mesh is None:
      raise ValueError(
        f"implementation={implementation!r} needs a mesh with a {config.context_axis!r} axis: pass "
        "mesh=..., or call under jax.set_mesh(mesh)"
      )
    inner = _local(
      config.local_implementation,
      causal=causal,
      scale=scale,
      config=config,
      block_q=block_q,
      block_kv=block_kv,
      s_kv=max(s_q, s_kv),
      window=window,
    )
    config = dataclasses.replace(config, block_q=block_q, block_kv=block_kv)
    return context_parallel_attention(
      q, k, v, kv_valid, causal=causal, scale=scale, mesh=mesh, config=config,
      implementation=implementation, attend=inner, window=window,
    )  # fmt: skip

  local = _local(
    implementation,
    causal=causal,
    scale=scale,
    config=config,
    block_q=block_q,
    block_kv=block_kv,
    s_kv=s_kv,
    has_mask=mask is not None,
    window=window,
  )
  q_pos, k_pos = jnp.arange(s_q, dtype=jnp.int32), jnp.arange(s_kv, dtype=jnp.int32)
  if mesh is None or mesh.size == 1:
    return local(q, k, v, kv_valid, q_pos, k_pos)

  # Under a mesh each device attends over its batch and head shards with the whole sequence.
  b_spec, h_spec = shd.activation_specs(mesh, config.rules, (b, s_q, h, d))
  k, v = shd.fit_kv_heads(k, v, h, shd.spec_size(mesh, h_spec))
  act, valid = P(b_spec, None, h_spec, None), P(b_spec, None)
  out = shd.shard_map(
    lambda q, k, v, kv_valid: local(q, k, v, kv_valid, q_pos, k_pos),
    mesh=mesh,
    in_specs=(act, act, act, valid),
    out_specs=act,
  )(q, k, v, kv_valid)
  context = config.context_axis if shd.axis_size(mesh, config.context_axis) > 1 else None
  return shd.constrain(out, mesh, P(b_spec, context, h_spec, None))
