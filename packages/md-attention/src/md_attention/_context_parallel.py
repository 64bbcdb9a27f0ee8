"""Attention over a sequence sharded along the mesh's context axis: ring, Ulysses, and both (USP).

The context axis of `C` devices is viewed as `R` ring positions of `U` neighbouring devices each
(`C = R * U`, Ulysses inner): an all-to-all inside each group of `U` gathers the group's sequence
blocks and splits the heads, then ring steps (`ppermute` by `U` devices) pass the `R` larger key
blocks around. `ring` is `U = 1`, `ulysses` is `R = 1`. Everything stays on the caller's mesh, so the
code also runs under `jax.set_mesh` inside jit. Cross-attention (`S_q != S_kv`) keeps the queries
sharded and replicates the (short, e.g. text) keys and values, so it needs no communication.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from md_attention import _sharding as shd
from md_attention._blockwise import fold_groups, unfold_groups
from md_attention._config import AttentionConfig
from md_attention._ring import ring_attention
from md_attention._ulysses import ulysses_attention


def _round_up(n: int, m: int) -> int:
  return -(-n // m) * m


def ulysses_degree(
  implementation: str, context: int, local_heads: int, heads: int, config: AttentionConfig
) -> int:
  """The Ulysses part of the context axis, validated against the heads per device."""
  chunks = config.ulysses_chunks
  working = [d for d in shd.divisors(context) if local_heads % (d * chunks) == 0]
  heads_note = (
    f"{local_heads} heads per device (num_heads={heads}"
    + (f" split {heads // local_heads} ways by the mesh" if local_heads != heads else "")
    + ")"
  )
  if implementation == "ring":
    return 1
  if implementation == "ulysses":
    degree = context
  elif config.ulysses_degree is not None:
    degree = config.ulysses_degree
    if context % degree:
      raise ValueError(
        f"ulysses_degree={degree} must divide the {config.context_axis!r} axis of size {context}; "
        f"divisors: {shd.divisors(context)}"
      )
  else:
    # The largest Ulysses part the heads allow (all-to-all is cheaper than ring steps per byte).
    return working[-1]
  if local_heads % (degree * chunks):
    raise ValueError(
      f"{implementation}: Ulysses degree {degree} x ulysses_chunks {chunks} must divide the "
      f"{heads_note}. Ulysses degrees that work: {working}; use implementation='ulysses_ring' with "
      f"ulysses_degree in {working}, fewer ulysses_chunks, or implementation='ring'."
    )
  return degree


def context_parallel_attention(
  q,
  k,
  v,
  kv_valid,
  *,
  causal,
  scale,
  mesh: Mesh,
  config: AttentionConfig,
  implementation,
  attend,
  window=None,
):
  """Ring / Ulysses / Ulysses x ring attention under `shard_map` over `mesh`.

  Args:
    q: `[B, S_q, H, D]`.
    k, v: `[B, S_kv, H_kv, D]` (`H % H_kv == 0`: grouped-query).
    kv_valid: `[B, S_kv]` bool.
    causal, scale: as in `attention`.
    window: normalized `(left, right)` local window or None; `attend` and the ring steps apply it
      by global position.
    mesh: a mesh with `config.context_axis`.
    config: block sizes, axes, Ulysses degree and chunks.
    implementation: "ring", "ulysses" or "ulysses_ring".
    attend: local attention `(q, k, v, kv_valid, q_pos, k_pos) -> out`, used by Ulysses (R = 1) and by
      cross-attention.

  Returns:
    `[B, S_q, H, D]`, sharded `(batch, context, heads, None)`.
  """
  ctx = config.context_axis
  if ctx not in mesh.shape:
    raise ValueError(
      f"{implementation} shards the sequence over mesh axis {ctx!r}, but the mesh has axes "
      f"{tuple(mesh.shape)}; set AttentionConfig(context_axis=...)"
    )
  context = mesh.shape[ctx]
  b, s_q, h, d = q.shape
  s_kv = k.shape[1]
  b_spec, h_spec = shd.activation_specs(mesh, config.rules, (b, _round_up(s_q, context), h, d))
  local_heads = h // shd.spec_size(mesh, h_spec)
  cross = s_q != s_kv
  degree = 1 if cross else ulysses_degree(implementation, context, local_heads, h, config)
  ring = context // degree
  tensor_split = h // local_heads
  if cross:
    k, v = shd.fit_kv_heads(k, v, h, tensor_split)
  else:
    # Ulysses splits K/V heads as it splits query heads; ring steps fold query groups into rows.
    ulysses_split = degree * config.ulysses_chunks if degree > 1 else 1
    k, v = shd.fit_kv_heads(k, v, h, tensor_split * ulysses_split)
  # Device c of the context axis is Ulysses position c % degree of ring position c // degree.
  groups = (
    None
    if ring == 1 or degree == 1
    else [[r * degree + u for u in range(degree)] for r in range(ring)]
  )

  s_q_pad = _round_up(s_q, context)
  q = jnp.pad(q, ((0, 0), (0, s_q_pad - s_q), (0, 0), (0, 0)))
  act = P(b_spec, ctx, h_spec, None)

  if cross:

    def body(q, k, v, kv_valid):
      q_pos = lax.axis_index(ctx) * q.shape[1] + jnp.arange(q.shape[1], dtype=jnp.int32)
      k_pos = jnp.arange(k.shape[1], dtype=jnp.int32)
      return attend(q, k, v, kv_valid, q_pos, k_pos)

    kv_spec, valid_spec = P(b_spec, None, h_spec, None), P(b_spec, None)
  else:
    pad = s_q_pad - s_kv
    k, v = (jnp.pad(x, ((0, 0), (0, pad), (0, 0), (0, 0))) for x in (k, v))
    kv_valid = jnp.pad(kv_valid, ((0, 0), (0, pad)), constant_values=False)

    def local(q, k, v, kv_valid):
      if ring > 1:
        groups = q.shape[2] // k.shape[2]
        if groups == 1:
          return ring_attention(
            q, k, v, kv_valid, ctx, ring, degree, causal, scale, config.block_q, config.block_kv,
            1, window,
          )  # fmt: skip
        q_rows, _ = fold_groups(q, jnp.zeros((q.shape[1],), jnp.int32), k.shape[2])
        out = ring_attention(
          q_rows, k, v, kv_valid, ctx, ring, degree, causal, scale, config.block_q * groups,
          config.block_kv, groups, window,
        )  # fmt: skip
        return unfold_groups(out, q.shape[2])
      pos = jnp.arange(q.shape[1], dtype=jnp.int32)
      return attend(q, k, v, kv_valid, pos, pos)

    def body(q, k, v, kv_valid):
      return ulysses_attention(
        q,
        k,
        v,
        kv_valid,
        local,
        axis_name=ctx,
        degree=degree,
        chunks=config.ulysses_chunks,
        groups=groups,
      )

    kv_spec, valid_spec = act, P(b_spec, ctx)

  out = shd.shard_map(body, mesh=mesh, in_specs=(act, kv_spec, kv_spec, valid_spec), out_specs=act)(
    q, k, v, kv_valid
  )
  return shd.constrain(out[:, :s_q], mesh, P(b_spec, ctx, h_spec, None))
