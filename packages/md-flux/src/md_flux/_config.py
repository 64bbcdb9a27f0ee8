"""Configs of the Flux.1 and Flux.2 transformers, read from the reference's `config.json`."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any

import md_attention as mda
import md_core


def _from_dict(cls, d: Mapping[str, Any], *, where: str, defaults_for_null: tuple[str, ...] = ()):
  """Builds `cls` from reference config keys; `_`-prefixed keys are metadata and are skipped."""
  fields = {f.name for f in dataclasses.fields(cls)} - set(cls._MD_ONLY)
  kwargs = {}
  unknown = []
  for key, value in d.items():
    if key.startswith("_"):
      continue
    if key not in fields:
      unknown.append(key)
      continue
    if isinstance(value, list):
      value = tuple(value)
    kwargs[key] = value
  if unknown:
    raise ValueError(
      f"{where}: unsupported config keys {sorted(unknown)} for {cls.__name__}; it reads "
      f"{sorted(fields)} (a key that changes the model's behaviour cannot be ignored)"
    )
  md_core.check_config_types(cls, kwargs, where)
  return cls(**kwargs)


def _check_common(cfg, where: str) -> None:
  if cfg.patch_size != 1:
    raise ValueError(
      f"{where}: patch_size={cfg.patch_size} is not supported; the Flux transformers take packed "
      "2x2 latents with patch_size=1"
    )
  if sum(cfg.axes_dims_rope) != cfg.attention_head_dim:
    raise ValueError(
      f"{where}: axes_dims_rope={cfg.axes_dims_rope} must sum to attention_head_dim="
      f"{cfg.attention_head_dim}"
    )
  if cfg.remat not in md_core.REMAT_POLICIES:
    raise ValueError(f"{where}: remat={cfg.remat!r} is not one of {md_core.REMAT_POLICIES}")
  if not isinstance(cfg.attention, mda.AttentionConfig):
    raise TypeError(
      f"{where}: attention must be an md_attention.AttentionConfig, got {cfg.attention!r}"
    )


@dataclasses.dataclass(frozen=True)
class FluxConfig:
  """Flux.1 transformer (diffusers `FluxTransformer2DModel`) sizes, plus md's run-time settings.

  The reference keys are those of `transformer/config.json`; `attention` (an
  `md_attention.AttentionConfig`, e.g. `AttentionConfig(implementation="ulysses")` for context
  parallelism) and `remat` (a name from `md_core.REMAT_POLICIES`: "none", "full", "dots" keeps every
  matmul output, "dots_no_batch" those without a batch dimension; what the scanned blocks recompute
  in the backward pass) are md's own and never read from the file.
  """

  patch_size: int = 1
  in_channels: int = 64
  out_channels: int | None = None
  num_layers: int = 19
  num_single_layers: int = 38
  attention_head_dim: int = 128
  num_attention_heads: int = 24
  joint_attention_dim: int = 4096
  pooled_projection_dim: int = 768
  guidance_embeds: bool = False
  axes_dims_rope: tuple[int, ...] = (16, 56, 56)
  attention: mda.AttentionConfig = dataclasses.field(default_factory=mda.AttentionConfig)
  remat: str = "none"

  _MD_ONLY = ("attention", "remat")
  rope_theta = 10000.0
  mlp_ratio = 4.0

  def __post_init__(self):
    object.__setattr__(self, "axes_dims_rope", tuple(self.axes_dims_rope))
    _check_common(self, "FluxConfig")
    if len(self.axes_dims_rope) != 3:
      raise ValueError(f"FluxConfig: axes_dims_rope={self.axes_dims_rope} must have 3 axes")

  @property
  def inner_dim(self) -> int:
    return self.num_attention_heads * self.attention_head_dim

  @property
  def out_dim(self) -> int:
    return self.patch_size * self.patch_size * (self.out_channels or self.in_channels)

  @property
  def mlp_hidden_dim(self) -> int:
    return int(self.inner_dim * self.mlp_ratio)

  @classmethod
  def from_dict(cls, d: Mapping[str, Any], *, where: str = "config") -> FluxConfig:
    """From a reference `config.json` dict; unknown keys raise `ValueError` naming them."""
    name = d.get("_class_name")
    if name not in (None, "FluxTransformer2DModel"):
      raise ValueError(f"{where}: _class_name={name!r}, expected 'FluxTransformer2DModel'")
    return _from_dict(cls, d, where=where)

  @classmethod
  def from_json(cls, path: str | os.PathLike) -> FluxConfig:
    return cls.from_dict(md_core.read_json(path), where=str(path))


@dataclasses.dataclass(frozen=True)
class Flux2Config:
  """Flux.2 transformer (diffusers `Flux2Transformer2DModel`) sizes, plus md's run-time settings.

  Klein 4B and 9B differ only in these numbers. `attention` and `remat` are md's own (see
  `FluxConfig`).
  """

  patch_size: int = 1
  in_channels: int = 128
  out_channels: int | None = None
  num_layers: int = 8
  num_single_layers: int = 48
  attention_head_dim: int = 128
  num_attention_heads: int = 48
  joint_attention_dim: int = 15360
  timestep_guidance_channels: int = 256
  mlp_ratio: float = 3.0
  axes_dims_rope: tuple[int, ...] = (32, 32, 32, 32)
  rope_theta: float = 2000.0
  eps: float = 1e-6
  guidance_embeds: bool = True
  attention: mda.AttentionConfig = dataclasses.field(default_factory=mda.AttentionConfig)
  remat: str = "none"

  _MD_ONLY = ("attention", "remat")

  def __post_init__(self):
    object.__setattr__(self, "axes_dims_rope", tuple(self.axes_dims_rope))
    _check_common(self, "Flux2Config")

  @property
  def inner_dim(self) -> int:
    return self.num_attention_heads * self.attention_head_dim

  @property
  def out_dim(self) -> int:
    return self.patch_size * self.patch_size * (self.out_channels or self.in_channels)

  @property
  def mlp_hidden_dim(self) -> int:
    return int(self.inner_dim * self.mlp_ratio)

  @classmethod
  def from_dict(cls, d: Mapping[str, Any], *, where: str = "config") -> Flux2Config:
    """From a reference `config.json` dict; unknown keys raise `ValueError` naming them."""
    name = d.get("_class_name")
    if name not in (None, "Flux2Transformer2DModel"):
      raise ValueError(f"{where}: _class_name={name!r}, expected 'Flux2Transformer2DModel'")
    return _from_dict(cls, d, where=where)

  @classmethod
  def from_json(cls, path: str | os.PathLike) -> Flux2Config:
    return cls.from_dict(md_core.read_json(path), where=str(path))


FLUX_VARIANTS: dict[str, FluxConfig] = {
  # black-forest-labs/FLUX.1-dev and FLUX.1-schnell (transformer/config.json).
  "dev": FluxConfig(guidance_embeds=True),
  "schnell": FluxConfig(guidance_embeds=False),
  # Tiny sizes for tests (the parity fixtures use these).
  "tiny": FluxConfig(
    in_channels=16,
    num_layers=2,
    num_single_layers=2,
    attention_head_dim=16,
    num_attention_heads=4,
    joint_attention_dim=24,
    pooled_projection_dim=12,
    guidance_embeds=True,
    axes_dims_rope=(4, 6, 6),
  ),
}

FLUX2_VARIANTS: dict[str, Flux2Config] = {
  # black-forest-labs/FLUX.2-dev: the reference's defaults (48 heads, 8 + 48 blocks, Mistral joint dim).
  "dev": Flux2Config(),
  # black-forest-labs/FLUX.2-klein-4B and -9B (transformer/config.json).
  "klein-4b": Flux2Config(
    num_attention_heads=24,
    num_layers=5,
    num_single_layers=20,
    joint_attention_dim=7680,
    guidance_embeds=False,
  ),
  "klein-9b": Flux2Config(
    num_attention_heads=32,
    num_layers=8,
    num_single_layers=24,
    joint_attention_dim=12288,
    guidance_embeds=False,
  ),
  "tiny": Flux2Config(
    in_channels=16,
    num_layers=2,
    num_single_layers=2,
    attention_head_dim=16,
    num_attention_heads=4,
    joint_attention_dim=24,
    timestep_guidance_channels=32,
    axes_dims_rope=(4, 4, 4, 4),
    guidance_embeds=True,
  ),
}
