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

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from md_vae._wan_blocks import (
  WanCausalConv3d,
  WanDecoder3d,
  WanEncoder3d,
  WanResample,
  _Caches,
  _patchify,
  _unpatchify,
)
from md_vae._wan_config import WanVAEConfig

_F32 = jnp.float32


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


def inflate_wan_vae(vae: WanVAE) -> None:
  """Makes a Wan VAE trained on still images (one-frame clips) a clip VAE that starts as that still VAE,
  frame by frame, in place.

  A one-frame clip runs only the last temporal tap of each causal `(3, k, k)` convolution (the taps before
  it see the zero padding) and none of the temporal resamplers, so those weights are still at their random
  init. Here every causal convolution keeps only its last tap (the others are zeroed: each frame then goes
  through the still VAE's spatial filters), each temporal upsampler copies its frame into both of its output
  frames, and each temporal downsampler keeps the later frame of each pair. A clip's latent frame then holds
  the last frame of its chunk, and the decoder repeats it; training on clips
  (md_train's `wan_vae_recipe` with `train_frames > 1`) learns the motion from there.

  Raises:
    ValueError: a Wan 2.2 VAE (`is_residual`), whose level shortcuts average frames, so no setting of the
      weights makes it the still VAE frame by frame.
  """
  if vae.config.is_residual:
    raise ValueError(
      "inflate_wan_vae: a Wan 2.2 VAE (is_residual=True) averages frames in its level shortcuts; only the "
      "Wan 2.1 layout can be inflated"
    )
  resamplers = [n for _, n in nnx.iter_graph(vae) if isinstance(n, WanResample)]
  time_convs = {id(r.time_conv) for r in resamplers if r.time_conv is not None}
  for _, node in nnx.iter_graph(vae):
    if isinstance(node, WanCausalConv3d) and id(node) not in time_convs:
      if node.kernel_size[0] > 1:
        node.kernel[...] = node.kernel[...].at[:-1].set(0.0)
  for r in resamplers:
    if r.time_conv is None:
      continue
    k = r.time_conv.kernel[...]  # [3, 1, 1, C, C or 2C]
    c = k.shape[3]
    eye = jnp.eye(c, dtype=k.dtype)
    tap = jnp.concatenate([eye, eye], axis=1) if k.shape[4] == 2 * c else eye
    r.time_conv.kernel[...] = jnp.zeros_like(k).at[-1, 0, 0].set(tap)
    r.time_conv.bias[...] = jnp.zeros_like(r.time_conv.bias[...])
