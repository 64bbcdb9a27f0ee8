"""`LTXConfig`: the LTX-Video transformer's settings, read from diffusers' `config.json`."""

from __future__ import annotations

import dataclasses
import os
import pathlib
from collections.abc import Mapping
from typing import Any

import md_attention as mda
import md_core

# Keys diffusers writes that do not change the model.
_IGNORED_KEYS = {"_class_name", "_diffusers_version", "_name_or_path", "_use_default_values"}

# The rotary embedding's fixed normalisation (diffusers builds it with these, whatever the config says).
ROPE_BASE_NUM_FRAMES = 20
ROPE_BASE_HEIGHT = 2048
ROPE_BASE_WIDTH = 2048
ROPE_THETA = 10000.0


@dataclasses.dataclass(frozen=True)
class LTXConfig:
  """The `LTXVideoTransformer3DModel` of LTX-Video 0.9.x (2B and 13B).

  The first block of attributes are diffusers' config keys; the last three are md's run-time settings.

  Attributes:
    in_channels: channels of one packed latent token (128 for the real VAE with patch size 1).
    out_channels: predicted channels per token.
    patch_size: spatial patch of the packing (the pipeline packs; rotary positions scale by it).
    patch_size_t: temporal patch of the packing.
    num_attention_heads: heads; the model width is `num_attention_heads * attention_head_dim`.
    attention_head_dim: width of one head.
    cross_attention_dim: key/value input width of cross-attention; the projected captions have the model
      width, so it must equal it (as in every real checkpoint).
    num_layers: transformer blocks.
    activation_fn: feed-forward activation; must be "gelu-approximate" (tanh GELU).
    qk_norm: must be "rms_norm_across_heads" (the only norm diffusers implements).
    norm_elementwise_affine: learned scales on the blocks' RMS norms (False in the real models).
    norm_eps: epsilon of the blocks' RMS norms.
    caption_channels: width of the text encoder states (T5-XXL: 4096).
    attention_bias: biases on the q/k/v projections.
    attention_out_bias: bias on the attention output projection.
    attention: md-attention implementation ("auto", "dot_product", "blockwise", "cudnn", "splash", or
      context-parallel "ring", "ulysses", "ulysses_ring") for self-attention and cross-attention.
    attention_config: further md-attention settings; its `implementation` is replaced by `attention`.
    remat: rematerialisation of each scanned block: "none", "full", "dots", "dots_no_batch".
  """

  in_channels: int = 128
  out_channels: int | None = 128
  patch_size: int = 1
  patch_size_t: int = 1
  num_attention_heads: int = 32
  attention_head_dim: int = 64
  cross_attention_dim: int = 2048
  num_layers: int = 28
  activation_fn: str = "gelu-approximate"
  qk_norm: str = "rms_norm_across_heads"
  norm_elementwise_affine: bool = False
  norm_eps: float = 1e-6
  caption_channels: int = 4096
  attention_bias: bool = True
  attention_out_bias: bool = True
  attention: str = "auto"
  attention_config: mda.AttentionConfig | None = None
  remat: str = "none"

  def __post_init__(self):
    if self.out_channels is None:
      object.__setattr__(self, "out_channels", self.in_channels)
    if self.qk_norm != "rms_norm_across_heads":
      raise ValueError(
        f"LTXConfig.qk_norm={self.qk_norm!r} is not supported; diffusers' LTX-Video implements only "
        "'rms_norm_across_heads'"
      )
    if self.activation_fn != "gelu-approximate":
      raise ValueError(
        f"LTXConfig.activation_fn={self.activation_fn!r} is not supported; LTX-Video uses "
        "'gelu-approximate' (tanh GELU)"
      )
    if self.cross_attention_dim != self.dim:
      raise ValueError(
        f"cross_attention_dim={self.cross_attention_dim} must equal the model width num_attention_heads "
        f"* attention_head_dim = {self.dim}: cross-attention reads the captions after their projection "
        "to the model width (2B: 2048, 13B: 4096)"
      )
    if self.patch_size < 1 or self.patch_size_t < 1:
      raise ValueError(
        f"patch_size={self.patch_size} and patch_size_t={self.patch_size_t} must be positive"
      )
    if self.attention not in mda.IMPLEMENTATIONS:
      raise ValueError(
        f"LTXConfig.attention={self.attention!r} is not one of {', '.join(mda.IMPLEMENTATIONS)}"
      )
    if self.remat not in md_core.REMAT_POLICIES:
      raise ValueError(f"LTXConfig.remat={self.remat!r} is not one of {md_core.REMAT_POLICIES}")
    if self.dim // 6 < 1:
      raise ValueError(
        f"model width {self.dim} is too small for the 3-axis rotary embedding (>= 6)"
      )

  @property
  def dim(self) -> int:
    """The model width."""
    return self.num_attention_heads * self.attention_head_dim

  @property
  def attention_settings(self) -> mda.AttentionConfig:
    base = self.attention_config or mda.AttentionConfig()
    return dataclasses.replace(base, implementation=self.attention)

  @classmethod
  def from_dict(cls, d: Mapping[str, Any], **overrides) -> LTXConfig:
    """Reads diffusers' `LTXVideoTransformer3DModel` config (keys as in `transformer/config.json`).

    Raises:
      ValueError: for another model class or keys md does not implement (named, with the supported ones).
    """
    d = dict(d)
    name = d.get("_class_name")
    if name not in (None, "LTXVideoTransformer3DModel"):
      raise ValueError(
        f"config is for {name!r}; LTXConfig reads LTXVideoTransformer3DModel configs (LTX-2 is "
        "LTX2VideoTransformer3DModel, another model)"
      )
    fields = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(k for k in d if k not in fields and k not in _IGNORED_KEYS)
    if unknown:
      raise ValueError(
        f"LTX-Video transformer config keys {unknown} are not supported (they would change the model); "
        f"supported keys: {sorted(fields)}"
      )
    kwargs = {k: v for k, v in d.items() if k in fields}
    kwargs.update(overrides)
    return cls(**kwargs)

  @classmethod
  def from_json(cls, path: str | os.PathLike, **overrides) -> LTXConfig:
    """Reads `config.json` (the file, or the folder holding it)."""
    path = pathlib.Path(path)
    if path.is_dir():
      path = path / "config.json"
    return cls.from_dict(md_core.read_json(path), **overrides)


VARIANTS: dict[str, LTXConfig] = {
  # Sizes from tools/configs/ltx/ (see its README for where they come from).
  "0.9-2b": LTXConfig(),  # LTX-Video 0.9.0 … 0.9.6 (2B)
  "0.9.7-13b": LTXConfig(attention_head_dim=128, cross_attention_dim=4096, num_layers=48),
  "0.9.8-13b": LTXConfig(attention_head_dim=128, cross_attention_dim=4096, num_layers=48),
  # Test size (tools/fixtures/ltx_transformer.py builds the same one in diffusers).
  "tiny": LTXConfig(
    in_channels=8, out_channels=8, num_attention_heads=2, attention_head_dim=16,
    cross_attention_dim=32, num_layers=2, caption_channels=24,
  ),
}  # fmt: skip
