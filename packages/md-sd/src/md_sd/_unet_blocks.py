"""The UNet's blocks: resnets, spatial transformers, down/up sampling and the down, mid and up stages.

Everything is channels-last (`[B, H, W, C]`). Module and attribute names follow the reference's so that its
tensor names map onto md's parameter paths almost one to one (see `_weights.py`).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

import md_attention as mda
import md_sharding as mds
from md_core import nn

# The token stream of the spatial transformers: batch over data × fsdp, features whole. Pinning it (under
# `jax.set_mesh`; a no-op without a mesh) keeps XLA from carrying the 1×1 conv's `tensor`-split channels into
# the residual adds. Left to itself, XLA's SPMD partitioner (jaxlib 0.10, CPU) miscompiles
# `x + x @ W` when x is `[(data, fsdp), ·, tensor]` and W is `[tensor, fsdp]` (the attention output
# projection): off by O(1) on short sequences (≤ 8 tokens), right at 16 (see tests/test_sd_pipeline_sharded.py).
_TOKENS = ("activation_batch", "activation_length", "activation_embed")


def _tokens(x: jax.Array) -> jax.Array:
  return mds.with_logical_constraint(x, _TOKENS)


def _conv(cin: int, cout: int, k: int, *, stride: int = 1, padding: int | None = None, **kw):
  pad = (k - 1) // 2 if padding is None else padding
  return nn.Conv(cin, cout, (k, k), stride=stride, padding=pad, **kw)


class ResnetBlock2D(nnx.Module):
  """GroupNorm → act → conv → + time embedding → GroupNorm → act → conv, plus a (1×1 conv) skip."""

  def __init__(
    self,
    in_channels: int,
    out_channels: int,
    temb_channels: int,
    *,
    groups: int,
    eps: float,
    act: str = "silu",
    output_scale_factor: float = 1.0,
    dtype: Any = None,
    rngs: nnx.Rngs | None = None,
  ):
    kw = dict(dtype=dtype, rngs=rngs)
    self.act = nn.activation(act)
    self.output_scale_factor = output_scale_factor
    self.norm1 = nn.GroupNorm(groups, in_channels, eps=eps, rngs=rngs)
    self.conv1 = _conv(in_channels, out_channels, 3, **kw)
    self.time_emb_proj = nn.Dense(temb_channels, out_channels, axes=("embed", "conv_out"), **kw)
    self.norm2 = nn.GroupNorm(groups, out_channels, eps=eps, rngs=rngs)
    self.conv2 = _conv(out_channels, out_channels, 3, **kw)
    self.conv_shortcut = (
      _conv(in_channels, out_channels, 1, **kw) if in_channels != out_channels else None
    )

  def __call__(self, x: jax.Array, temb: jax.Array) -> jax.Array:
    # x [B, H, W, Cin], temb [B, T] → [B, H, W, Cout]
    h = self.conv1(self.act(self.norm1(x)))
    t = self.time_emb_proj(self.act(temb))  # [B, Cout]
    h = h + t[:, None, None, :].astype(h.dtype)
    h = self.conv2(self.act(self.norm2(h)))
    skip = self.conv_shortcut(x) if self.conv_shortcut is not None else x
    out = skip + h
    if self.output_scale_factor != 1.0:
      out = out / self.output_scale_factor
    return out


class Attention(nnx.Module):
  """Multi-head attention with bias-free q/k/v projections and a biased output projection."""

  def __init__(
    self,
    query_dim: int,
    heads: int,
    head_dim: int,
    *,
    context_dim: int | None = None,
    attention: mda.AttentionConfig | None = None,
    dtype: Any = None,
    rngs: nnx.Rngs | None = None,
  ):
    kw = dict(dtype=dtype, rngs=rngs)
    inner = heads * head_dim
    kv_dim = context_dim or query_dim
    self.heads, self.head_dim, self.attention = heads, head_dim, attention
    self.to_q = nn.Dense(query_dim, inner, use_bias=False, axes=("embed", "heads"), **kw)
    self.to_k = nn.Dense(kv_dim, inner, use_bias=False, axes=("embed", "heads"), **kw)
    self.to_v = nn.Dense(kv_dim, inner, use_bias=False, axes=("embed", "heads"), **kw)
    self.to_out = nn.Dense(inner, query_dim, axes=("heads", "embed"), **kw)

  def __call__(
    self, x: jax.Array, context: jax.Array | None = None, mask: jax.Array | None = None
  ) -> jax.Array:
    # x [B, S, D]; context [B, S_kv, D_kv] (self-attention when None); mask [B, S_kv] True = attend.
    context = x if context is None else context
    b, s, _ = x.shape
    s_kv = context.shape[1]
    q = self.to_q(x).reshape(b, s, self.heads, self.head_dim)
    k = self.to_k(context).reshape(b, s_kv, self.heads, self.head_dim)
    v = self.to_v(context).reshape(b, s_kv, self.heads, self.head_dim)
    # md's attention keeps scores and softmax in float32, which is what `upcast_attention` asks for.
    o = mda.attention(q, k, v, mask=mask, config=self.attention)  # [B, S, H, Dh]
    return self.to_out(o.reshape(b, s, self.heads * self.head_dim))


class BasicTransformerBlock(nnx.Module):
  """Pre-norm self-attention, cross-attention to the text states, and a GEGLU feed-forward."""

  def __init__(
    self,
    dim: int,
    heads: int,
    head_dim: int,
    context_dim: int,
    *,
    attention: mda.AttentionConfig | None = None,
    dtype: Any = None,
    rngs: nnx.Rngs | None = None,
  ):
    akw = dict(attention=attention, dtype=dtype, rngs=rngs)
    self.norm1 = nn.LayerNorm(dim, eps=1e-5, rngs=rngs)
    self.attn1 = Attention(dim, heads, head_dim, **akw)
    self.norm2 = nn.LayerNorm(dim, eps=1e-5, rngs=rngs)
    self.attn2 = Attention(dim, heads, head_dim, context_dim=context_dim, **akw)
    self.norm3 = nn.LayerNorm(dim, eps=1e-5, rngs=rngs)
    self.ff = nn.FeedForward(dim, mult=4, activation="geglu", dtype=dtype, rngs=rngs)

  def __call__(self, x: jax.Array, context: jax.Array, mask: jax.Array | None) -> jax.Array:
    x = _tokens(x + self.attn1(self.norm1(x)))
    x = _tokens(x + self.attn2(self.norm2(x), context, mask))
    return _tokens(x + self.ff(self.norm3(x)))


class Transformer2D(nnx.Module):
  """The reference's `Transformer2DModel` over continuous inputs: GroupNorm, proj_in (1×1 conv or linear),
  transformer blocks over the `H·W` tokens, proj_out, residual."""

  def __init__(
    self,
    channels: int,
    heads: int,
    context_dim: int,
    num_layers: int,
    *,
    groups: int,
    linear_projection: bool,
    attention: mda.AttentionConfig | None = None,
    dtype: Any = None,
    rngs: nnx.Rngs | None = None,
  ):
    kw = dict(dtype=dtype, rngs=rngs)
    head_dim = channels // heads
    inner = heads * head_dim
    self.linear_projection = linear_projection
    self.norm = nn.GroupNorm(groups, channels, eps=1e-6, rngs=rngs)
    if linear_projection:
      self.proj_in = nn.Dense(channels, inner, axes=("embed", "heads"), **kw)
      self.proj_out = nn.Dense(inner, channels, axes=("heads", "embed"), **kw)
    else:
      self.proj_in = _conv(channels, inner, 1, **kw)
      self.proj_out = _conv(inner, channels, 1, **kw)
    self.transformer_blocks = nnx.List(
      [
        BasicTransformerBlock(inner, heads, head_dim, context_dim, attention=attention, **kw)
        for _ in range(num_layers)
      ]
    )

  def __call__(self, x: jax.Array, context: jax.Array, mask: jax.Array | None) -> jax.Array:
    b, h, w, c = x.shape
    y = self.norm(x)
    if self.linear_projection:
      y = self.proj_in(y.reshape(b, h * w, c))  # [B, HW, inner]
    else:
      y = self.proj_in(y)
      y = y.reshape(b, h * w, y.shape[-1])
    y = _tokens(y)
    for block in self.transformer_blocks:
      y = block(y, context, mask)
    if self.linear_projection:
      y = self.proj_out(y).reshape(b, h, w, c)
    else:
      y = self.proj_out(y.reshape(b, h, w, y.shape[-1]))
    return y + x


class Downsample2D(nnx.Module):
  """A stride-2 3×3 convolution."""

  def __init__(
    self, channels: int, *, padding: int = 1, dtype: Any = None, rngs: nnx.Rngs | None = None
  ):
    # padding=0 means the reference's asymmetric (0, 1) padding before a VALID convolution.
    pad = padding if padding else ((0, 1), (0, 1))
    self.conv = nn.Conv(channels, channels, (3, 3), stride=2, padding=pad, dtype=dtype, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    return self.conv(x)


class Upsample2D(nnx.Module):
  """Nearest-neighbour ×2 upsampling followed by a 3×3 convolution."""

  def __init__(self, channels: int, *, dtype: Any = None, rngs: nnx.Rngs | None = None):
    self.conv = _conv(channels, channels, 3, dtype=dtype, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    x = jnp.repeat(jnp.repeat(x, 2, axis=1), 2, axis=2)
    return self.conv(x)


def _layers_list(value, n: int) -> tuple[int, ...]:
  return tuple(value) if isinstance(value, tuple | list) else (value,) * n


class DownBlock(nnx.Module):
  """`CrossAttnDownBlock2D` (with `attention`) or `DownBlock2D`: resnets (each followed by a spatial
  transformer when cross-attending) and an optional downsampler. Returns the output and the skips."""

  def __init__(
    self,
    in_channels: int,
    out_channels: int,
    temb_channels: int,
    *,
    num_layers: int,
    cross_attention: bool,
    transformer_layers: int | tuple[int, ...],
    heads: int,
    context_dim: int,
    add_downsample: bool,
    groups: int,
    eps: float,
    act: str,
    linear_projection: bool,
    downsample_padding: int,
    attention: mda.AttentionConfig | None = None,
    dtype: Any = None,
    rngs: nnx.Rngs | None = None,
  ):
    kw = dict(dtype=dtype, rngs=rngs)
    rkw = dict(groups=groups, eps=eps, act=act, **kw)
    self.resnets = nnx.List(
      [
        ResnetBlock2D(in_channels if i == 0 else out_channels, out_channels, temb_channels, **rkw)
        for i in range(num_layers)
      ]
    )
    layers = _layers_list(transformer_layers, num_layers)
    self.attentions = (
      nnx.List(
        [
          Transformer2D(
            out_channels,
            heads,
            context_dim,
            layers[i],
            groups=groups,
            linear_projection=linear_projection,
            attention=attention,
            **kw,
          )
          for i in range(num_layers)
        ]
      )
      if cross_attention
      else None
    )
    self.downsampler = (
      Downsample2D(out_channels, padding=downsample_padding, **kw) if add_downsample else None
    )

  def __call__(self, x, temb, context, mask) -> tuple[jax.Array, tuple[jax.Array, ...]]:
    skips = []
    for i, resnet in enumerate(self.resnets):
      x = resnet(x, temb)
      if self.attentions is not None:
        x = self.attentions[i](x, context, mask)
      skips.append(x)
    if self.downsampler is not None:
      x = self.downsampler(x)
      skips.append(x)
    return x, tuple(skips)


class MidBlock(nnx.Module):
  """`UNetMidBlock2DCrossAttn`: resnet, then (spatial transformer, resnet) once."""

  def __init__(
    self,
    channels: int,
    temb_channels: int,
    *,
    transformer_layers: int | tuple[int, ...],
    heads: int,
    context_dim: int,
    groups: int,
    eps: float,
    act: str,
    output_scale_factor: float,
    linear_projection: bool,
    attention: mda.AttentionConfig | None = None,
    dtype: Any = None,
    rngs: nnx.Rngs | None = None,
  ):
    kw = dict(dtype=dtype, rngs=rngs)
    rkw = dict(groups=groups, eps=eps, act=act, output_scale_factor=output_scale_factor, **kw)
    layers = _layers_list(transformer_layers, 1)
    self.resnets = nnx.List(
      [ResnetBlock2D(channels, channels, temb_channels, **rkw) for _ in (0, 1)]
    )
    self.attentions = nnx.List(
      [
        Transformer2D(
          channels,
          heads,
          context_dim,
          layers[0],
          groups=groups,
          linear_projection=linear_projection,
          attention=attention,
          **kw,
        )
      ]
    )

  def __call__(self, x, temb, context, mask) -> jax.Array:
    x = self.resnets[0](x, temb)
    x = self.attentions[0](x, context, mask)
    return self.resnets[1](x, temb)


class UpBlock(nnx.Module):
  """`CrossAttnUpBlock2D` (with `attention`) or `UpBlock2D`: each resnet takes the running sample
  concatenated with one skip (last skip first), then the optional spatial transformer; an optional
  upsampler at the end."""

  def __init__(
    self,
    in_channels: int,
    prev_output_channels: int,
    out_channels: int,
    temb_channels: int,
    *,
    num_layers: int,
    cross_attention: bool,
    transformer_layers: int | tuple[int, ...],
    heads: int,
    context_dim: int,
    add_upsample: bool,
    groups: int,
    eps: float,
    act: str,
    linear_projection: bool,
    attention: mda.AttentionConfig | None = None,
    dtype: Any = None,
    rngs: nnx.Rngs | None = None,
  ):
    kw = dict(dtype=dtype, rngs=rngs)
    rkw = dict(groups=groups, eps=eps, act=act, **kw)
    resnets = []
    for i in range(num_layers):
      skip = in_channels if i == num_layers - 1 else out_channels
      cin = prev_output_channels if i == 0 else out_channels
      resnets.append(ResnetBlock2D(cin + skip, out_channels, temb_channels, **rkw))
    self.resnets = nnx.List(resnets)
    layers = _layers_list(transformer_layers, num_layers)
    self.attentions = (
      nnx.List(
        [
          Transformer2D(
            out_channels,
            heads,
            context_dim,
            layers[i],
            groups=groups,
            linear_projection=linear_projection,
            attention=attention,
            **kw,
          )
          for i in range(num_layers)
        ]
      )
      if cross_attention
      else None
    )
    self.upsampler = Upsample2D(out_channels, **kw) if add_upsample else None

  def __call__(self, x, skips: tuple[jax.Array, ...], temb, context, mask) -> jax.Array:
    # `skips` holds exactly one skip per resnet, in the order the down path produced them.
    for i, resnet in enumerate(self.resnets):
      skip = skips[-1 - i]
      x = resnet(jnp.concatenate([x, skip.astype(x.dtype)], axis=-1), temb)
      if self.attentions is not None:
        x = self.attentions[i](x, context, mask)
    if self.upsampler is not None:
      x = self.upsampler(x)
    return x
