"""Configs of the SD UNet and ControlNet, read from the reference's `config.json`."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any

from md_core import check_config_types, read_json

DOWN_BLOCKS = ("CrossAttnDownBlock2D", "DownBlock2D")
UP_BLOCKS = ("CrossAttnUpBlock2D", "UpBlock2D")
MID_BLOCKS = ("UNetMidBlock2DCrossAttn",)

# Keys that record provenance or only matter for features md does not build (and are inert at the values the
# real checkpoints use); they are read and dropped.
_INERT = {
  "_class_name",
  "_diffusers_version",
  "_name_or_path",
  "_use_default_values",
  "dropout",  # inference only
  "addition_embed_type_num_heads",  # used by addition_embed_type="text" only
  "mid_block_only_cross_attention",  # used by UNetMidBlock2DSimpleCrossAttn only
}

# Behaviour-changing keys md does not implement: the value(s) md accepts for each (the reference's defaults).
_FIXED: dict[str, tuple] = {
  "class_embed_type": (None,),
  "num_class_embeds": (None,),
  "class_embeddings_concat": (False,),
  "encoder_hid_dim": (None,),
  "encoder_hid_dim_type": (None,),
  "time_embedding_type": ("positional",),
  "time_embedding_act_fn": (None,),
  "timestep_post_act": (None,),
  "time_cond_proj_dim": (None,),
  "dual_cross_attention": (False,),
  "only_cross_attention": (False, (False,)),
  "resnet_time_scale_shift": ("default",),
  "resnet_skip_time_act": (False,),
  "resnet_out_scale_factor": (1.0,),
  "attention_type": ("default",),
  "cross_attention_norm": (None,),
  "num_attention_heads": (None,),
  "global_pool_conditions": (False,),
}


def _per_block(value: Any, n: int, name: str, source: str) -> tuple:
  if isinstance(value, list | tuple):
    if len(value) != n:
      raise ValueError(f"{source}: {name}={list(value)} must have one entry per block ({n} blocks)")
    return tuple(tuple(v) if isinstance(v, list) else v for v in value)
  return (value,) * n


def _check_fixed(d: Mapping[str, Any], source: str, what: str) -> None:
  for key, allowed in _FIXED.items():
    if key not in d:
      continue
    value = d[key]
    value = tuple(value) if isinstance(value, list) else value
    if isinstance(value, tuple) and value and all(v is False for v in value):
      value = (False,)
    if value not in allowed:
      raise ValueError(
        f"{source}: {key}={d[key]!r} is not supported by md's {what} (supported: "
        f"{' or '.join(repr(a) for a in allowed)}); the SD 1.x/2.x/XL checkpoints use the default"
      )


def _check_unknown(d: Mapping[str, Any], fields: set[str], source: str, what: str) -> None:
  unknown = sorted(set(d) - fields - _INERT - set(_FIXED))
  if unknown:
    raise ValueError(
      f"{source}: unknown config key(s) {unknown} for {what}; md reads {sorted(fields)} (and ignores "
      f"{sorted(_INERT)})"
    )


@dataclasses.dataclass(frozen=True)
class UNetConfig:
  """The diffusers `UNet2DConditionModel` settings md implements (SD 1.x, 2.x, XL).

  Per-block settings are tuples with one entry per down block, in down-block order. `num_attention_heads` is
  what the reference's config calls `attention_head_dim` (a historical misnomer it keeps: the value is the
  number of heads). `transformer_layers_per_block` entries may themselves be per-layer tuples.
  """

  in_channels: int = 4
  out_channels: int = 4
  block_out_channels: tuple[int, ...] = (320, 640, 1280, 1280)
  down_block_types: tuple[str, ...] = (
    "CrossAttnDownBlock2D",
    "CrossAttnDownBlock2D",
    "CrossAttnDownBlock2D",
    "DownBlock2D",
  )
  up_block_types: tuple[str, ...] = (
    "UpBlock2D",
    "CrossAttnUpBlock2D",
    "CrossAttnUpBlock2D",
    "CrossAttnUpBlock2D",
  )
  mid_block_type: str = "UNetMidBlock2DCrossAttn"
  layers_per_block: tuple[int, ...] = (2, 2, 2, 2)
  transformer_layers_per_block: tuple = (1, 1, 1, 1)
  reverse_transformer_layers_per_block: tuple | None = None
  num_attention_heads: tuple[int, ...] = (8, 8, 8, 8)
  cross_attention_dim: tuple[int, ...] = (768, 768, 768, 768)
  use_linear_projection: bool = False
  upcast_attention: bool = False
  flip_sin_to_cos: bool = True
  freq_shift: float = 0
  norm_num_groups: int = 32
  norm_eps: float = 1e-5
  act_fn: str = "silu"
  downsample_padding: int = 1
  mid_block_scale_factor: float = 1.0
  center_input_sample: bool = False
  conv_in_kernel: int = 3
  conv_out_kernel: int = 3
  time_embedding_dim: int | None = None
  addition_embed_type: str | None = None
  addition_time_embed_dim: int | None = None
  projection_class_embeddings_input_dim: int | None = None
  sample_size: int | None = (
    None  # the latent size it was trained at (pipelines' default); no effect here
  )

  def __post_init__(self):
    n = len(self.down_block_types)
    for name in (
      "block_out_channels",
      "up_block_types",
      "layers_per_block",
      "transformer_layers_per_block",
      "num_attention_heads",
      "cross_attention_dim",
    ):
      if len(getattr(self, name)) != n:
        raise ValueError(
          f"UNetConfig: {name}={getattr(self, name)} must have {n} entries (one per down block)"
        )
    for t in self.down_block_types:
      if t not in DOWN_BLOCKS:
        raise ValueError(
          f"UNetConfig: down block type {t!r} is not supported; md has {DOWN_BLOCKS}"
        )
    for t in self.up_block_types:
      if t not in UP_BLOCKS:
        raise ValueError(f"UNetConfig: up block type {t!r} is not supported; md has {UP_BLOCKS}")
    if self.mid_block_type not in MID_BLOCKS:
      raise ValueError(
        f"UNetConfig: mid_block_type={self.mid_block_type!r} is not supported; md has {MID_BLOCKS}"
      )
    if self.addition_embed_type not in (None, "text_time"):
      raise ValueError(
        f"UNetConfig: addition_embed_type={self.addition_embed_type!r} is not supported; md has None "
        "(SD 1.x/2.x) and 'text_time' (SDXL)"
      )
    if self.addition_embed_type == "text_time" and (
      self.addition_time_embed_dim is None or self.projection_class_embeddings_input_dim is None
    ):
      raise ValueError(
        "UNetConfig: addition_embed_type='text_time' needs addition_time_embed_dim and "
        "projection_class_embeddings_input_dim"
      )
    for c, h in zip(self.block_out_channels, self.num_attention_heads):
      if c % h:
        raise ValueError(f"UNetConfig: {h} attention heads do not divide {c} channels")
      if c % self.norm_num_groups:
        raise ValueError(f"UNetConfig: norm_num_groups={self.norm_num_groups} must divide {c}")

  @property
  def time_embed_dim(self) -> int:
    return self.time_embedding_dim or 4 * self.block_out_channels[0]

  @property
  def downsample_factor(self) -> int:
    """How much the sample's height and width shrink at the bottom of the UNet."""
    return 2 ** (len(self.block_out_channels) - 1)

  @classmethod
  def from_dict(cls, d: Mapping[str, Any], *, source: str = "UNet config") -> UNetConfig:
    """Reads a diffusers `UNet2DConditionModel` config dict; unsupported settings raise ValueError."""
    fields = {f.name for f in dataclasses.fields(cls)} | {"attention_head_dim"}
    fields.discard("num_attention_heads")
    _check_unknown(d, fields, source, "UNet2DConditionModel")
    _check_fixed(d, source, "UNet2DConditionModel")
    kw = _common_kwargs(d, source)
    n = len(kw["down_block_types"])
    kw["layers_per_block"] = _per_block(d.get("layers_per_block", 2), n, "layers_per_block", source)
    kw["up_block_types"] = tuple(d.get("up_block_types", cls.up_block_types))
    rev = d.get("reverse_transformer_layers_per_block")
    if rev is not None:
      rev = tuple(tuple(r) if isinstance(r, list | tuple) else (r,) for r in rev)
    kw["reverse_transformer_layers_per_block"] = rev
    for key in (
      "center_input_sample",
      "conv_in_kernel",
      "conv_out_kernel",
      "time_embedding_dim",
      "sample_size",
    ):
      if key in d:
        kw[key] = d[key]
    if kw["norm_num_groups"] is None:
      raise ValueError(f"{source}: norm_num_groups=None (no final norm) is not supported by md")
    check_config_types(cls, kw, source)
    return cls(**kw)

  @classmethod
  def from_json(cls, path: str | os.PathLike) -> UNetConfig:
    """Reads a UNet `config.json`."""
    return cls.from_dict(read_json(path), source=str(path))


def _common_kwargs(d: Mapping[str, Any], source: str) -> dict[str, Any]:
  """Settings the UNet and the ControlNet share, normalised to per-block tuples."""
  down = tuple(d.get("down_block_types", UNetConfig.down_block_types))
  n = len(down)
  heads = d.get("attention_head_dim", 8)
  kw: dict[str, Any] = dict(
    in_channels=d.get("in_channels", 4),
    block_out_channels=tuple(d.get("block_out_channels", (320, 640, 1280, 1280))),
    down_block_types=down,
    mid_block_type=d.get("mid_block_type") or "UNetMidBlock2DCrossAttn",
    transformer_layers_per_block=_per_block(
      d.get("transformer_layers_per_block", 1), n, "transformer_layers_per_block", source
    ),
    num_attention_heads=_per_block(heads, n, "attention_head_dim", source),
    cross_attention_dim=_per_block(
      d.get("cross_attention_dim", 1280), n, "cross_attention_dim", source
    ),
    use_linear_projection=bool(d.get("use_linear_projection", False)),
    upcast_attention=bool(d.get("upcast_attention") or False),
    flip_sin_to_cos=bool(d.get("flip_sin_to_cos", True)),
    freq_shift=d.get("freq_shift", 0),
    norm_num_groups=d.get("norm_num_groups", 32),
    norm_eps=d.get("norm_eps", 1e-5),
    act_fn=d.get("act_fn", "silu"),
    downsample_padding=d.get("downsample_padding", 1),
    mid_block_scale_factor=d.get("mid_block_scale_factor", 1.0),
    addition_embed_type=d.get("addition_embed_type"),
    addition_time_embed_dim=d.get("addition_time_embed_dim"),
    projection_class_embeddings_input_dim=d.get("projection_class_embeddings_input_dim"),
  )
  if "out_channels" in d:
    kw["out_channels"] = d["out_channels"]
  return kw


@dataclasses.dataclass(frozen=True)
class ControlNetConfig:
  """The diffusers `ControlNetModel` settings md implements (SD 1.x/2.x and SDXL ControlNets).

  The down and mid blocks are the UNet's (`unet` holds those settings); the rest is the conditioning-image
  encoder and the channel order of the conditioning image.
  """

  unet: UNetConfig = dataclasses.field(default_factory=UNetConfig)
  conditioning_channels: int = 3
  conditioning_embedding_out_channels: tuple[int, ...] = (16, 32, 96, 256)
  controlnet_conditioning_channel_order: str = "rgb"

  def __post_init__(self):
    if self.controlnet_conditioning_channel_order not in ("rgb", "bgr"):
      raise ValueError(
        "ControlNetConfig: controlnet_conditioning_channel_order="
        f"{self.controlnet_conditioning_channel_order!r} must be 'rgb' or 'bgr'"
      )

  @property
  def image_downsample_factor(self) -> int:
    """How much smaller the latents are than the conditioning image."""
    return 2 ** (len(self.conditioning_embedding_out_channels) - 1)

  @classmethod
  def from_dict(
    cls, d: Mapping[str, Any], *, source: str = "ControlNet config"
  ) -> ControlNetConfig:
    """Reads a diffusers `ControlNetModel` config dict; unsupported settings raise ValueError."""
    own = {
      "conditioning_channels",
      "conditioning_embedding_out_channels",
      "controlnet_conditioning_channel_order",
    }
    unet_fields = {
      "in_channels",
      "block_out_channels",
      "down_block_types",
      "mid_block_type",
      "layers_per_block",
      "transformer_layers_per_block",
      "attention_head_dim",
      "cross_attention_dim",
      "use_linear_projection",
      "upcast_attention",
      "flip_sin_to_cos",
      "freq_shift",
      "norm_num_groups",
      "norm_eps",
      "act_fn",
      "downsample_padding",
      "mid_block_scale_factor",
      "addition_embed_type",
      "addition_time_embed_dim",
      "projection_class_embeddings_input_dim",
    }
    _check_unknown(d, own | unet_fields | {"sample_size"}, source, "ControlNetModel")
    _check_fixed(d, source, "ControlNetModel")
    kw = _common_kwargs(d, source)
    n = len(kw["down_block_types"])
    layers = d.get("layers_per_block", 2)
    if not isinstance(layers, int):
      raise ValueError(f"{source}: ControlNetModel takes one int layers_per_block, got {layers!r}")
    kw["layers_per_block"] = (layers,) * n
    # The ControlNet has no up blocks; give the UNet config a mirror image so it validates.
    kw["up_block_types"] = tuple(
      "CrossAttnUpBlock2D" if t == "CrossAttnDownBlock2D" else "UpBlock2D"
      for t in reversed(kw["down_block_types"])
    )
    if kw["norm_num_groups"] is None:
      raise ValueError(f"{source}: norm_num_groups=None is not supported by md")
    unet = UNetConfig(**kw)
    return cls(
      unet=unet,
      conditioning_channels=d.get("conditioning_channels", 3),
      conditioning_embedding_out_channels=tuple(
        d.get("conditioning_embedding_out_channels") or (16, 32, 96, 256)
      ),
      controlnet_conditioning_channel_order=d.get("controlnet_conditioning_channel_order", "rgb"),
    )

  @classmethod
  def from_json(cls, path: str | os.PathLike) -> ControlNetConfig:
    """Reads a ControlNet `config.json`."""
    return cls.from_dict(read_json(path), source=str(path))


def _sd15() -> UNetConfig:
  return UNetConfig(sample_size=64)


def _sd21() -> UNetConfig:
  return UNetConfig(
    num_attention_heads=(5, 10, 20, 20),
    cross_attention_dim=(1024,) * 4,
    use_linear_projection=True,
    upcast_attention=True,
    sample_size=96,
  )


def _sdxl() -> UNetConfig:
  return UNetConfig(
    block_out_channels=(320, 640, 1280),
    down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
    up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
    layers_per_block=(2, 2, 2),
    transformer_layers_per_block=(1, 2, 10),
    num_attention_heads=(5, 10, 20),
    cross_attention_dim=(2048,) * 3,
    use_linear_projection=True,
    addition_embed_type="text_time",
    addition_time_embed_dim=256,
    projection_class_embeddings_input_dim=2816,
    sample_size=128,
  )


def _tiny() -> UNetConfig:
  return UNetConfig(
    block_out_channels=(32, 64),
    down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
    up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
    layers_per_block=(1, 1),
    transformer_layers_per_block=(1, 1),
    num_attention_heads=(2, 2),
    cross_attention_dim=(32, 32),
    norm_num_groups=8,
  )


VARIANTS: dict[str, UNetConfig] = {
  "sd1.5": _sd15(),
  "sd2.1": _sd21(),
  "sdxl-base": _sdxl(),
  "tiny": _tiny(),
}
"""UNet configs by name: the real SD 1.5, SD 2.1 and SDXL base UNets, and `tiny` for tests."""

CONTROLNET_VARIANTS: dict[str, ControlNetConfig] = {
  "sd1.5": ControlNetConfig(unet=dataclasses.replace(_sd15(), sample_size=None)),
  "sdxl": ControlNetConfig(
    unet=dataclasses.replace(_sdxl(), upcast_attention=False, sample_size=None)
  ),
  "tiny": ControlNetConfig(unet=_tiny(), conditioning_embedding_out_channels=(8, 16)),
}
"""ControlNet configs by name: SD 1.5 (e.g. lllyasviel/sd-controlnet-canny), SDXL, and `tiny`."""
