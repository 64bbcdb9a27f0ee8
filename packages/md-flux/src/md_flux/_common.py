"""Pieces both Flux transformers share: stacked blocks, the output norm, attention over heads, checks.

The stacks run through `md_core.scan_layers` (one block compiled, `md_core.REMAT_POLICIES`).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

import md_attention as mda
import md_core
import md_sharding as mds
from md_core import nn

_F32 = jnp.float32
HIDDEN_AXES = ("activation_batch", "activation_length", "activation_embed")


def stack_blocks(make: Callable[[nnx.Rngs], nnx.Module], num: int, rngs: nnx.Rngs) -> nnx.Module:
  """`num` blocks from `make(rngs)` as one module whose parameters carry a leading `layers` axis.

  The loader fills such a parameter with `Target(layer=i)`; md-sharding keeps the `layers` axis whole.
  """

  @nnx.split_rngs(splits=num)
  @nnx.vmap(in_axes=(0,), out_axes=0)
  def build(r):
    return make(r)

  stacked = build(rngs)
  for _, var in nnx.to_flat_state(nnx.state(stacked)):
    axes = md_core.logical_axes(var)
    ndim = (var.get_value() if hasattr(var, "get_value") else var.value).ndim
    var.set_metadata(logical_axes=("layers",) + (axes or (None,) * (ndim - 1)))
  return stacked


def constrain(x: jax.Array) -> jax.Array:
  """Hidden states `[B, S, D]`: batch over data/fsdp and tokens over context where a mesh is set."""
  return mds.with_logical_constraint(x, HIDDEN_AXES)


def modulate(x: jax.Array, shift: jax.Array, scale: jax.Array) -> jax.Array:
  """`x * (1 + scale) + shift` with per-sample `[B, D]` (or per-token `[B, S, D]`) parameters."""
  if shift.ndim == 2:
    shift, scale = shift[:, None, :], scale[:, None, :]
  return x * (1 + scale) + shift


def gate(g: jax.Array, x: jax.Array) -> jax.Array:
  return (g[:, None, :] if g.ndim == 2 else g) * x


def heads(x: jax.Array, head_dim: int) -> jax.Array:
  """`[B, S, H * D]` → `[B, S, H, D]`."""
  return x.reshape(x.shape[:-1] + (x.shape[-1] // head_dim, head_dim))


def attend(q, k, v, config: mda.AttentionConfig) -> jax.Array:
  """Attention over `[B, S, H, D]`, returning `[B, S, H * D]` in q's dtype."""
  out = mda.attention(q, k, v, config=config)
  return out.reshape(out.shape[:2] + (-1,)).astype(q.dtype)


def rope_tables(ids: jax.Array, axes_dims, theta: float) -> tuple[jax.Array, jax.Array]:
  """`(cos, sin)` `[S, D]` (or `[B, S, D]` for per-sample ids) from position ids `[(B,) S, N]`."""
  return nn.rope_nd(ids.astype(_F32), axes_dims, theta=theta)


def apply_rope(x: jax.Array, rope: tuple[jax.Array, jax.Array]) -> jax.Array:
  return nn.apply_rope(x, rope[0], rope[1], interleaved=True)


class AdaNormOut(nnx.Module):
  """The final adaptive layer norm (diffusers `AdaLayerNormContinuous`): `norm(x) * (1 + scale) + shift`.

  The reference holds one linear giving `[scale, shift]` (BFL's file: `[shift, scale]`); md keeps two
  linears so either order loads with plain splits.
  """

  def __init__(self, dim: int, *, eps: float, use_bias: bool, rngs: nnx.Rngs):
    kw = dict(use_bias=use_bias, axes=("embed", "mlp"), rngs=rngs)
    self.scale = nn.Dense(dim, dim, **kw)
    self.shift = nn.Dense(dim, dim, **kw)
    self.norm = nn.LayerNorm(dim, eps=eps, elementwise_affine=False)

  def __call__(self, x: jax.Array, temb: jax.Array) -> jax.Array:
    c = jax.nn.silu(temb).astype(x.dtype)
    return modulate(self.norm(x), self.shift(c), self.scale(c))


def check_ids(name: str, ids: jax.Array, tokens: int, axes: int, batch: int) -> jax.Array:
  """Validates position ids `[S, N]` or `[B, S, N]` against the token count they must describe."""
  if ids.ndim not in (2, 3) or ids.shape[-1] != axes or ids.shape[-2] != tokens:
    raise ValueError(
      f"{name} must be [S, {axes}] or [B, S, {axes}] with S={tokens} (one id per token), got shape "
      f"{ids.shape}"
    )
  if ids.ndim == 3 and ids.shape[0] not in (1, batch):
    raise ValueError(f"{name} has batch {ids.shape[0]}, the inputs have batch {batch}")
  return ids


def join_ids(txt_ids: jax.Array, img_ids: jax.Array, batch: int) -> jax.Array:
  """`[txt; img]` ids along the tokens: `[S, N]` when both are shared, else `[B, S, N]`."""
  if txt_ids.ndim == img_ids.ndim == 2:
    return jnp.concatenate([txt_ids, img_ids], axis=0)

  def per_sample(ids):
    return jnp.broadcast_to(ids if ids.ndim == 3 else ids[None], (batch,) + ids.shape[-2:])

  return jnp.concatenate([per_sample(txt_ids), per_sample(img_ids)], axis=1)
