"""Configuration of the Wan causal video VAE (diffusers `AutoencoderKLWan`), for Wan 2.1 and Wan 2.2."""

from __future__ import annotations

import dataclasses
import difflib
import os
from collections.abc import Mapping
from typing import Any

import md_core

# Per-channel latent statistics, as published in the models' vae/config.json.
WAN21_LATENTS_MEAN = (
  -0.7571, -0.7089, -0.9113, 0.1075, -0.1745, 0.9653, -0.1517, 1.5508,
  0.4134, -0.0715, 0.5517, -0.3632, -0.1922, -0.9497, 0.2503, -0.2921,
)  # fmt: skip
WAN21_LATENTS_STD = (
  2.8184, 1.4541, 2.3275, 2.6558, 1.2196, 1.7708, 2.6052, 2.0743,
  3.2687, 2.1526, 2.8652, 1.5579, 1.6382, 1.1253, 2.8251, 1.9160,
)  # fmt: skip
WAN22_LATENTS_MEAN = (
  -0.2289, -0.0052, -0.1323, -0.2339, -0.2799, 0.0174, 0.1838, 0.1557,
  -0.1382, 0.0542, 0.2813, 0.0891, 0.1570, -0.0098, 0.0375, -0.1825,
  -0.2246, -0.1207, -0.0698, 0.5109, 0.2665, -0.2108, -0.2158, 0.2502,
  -0.2055, -0.0322, 0.1109, 0.1567, -0.0729, 0.0899, -0.2799, -0.1230,
  -0.0313, -0.1649, 0.0117, 0.0723, -0.2839, -0.2083, -0.0520, 0.3748,
  0.0152, 0.1957, 0.1433, -0.2944, 0.3573, -0.0548, -0.1681, -0.0667,
)  # fmt: skip
WAN22_LATENTS_STD = (
  0.4765, 1.0364, 0.4514, 1.1677, 0.5313, 0.4990, 0.4818, 0.5013,
  0.8158, 1.0344, 0.5894, 1.0901, 0.6885, 0.6165, 0.8454, 0.4978,
  0.5759, 0.3523, 0.7135, 0.6804, 0.5833, 1.4146, 0.8986, 0.5659,
  0.7069, 0.5338, 0.4889, 0.4917, 0.4069, 0.4999, 0.6866, 0.4093,
  0.5709, 0.6065, 0.6415, 0.4944, 0.5726, 1.2042, 0.5458, 1.6887,
  0.3971, 1.0600, 0.3943, 0.5537, 0.5444, 0.4089, 0.7468, 0.7744,
)  # fmt: skip

# Keys of the reference config that do not change what the model computes at inference.
#   dropout: only active in training, which the reference never does inside encode/decode.
#   clip_output: written by older diffusers into the Wan 2.2 config; diffusers 0.42 ignores it and always
#     clamps decoded frames to [-1, 1], as md does.
_IGNORED = ("dropout", "clip_output")


@dataclasses.dataclass(frozen=True)
class WanVAEConfig:
  """The Wan VAE's architecture, with the reference's field names (`temperal_downsample` spelling included).

  Attributes:
    base_dim: encoder width of the first level (96 in 2.1, 160 in 2.2).
    decoder_base_dim: decoder width of the last level (default `base_dim`; 256 in 2.2).
    z_dim: latent channels (16 in 2.1, 48 in 2.2); the encoder produces `2 * z_dim` (mean and log-variance).
    dim_mult: width multiplier per level; each level but the last halves height and width.
    num_res_blocks: residual blocks per encoder level (the decoder has one more per level).
    attn_scales: unsupported unless empty (no released Wan VAE uses it).
    temperal_downsample: per level transition, whether time is halved too (the decoder mirrors it).
    latents_mean, latents_std: per-channel statistics for `normalize_latents` / `denormalize_latents`.
    is_residual: Wan 2.2 blocks, with parameter-free average-down / duplicate-up shortcuts around each level.
    in_channels, out_channels: channels the encoder takes and the decoder gives, after patchify (12 in 2.2).
    patch_size: space-to-channel patchify of the frames before encoding (2 in 2.2; None = 1).
    scale_factor_temporal, scale_factor_spatial: the compression, checked against the architecture.
  """

  base_dim: int = 96
  decoder_base_dim: int | None = None
  z_dim: int = 16
  dim_mult: tuple[int, ...] = (1, 2, 4, 4)
  num_res_blocks: int = 2
  attn_scales: tuple[float, ...] = ()
  temperal_downsample: tuple[bool, ...] = (False, True, True)
  latents_mean: tuple[float, ...] = WAN21_LATENTS_MEAN
  latents_std: tuple[float, ...] = WAN21_LATENTS_STD
  is_residual: bool = False
  in_channels: int = 3
  out_channels: int = 3
  patch_size: int | None = None
  scale_factor_temporal: int | None = 4
  scale_factor_spatial: int | None = 8

  def __post_init__(self):
    for name in ("dim_mult", "attn_scales", "temperal_downsample", "latents_mean", "latents_std"):
      object.__setattr__(self, name, tuple(getattr(self, name)))
    levels = len(self.dim_mult)
    if len(self.temperal_downsample) != levels - 1:
      raise ValueError(
        f"temperal_downsample={list(self.temperal_downsample)} must have len(dim_mult) - 1 = {levels - 1} "
        f"entries (one per level transition)"
      )
    if self.attn_scales:
      raise ValueError(
        f"attn_scales={list(self.attn_scales)} is not supported (no released Wan VAE uses attention in the "
        "down blocks); use []"
      )
    for name in ("latents_mean", "latents_std"):
      if len(getattr(self, name)) != self.z_dim:
        raise ValueError(
          f"{name} has {len(getattr(self, name))} entries, expected z_dim={self.z_dim}"
        )
    p = self.patch
    if self.in_channels % (p * p) or self.out_channels % (p * p):
      raise ValueError(
        f"in_channels={self.in_channels} and out_channels={self.out_channels} must be divisible by "
        f"patch_size**2={p * p}"
      )
    if self.scale_factor_spatial is not None and self.scale_factor_spatial != self.spatial_factor:
      raise ValueError(
        f"scale_factor_spatial={self.scale_factor_spatial} disagrees with the architecture: "
        f"{len(self.dim_mult) - 1} spatial halvings x patch_size {p} = {self.spatial_factor}"
      )
    if (
      self.scale_factor_temporal is not None and self.scale_factor_temporal != self.temporal_factor
    ):
      raise ValueError(
        f"scale_factor_temporal={self.scale_factor_temporal} disagrees with "
        f"temperal_downsample={list(self.temperal_downsample)} (factor {self.temporal_factor})"
      )

  @property
  def patch(self) -> int:
    return self.patch_size or 1

  @property
  def decoder_dim(self) -> int:
    return self.decoder_base_dim or self.base_dim

  @property
  def spatial_factor(self) -> int:
    """Pixels per latent along height and width (8 in 2.1, 16 in 2.2)."""
    return 2 ** (len(self.dim_mult) - 1) * self.patch

  @property
  def temporal_factor(self) -> int:
    """Frames per latent frame after the first (4 for both released VAEs)."""
    return 2 ** sum(bool(t) for t in self.temperal_downsample)

  @property
  def video_channels(self) -> int:
    """Channels of the videos encode takes and decode returns (3: RGB)."""
    return self.in_channels // (self.patch * self.patch)

  @classmethod
  def from_dict(cls, d: Mapping[str, Any]) -> WanVAEConfig:
    """From a reference `config.json` dict (`_class_name` and other `_` keys are skipped).

    Raises:
      ValueError: a key md does not know (with the closest known key), or an unsupported setting.
    """
    fields = {f.name for f in dataclasses.fields(cls)}
    known = fields | set(_IGNORED)
    unknown = [k for k in d if not k.startswith("_") and k not in known]
    if unknown:
      hints = {k: difflib.get_close_matches(k, sorted(known), n=1) for k in unknown}
      text = ", ".join(
        f"{k!r}" + (f" (did you mean {h[0]!r}?)" if h else "") for k, h in hints.items()
      )
      raise ValueError(f"unknown Wan VAE config keys {text}; known keys: {sorted(known)}")
    cls_name = d.get("_class_name")
    if cls_name not in (None, "AutoencoderKLWan"):
      raise ValueError(f"config is for {cls_name!r}, not AutoencoderKLWan")
    return cls(**{k: v for k, v in d.items() if k in fields})

  @classmethod
  def from_json(cls, path: str | os.PathLike) -> WanVAEConfig:
    """From a reference `config.json` file (errors name the file)."""
    try:
      return cls.from_dict(md_core.read_json(path))
    except (TypeError, ValueError) as e:
      raise ValueError(f"{path}: {e}") from None


WAN_VARIANTS: dict[str, WanVAEConfig] = {
  # Wan-AI/Wan2.1-T2V-1.3B-Diffusers (and every Wan 2.1 / 2.2 A14B model) vae/config.json.
  "wan2.1": WanVAEConfig(),
  # Wan-AI/Wan2.2-TI2V-5B-Diffusers vae/config.json.
  "wan2.2": WanVAEConfig(
    base_dim=160,
    decoder_base_dim=256,
    z_dim=48,
    latents_mean=WAN22_LATENTS_MEAN,
    latents_std=WAN22_LATENTS_STD,
    is_residual=True,
    in_channels=12,
    out_channels=12,
    patch_size=2,
    scale_factor_spatial=16,
  ),
  # Test sizes with the real structure (4 levels, temporal halving on the last two).
  "tiny": WanVAEConfig(
    base_dim=4, z_dim=4, dim_mult=(1, 2, 2, 2), latents_mean=(0.0,) * 4, latents_std=(1.0,) * 4
  ),
  "tiny-2.2": WanVAEConfig(
    base_dim=4,
    decoder_base_dim=6,
    z_dim=6,
    dim_mult=(1, 2, 2, 2),
    latents_mean=(0.0,) * 6,
    latents_std=(1.0,) * 6,
    is_residual=True,
    in_channels=12,
    out_channels=12,
    patch_size=2,
    scale_factor_spatial=16,
  ),
}
