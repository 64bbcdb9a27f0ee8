"""The FLUX.2 VAE (diffusers `AutoencoderKLFlux2`), channels-last, with the Klein pipeline's latent helpers.

The encoder and decoder are AutoencoderKL's (`md_vae._kl`) with 32 latent channels and quant convs. What is
new is on the pipeline side: latents `[B, h, w, 32]` are cut into 2x2 patches (`[B, h/2, w/2, 128]`, channel
`c * 4 + dy * 2 + dx` as the reference's `_patchify_latents`) and normalised per channel with the running
mean / variance of a batch norm stored in the checkpoint (`bn.running_mean`, `bn.running_var`; its int64
`bn.num_batches_tracked` is allowed and ignored). `encode_latents` / `decode_latents` do the whole path the
FLUX.2 [klein] pipeline does around the transformer.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

import md_core
from md_vae._kl import (
  AutoencoderKL,
  AutoencoderKLConfig,
  Decoder,
  DiagonalGaussian,
  Encoder,
  _batch_sliced,
  _constrain,
  _conv,
  _tiled,
)

_F32 = jnp.float32
_IGNORED_KEYS = frozenset(
  {"_class_name", "_diffusers_version", "_name_or_path", "_use_default_values", "_md_source"}
)


@dataclasses.dataclass(frozen=True)
class AutoencoderKLFlux2Config:
  """An `AutoencoderKLFlux2` (diffusers `vae/config.json`); defaults are diffusers', which are the real VAE's.

  Attributes:
    in_channels: image channels in.
    out_channels: image channels out.
    block_out_channels: encoder channels per resolution level (each level but the last halves the size).
    decoder_block_out_channels: decoder channels per level (None: as the encoder's).
    layers_per_block: resnets per encoder level (the decoder has one more).
    latent_channels: 32.
    norm_num_groups: GroupNorm groups everywhere.
    sample_size: tile size in pixels of the tiled encode / decode.
    use_quant_conv: a 1x1 conv on the encoder's moments.
    use_post_quant_conv: a 1x1 conv on latents before decoding.
    mid_block_add_attention: self-attention in the mid blocks.
    act_fn: activation.
    batch_norm_eps: added to the running variance before its square root.
    batch_norm_momentum: training only (kept).
    patch_size: latent patch `(ph, pw)`; the batch norm has `ph * pw * latent_channels` channels.
    down_block_types: only `DownEncoderBlock2D` levels.
    up_block_types: only `UpDecoderBlock2D` levels.
    force_upcast: run in float32 whatever the weights' dtype (md's choice for VAEs, as AutoencoderKL's).
    attention_query_chunk: md only: query positions per chunk in the mid-block attention (exact).
  """

  in_channels: int = 3
  out_channels: int = 3
  block_out_channels: tuple[int, ...] = (128, 256, 512, 512)
  decoder_block_out_channels: tuple[int, ...] | None = None
  layers_per_block: int = 2
  latent_channels: int = 32
  norm_num_groups: int = 32
  sample_size: int = 1024
  use_quant_conv: bool = True
  use_post_quant_conv: bool = True
  mid_block_add_attention: bool = True
  act_fn: str = "silu"
  batch_norm_eps: float = 1e-4
  batch_norm_momentum: float = 0.1
  patch_size: tuple[int, int] = (2, 2)
  down_block_types: tuple[str, ...] | None = None
  up_block_types: tuple[str, ...] | None = None
  force_upcast: bool = True
  attention_query_chunk: int = 4096

  def __post_init__(self):
    if self.decoder_block_out_channels is not None and len(self.decoder_block_out_channels) != len(
      self.block_out_channels
    ):
      raise ValueError(
        f"decoder_block_out_channels={list(self.decoder_block_out_channels)} must have one entry per "
        f"level, like block_out_channels={list(self.block_out_channels)}"
      )
    if len(self.patch_size) != 2 or min(self.patch_size) < 1:
      raise ValueError(f"patch_size={self.patch_size} must be two positive ints (ph, pw)")
    n = len(self.block_out_channels)
    for name, kind in (
      ("down_block_types", "DownEncoderBlock2D"),
      ("up_block_types", "UpDecoderBlock2D"),
    ):
      if getattr(self, name) is None:
        object.__setattr__(self, name, (kind,) * n)
    # Builds (and so validates) both halves' configs.
    self.encoder_config()
    self.decoder_config()

  def _kl(self, channels) -> AutoencoderKLConfig:
    return AutoencoderKLConfig(
      in_channels=self.in_channels,
      out_channels=self.out_channels,
      block_out_channels=tuple(channels),
      layers_per_block=self.layers_per_block,
      latent_channels=self.latent_channels,
      norm_num_groups=self.norm_num_groups,
      sample_size=self.sample_size,
      force_upcast=self.force_upcast,
      use_quant_conv=self.use_quant_conv,
      use_post_quant_conv=self.use_post_quant_conv,
      mid_block_add_attention=self.mid_block_add_attention,
      act_fn=self.act_fn,
      down_block_types=self.down_block_types,
      up_block_types=self.up_block_types,
      attention_query_chunk=self.attention_query_chunk,
    )

  def encoder_config(self) -> AutoencoderKLConfig:
    """The AutoencoderKL config the encoder is built from."""
    return self._kl(self.block_out_channels)

  def decoder_config(self) -> AutoencoderKLConfig:
    """The AutoencoderKL config the decoder is built from (its own channels when given)."""
    return self._kl(self.decoder_block_out_channels or self.block_out_channels)

  @property
  def downscale(self) -> int:
    """Pixels per latent along each side (8 for the real VAE)."""
    return 2 ** (len(self.block_out_channels) - 1)

  @property
  def patch_channels(self) -> int:
    """Channels of patchified latents (128 for the real VAE): what the transformer sees."""
    return self.patch_size[0] * self.patch_size[1] * self.latent_channels

  @classmethod
  def from_dict(cls, d: Mapping[str, Any], *, where: str = "config") -> AutoencoderKLFlux2Config:
    """From a diffusers `config.json` dict; keys md does not implement are an error."""
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(k for k in d if k not in names and k not in _IGNORED_KEYS)
    if unknown:
      raise ValueError(
        f"{where}: config keys {unknown} are not supported by md's AutoencoderKLFlux2 (supported: "
        f"{sorted(names)})"
      )
    if d.get("_class_name", "AutoencoderKLFlux2") != "AutoencoderKLFlux2":
      raise ValueError(f"{where}: _class_name={d['_class_name']!r}, expected 'AutoencoderKLFlux2'")
    kw = {k: d[k] for k in names if k in d}
    for key in (
      "block_out_channels",
      "decoder_block_out_channels",
      "down_block_types",
      "up_block_types",
      "patch_size",
    ):
      if kw.get(key) is not None:
        kw[key] = tuple(kw[key])
    if isinstance(kw.get("sample_size"), list | tuple):
      kw["sample_size"] = int(kw["sample_size"][0])
    return cls(**kw)

  @classmethod
  def from_json(cls, path: str | os.PathLike) -> AutoencoderKLFlux2Config:
    """From a `config.json` file."""
    return cls.from_dict(md_core.read_json(path), where=os.fspath(path))


FLUX2_VAE_VARIANTS: dict[str, AutoencoderKLFlux2Config] = {
  # black-forest-labs/FLUX.2-klein-4B vae (also FLUX.2-dev and klein 9B).
  "flux2": AutoencoderKLFlux2Config(),
  "tiny": AutoencoderKLFlux2Config(
    block_out_channels=(8, 16),
    decoder_block_out_channels=(8, 12),
    layers_per_block=1,
    latent_channels=8,
    norm_num_groups=4,
    sample_size=32,
  ),
}


class LatentStats(nnx.Module):
  """The reference's `bn` (affine-free BatchNorm2d): only its running statistics are used, as buffers."""

  def __init__(self, channels: int):
    self.running_mean = nnx.BatchStat(jnp.zeros((channels,), _F32))
    self.running_var = nnx.BatchStat(jnp.ones((channels,), _F32))


def patchify_latents(latents: jax.Array, patch_size: tuple[int, int] = (2, 2)) -> jax.Array:
  """`[B, h, w, C]` → `[B, h/ph, w/pw, C*ph*pw]`, channel `c*ph*pw + dy*pw + dx` (the reference's order)."""
  ph, pw = patch_size
  if latents.ndim != 4:
    raise ValueError(f"latents must be channels-last [B, h, w, C], got shape {latents.shape}")
  b, h, w, c = latents.shape
  if h % ph or w % pw:
    raise ValueError(
      f"latents of height and width ({h}, {w}) cannot be cut into {ph}x{pw} patches; they must be "
      f"multiples of ({ph}, {pw}) (images multiples of 16 for the FLUX.2 VAE, e.g. "
      f"{(h // ph * ph or ph) * 8}x{(w // pw * pw or pw) * 8})"
    )
  x = latents.reshape(b, h // ph, ph, w // pw, pw, c).transpose(0, 1, 3, 5, 2, 4)
  return x.reshape(b, h // ph, w // pw, c * ph * pw)


def unpatchify_latents(patches: jax.Array, patch_size: tuple[int, int] = (2, 2)) -> jax.Array:
  """`[B, h, w, C*ph*pw]` → `[B, h*ph, w*pw, C]` (inverse of `patchify_latents`)."""
  ph, pw = patch_size
  if patches.ndim != 4 or patches.shape[-1] % (ph * pw):
    raise ValueError(
      f"patchified latents must be [B, h, w, C*{ph * pw}], got shape {patches.shape}"
    )
  b, h, w, cp = patches.shape
  c = cp // (ph * pw)
  x = patches.reshape(b, h, w, c, ph, pw).transpose(0, 1, 4, 2, 5, 3)
  return x.reshape(b, h * ph, w * pw, c)


class AutoencoderKLFlux2(nnx.Module):
  """diffusers' `AutoencoderKLFlux2` over channels-last arrays, with the Klein pipeline's latent helpers.

  Under `config.force_upcast` activations run in float32 whatever the parameters' dtype.
  """

  def __init__(self, config: AutoencoderKLFlux2Config, *, rngs: nnx.Rngs):
    c = self.config = config
    self.encoder = Encoder(c.encoder_config(), rngs=rngs)
    self.decoder = Decoder(c.decoder_config(), rngs=rngs)
    two = 2 * c.latent_channels
    self.quant_conv = _conv(two, two, 1, rngs) if c.use_quant_conv else None
    self.post_quant_conv = (
      _conv(c.latent_channels, c.latent_channels, 1, rngs) if c.use_post_quant_conv else None
    )
    self.bn = LatentStats(c.patch_channels)

  def _check(self, x: jax.Array, channels: int, what: str, factor: int) -> None:
    if x.ndim != 4 or x.shape[-1] != channels:
      raise ValueError(
        f"{what} must be channels-last [B, H, W, {channels}], got shape {x.shape} (md_vae.nchw_to_nhwc "
        "converts [B, C, H, W])"
      )
    h, w = x.shape[1:3]
    if factor > 1 and (h % factor or w % factor):
      raise ValueError(
        f"{what} height and width ({h}, {w}) must be multiples of {factor}; e.g. "
        f"{h // factor * factor or factor}x{w // factor * factor or factor}"
      )

  def _dtype(self, x: jax.Array):
    return _F32 if self.config.force_upcast else x.dtype

  def _moments(self, x: jax.Array) -> jax.Array:
    h = self.encoder(x)
    return self.quant_conv(h) if self.quant_conv is not None else h

  def _decode(self, z: jax.Array) -> jax.Array:
    if self.post_quant_conv is not None:
      z = self.post_quant_conv(z)
    return self.decoder(z)

  def _tile_sizes(self, tile_sample_size: int | None) -> tuple[int, int]:
    sample = int(tile_sample_size or self.config.sample_size)
    return sample, int(sample / self.config.downscale)

  def encode(
    self,
    images: jax.Array,
    *,
    tiled: bool = False,
    tile_sample_size: int | None = None,
    tile_overlap: float = 0.25,
    batch_slice: int | None = None,
  ) -> DiagonalGaussian:
    """Images `[B, H, W, C]` in [-1, 1] (H, W multiples of `config.downscale`) → the latent posterior
    `[B, H/8, W/8, 32]` (`.mode()`, `.sample(key)`).

    Args:
      images: channels-last images.
      tiled: encode overlapping tiles of `tile_sample_size` (default `config.sample_size`) when the image
        is larger than one tile, blending `tile_overlap` of each, as diffusers' `enable_tiling`.
      tile_sample_size: tile size in pixels.
      tile_overlap: the fraction of a tile shared with its neighbours.
      batch_slice: encode this many examples at a time.
    """
    c = self.config
    self._check(images, c.in_channels, "images", c.downscale)
    x = _constrain(images.astype(self._dtype(images)))
    sample, latent = self._tile_sizes(tile_sample_size)
    fn = self._moments
    if tiled and (x.shape[1] > sample or x.shape[2] > sample):
      blend = int(latent * tile_overlap)
      step = int(sample * (1 - tile_overlap))
      fn = lambda t: _tiled(t, sample, step, blend, latent - blend, self._moments)  # noqa: E731
    return AutoencoderKL._posterior(_batch_sliced(fn, x, batch_slice))

  def decode(
    self,
    latents: jax.Array,
    *,
    tiled: bool = False,
    tile_sample_size: int | None = None,
    tile_overlap: float = 0.25,
    batch_slice: int | None = None,
  ) -> jax.Array:
    """Latents `[B, h, w, 32]` (unpatchified, unnormalised) → images `[B, 8h, 8w, C]`, roughly in [-1, 1].

    Args:
      latents: channels-last latents.
      tiled: decode overlapping latent tiles of `tile_sample_size / 8` when larger than one tile, as
        diffusers' `enable_tiling`.
      tile_sample_size: tile size in pixels (default `config.sample_size`).
      tile_overlap: the fraction of a tile shared with its neighbours.
      batch_slice: decode this many examples at a time.
    """
    c = self.config
    self._check(latents, c.latent_channels, "latents", 1)
    z = _constrain(latents.astype(self._dtype(latents)))
    sample, latent = self._tile_sizes(tile_sample_size)
    fn = self._decode
    if tiled and (z.shape[1] > latent or z.shape[2] > latent):
      blend = int(sample * tile_overlap)
      step = int(latent * (1 - tile_overlap))
      fn = lambda t: _tiled(t, latent, step, blend, sample - blend, self._decode)  # noqa: E731
    return _batch_sliced(fn, z, batch_slice)

  def _stats(self, dtype) -> tuple[jax.Array, jax.Array]:
    mean = self.bn.running_mean[...].astype(_F32)
    std = jnp.sqrt(self.bn.running_var[...].astype(_F32) + self.config.batch_norm_eps)
    n = mean.shape[0]
    return mean.reshape(1, 1, 1, n).astype(dtype), std.reshape(1, 1, 1, n).astype(dtype)

  def normalize_latents(self, patches: jax.Array) -> jax.Array:
    """Patchified latents `[B, h, w, 128]` → the transformer's: `(x - running_mean) / sqrt(running_var +
    eps)`, per channel."""
    self._check(patches, self.config.patch_channels, "patchified latents", 1)
    mean, std = self._stats(patches.dtype)
    return (patches - mean) / std

  def denormalize_latents(self, patches: jax.Array) -> jax.Array:
    """The transformer's latents `[B, h, w, 128]` → patchified VAE latents: `x * std + mean`."""
    self._check(patches, self.config.patch_channels, "patchified latents", 1)
    mean, std = self._stats(patches.dtype)
    return patches * std + mean

  def encode_latents(self, images: jax.Array) -> jax.Array:
    """Images `[B, H, W, C]` (H, W multiples of 16) → the transformer's latents `[B, H/16, W/16, 128]`:
    posterior mode, 2x2 patchify, normalise (the Klein pipeline's `_encode_vae_image`)."""
    c = self.config
    factor = c.downscale * max(c.patch_size)
    self._check(images, c.in_channels, "images", factor)
    return self.normalize_latents(patchify_latents(self.encode(images).mode(), c.patch_size))

  def decode_latents(self, patches: jax.Array) -> jax.Array:
    """The transformer's latents `[B, h, w, 128]` → images `[B, 16h, 16w, C]`: denormalise, unpatchify,
    decode (the end of the Klein pipeline)."""
    return self.decode(
      unpatchify_latents(self.denormalize_latents(patches), self.config.patch_size)
    )

  def __call__(self, images: jax.Array) -> jax.Array:
    """Reconstructs images: decode of the posterior's mode."""
    return self.decode(self.encode(images).mode())
