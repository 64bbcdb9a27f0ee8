"""Building blocks of the Wan causal video VAE (diffusers `autoencoder_kl_wan`), channels-last `[B, T, H, W, C]`.

Every block runs on one chunk of frames and threads the chunk's feature caches (`_Caches`) through its causal
convolutions in a fixed order, so the first chunk (which sees zeros before it) and every later chunk (which sees
the previous chunk's last frames) produce and consume the same list of caches.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from md_core import nn
from md_vae._wan_config import WanVAEConfig

_F32 = jnp.float32


class _Caches:
  """The feature caches of one chunk: reads the previous chunk's in call order and collects this chunk's in the
  same order (the reference's `feat_cache` list and `feat_idx` counter, made functional). `previous=None` marks
  the first chunk, which sees zeros before it."""

  def __init__(self, previous: Sequence[jax.Array] | None):
    self._previous = None if previous is None else iter(previous)
    self.new: list[jax.Array] = []

  @property
  def first(self) -> bool:
    return self._previous is None

  def take(self) -> jax.Array | None:
    return None if self._previous is None else next(self._previous)

  def put(self, x: jax.Array) -> None:
    self.new.append(x)


class WanRMSNorm(nnx.Module):
  """The reference's `WanRMS_norm`: `x / max(||x||, 1e-12) * sqrt(C) * gamma` over channels (L2 normalisation,
  not md_core.nn.RMSNorm's mean-square form with eps inside the root), computed in float32.

  `scale` has the reference's `gamma` shape moved channels-last: `(1, 1, 1, C)` for video norms, `(1, 1, C)` for
  the per-frame attention norm, so checkpoints map by a transpose alone.
  """

  def __init__(self, dim: int, *, spatial_dims: int = 3, rngs: nnx.Rngs | None = None):
    del rngs  # ones, as the reference initialises gamma
    self.dim = dim
    shape = (1,) * spatial_dims + (dim,)
    self.scale = nnx.Param(jnp.ones(shape, _F32), logical_axes=(None,) * spatial_dims + ("norm",))

  def __call__(self, x: jax.Array) -> jax.Array:
    h = x.astype(_F32)
    norm = jnp.sqrt(jnp.sum(jnp.square(h), axis=-1, keepdims=True))
    h = (h / jnp.maximum(norm, 1e-12)).astype(x.dtype)
    gamma = self.scale[...].reshape((1,) * (x.ndim - 1) + (self.dim,))
    return h * jnp.asarray(self.dim**0.5, x.dtype) * gamma.astype(x.dtype)


class WanCausalConv3d(nn.Conv):
  """A 3-d convolution over `[B, T, H, W, C]`, zero padded in space and causal in time: each output frame sees
  only current and past frames. Given the chunk's `caches`, the `kt - 1` frames before the chunk come from the
  previous chunk's input (zeros before the first) and the last `kt - 1` input frames are kept for the next."""

  def __init__(
    self,
    in_channels: int,
    out_channels: int,
    kernel_size: Sequence[int] = (3, 3, 3),
    *,
    stride: Sequence[int] = (1, 1, 1),
    rngs: nnx.Rngs | None = None,
  ):
    _, kh, kw = kernel_size
    super().__init__(
      in_channels,
      out_channels,
      tuple(kernel_size),
      stride=tuple(stride),
      padding=((0, 0), (kh // 2, kh // 2), (kw // 2, kw // 2)),
      rngs=rngs,
    )

  def __call__(self, x: jax.Array, caches: _Caches | None = None) -> jax.Array:
    past = self.kernel_size[0] - 1
    if past == 0:
      return super().__call__(x)
    before = caches.take() if caches is not None else None
    if before is None:
      before = jnp.zeros((x.shape[0], past, *x.shape[2:]), x.dtype)
    h = jnp.concatenate([before, x], axis=1)  # [B, past + T, H, W, C]
    if caches is not None:
      caches.put(h[:, -past:])
    return super().__call__(h)

  def convolve(self, x: jax.Array) -> jax.Array:
    """The convolution alone, without any temporal padding or cache."""
    return super().__call__(x)


class WanResample(nnx.Module):
  """Spatial 2x down/up-sampling, optionally with temporal 2x (the reference's `WanResample` modes).

  upsample2d/3d: nearest 2x then a 3x3 conv to `out_dim` (default `dim // 2`); 3d first doubles the frames with a
  causal (3, 1, 1) conv to `2 * dim` channels whose halves become even and odd frames (skipped on the first
  chunk, whose single frame stays single). downsample2d/3d: a 3x3 stride-2 conv padded on the right and bottom;
  3d then halves the frames with a stride-2 (3, 1, 1) conv over the previous chunk's last frame and this chunk's
  (skipped on the first chunk).
  """

  MODES = ("upsample2d", "upsample3d", "downsample2d", "downsample3d")

  def __init__(
    self, dim: int, mode: str, *, out_dim: int | None = None, rngs: nnx.Rngs | None = None
  ):
    if mode not in self.MODES:
      raise ValueError(f"unknown resample mode {mode!r}; expected one of {self.MODES}")
    self.mode = mode
    time_conv = None
    if mode.startswith("up"):
      self.resample = nn.Conv(dim, out_dim or dim // 2, (3, 3), padding=1, rngs=rngs)
      if mode == "upsample3d":
        time_conv = WanCausalConv3d(dim, 2 * dim, (3, 1, 1), rngs=rngs)
    else:
      self.resample = nn.Conv(dim, dim, (3, 3), stride=2, padding=((0, 1), (0, 1)), rngs=rngs)
      if mode == "downsample3d":
        time_conv = WanCausalConv3d(dim, dim, (3, 1, 1), stride=(2, 1, 1), rngs=rngs)
    self.time_conv = time_conv

  def __call__(self, x: jax.Array, caches: _Caches) -> jax.Array:
    b, t, h, w, c = x.shape
    if self.mode == "upsample3d":
      if caches.first:
        # The reference's "Rep" marker: the next chunk's time conv sees zeros before it.
        caches.put(jnp.zeros((b, 2, h, w, c), x.dtype))
      else:
        y = self.time_conv(x, caches)  # [B, T, H, W, 2C]: first half → frame 2t, second → 2t + 1
        x = y.reshape(b, t, h, w, 2, c).transpose(0, 1, 4, 2, 3, 5).reshape(b, 2 * t, h, w, c)
    t = x.shape[1]
    frames = x.reshape(b * t, *x.shape[2:])
    if self.mode.startswith("up"):
      frames = jnp.repeat(jnp.repeat(frames, 2, axis=1), 2, axis=2)  # nearest(-exact) at scale 2
    frames = self.resample(frames)
    x = frames.reshape(b, t, *frames.shape[1:])
    if self.mode == "downsample3d":
      before = caches.take()
      caches.put(x[:, -1:])
      if before is not None:
        x = self.time_conv.convolve(jnp.concatenate([before, x], axis=1))
    return x


class WanResidualBlock(nnx.Module):
  """`conv2(silu(norm2(conv1(silu(norm1(x)))))) + shortcut(x)` with causal 3x3x3 convs (1x1x1 shortcut when
  the width changes). Dropout is inference-inactive and omitted."""

  def __init__(self, in_dim: int, out_dim: int, *, rngs: nnx.Rngs | None = None):
    self.norm1 = WanRMSNorm(in_dim)
    self.conv1 = WanCausalConv3d(in_dim, out_dim, rngs=rngs)
    self.norm2 = WanRMSNorm(out_dim)
    self.conv2 = WanCausalConv3d(out_dim, out_dim, rngs=rngs)
    self.conv_shortcut = (
      WanCausalConv3d(in_dim, out_dim, (1, 1, 1), rngs=rngs) if in_dim != out_dim else None
    )

  def __call__(self, x: jax.Array, caches: _Caches) -> jax.Array:
    shortcut = x if self.conv_shortcut is None else self.conv_shortcut(x)
    x = self.conv1(jax.nn.silu(self.norm1(x)), caches)
    x = self.conv2(jax.nn.silu(self.norm2(x)), caches)
    return x + shortcut


class WanAttentionBlock(nnx.Module):
  """Single-head self-attention over the pixels of each frame separately, with a residual."""

  def __init__(self, dim: int, *, rngs: nnx.Rngs | None = None):
    self.norm = WanRMSNorm(dim, spatial_dims=2)
    self.to_qkv = nn.Conv(dim, 3 * dim, (1, 1), rngs=rngs)
    self.proj = nn.Conv(dim, dim, (1, 1), rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    b, t, h, w, c = x.shape
    frames = x.reshape(b * t, h, w, c)
    qkv = self.to_qkv(self.norm(frames)).reshape(b * t, h * w, 1, 3 * c)
    q, k, v = jnp.split(qkv, 3, axis=-1)  # each [B*T, HW, 1 head, C]
    out = jax.nn.dot_product_attention(q, k, v)
    out = self.proj(out.reshape(b * t, h, w, c))
    return out.reshape(b, t, h, w, c) + x


class WanMidBlock(nnx.Module):
  """resnet → attention → resnet at the lowest resolution."""

  def __init__(self, dim: int, *, rngs: nnx.Rngs | None = None):
    self.resnets = nnx.List([WanResidualBlock(dim, dim, rngs=rngs) for _ in range(2)])
    self.attentions = nnx.List([WanAttentionBlock(dim, rngs=rngs)])

  def __call__(self, x: jax.Array, caches: _Caches) -> jax.Array:
    x = self.resnets[0](x, caches)
    x = self.attentions[0](x)
    return self.resnets[1](x, caches)


def _avg_down(x: jax.Array, factor_t: int, factor_s: int, out_dim: int) -> jax.Array:
  """The reference's `AvgDown3D`: space/time-to-channel folding then a mean over channel groups; the chunk is
  zero padded at its start to a multiple of `factor_t` frames (so a single first frame averages with zeros)."""
  b, t, h, w, c = x.shape
  pad = -t % factor_t
  if pad:
    x = jnp.pad(x, ((0, 0), (pad, 0), (0, 0), (0, 0), (0, 0)))
    t += pad
  fs = factor_s
  x = x.reshape(b, t // factor_t, factor_t, h // fs, fs, w // fs, fs, c)
  x = x.transpose(
    0, 1, 3, 5, 7, 2, 4, 6
  )  # [B, T', H', W', C, ft, fs_h, fs_w]: channel-major like the reference
  group = c * factor_t * fs * fs // out_dim
  return x.reshape(b, t // factor_t, h // fs, w // fs, out_dim, group).mean(axis=-1)


def _dup_up(
  x: jax.Array, factor_t: int, factor_s: int, out_dim: int, first_chunk: bool
) -> jax.Array:
  """The reference's `DupUp3D`: repeat channels, then unfold them into time and space; the first chunk drops
  the `factor_t - 1` leading frames so a single frame stays single."""
  b, t, h, w, c = x.shape
  fs = factor_s
  repeats = out_dim * factor_t * fs * fs // c
  x = jnp.repeat(x, repeats, axis=-1).reshape(b, t, h, w, out_dim, factor_t, fs, fs)
  x = x.transpose(0, 1, 5, 2, 6, 3, 7, 4).reshape(b, t * factor_t, h * fs, w * fs, out_dim)
  return x[:, factor_t - 1 :] if first_chunk else x


class WanResidualDownBlock(nnx.Module):
  """A Wan 2.2 encoder level: resnets and downsampler, plus an average-down shortcut of the level's input."""

  def __init__(
    self, in_dim: int, out_dim: int, num_res_blocks: int, temporal: bool, down: bool, *, rngs=None
  ):
    self.factor_t, self.factor_s, self.out_dim = 2 if temporal else 1, 2 if down else 1, out_dim
    factor = self.factor_t * self.factor_s**2
    if (in_dim * factor) % out_dim:
      raise ValueError(f"in_dim {in_dim} x factor {factor} must be divisible by out_dim {out_dim}")
    dims = [in_dim] + [out_dim] * num_res_blocks
    self.resnets = nnx.List(
      [WanResidualBlock(a, b, rngs=rngs) for a, b in zip(dims[:-1], dims[1:], strict=True)]
    )
    mode = "downsample3d" if temporal else "downsample2d"
    self.downsampler = WanResample(out_dim, mode, rngs=rngs) if down else None

  def __call__(self, x: jax.Array, caches: _Caches) -> jax.Array:
    shortcut = _avg_down(x, self.factor_t, self.factor_s, self.out_dim)
    for resnet in self.resnets:
      x = resnet(x, caches)
    if self.downsampler is not None:
      x = self.downsampler(x, caches)
    return x + shortcut


class WanUpBlock(nnx.Module):
  """A Wan 2.1 decoder level: `num_res_blocks + 1` resnets, then an upsampler (absent on the last level)."""

  def __init__(
    self, in_dim: int, out_dim: int, num_res_blocks: int, mode: str | None, *, rngs=None
  ):
    dims = [in_dim] + [out_dim] * (num_res_blocks + 1)
    self.resnets = nnx.List(
      [WanResidualBlock(a, b, rngs=rngs) for a, b in zip(dims[:-1], dims[1:], strict=True)]
    )
    self.upsamplers = nnx.List([WanResample(out_dim, mode, rngs=rngs)]) if mode else None

  def __call__(self, x: jax.Array, caches: _Caches, first_chunk: bool) -> jax.Array:
    del first_chunk
    for resnet in self.resnets:
      x = resnet(x, caches)
    if self.upsamplers is not None:
      x = self.upsamplers[0](x, caches)
    return x


class WanResidualUpBlock(nnx.Module):
  """A Wan 2.2 decoder level: resnets and upsampler, plus a duplicate-up shortcut of the level's input."""

  def __init__(
    self, in_dim: int, out_dim: int, num_res_blocks: int, temporal: bool, up: bool, *, rngs=None
  ):
    self.factor_t, self.out_dim, self.up = 2 if temporal else 1, out_dim, up
    if up and (out_dim * self.factor_t * 4) % in_dim:
      raise ValueError(
        f"out_dim {out_dim} x factor {self.factor_t * 4} must be divisible by in_dim {in_dim}"
      )
    dims = [in_dim] + [out_dim] * (num_res_blocks + 1)
    self.resnets = nnx.List(
      [WanResidualBlock(a, b, rngs=rngs) for a, b in zip(dims[:-1], dims[1:], strict=True)]
    )
    mode = "upsample3d" if temporal else "upsample2d"
    self.upsampler = WanResample(out_dim, mode, out_dim=out_dim, rngs=rngs) if up else None

  def __call__(self, x: jax.Array, caches: _Caches, first_chunk: bool) -> jax.Array:
    shortcut = _dup_up(x, self.factor_t, 2, self.out_dim, first_chunk) if self.up else None
    for resnet in self.resnets:
      x = resnet(x, caches)
    if self.upsampler is not None:
      x = self.upsampler(x, caches)
    return x if shortcut is None else x + shortcut


class WanEncoder3d(nnx.Module):
  """Frames `[B, T, H, W, in_channels]` → `[B, T', H / 2^L, W / 2^L, 2 * z_dim]` (one chunk)."""

  def __init__(self, cfg: WanVAEConfig, *, rngs: nnx.Rngs | None = None):
    dims = [cfg.base_dim * m for m in (1, *cfg.dim_mult)]
    last = len(cfg.dim_mult) - 1
    self.conv_in = WanCausalConv3d(cfg.in_channels, dims[0], rngs=rngs)
    blocks: list[nnx.Module] = []
    for i, (in_dim, out_dim) in enumerate(zip(dims[:-1], dims[1:], strict=True)):
      down = i != last
      temporal = down and bool(cfg.temperal_downsample[i])
      if cfg.is_residual:
        blocks.append(
          WanResidualDownBlock(in_dim, out_dim, cfg.num_res_blocks, temporal, down, rngs=rngs)
        )
        continue
      for _ in range(cfg.num_res_blocks):
        blocks.append(WanResidualBlock(in_dim, out_dim, rngs=rngs))
        in_dim = out_dim
      if down:
        mode = "downsample3d" if temporal else "downsample2d"
        blocks.append(WanResample(out_dim, mode, rngs=rngs))
    self.down_blocks = nnx.List(blocks)
    self.mid_block = WanMidBlock(dims[-1], rngs=rngs)
    self.norm_out = WanRMSNorm(dims[-1])
    self.conv_out = WanCausalConv3d(dims[-1], 2 * cfg.z_dim, rngs=rngs)

  def __call__(self, x: jax.Array, caches: _Caches) -> jax.Array:
    x = self.conv_in(x, caches)
    for block in self.down_blocks:
      x = block(x, caches)
    x = self.mid_block(x, caches)
    return self.conv_out(jax.nn.silu(self.norm_out(x)), caches)


class WanDecoder3d(nnx.Module):
  """Latents `[B, t, h, w, z_dim]` → frames `[B, T, 2^L h, 2^L w, out_channels]` (one chunk)."""

  def __init__(self, cfg: WanVAEConfig, *, rngs: nnx.Rngs | None = None):
    mult = cfg.dim_mult
    dims = [cfg.decoder_dim * m for m in (mult[-1], *mult[::-1])]
    temporal_up = cfg.temperal_downsample[::-1]
    last = len(mult) - 1
    self.conv_in = WanCausalConv3d(cfg.z_dim, dims[0], rngs=rngs)
    self.mid_block = WanMidBlock(dims[0], rngs=rngs)
    blocks: list[nnx.Module] = []
    for i, (in_dim, out_dim) in enumerate(zip(dims[:-1], dims[1:], strict=True)):
      up = i != last
      temporal = up and bool(temporal_up[i])
      if cfg.is_residual:
        blocks.append(
          WanResidualUpBlock(in_dim, out_dim, cfg.num_res_blocks, temporal, up, rngs=rngs)
        )
      else:
        if i > 0:
          in_dim //= 2  # the 2.1 upsamplers halve the width
        mode = ("upsample3d" if temporal else "upsample2d") if up else None
        blocks.append(WanUpBlock(in_dim, out_dim, cfg.num_res_blocks, mode, rngs=rngs))
    self.up_blocks = nnx.List(blocks)
    self.norm_out = WanRMSNorm(dims[-1])
    self.conv_out = WanCausalConv3d(dims[-1], cfg.out_channels, rngs=rngs)

  def __call__(self, x: jax.Array, caches: _Caches, first_chunk: bool) -> jax.Array:
    x = self.conv_in(x, caches)
    x = self.mid_block(x, caches)
    for block in self.up_blocks:
      x = block(x, caches, first_chunk)
    return self.conv_out(jax.nn.silu(self.norm_out(x)), caches)


def _patchify(x: jax.Array, p: int) -> jax.Array:
  """`[B, F, H, W, C]` → `[B, F, H/p, W/p, C*p*p]`, channels ordered (c, column, row) as the reference's."""
  if p == 1:
    return x
  b, f, h, w, c = x.shape
  x = x.reshape(b, f, h // p, p, w // p, p, c).transpose(0, 1, 2, 4, 6, 5, 3)
  return x.reshape(b, f, h // p, w // p, c * p * p)


def _unpatchify(x: jax.Array, p: int) -> jax.Array:
  """The inverse of `_patchify`."""
  if p == 1:
    return x
  b, f, h, w, cpp = x.shape
  x = x.reshape(b, f, h, w, cpp // (p * p), p, p).transpose(0, 1, 2, 6, 3, 5, 4)
  return x.reshape(b, f, h * p, w * p, cpp // (p * p))
