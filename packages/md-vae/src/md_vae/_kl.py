"""AutoencoderKL: the image VAE of SD 1.x/2.x, SDXL and Flux (diffusers `AutoencoderKL`), channels-last.

Images are `[B, H, W, C]` in [-1, 1]; latents `[B, H/f, W/f, latent_channels]` with `f = 2**(blocks - 1)` (8 for
every released model). `encode` gives a diagonal Gaussian (`mean`, `logvar`), `decode` the image. Tiled encode /
decode reproduce diffusers' tiles, overlaps and linear blending, for images larger than `sample_size`.
`md_vae.nchw_to_nhwc` / `nhwc_to_nchw` convert the reference layout.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

import md_core
import md_sharding as mds
from md_core import nn

_F32 = jnp.float32
# Bookkeeping keys of diffusers configs.
_IGNORED_KEYS = frozenset(
  {"_class_name", "_diffusers_version", "_name_or_path", "_use_default_values"}
)


@dataclasses.dataclass(frozen=True)
class AutoencoderKLConfig:
  """An `AutoencoderKL` (diffusers `vae/config.json`).

  Defaults are diffusers' (a config.json that omits a key means the same here); `KL_VARIANTS` holds the real
  models.

  Attributes:
    in_channels: image channels in.
    out_channels: image channels out.
    block_out_channels: channels of each resolution level (encoder order); each level but the last halves
      the resolution.
    layers_per_block: resnets per encoder level (the decoder has one more).
    latent_channels: 4 (SD, SDXL) or 16 (Flux).
    norm_num_groups: GroupNorm groups everywhere.
    sample_size: image size the tiled paths cut tiles of.
    scaling_factor: latents are `(z - shift_factor) * scaling_factor` for the denoiser.
    shift_factor: see `scaling_factor` (Flux: 0.1159; None: 0).
    latents_mean: per-channel latent mean some pipelines normalise with (kept, not used here).
    latents_std: per-channel latent std (kept, not used here).
    force_upcast: run the VAE in float32 whatever the weights' dtype (the reference's pipelines upcast).
    use_quant_conv: a 1x1 conv on the encoder's moments (False for Flux).
    use_post_quant_conv: a 1x1 conv on latents before decoding (False for Flux).
    mid_block_add_attention: self-attention in the mid blocks.
    act_fn: activation (silu in every released model).
    down_block_types: only `DownEncoderBlock2D` levels.
    up_block_types: only `UpDecoderBlock2D` levels.
    attention_query_chunk: md only: the mid-block attention handles at most this many query positions at a
      time (whole latent rows), bounding its memory; the result does not depend on it.
  """

  in_channels: int = 3
  out_channels: int = 3
  block_out_channels: tuple[int, ...] = (64,)
  layers_per_block: int = 1
  latent_channels: int = 4
  norm_num_groups: int = 32
  sample_size: int = 32
  scaling_factor: float = 0.18215
  shift_factor: float | None = None
  latents_mean: tuple[float, ...] | None = None
  latents_std: tuple[float, ...] | None = None
  force_upcast: bool = True
  use_quant_conv: bool = True
  use_post_quant_conv: bool = True
  mid_block_add_attention: bool = True
  act_fn: str = "silu"
  down_block_types: tuple[str, ...] | None = None
  up_block_types: tuple[str, ...] | None = None
  attention_query_chunk: int = 4096

  def __post_init__(self):
    n = len(self.block_out_channels)
    for name, kind in (
      ("down_block_types", "DownEncoderBlock2D"),
      ("up_block_types", "UpDecoderBlock2D"),
    ):
      types = getattr(self, name)
      if types is None:
        object.__setattr__(self, name, (kind,) * n)
      elif any(t != kind for t in types) or len(types) != n:
        raise ValueError(
          f"{name}={list(types)}: md's AutoencoderKL has {n} {kind} levels (one per block_out_channels)"
        )
    for c in self.block_out_channels:
      if c % self.norm_num_groups:
        raise ValueError(
          f"norm_num_groups={self.norm_num_groups} must divide block_out_channels {c}"
        )
    nn.activation(self.act_fn)

  @property
  def downscale(self) -> int:
    """Pixels per latent along each side (8 for every released model)."""
    return 2 ** (len(self.block_out_channels) - 1)

  @classmethod
  def from_dict(cls, d: Mapping[str, Any], *, where: str = "config") -> AutoencoderKLConfig:
    """From a diffusers `config.json` dict; keys md does not implement are an error."""
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(k for k in d if k not in names and k not in _IGNORED_KEYS)
    if unknown:
      raise ValueError(
        f"{where}: config keys {unknown} are not supported by md's AutoencoderKL (supported: {sorted(names)})"
      )
    kw = {k: d[k] for k in names if k in d}
    if d.get("_class_name", "AutoencoderKL") != "AutoencoderKL":
      raise ValueError(f"{where}: _class_name={d['_class_name']!r}, expected 'AutoencoderKL'")
    for key in (
      "block_out_channels",
      "down_block_types",
      "up_block_types",
      "latents_mean",
      "latents_std",
    ):
      if kw.get(key) is not None:
        kw[key] = tuple(kw[key])
    if isinstance(kw.get("sample_size"), list | tuple):
      kw["sample_size"] = int(kw["sample_size"][0])
    md_core.check_config_types(cls, kw, where)
    return cls(**kw)

  @classmethod
  def from_json(cls, path: str | os.PathLike) -> AutoencoderKLConfig:
    """From a `config.json` file."""
    return cls.from_dict(md_core.read_json(path), where=os.fspath(path))


# Every released KL VAE: four levels of 128-512 channels, two resnets per encoder level.
_SD_LAYOUT = dict(block_out_channels=(128, 256, 512, 512), layers_per_block=2)

KL_VARIANTS: dict[str, AutoencoderKLConfig] = {
  # runwayml/stable-diffusion-v1-5 vae (also SD 1.4 and most SD 1.x fine-tunes).
  "sd": AutoencoderKLConfig(**_SD_LAYOUT, sample_size=512),
  # stabilityai/stable-diffusion-2-1 vae.
  "sd2": AutoencoderKLConfig(**_SD_LAYOUT, sample_size=768),
  # stabilityai/stable-diffusion-xl-base-1.0 vae.
  "sdxl": AutoencoderKLConfig(**_SD_LAYOUT, sample_size=1024, scaling_factor=0.13025),
  # black-forest-labs/FLUX.1-dev vae.
  "flux": AutoencoderKLConfig(
    **_SD_LAYOUT,
    latent_channels=16,
    sample_size=1024,
    scaling_factor=0.3611,
    shift_factor=0.1159,
    use_quant_conv=False,
    use_post_quant_conv=False,
  ),
  "tiny": AutoencoderKLConfig(
    block_out_channels=(8, 16),
    layers_per_block=1,
    norm_num_groups=4,
    sample_size=32,
  ),
}


class DiagonalGaussian(NamedTuple):
  """The encoder's posterior: independent Gaussians per latent element.

  Attributes:
    mean: `[B, h, w, C]`.
    logvar: `[B, h, w, C]`, clamped to [-30, 20] as the reference.
  """

  mean: jax.Array
  logvar: jax.Array

  @property
  def std(self) -> jax.Array:
    return jnp.exp(0.5 * self.logvar)

  def sample(self, key: jax.Array) -> jax.Array:
    """`mean + std * eps`, eps ~ N(0, 1) from `key`."""
    eps = jax.random.normal(key, self.mean.shape, self.mean.dtype)
    return self.mean + self.std * eps

  def mode(self) -> jax.Array:
    """The mean."""
    return self.mean

  def kl(self) -> jax.Array:
    """KL divergence to N(0, 1), summed per example: `[B]`."""
    terms = jnp.square(self.mean) + jnp.exp(self.logvar) - 1.0 - self.logvar
    return 0.5 * jnp.sum(terms, axis=(1, 2, 3))


def _conv(cin, cout, k, rngs, **kw):
  return nn.Conv(cin, cout, (k, k), rngs=rngs, **kw)


class ResnetBlock2D(nnx.Module):
  """`x + conv2(act(norm2(conv1(act(norm1(x))))))`, with a 1x1 shortcut when channels change."""

  def __init__(self, cin: int, cout: int, groups: int, act: str, *, rngs: nnx.Rngs):
    self.act = nn.activation(act)
    self.norm1 = nn.GroupNorm(groups, cin, eps=1e-6, rngs=rngs)
    self.conv1 = _conv(cin, cout, 3, rngs, padding=1)
    self.norm2 = nn.GroupNorm(groups, cout, eps=1e-6, rngs=rngs)
    self.conv2 = _conv(cout, cout, 3, rngs, padding=1)
    self.conv_shortcut = _conv(cin, cout, 1, rngs) if cin != cout else None

  def __call__(self, x: jax.Array) -> jax.Array:
    h = self.conv1(self.act(self.norm1(x)))
    h = self.conv2(self.act(self.norm2(h)))
    if self.conv_shortcut is not None:
      x = self.conv_shortcut(x)
    return x + h


class Attention(nnx.Module):
  """Single-head self-attention over all positions, GroupNorm first, residual added (the VAE mid block).

  Queries go in chunks of whole latent rows, at most `query_chunk` positions each (`lax.map`), so the
  float32 score matrix stays `[B, chunk, h*w]` instead of `[B, h*w, h*w]` (16k x 16k for a 1024 px SDXL
  image); every query's softmax is complete, so the result is exact.
  """

  def __init__(self, channels: int, groups: int, *, query_chunk: int = 4096, rngs: nnx.Rngs):
    axes = ("conv_in", "conv_out")
    self.query_chunk = query_chunk
    self.group_norm = nn.GroupNorm(groups, channels, eps=1e-6, rngs=rngs)
    self.to_q = nn.Dense(channels, channels, axes=axes, rngs=rngs)
    self.to_k = nn.Dense(channels, channels, axes=axes, rngs=rngs)
    self.to_v = nn.Dense(channels, channels, axes=axes, rngs=rngs)
    self.to_out = nn.Dense(channels, channels, axes=axes, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    b, h, w, c = x.shape
    t = self.group_norm(x).reshape(b, h * w, c)  # [B, S, C]
    q, k, v = self.to_q(t), self.to_k(t), self.to_v(t)
    scale = 1.0 / math.sqrt(c)

    def attend(q_chunk):  # [B, Q, C] → [B, Q, C]
      # Scores and softmax in float32 whatever the activations' dtype.
      scores = jnp.einsum("bqd,bkd->bqk", q_chunk, k, preferred_element_type=_F32) * scale
      probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
      return jnp.einsum("bqk,bkd->bqd", probs, v, preferred_element_type=_F32).astype(x.dtype)

    rows = max(r for r in range(1, h + 1) if h % r == 0 and (r * w <= self.query_chunk or r == 1))
    if rows == h:
      out = attend(q)
    else:
      chunks = q.reshape(b, h // rows, rows * w, c).transpose(1, 0, 2, 3)  # [N, B, Q, C]
      out = jax.lax.map(attend, chunks).transpose(1, 0, 2, 3).reshape(b, h * w, c)
    return x + self.to_out(out).reshape(b, h, w, c)


class Downsample2D(nnx.Module):
  """Zero-pads right and bottom by one, then a stride-2 3x3 conv (diffusers' `padding=0` downsampler)."""

  def __init__(self, channels: int, *, rngs: nnx.Rngs):
    self.conv = _conv(channels, channels, 3, rngs, stride=2, padding=((0, 1), (0, 1)))

  def __call__(self, x: jax.Array) -> jax.Array:
    return self.conv(x)


class Upsample2D(nnx.Module):
  """Nearest-neighbour 2x, then a 3x3 conv."""

  def __init__(self, channels: int, *, rngs: nnx.Rngs):
    self.conv = _conv(channels, channels, 3, rngs, padding=1)

  def __call__(self, x: jax.Array) -> jax.Array:
    x = jnp.repeat(jnp.repeat(x, 2, axis=1), 2, axis=2)
    return self.conv(x)


class DownEncoderBlock2D(nnx.Module):
  def __init__(self, cin, cout, layers, groups, act, downsample, *, rngs):
    self.resnets = nnx.List(
      [ResnetBlock2D(cin if i == 0 else cout, cout, groups, act, rngs=rngs) for i in range(layers)]
    )
    self.downsamplers = nnx.List([Downsample2D(cout, rngs=rngs)] if downsample else [])

  def __call__(self, x):
    for block in self.resnets:
      x = block(x)
    for down in self.downsamplers:
      x = down(x)
    return x


class UpDecoderBlock2D(nnx.Module):
  def __init__(self, cin, cout, layers, groups, act, upsample, *, rngs):
    self.resnets = nnx.List(
      [ResnetBlock2D(cin if i == 0 else cout, cout, groups, act, rngs=rngs) for i in range(layers)]
    )
    self.upsamplers = nnx.List([Upsample2D(cout, rngs=rngs)] if upsample else [])

  def __call__(self, x):
    for block in self.resnets:
      x = block(x)
    for up in self.upsamplers:
      x = up(x)
    return x


class UNetMidBlock2D(nnx.Module):
  """resnet → (attention → resnet)."""

  def __init__(self, channels, groups, act, attention, query_chunk, *, rngs):
    self.resnets = nnx.List(
      [ResnetBlock2D(channels, channels, groups, act, rngs=rngs) for _ in range(2)]
    )
    self.attentions = nnx.List(
      [Attention(channels, groups, query_chunk=query_chunk, rngs=rngs)] if attention else []
    )

  def __call__(self, x):
    x = self.resnets[0](x)
    if len(self.attentions):
      x = self.attentions[0](x)
    return self.resnets[1](x)


class Encoder(nnx.Module):
  """Image `[B, H, W, in]` → moments `[B, H/f, W/f, 2 * latent]` (mean then logvar)."""

  def __init__(self, config: AutoencoderKLConfig, *, rngs: nnx.Rngs):
    c = config
    ch, g, act = c.block_out_channels, c.norm_num_groups, c.act_fn
    self.act = nn.activation(act)
    self.conv_in = _conv(c.in_channels, ch[0], 3, rngs, padding=1, axes=(None, "conv_out"))
    self.down_blocks = nnx.List(
      [
        DownEncoderBlock2D(
          ch[max(i - 1, 0)], ch[i], c.layers_per_block, g, act, i < len(ch) - 1, rngs=rngs
        )
        for i in range(len(ch))
      ]
    )
    self.mid_block = UNetMidBlock2D(
      ch[-1], g, act, c.mid_block_add_attention, c.attention_query_chunk, rngs=rngs
    )
    self.conv_norm_out = nn.GroupNorm(g, ch[-1], eps=1e-6, rngs=rngs)
    self.conv_out = _conv(ch[-1], 2 * c.latent_channels, 3, rngs, padding=1)

  def __call__(self, x: jax.Array) -> jax.Array:
    x = self.conv_in(x)
    for block in self.down_blocks:
      x = block(x)
    x = self.mid_block(x)
    return self.conv_out(self.act(self.conv_norm_out(x)))


class Decoder(nnx.Module):
  """Latents `[B, h, w, latent]` → image `[B, h*f, w*f, out]`."""

  def __init__(self, config: AutoencoderKLConfig, *, rngs: nnx.Rngs):
    c = config
    ch, g, act = tuple(reversed(c.block_out_channels)), c.norm_num_groups, c.act_fn
    self.act = nn.activation(act)
    self.conv_in = _conv(c.latent_channels, ch[0], 3, rngs, padding=1, axes=(None, "conv_out"))
    self.mid_block = UNetMidBlock2D(
      ch[0], g, act, c.mid_block_add_attention, c.attention_query_chunk, rngs=rngs
    )
    self.up_blocks = nnx.List(
      [
        UpDecoderBlock2D(
          ch[max(i - 1, 0)], ch[i], c.layers_per_block + 1, g, act, i < len(ch) - 1, rngs=rngs
        )
        for i in range(len(ch))
      ]
    )
    self.conv_norm_out = nn.GroupNorm(g, ch[-1], eps=1e-6, rngs=rngs)
    self.conv_out = _conv(ch[-1], c.out_channels, 3, rngs, padding=1, axes=("conv_in", None))

  def __call__(self, z: jax.Array) -> jax.Array:
    x = self.mid_block(self.conv_in(z))
    for block in self.up_blocks:
      x = block(x)
    return self.conv_out(self.act(self.conv_norm_out(x)))


def _blend(a: jax.Array, b: jax.Array, extent: int, axis: int) -> jax.Array:
  """The first `extent` rows (or columns) of `b` fade in from the last ones of `a` (diffusers' blend_v/h)."""
  extent = min(a.shape[axis], b.shape[axis], extent)
  if extent <= 0:
    return b
  shape = [1] * b.ndim
  shape[axis] = extent
  ramp = (jnp.arange(extent, dtype=_F32) / extent).reshape(shape)
  head_a = jax.lax.slice_in_dim(a, a.shape[axis] - extent, a.shape[axis], axis=axis).astype(_F32)
  head_b = jax.lax.slice_in_dim(b, 0, extent, axis=axis).astype(_F32)
  mixed = (head_a * (1.0 - ramp) + head_b * ramp).astype(b.dtype)
  rest = jax.lax.slice_in_dim(b, extent, b.shape[axis], axis=axis)
  return jnp.concatenate([mixed, rest], axis=axis)


def _tiled(
  x: jax.Array, tile_in: int, overlap_in: int, blend: int, keep: int, fn: Callable
) -> jax.Array:
  """Runs `fn` on overlapping tiles of `x [B, H, W, C]` and stitches the results as diffusers does.

  Tiles start every `overlap_in` pixels (edge tiles are smaller); each result tile is blended with the already
  blended tiles above and to its left over `blend` rows / columns, then cropped to `keep`. Tiles of one shape
  (at most four shapes: inner, right edge, bottom edge, corner) go through one `lax.map`, so `fn` compiles
  once per shape and only one tile is live at a time.
  """
  starts_h, starts_w = range(0, x.shape[1], overlap_in), range(0, x.shape[2], overlap_in)
  tiles = {(i, j): x[:, i : i + tile_in, j : j + tile_in] for i in starts_h for j in starts_w}
  by_shape: dict[tuple, list] = {}
  for pos, tile in tiles.items():
    by_shape.setdefault(tile.shape, []).append(pos)
  done = {}
  for positions in by_shape.values():
    outs = jax.lax.map(fn, jnp.stack([tiles[p] for p in positions]))
    done.update({p: outs[n] for n, p in enumerate(positions)})
  rows = [[done[(i, j)] for j in starts_w] for i in starts_h]
  out_rows = []
  for i, row in enumerate(rows):
    kept = []
    for j, tile in enumerate(row):
      if i > 0:
        tile = _blend(rows[i - 1][j], tile, blend, axis=1)
      if j > 0:
        tile = _blend(row[j - 1], tile, blend, axis=2)
      row[j] = tile  # later tiles blend with this blended tile, as the reference's in-place update
      kept.append(tile[:, :keep, :keep])
    out_rows.append(jnp.concatenate(kept, axis=2))
  return jnp.concatenate(out_rows, axis=1)


def _batch_sliced(fn: Callable, x: jax.Array, batch_slice: int | None) -> jax.Array:
  """`fn(x)`, or `fn` over chunks of `batch_slice` examples one after another (lower peak memory)."""
  b = x.shape[0]
  if batch_slice is None or batch_slice >= b:
    return fn(x)
  if b % batch_slice:
    raise ValueError(f"batch_slice={batch_slice} must divide the batch size {b}")
  chunks = x.reshape(b // batch_slice, batch_slice, *x.shape[1:])
  out = jax.lax.map(fn, chunks)
  return out.reshape(b, *out.shape[2:])


def _constrain(x: jax.Array) -> jax.Array:
  # Batch over data/fsdp where a mesh is set (a no-op otherwise); spatial dims stay whole for the convs.
  return mds.with_logical_constraint(x, ("activation_batch", None, None, None))


class AutoencoderKL(nnx.Module):
  """diffusers' `AutoencoderKL` over channels-last arrays.

  Under `config.force_upcast` activations run in float32 whatever the parameters' dtype (the reference's
  pipelines upcast the VAE); otherwise in the input's dtype.
  """

  def __init__(self, config: AutoencoderKLConfig, *, rngs: nnx.Rngs):
    c = self.config = config
    self.encoder = Encoder(c, rngs=rngs)
    self.decoder = Decoder(c, rngs=rngs)
    two = 2 * c.latent_channels
    self.quant_conv = _conv(two, two, 1, rngs) if c.use_quant_conv else None
    self.post_quant_conv = (
      _conv(c.latent_channels, c.latent_channels, 1, rngs) if c.use_post_quant_conv else None
    )

  # --- shapes and dtypes -------------------------------------------------------------------------------
  def _check(self, x: jax.Array, channels: int, what: str, factor: int) -> None:
    if x.ndim != 4 or x.shape[-1] != channels:
      raise ValueError(
        f"{what} must be channels-last [B, H, W, {channels}], got shape {x.shape} (md_vae.nchw_to_nhwc "
        "converts [B, C, H, W])"
      )
    h, w = x.shape[1:3]
    if factor > 1 and (h % factor or w % factor):
      raise ValueError(
        f"{what} height and width ({h}, {w}) must be multiples of the VAE factor {factor}; e.g. "
        f"{h // factor * factor or factor}x{w // factor * factor or factor}"
      )

  def _dtype(self, x: jax.Array):
    return _F32 if self.config.force_upcast else x.dtype

  # --- pieces --------------------------------------------------------------------------------------------
  def _moments(self, x: jax.Array) -> jax.Array:
    h = self.encoder(x)
    if self.quant_conv is not None:
      h = self.quant_conv(h)
    return h

  def _decode(self, z: jax.Array) -> jax.Array:
    if self.post_quant_conv is not None:
      z = self.post_quant_conv(z)
    return self.decoder(z)

  @staticmethod
  def _posterior(moments: jax.Array) -> DiagonalGaussian:
    mean, logvar = jnp.split(moments, 2, axis=-1)
    return DiagonalGaussian(mean, jnp.clip(logvar, -30.0, 20.0))

  def _tile_sizes(self, tile_sample_size: int | None) -> tuple[int, int]:
    sample = int(tile_sample_size or self.config.sample_size)
    return sample, int(sample / self.config.downscale)

  # --- public --------------------------------------------------------------------------------------------
  def encode(
    self,
    images: jax.Array,
    *,
    tiled: bool = False,
    tile_sample_size: int | None = None,
    tile_overlap: float = 0.25,
    batch_slice: int | None = None,
  ) -> DiagonalGaussian:
    """Encodes images `[B, H, W, C]` in [-1, 1] to the latent posterior `[B, H/f, W/f, latent]`.

    Args:
      images: channels-last images; H and W multiples of `config.downscale`.
      tiled: encode overlapping tiles of `tile_sample_size` (default `config.sample_size`) when the image is
        larger than one tile, blending `tile_overlap` of each tile, as diffusers' `enable_tiling`.
      tile_sample_size: tile size in pixels.
      tile_overlap: the fraction of a tile shared with its neighbours.
      batch_slice: encode this many examples at a time (diffusers' `enable_slicing` is 1).

    Returns:
      The posterior (`.mode()`, `.sample(key)`).
    """
    c = self.config
    self._check(images, c.in_channels, "images", c.downscale)
    x = _constrain(images.astype(self._dtype(images)))
    sample, latent = self._tile_sizes(tile_sample_size)
    if tiled and (x.shape[1] > sample or x.shape[2] > sample):
      blend = int(latent * tile_overlap)
      fn = lambda t: _tiled(
        t, sample, int(sample * (1 - tile_overlap)), blend, latent - blend, self._moments
      )  # noqa: E731
    else:
      fn = self._moments
    return self._posterior(_batch_sliced(fn, x, batch_slice))

  def decode(
    self,
    latents: jax.Array,
    *,
    tiled: bool = False,
    tile_sample_size: int | None = None,
    tile_overlap: float = 0.25,
    batch_slice: int | None = None,
  ) -> jax.Array:
    """Decodes latents `[B, h, w, latent]` (unscaled: see `unscale_latents`) to images `[B, h*f, w*f, C]`.

    Args:
      latents: channels-last latents.
      tiled: decode overlapping latent tiles of `tile_sample_size / f` when larger than one tile, as
        diffusers' `enable_tiling`.
      tile_sample_size: tile size in pixels (default `config.sample_size`).
      tile_overlap: the fraction of a tile shared with its neighbours.
      batch_slice: decode this many examples at a time.

    Returns:
      Images, roughly in [-1, 1].
    """
    c = self.config
    self._check(latents, c.latent_channels, "latents", 1)
    z = _constrain(latents.astype(self._dtype(latents)))
    sample, latent = self._tile_sizes(tile_sample_size)
    if tiled and (z.shape[1] > latent or z.shape[2] > latent):
      blend = int(sample * tile_overlap)
      fn = lambda t: _tiled(
        t, latent, int(latent * (1 - tile_overlap)), blend, sample - blend, self._decode
      )  # noqa: E731
    else:
      fn = self._decode
    return _batch_sliced(fn, z, batch_slice)

  def __call__(self, images: jax.Array, *, key: jax.Array | None = None) -> jax.Array:
    """Reconstructs images: decode of the posterior's mode (or a sample with `key`)."""
    posterior = self.encode(images)
    z = posterior.mode() if key is None else posterior.sample(key)
    return self.decode(z)

  def scale_latents(self, z: jax.Array) -> jax.Array:
    """VAE latents → the denoiser's: `(z - shift_factor) * scaling_factor`."""
    c = self.config
    return (z - (c.shift_factor or 0.0)) * c.scaling_factor

  def unscale_latents(self, z: jax.Array) -> jax.Array:
    """The denoiser's latents → VAE latents: `z / scaling_factor + shift_factor`."""
    c = self.config
    return z / c.scaling_factor + (c.shift_factor or 0.0)


def nchw_to_nhwc(x: jax.Array) -> jax.Array:
  """`[B, C, H, W]` (the reference's layout) → `[B, H, W, C]`."""
  if x.ndim != 4:
    raise ValueError(f"expected a [B, C, H, W] array, got shape {x.shape}")
  return jnp.transpose(x, (0, 2, 3, 1))


def nhwc_to_nchw(x: jax.Array) -> jax.Array:
  """`[B, H, W, C]` → `[B, C, H, W]` (the reference's layout)."""
  if x.ndim != 4:
    raise ValueError(f"expected a [B, H, W, C] array, got shape {x.shape}")
  return jnp.transpose(x, (0, 3, 1, 2))
