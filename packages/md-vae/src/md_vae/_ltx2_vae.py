"""The LTX-2 video VAE (diffusers' `AutoencoderKLLTX2Video`), channels-last `[B, F, H, W, C]`.

The same blocks as the LTX-Video 0.9.5+ VAE (md_vae._ltx_vae, reused here): a causal encoder of 4x4 pixel
patches and four space-to-depth stages (spatial, temporal, spatiotemporal, spatiotemporal: 32x space, 8x time,
128 latent channels), and a decoder of three depth-to-space residual upsamplers. What LTX-2 changes is
parametrised there: the encoder's first conv goes to the latent width, the decoder pads by reflection in space
(the encoder with zeros), upsamplers may be spatial or temporal only, and whether the convs are causal can be
forced at call time. The released decoder is not timestep-conditioned and injects no noise; configs that do are
supported as for LTX-Video 0.9.1.

Tiled encode / decode (`LTX2Tiling`) cut the video into overlapping temporal chunks and spatial tiles, run each
through the encoder or decoder (tiles of one shape share one compiled program via `lax.map`, one tile live at a
time) and blend the seams linearly, exactly as the reference's `enable_tiling` + framewise paths do.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

import md_core
from md_vae._kl import _blend
from md_vae._ltx_vae import (
  _DOWNSAMPLE_STRIDES,
  _IGNORED_KEYS,
  _PADDING_MODES,
  Decoder,
  Encoder,
  LTXLatentDist,
  LTXVideoVAE,
  LTXVideoVAEConfig,
  causal_override,
)

_F32 = jnp.float32
_DOWN_TYPE = "LTX2VideoDownBlock3D"
# Per-block options and how many entries the reference reads: (name, extra, "down" / "up"), i.e. the number
# of down (up) blocks + extra.
_READ = (
  ("layers_per_block", 0, "down"), ("down_block_types", 0, "down"),
  ("spatio_temporal_scaling", 0, "down"), ("downsample_type", 0, "down"),
  ("decoder_layers_per_block", 1, "up"), ("decoder_spatio_temporal_scaling", 0, "up"),
  ("decoder_inject_noise", 1, "up"), ("upsample_type", 0, "up"), ("upsample_residual", 0, "up"),
  ("upsample_factor", 0, "up"),
)  # fmt: skip


def _per_block(value, n: int) -> tuple:
  """diffusers lets some per-block options be one bool for all `n` blocks."""
  return (value,) * n if isinstance(value, bool) else tuple(value)


@dataclasses.dataclass(frozen=True)
class LTX2VideoVAEConfig:
  """diffusers' `AutoencoderKLLTX2Video` config keys and defaults (`LTX2_VAE_VARIANTS` has the released one).

  `block_out_channels` are the encoder's down-block widths (its first conv maps the patches to
  `latent_channels`); the decoder's run the other way. Per-block bools may be given as one bool.
  """

  in_channels: int = 3
  out_channels: int = 3
  latent_channels: int = 128
  block_out_channels: tuple[int, ...] = (256, 512, 1024, 2048)
  down_block_types: tuple[str, ...] = (_DOWN_TYPE,) * 4
  decoder_block_out_channels: tuple[int, ...] = (256, 512, 1024)
  layers_per_block: tuple[int, ...] = (4, 6, 6, 2, 2)
  decoder_layers_per_block: tuple[int, ...] = (5, 5, 5, 5)
  spatio_temporal_scaling: bool | tuple[bool, ...] = (True, True, True, True)
  decoder_spatio_temporal_scaling: bool | tuple[bool, ...] = (True, True, True)
  decoder_inject_noise: bool | tuple[bool, ...] = (False, False, False, False)
  downsample_type: tuple[str, ...] = ("spatial", "temporal", "spatiotemporal", "spatiotemporal")
  upsample_type: tuple[str, ...] = ("spatiotemporal",) * 3
  upsample_residual: bool | tuple[bool, ...] = (True, True, True)
  upsample_factor: tuple[int, ...] = (2, 2, 2)
  timestep_conditioning: bool = False
  patch_size: int = 4
  patch_size_t: int = 1
  resnet_norm_eps: float = 1e-6
  scaling_factor: float = 1.0
  encoder_causal: bool = True
  decoder_causal: bool = True
  encoder_spatial_padding_mode: str = "zeros"
  decoder_spatial_padding_mode: str = "reflect"
  spatial_compression_ratio: int | None = None
  temporal_compression_ratio: int | None = None

  def __post_init__(self):
    set_ = lambda k, v: object.__setattr__(self, k, v)  # noqa: E731
    for f in dataclasses.fields(self):
      if isinstance(getattr(self, f.name), list):
        set_(f.name, tuple(getattr(self, f.name)))
    # As diffusers: one bool stands for len(layers_per_block) - 1 entries (the compression ratios count
    # them all), the blocks are counted by the widths, and only the entries they read must be there.
    n_enc, n_dec = len(self.layers_per_block), len(self.decoder_layers_per_block)
    set_("spatio_temporal_scaling", _per_block(self.spatio_temporal_scaling, n_enc - 1))
    set_(
      "decoder_spatio_temporal_scaling", _per_block(self.decoder_spatio_temporal_scaling, n_dec - 1)
    )
    set_("decoder_inject_noise", _per_block(self.decoder_inject_noise, n_dec))
    set_("upsample_residual", _per_block(self.upsample_residual, n_dec - 1))
    n_down, n_up = len(self.block_out_channels), len(self.decoder_block_out_channels)
    if n_down < 1 or n_up < 1:
      raise ValueError(
        f"block_out_channels={self.block_out_channels} and decoder_block_out_channels="
        f"{self.decoder_block_out_channels} need one entry per down / up block (at least one each)"
      )
    short = []
    for name, extra, side in _READ:
      need, value = (n_down if side == "down" else n_up) + extra, getattr(self, name)
      if len(value) < need:
        short.append(f"{name}={value} has {len(value)}, needs {need}")
    if short:
      raise ValueError(
        f"LTX-2 video VAE config: {n_down} down blocks (block_out_channels={self.block_out_channels}) "
        f"and {n_up} up blocks (decoder_block_out_channels={self.decoder_block_out_channels}) need "
        f"more entries in: {', '.join(short)}"
      )
    bad = [t for t in self.down_block_types[:n_down] if t != _DOWN_TYPE]
    if bad:
      raise ValueError(f"down_block_types {bad} are not supported; expected {_DOWN_TYPE!r}")
    for name, extra, n in (("downsample_type", ("conv",), n_down), ("upsample_type", (), n_up)):
      kinds = (*extra, *_DOWNSAMPLE_STRIDES)
      bad = [t for t in getattr(self, name)[:n] if t not in kinds]
      if bad:
        raise ValueError(f"{name} {bad} not supported; expected one of {kinds}")
    for name in ("encoder_spatial_padding_mode", "decoder_spatial_padding_mode"):
      if getattr(self, name) not in _PADDING_MODES:
        raise ValueError(
          f"{name}={getattr(self, name)!r} not supported; expected one of {_PADDING_MODES}"
        )

  @property
  def spatial_ratio(self) -> int:
    if self.spatial_compression_ratio is not None:
      return self.spatial_compression_ratio
    return self.patch_size * 2 ** sum(self.spatio_temporal_scaling)

  @property
  def temporal_ratio(self) -> int:
    if self.temporal_compression_ratio is not None:
      return self.temporal_compression_ratio
    return self.patch_size_t * 2 ** sum(self.spatio_temporal_scaling)

  def to_ltx(self) -> LTXVideoVAEConfig:
    """The same network as an LTX-Video config (0.9.5-style blocks), which md's shared blocks are built from.

    Only the entries the reference reads are passed: down block i takes entry i of the encoder's options and
    the encoder's mid block the last `layers_per_block`; the decoder reverses its options, so its mid block
    and up blocks take the last entries (all but `upsample_type`, which it reads from the front).
    """
    n, m = len(self.block_out_channels), len(self.decoder_block_out_channels)
    return LTXVideoVAEConfig(
      in_channels=self.in_channels,
      out_channels=self.out_channels,
      latent_channels=self.latent_channels,
      block_out_channels=(self.latent_channels, *self.block_out_channels),
      down_block_types=("LTXVideo095DownBlock3D",) * n,
      decoder_block_out_channels=self.decoder_block_out_channels,
      layers_per_block=(*self.layers_per_block[:n], self.layers_per_block[-1]),
      decoder_layers_per_block=self.decoder_layers_per_block[-(m + 1) :],
      spatio_temporal_scaling=self.spatio_temporal_scaling[:n],
      decoder_spatio_temporal_scaling=self.decoder_spatio_temporal_scaling[-m:],
      decoder_inject_noise=self.decoder_inject_noise[-(m + 1) :],
      downsample_type=self.downsample_type[:n],
      upsample_residual=self.upsample_residual[-m:],
      upsample_factor=self.upsample_factor[-m:],
      timestep_conditioning=self.timestep_conditioning,
      patch_size=self.patch_size,
      patch_size_t=self.patch_size_t,
      resnet_norm_eps=self.resnet_norm_eps,
      scaling_factor=self.scaling_factor,
      encoder_causal=self.encoder_causal,
      decoder_causal=self.decoder_causal,
      spatial_compression_ratio=self.spatial_ratio,
      temporal_compression_ratio=self.temporal_ratio,
      upsample_type=self.upsample_type[:m],
      encoder_spatial_padding_mode=self.encoder_spatial_padding_mode,
      decoder_spatial_padding_mode=self.decoder_spatial_padding_mode,
    )

  @classmethod
  def from_dict(cls, d: Mapping[str, Any], **overrides) -> LTX2VideoVAEConfig:
    """Reads `vae/config.json` of an LTX-2 checkpoint.

    Raises:
      ValueError: another class, or keys md does not implement (named, with the supported ones).
    """
    d = dict(d)
    name = d.get("_class_name")
    if name not in (None, "AutoencoderKLLTX2Video"):
      raise ValueError(
        f"config is for {name!r}; LTX2VideoVAEConfig reads AutoencoderKLLTX2Video"
        + (
          " (LTX-Video's VAE: md_vae.LTXVideoVAEConfig)" if name == "AutoencoderKLLTXVideo" else ""
        )
      )
    fields = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(k for k in d if k not in fields and k not in _IGNORED_KEYS)
    if unknown:
      raise ValueError(
        f"LTX-2 video VAE config keys {unknown} are not supported; supported keys: {sorted(fields)}"
      )
    kwargs = {k: tuple(v) if isinstance(v, list) else v for k, v in d.items() if k in fields}
    kwargs.update(overrides)
    return cls(**kwargs)

  @classmethod
  def from_json(cls, path: str | os.PathLike, **overrides) -> LTX2VideoVAEConfig:
    path = pathlib.Path(path)
    if path.is_dir():
      path = path / "config.json"
    return cls.from_dict(md_core.read_json(path), **overrides)


# The released VAE (`Lightricks/LTX-2` `vae/`), as diffusers' scripts/convert_ltx2_to_diffusers.py
# (get_ltx2_video_vae_config "2.0") writes it; tools/configs/ltx/ltx2_vae.json.
LTX2_VAE_VARIANTS: dict[str, LTX2VideoVAEConfig] = {
  "2.0": LTX2VideoVAEConfig(
    decoder_causal=False, spatial_compression_ratio=32, temporal_compression_ratio=8
  ),
}


@dataclasses.dataclass(frozen=True)
class LTX2Tiling:
  """Tiled encode / decode, as diffusers' `enable_tiling(...)` (spatial) and framewise decoding (temporal).

  Sizes are in pixels and frames of the video; the reference's defaults. A video (or its latents) larger than
  one tile in height or width is cut into `tile_sample_min_*` tiles every `tile_sample_stride_*`; one longer
  than `tile_sample_min_num_frames` into chunks of that many (+1) frames every `tile_sample_stride_num_frames`.
  The overlaps are blended linearly. Sizes must be multiples of the VAE's compression ratios.
  """

  tile_sample_min_height: int = 512
  tile_sample_min_width: int = 512
  tile_sample_min_num_frames: int = 16
  tile_sample_stride_height: int = 448
  tile_sample_stride_width: int = 448
  tile_sample_stride_num_frames: int = 8
  spatial: bool = True  # diffusers' use_tiling
  temporal: bool = True  # diffusers' use_framewise_decoding (its encode reads the same flag)

  def check(self, spatial_ratio: int, temporal_ratio: int) -> None:
    problems = []
    for name, ratio in (
      ("tile_sample_min_height", spatial_ratio), ("tile_sample_min_width", spatial_ratio),
      ("tile_sample_stride_height", spatial_ratio), ("tile_sample_stride_width", spatial_ratio),
      ("tile_sample_min_num_frames", temporal_ratio), ("tile_sample_stride_num_frames", temporal_ratio),
    ):  # fmt: skip
      v = getattr(self, name)
      if v <= 0 or v % ratio:
        problems.append(f"{name}={v} is not a positive multiple of {ratio}")
    for what in ("height", "width", "num_frames"):
      lo, hi = getattr(self, f"tile_sample_stride_{what}"), getattr(self, f"tile_sample_min_{what}")
      if lo > hi:
        problems.append(f"tile_sample_stride_{what}={lo} exceeds tile_sample_min_{what}={hi}")
    if problems:
      raise ValueError("LTX2Tiling: " + "; ".join(problems))


def _map_tiles(fn: Callable, tiles: dict, key: jax.Array | None) -> dict:
  """`fn(tile, key)` for every tile; tiles of one shape go through one `lax.map` (one compile, one live)."""
  by_shape: dict[tuple, list] = {}
  for pos, tile in tiles.items():
    by_shape.setdefault(tile.shape, []).append(pos)
  order = {pos: n for n, pos in enumerate(tiles)}
  done = {}
  for positions in by_shape.values():
    stacked = jnp.stack([tiles[p] for p in positions])
    if key is None:
      outs = jax.lax.map(lambda t: fn(t, None), stacked)
    else:
      keys = jnp.stack([jax.random.fold_in(key, order[p]) for p in positions])
      outs = jax.lax.map(lambda a: fn(*a), (stacked, keys))
    done.update({p: outs[n] for n, p in enumerate(positions)})
  return done


def _stitch(
  rows: list[list[jax.Array]], blend: tuple[int, int], keep: tuple[int, int]
) -> jax.Array:
  """Blends each tile `[B, F, h, w, C]` with the (already blended) one above and the one to its left, keeps
  its first `keep` rows / columns and concatenates (diffusers' tiled_encode / tiled_decode)."""
  out_rows = []
  for i, row in enumerate(rows):
    kept = []
    for j, tile in enumerate(row):
      if i > 0:
        tile = _blend(rows[i - 1][j], tile, blend[0], axis=2)
      if j > 0:
        tile = _blend(row[j - 1], tile, blend[1], axis=3)
      row[j] = tile  # the reference blends in place: later tiles see this blended tile
      kept.append(tile[:, :, : keep[0], : keep[1]])
    out_rows.append(jnp.concatenate(kept, axis=3))
  return jnp.concatenate(out_rows, axis=2)


def _tiled(
  x: jax.Array,
  fn: Callable,
  key: jax.Array | None,
  *,
  temporal: tuple[int, int, int, int] | None,
  spatial: tuple[int, ...] | None,
  drop_edge_frame: str,
  out_size: tuple[int, int, int],
) -> jax.Array:
  """The reference's framewise + spatially tiled paths over `x [B, F, H, W, C]` (sample or latent grid).

  temporal: (chunk frames beyond the first, chunk stride, blend frames, kept frames) or None.
  spatial: (tile h, tile w, stride h, stride w, blend h, blend w, kept h, kept w), tiles and strides in
    `x`'s grid, blends and kept sizes in the output's; tiles are cut when `x` is larger than one tile.
  drop_edge_frame: "first" (encode) or "last" (decode): the frame later chunks drop before blending.
  out_size: (frames, height, width) of the result.
  """
  f, h, w = x.shape[1:4]
  if temporal is not None and f > temporal[0]:
    chunks = [x[:, i : i + temporal[0] + 1] for i in range(0, f, temporal[1])]
  else:
    chunks, temporal = [x], None
  # A later one-frame chunk comes out empty after its edge frame is dropped: nothing to run.
  chunks = [c for n, c in enumerate(chunks) if n == 0 or c.shape[1] > 1]
  tiles, grids = {}, []
  for n, chunk in enumerate(chunks):
    if spatial is not None and (chunk.shape[2] > spatial[0] or chunk.shape[3] > spatial[1]):
      grid = (range(0, h, spatial[2]), range(0, w, spatial[3]))
      for i in grid[0]:
        for j in grid[1]:
          tiles[(n, i, j)] = chunk[:, :, i : i + spatial[0], j : j + spatial[1]]
    else:
      grid = None
      tiles[(n, 0, 0)] = chunk
    grids.append(grid)
  done = _map_tiles(fn, tiles, key)
  outs = []
  for n, grid in enumerate(grids):
    if grid is None:
      out = done[(n, 0, 0)]
    else:
      rows = [[done[(n, i, j)] for j in grid[1]] for i in grid[0]]
      out = _stitch(rows, spatial[4:6], spatial[6:8])
      out = out[:, :, : out_size[1], : out_size[2]]
    outs.append(out)
  if temporal is None:
    return outs[0][:, : out_size[0]]
  kept = []
  for n, out in enumerate(outs):
    if n > 0:
      out = out[:, 1:] if drop_edge_frame == "first" else out[:, :-1]
      out = _blend(outs[n - 1], out, temporal[2], axis=1)
      outs[n] = out
      kept.append(out[:, : temporal[3]])
    else:
      kept.append(out[:, : temporal[3] + 1])
  return jnp.concatenate(kept, axis=1)[:, : out_size[0]]


class LTX2VideoVAE(LTXVideoVAE):
  """`AutoencoderKLLTX2Video`: `encode(video) -> LTXLatentDist`, `decode(latents) -> video`.

  Video is `[B, F, H, W, 3]` in [-1, 1] with `F = 1 + 8k` and H, W multiples of 32; latents are
  `[B, 1 + k, H/32, W/32, 128]`. Parameter names are diffusers' (`encoder.down_blocks.0.resnets.0.conv1.conv`…);
  `normalize_latents` / `denormalize_latents` apply the file's per-channel statistics as the pipelines do.
  """

  _NAME = "LTX-2 video VAE"

  def __init__(self, config: LTX2VideoVAEConfig, *, rngs: nnx.Rngs | None = None):
    self.config = config
    inner = config.to_ltx()
    self.encoder = Encoder(inner, rngs=rngs)
    self.decoder = Decoder(inner, rngs=rngs)
    c = config.latent_channels
    # Buffers in the file (DESIGN.md §6): per-channel latent statistics.
    self.latents_mean = nnx.Param(jnp.zeros((c,), _F32), logical_axes=("norm",))
    self.latents_std = nnx.Param(jnp.ones((c,), _F32), logical_axes=("norm",))

  def _checked_tiling(self, tiling: LTX2Tiling | bool | None) -> LTX2Tiling | None:
    if tiling is None or tiling is False:
      return None
    tiling = LTX2Tiling() if tiling is True else tiling
    tiling.check(self.config.spatial_ratio, self.config.temporal_ratio)
    return tiling

  def encode(
    self,
    video: jax.Array,
    *,
    causal: bool | None = None,
    tiling: LTX2Tiling | bool | None = None,
  ) -> LTXLatentDist:
    """`[B, F, H, W, 3]` (F = 1 + 8k, H and W multiples of 32) → the latent posterior.

    Args:
      causal: True forces causal convs; None or False keeps the config's `encoder_causal` (the reference's
        `causal or is_causal`).
      tiling: `LTX2Tiling` (True: its defaults) to encode overlapping tiles / frame chunks and blend them.
    """
    self.check_video(video)
    cfg, tiling = self.config, self._checked_tiling(tiling)
    s, r = cfg.spatial_ratio, cfg.temporal_ratio
    with causal_override(bool(causal) or cfg.encoder_causal):
      if tiling is None:
        moments = self.encoder(video)
      else:
        tl = tiling
        f, h, w = video.shape[1:4]
        temporal = spatial = None
        if tl.temporal:
          lat_min, lat_stride = (
            tl.tile_sample_min_num_frames // r,
            tl.tile_sample_stride_num_frames // r,
          )
          temporal = (tl.tile_sample_min_num_frames, tl.tile_sample_stride_num_frames,
                      lat_min - lat_stride, lat_stride)  # fmt: skip
        if tl.spatial:
          spatial = (
            tl.tile_sample_min_height, tl.tile_sample_min_width, tl.tile_sample_stride_height,
            tl.tile_sample_stride_width,
            tl.tile_sample_min_height // s - tl.tile_sample_stride_height // s,
            tl.tile_sample_min_width // s - tl.tile_sample_stride_width // s,
            tl.tile_sample_stride_height // s, tl.tile_sample_stride_width // s,
          )  # fmt: skip
        moments = _tiled(
          video, lambda t, _: self.encoder(t), None, temporal=temporal, spatial=spatial,
          drop_edge_frame="first", out_size=((f - 1) // r + 1, h // s, w // s),
        )  # fmt: skip
    c = cfg.latent_channels
    logvar = jnp.broadcast_to(moments[..., c:], moments[..., :c].shape)
    return LTXLatentDist(moments[..., :c], jnp.clip(logvar, -30.0, 20.0))

  def decode(
    self,
    latents: jax.Array,
    timestep: jax.Array | float | None = None,
    *,
    key: jax.Array | None = None,
    causal: bool | None = None,
    tiling: LTX2Tiling | bool | None = None,
  ) -> jax.Array:
    """`[B, F, H, W, 128]` latents → `[B, 1 + 8 (F - 1), 32 H, 32 W, 3]` video.

    Args:
      latents: unnormalised latents (see `denormalize_latents`).
      timestep: `[B]` or a number, required exactly when the decoder is timestep-conditioned (the released
        LTX-2 VAE is not).
      key: random key for a noise-injecting decoder (required then; the released one injects none).
      causal: True forces causal convs; None or False keeps the config's `decoder_causal`.
      tiling: `LTX2Tiling` (True: its defaults) to decode overlapping tiles / frame chunks and blend them,
        bounding memory by the tile size.
    """
    t, key = self._decoder_inputs(latents, timestep, key)
    cfg, tiling = self.config, self._checked_tiling(tiling)
    s, r = cfg.spatial_ratio, cfg.temporal_ratio
    with causal_override(bool(causal) or cfg.decoder_causal):
      if tiling is None:
        return self.decoder(latents, t, key)
      tl = tiling
      f, h, w = latents.shape[1:4]
      temporal = spatial = None
      if tl.temporal:
        temporal = (
          tl.tile_sample_min_num_frames // r, tl.tile_sample_stride_num_frames // r,
          tl.tile_sample_min_num_frames - tl.tile_sample_stride_num_frames,
          tl.tile_sample_stride_num_frames,
        )  # fmt: skip
      if tl.spatial:
        spatial = (
          tl.tile_sample_min_height // s, tl.tile_sample_min_width // s,
          tl.tile_sample_stride_height // s, tl.tile_sample_stride_width // s,
          tl.tile_sample_min_height - tl.tile_sample_stride_height,
          tl.tile_sample_min_width - tl.tile_sample_stride_width,
          tl.tile_sample_stride_height, tl.tile_sample_stride_width,
        )  # fmt: skip
      return _tiled(
        latents, lambda z, k: self.decoder(z, t, k), key, temporal=temporal, spatial=spatial,
        drop_edge_frame="last", out_size=((f - 1) * r + 1, h * s, w * s),
      )  # fmt: skip
