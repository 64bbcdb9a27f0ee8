"""The Wan causal video VAE (diffusers `AutoencoderKLWan`): Wan 2.1 (16 latent channels, 4x8x8) and Wan 2.2
(48 channels, 4x16x16 with a 2x2 patchify and residual level shortcuts).

Videos are channels-last `[B, F, H, W, C]` in [-1, 1]; latents `[B, f, h, w, z_dim]` with `f = 1 + (F - 1) / 4`.

Like the reference, the video is processed causally in chunks: the first frame alone, then 4 frames at a time when
encoding (one latent frame at a time when decoding). Every causal convolution keeps the last two frames of its
input from the previous chunk (the reference's `feat_cache`) and sees them before the current chunk instead of
zero padding. Here the chunks after the first run inside one `jax.lax.scan` whose carry is the list of those
caches, so a chunk is compiled once and memory does not grow with the number of frames.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

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


def _blend(above: jax.Array, tile: jax.Array, extent: int, axis: int) -> jax.Array:
  """The reference's `blend_v`/`blend_h`: the first `extent` rows (columns) of `tile` fade in linearly from
  the last `extent` of the tile `above` (to its left)."""
  extent = min(above.shape[axis], tile.shape[axis], extent)
  if extent <= 0:
    return tile
  shape = [1] * tile.ndim
  shape[axis] = extent
  ramp = (jnp.arange(extent, dtype=_F32) / extent).reshape(shape)
  tail = jax.lax.slice_in_dim(above, above.shape[axis] - extent, above.shape[axis], axis=axis)
  head = jax.lax.slice_in_dim(tile, 0, extent, axis=axis)
  mixed = (tail.astype(_F32) * (1 - ramp) + head.astype(_F32) * ramp).astype(tile.dtype)
  rest = jax.lax.slice_in_dim(tile, extent, tile.shape[axis], axis=axis)
  return jnp.concatenate([mixed, rest], axis=axis)


def _check_tiles(size: int, stride: int, factor: int) -> None:
  if size % factor or stride % factor or not 0 < stride <= size:
    raise ValueError(
      f"tile_sample_size={size} and tile_sample_stride={stride} must be multiples of the spatial factor "
      f"{factor} with 0 < stride <= size"
    )


def _tiled(x: jax.Array, tile: int, stride: int, blend: int, keep: int, fn) -> jax.Array:
  """Runs `fn` on overlapping spatial tiles of `x [B, F, H, W, C]` (every `stride`, `tile` wide; edge tiles are
  smaller) and stitches the results `[B, F', H', W', C']` as the reference: each result tile is blended with the
  already blended tiles above and to its left over `blend` rows / columns, then cropped to `keep`. Tiles of one
  shape go through one `jax.lax.map`, so `fn` compiles once per tile shape (at most four)."""
  starts_h, starts_w = range(0, x.shape[2], stride), range(0, x.shape[3], stride)
  tiles = {(i, j): x[:, :, i : i + tile, j : j + tile] for i in starts_h for j in starts_w}
  by_shape: dict[tuple[int, ...], list[tuple[int, int]]] = {}
  for pos, t in tiles.items():
    by_shape.setdefault(t.shape, []).append(pos)
  results = {}
  for positions in by_shape.values():
    outs = jax.lax.map(fn, jnp.stack([tiles[pos] for pos in positions]))
    results.update({pos: outs[k] for k, pos in enumerate(positions)})
  rows = []
  for i in starts_h:
    kept = []
    for j in starts_w:
      t = results[(i, j)]
      if i > 0:
        t = _blend(results[(i - stride, j)], t, blend, axis=2)
      if j > 0:
        t = _blend(results[(i, j - stride)], t, blend, axis=3)
      results[(i, j)] = (
        t  # later tiles blend with this blended tile, as the reference's in-place update
      )
      kept.append(t[:, :, :keep, :keep])
    rows.append(jnp.concatenate(kept, axis=3))
  return jnp.concatenate(rows, axis=2)


class WanLatentDist(NamedTuple):
  """The encoder's diagonal Gaussian over latents (the reference's `DiagonalGaussianDistribution`)."""

  mean: jax.Array  # [B, f, h, w, z_dim]
  logvar: jax.Array  # [B, f, h, w, z_dim], clipped to [-30, 20] as the reference

  @property
  def std(self) -> jax.Array:
    return jnp.exp(0.5 * self.logvar)

  def mode(self) -> jax.Array:
    """The mean (what the Wan pipelines use for conditioning images and videos)."""
    return self.mean

  def sample(self, key: jax.Array) -> jax.Array:
    """`mean + std * N(0, 1)` with noise drawn from `key`."""
    noise = jax.random.normal(key, self.mean.shape, self.mean.dtype)
    return self.mean + self.std * noise


def _nearest_frame_counts(frames: int, step: int) -> str:
  if frames < 1:
    return "1"
  below = 1 + step * ((frames - 1) // step)
  return f"{below} or {below + step}"


class WanVAE(nnx.Module):
  """The Wan causal video autoencoder (diffusers `AutoencoderKLWan`) for Wan 2.1 and 2.2 configurations.

  `encode` and `decode` are traceable (wrap them in `jax.jit`/`nnx.jit`); each compiles the first chunk and one
  scanned chunk, whatever the number of frames.
  """

  def __init__(self, config: WanVAEConfig, *, rngs: nnx.Rngs | None = None):
    self.config = config
    z = config.z_dim
    self.encoder = WanEncoder3d(config, rngs=rngs)
    self.quant_conv = WanCausalConv3d(2 * z, 2 * z, (1, 1, 1), rngs=rngs)
    self.post_quant_conv = WanCausalConv3d(z, z, (1, 1, 1), rngs=rngs)
    self.decoder = WanDecoder3d(config, rngs=rngs)

  # --- checks ---------------------------------------------------------------------------------------------

  def check_video(self, video: jax.Array) -> None:
    """Raises ValueError unless `video` is `[B, F, H, W, C]` with F = 1 + 4k, H and W multiples of the spatial
    factor and C the configured channels (static shapes only)."""
    cfg = self.config
    if video.ndim != 5:
      raise ValueError(f"Wan VAE encodes videos [B, F, H, W, C]; got shape {video.shape}")
    _, f, h, w, c = video.shape
    step, s = cfg.temporal_factor, cfg.spatial_factor
    if f < 1 or (f - 1) % step:
      raise ValueError(
        f"Wan VAE needs num_frames = 1 + {step}k; got {f} frames; nearest valid counts: "
        f"{_nearest_frame_counts(f, step)}"
      )
    if h % s or w % s:
      fix = f"{max(h // s, 1) * s}x{max(w // s, 1) * s} or {-(-h // s) * s}x{-(-w // s) * s}"
      raise ValueError(
        f"Wan VAE height and width must be multiples of the spatial factor {s}; got {h}x{w} (try {fix})"
      )
    if c != cfg.video_channels:
      raise ValueError(
        f"Wan VAE encodes {cfg.video_channels}-channel videos (channels last); got {c} channels in shape "
        f"{video.shape}"
      )

  def check_latents(self, latents: jax.Array) -> None:
    """Raises ValueError unless `latents` is `[B, f, h, w, z_dim]`."""
    z = self.config.z_dim
    if latents.ndim != 5 or latents.shape[-1] != z:
      raise ValueError(
        f"Wan VAE decodes latents [B, f, h, w, {z}] (channels last); got shape {latents.shape}"
      )

  # --- one chunk ------------------------------------------------------------------------------------------

  def _encode_chunk(self, frames: jax.Array, caches: _Caches, patchified: bool) -> jax.Array:
    x = frames if patchified else _patchify(frames, self.config.patch)
    return self.quant_conv(self.encoder(x, caches))

  def _decode_chunk(
    self, latents: jax.Array, caches: _Caches, first: bool, finish: bool
  ) -> jax.Array:
    x = self.decoder(self.post_quant_conv(latents), caches, first)
    return self._finish(x) if finish else x

  def _finish(self, x: jax.Array) -> jax.Array:
    return jnp.clip(_unpatchify(x, self.config.patch), -1.0, 1.0)

  # --- whole videos ---------------------------------------------------------------------------------------

  def encode(
    self,
    video: jax.Array,
    *,
    tiled: bool = False,
    tile_sample_size: int = 256,
    tile_sample_stride: int = 192,
  ) -> WanLatentDist:
    """Encodes `video [B, F, H, W, 3]` in [-1, 1] (F = 1 + 4k) to the latent distribution over
    `[B, 1 + k, H / s, W / s, z_dim]` (s = 8 in 2.1, 16 in 2.2).

    Args:
      video: the frames, channels last.
      tiled: when the video is larger than one tile, encode overlapping spatial tiles (each through the whole
        chunked encode) and blend their latents linearly, as the reference's `enable_tiling()`. As there, with
        a patchify (2.2) the tiles are cut from the patchified frames with these sizes, so they cover
        `patch_size` times more pixels.
      tile_sample_size: tile size in pixels (the reference's `tile_sample_min_height/width`).
      tile_sample_stride: distance between tiles in pixels (`tile_sample_stride_height/width`).

    Raises:
      ValueError: wrong rank, frame count, height/width or channels (the message names valid values), or tile
        sizes that are not multiples of the spatial factor.
    """
    self.check_video(video)
    _, _, h, w, _ = video.shape
    if tiled:
      _check_tiles(tile_sample_size, tile_sample_stride, self.config.spatial_factor)
    if tiled and (h > tile_sample_size or w > tile_sample_size):
      p = self.config.patch
      down = self.config.spatial_factor // p  # the encoder's own downsampling
      tile, stride = tile_sample_size // down, tile_sample_stride // down  # in latents
      out = _tiled(
        _patchify(video, p),
        tile_sample_size,
        tile_sample_stride,
        tile - stride,
        stride,
        lambda x: self._encode_video(x, patchified=True),
      )
      out = out[:, :, : h // self.config.spatial_factor, : w // self.config.spatial_factor]
    else:
      out = self._encode_video(video, patchified=False)
    mean, logvar = jnp.split(out, 2, axis=-1)
    return WanLatentDist(mean, jnp.clip(logvar, -30.0, 20.0))

  def _encode_video(self, video: jax.Array, patchified: bool) -> jax.Array:
    """The chunked encode: frames `[B, F, H, W, C]` → moments `[B, 1 + (F - 1) / 4, h, w, 2 z]`."""
    step = self.config.temporal_factor
    caches = _Caches(None)
    out = self._encode_chunk(video[:, :1], caches, patchified)  # [B, 1, h, w, 2z]
    chunks = (video.shape[1] - 1) // step
    if chunks:

      def encode_chunk(previous, i):
        frames = jax.lax.dynamic_slice_in_dim(video, 1 + step * i, step, axis=1)
        now = _Caches(previous)
        moments = self._encode_chunk(frames, now, patchified)  # [B, 1, h, w, 2z]
        return now.new, moments

      _, rest = jax.lax.scan(encode_chunk, caches.new, jnp.arange(chunks))  # [n, B, 1, h, w, 2z]
      rest = jnp.moveaxis(rest[:, :, 0], 0, 1)  # [B, n, h, w, 2z]
      out = jnp.concatenate([out, rest], axis=1)
    return out

  def decode(
    self,
    latents: jax.Array,
    *,
    tiled: bool = False,
    tile_sample_size: int = 256,
    tile_sample_stride: int = 192,
  ) -> jax.Array:
    """Decodes `latents [B, f, h, w, z_dim]` to frames `[B, 1 + 4(f - 1), s h, s w, 3]` clipped to [-1, 1].

    The output buffer is written chunk by chunk inside the scan, so the only memory that grows with `f` is the
    output itself.

    Args:
      latents: VAE latents (`denormalize_latents` of the denoiser's).
      tiled: when the latents are larger than one tile, decode overlapping spatial tiles (each through the
        whole chunked video decode) and blend them linearly, as the reference's `enable_tiling()`.
      tile_sample_size: tile size in output pixels (the reference's `tile_sample_min_height/width`).
      tile_sample_stride: distance between tiles in output pixels (`tile_sample_stride_height/width`).

    Raises:
      ValueError: wrong rank or channels, or tile sizes that are not multiples of the spatial factor.
    """
    self.check_latents(latents)
    if tiled:
      s, p = self.config.spatial_factor, self.config.patch
      _check_tiles(tile_sample_size, tile_sample_stride, s)
      tile, stride = tile_sample_size // s, tile_sample_stride // s  # in latents
      if latents.shape[2] > tile or latents.shape[3] > tile:
        blend, keep = (tile_sample_size - tile_sample_stride) // p, tile_sample_stride // p
        out = _tiled(
          latents, tile, stride, blend, keep, lambda z: self._decode_video(z, finish=False)
        )
        h, w = latents.shape[2] * s // p, latents.shape[3] * s // p
        return self._finish(out[:, :, :h, :w])
    return self._decode_video(latents, finish=True)

  def _decode_video(self, latents: jax.Array, finish: bool) -> jax.Array:
    """The chunked decode: `[B, f, h, w, z]` → frames (unpatchified and clipped when `finish`)."""
    step = self.config.temporal_factor
    caches = _Caches(None)
    first = self._decode_chunk(latents[:, :1], caches, True, finish)  # [B, 1, H, W, C]
    num = latents.shape[1]
    if num == 1:
      return first
    b, _, h, w, c = first.shape
    out = jnp.zeros((b, 1 + step * (num - 1), h, w, c), first.dtype)
    out = jax.lax.dynamic_update_slice_in_dim(out, first, 0, axis=1)

    def decode_chunk(carry, i):
      previous, out = carry
      now = _Caches(previous)
      z = jax.lax.dynamic_slice_in_dim(latents, i, 1, axis=1)
      frames = self._decode_chunk(z, now, False, finish)  # [B, 4, H, W, C]
      out = jax.lax.dynamic_update_slice_in_dim(out, frames, 1 + step * (i - 1), axis=1)
      return (now.new, out), None

    (_, out), _ = jax.lax.scan(decode_chunk, (caches.new, out), jnp.arange(1, num))
    return out

  # --- latent statistics ----------------------------------------------------------------------------------

  def _stats(self, like: jax.Array) -> tuple[jax.Array, jax.Array]:
    shape = (1,) * (like.ndim - 1) + (self.config.z_dim,)
    mean = jnp.asarray(self.config.latents_mean, _F32).reshape(shape)
    inv_std = (1.0 / jnp.asarray(self.config.latents_std, _F32)).reshape(shape)
    return mean, inv_std

  def normalize_latents(self, latents: jax.Array) -> jax.Array:
    """`(latents - mean) * (1 / std)` per channel: VAE latents → the denoiser's space (as the pipelines do)."""
    mean, inv_std = self._stats(latents)
    return ((latents.astype(_F32) - mean) * inv_std).astype(latents.dtype)

  def denormalize_latents(self, latents: jax.Array) -> jax.Array:
    """`latents / (1 / std) + mean` per channel: the denoiser's latents → what `decode` takes."""
    mean, inv_std = self._stats(latents)
    return (latents.astype(_F32) / inv_std + mean).astype(latents.dtype)


def video_to_uint8(video: jax.Array) -> jax.Array:
  """Decoded frames in [-1, 1] → uint8 `[B, F, H, W, 3]` on device (`round(255 * clip(x / 2 + 0.5, 0, 1))`, as
  diffusers' video post-processing)."""
  if video.ndim != 5 or video.shape[-1] != 3:
    raise ValueError(f"expected decoded frames [B, F, H, W, 3]; got shape {video.shape}")
  x = jnp.clip(video.astype(_F32) * 0.5 + 0.5, 0.0, 1.0)
  return jnp.round(x * 255.0).astype(jnp.uint8)
