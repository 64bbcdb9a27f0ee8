"""`WanConfig`: the Wan 2.1 / 2.2 transformer's settings, read from diffusers' `config.json`."""

from __future__ import annotations

import dataclasses
import os
import pathlib
from collections.abc import Mapping
from typing import Any

import md_attention as mda
import md_core

# diffusers passes `qk_norm` to the blocks but always builds RMS norms over all heads; these are the values
# that mean exactly that.
_QK_NORMS = ("rms_norm_across_heads", None)

# Keys diffusers writes that do not change the model.
_IGNORED_KEYS = {"_class_name", "_diffusers_version", "_name_or_path", "_use_default_values"}


@dataclasses.dataclass(frozen=True)
class WanConfig:
  """The `WanTransformer3DModel` of Wan 2.1 (T2V, I2V, FLF2V) and Wan 2.2 (A14B experts, TI2V-5B).

  The first block of attributes are diffusers' config keys; the last three are md's run-time settings.

  Attributes:
    patch_size: `(t, h, w)` latent patch of one token.
    num_attention_heads: heads; the model width is `num_attention_heads * attention_head_dim`.
    attention_head_dim: width of one head (split into temporal / height / width rotary parts).
    in_channels: latent channels in (16; 36 for I2V: noise + mask + image latents; 48 for TI2V-5B).
    out_channels: predicted channels.
    text_dim: width of the text encoder's hidden states (UMT5-XXL: 4096).
    freq_dim: sinusoidal timestep features.
    ffn_dim: feed-forward inner width.
    num_layers: transformer blocks.
    cross_attn_norm: affine LayerNorm before cross-attention (else none).
    qk_norm: must be "rms_norm_across_heads" (or None, which diffusers treats the same).
    eps: epsilon of the block norms.
    image_dim: width of the CLIP image tokens (Wan 2.1 I2V / FLF2V: 1280), None without image branch.
    added_kv_proj_dim: input width of the image key/value projections (Wan 2.1 I2V: the model width).
      None with `image_dim` set: the projected image tokens are prepended to the text tokens and
      cross-attention reads both through its ordinary key/value projections (as diffusers does).
    rope_max_seq_len: longest rotary table per axis (latent frames / rows / columns per video).
    pos_embed_seq_len: FLF2V's learned position table over the two images' tokens (2 x 257), or None.
    attention: md-attention implementation for self-attention ("auto", "dot_product", "blockwise",
      "cudnn", "splash", or context-parallel "ring", "ulysses", "ulysses_ring").
    attention_config: further md-attention settings (block sizes, Ulysses degree...); its
      `implementation` is replaced by `attention`.
    remat: rematerialisation of each scanned block: "none", "full", "dots", "dots_no_batch".
  """

  patch_size: tuple[int, int, int] = (1, 2, 2)
  num_attention_heads: int = 40
  attention_head_dim: int = 128
  in_channels: int = 16
  out_channels: int | None = 16
  text_dim: int = 4096
  freq_dim: int = 256
  ffn_dim: int = 13824
  num_layers: int = 40
  cross_attn_norm: bool = True
  qk_norm: str | None = "rms_norm_across_heads"
  eps: float = 1e-6
  image_dim: int | None = None
  added_kv_proj_dim: int | None = None
  rope_max_seq_len: int = 1024
  pos_embed_seq_len: int | None = None
  attention: str = "auto"
  attention_config: mda.AttentionConfig | None = None
  remat: str = "none"

  def __post_init__(self):
    patch = tuple(int(p) for p in self.patch_size)
    if len(patch) != 3 or min(patch) < 1:
      raise ValueError(
        f"WanConfig.patch_size={self.patch_size} must be three positive ints (t, h, w)"
      )
    object.__setattr__(self, "patch_size", patch)
    if self.out_channels is None:
      object.__setattr__(self, "out_channels", self.in_channels)
    if self.qk_norm not in _QK_NORMS:
      raise ValueError(
        f"WanConfig.qk_norm={self.qk_norm!r} is not supported; diffusers' Wan always normalises q and k "
        f"with an RMS norm across heads: use one of {_QK_NORMS}"
      )
    if self.attention not in mda.IMPLEMENTATIONS:
      raise ValueError(
        f"WanConfig.attention={self.attention!r} is not one of {', '.join(mda.IMPLEMENTATIONS)}"
      )
    if self.remat not in md_core.REMAT_POLICIES:
      raise ValueError(f"WanConfig.remat={self.remat!r} is not one of {md_core.REMAT_POLICIES}")
    if self.attention_head_dim % 2 or self.attention_head_dim < 6:
      raise ValueError(
        f"attention_head_dim={self.attention_head_dim} must be even and >= 6 (three rotary parts)"
      )
    if self.added_kv_proj_dim is not None and self.image_dim is None:
      raise ValueError(
        f"added_kv_proj_dim={self.added_kv_proj_dim} needs image_dim (the width of the CLIP image tokens "
        "its projections read; Wan 2.1 I2V: 1280)"
      )
    if self.added_kv_proj_dim is not None and self.added_kv_proj_dim != self.dim:
      # The image embedder projects CLIP tokens to the model width, which the added projections read.
      raise ValueError(
        f"added_kv_proj_dim={self.added_kv_proj_dim} must equal the model width "
        f"num_attention_heads * attention_head_dim = {self.dim}"
      )
    if self.pos_embed_seq_len is not None and self.image_dim is None:
      raise ValueError(
        f"pos_embed_seq_len={self.pos_embed_seq_len} needs the image branch (image_dim)"
      )

  @property
  def dim(self) -> int:
    """The model width."""
    return self.num_attention_heads * self.attention_head_dim

  @property
  def rope_dims(self) -> tuple[int, int, int]:
    """Head-dim features rotated by frame, row and column position (as diffusers splits them)."""
    h = w = 2 * (self.attention_head_dim // 6)
    return self.attention_head_dim - h - w, h, w

  @property
  def attention_settings(self) -> mda.AttentionConfig:
    base = self.attention_config or mda.AttentionConfig()
    return dataclasses.replace(base, implementation=self.attention)

  @classmethod
  def from_dict(cls, d: Mapping[str, Any], **overrides) -> WanConfig:
    """Reads diffusers' `WanTransformer3DModel` config (keys as in `transformer/config.json`).

    Raises:
      ValueError: for another model class or keys md does not implement (named, with the supported ones).
    """
    d = dict(d)
    name = d.get("_class_name")
    if name not in (None, "WanTransformer3DModel"):
      raise ValueError(
        f"config is for {name!r}; WanConfig reads WanTransformer3DModel configs (VACE and Animate "
        "transformers are other classes)"
      )
    fields = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(k for k in d if k not in fields and k not in _IGNORED_KEYS)
    if unknown:
      raise ValueError(
        f"Wan transformer config keys {unknown} are not supported (they would change the model); "
        f"supported keys: {sorted(fields)}"
      )
    kwargs = {k: v for k, v in d.items() if k in fields}
    if "patch_size" in kwargs:
      kwargs["patch_size"] = tuple(kwargs["patch_size"])
    kwargs.update(overrides)
    return cls(**kwargs)

  @classmethod
  def from_json(cls, path: str | os.PathLike, **overrides) -> WanConfig:
    """Reads `config.json` (the file, or the folder holding it)."""
    path = pathlib.Path(path)
    if path.is_dir():
      path = path / "config.json"
    return cls.from_dict(md_core.read_json(path), **overrides)


_14B = dict(num_attention_heads=40, ffn_dim=13824, num_layers=40)
VARIANTS: dict[str, WanConfig] = {
  # Sizes from diffusers' scripts/convert_wan_to_diffusers.py and the hub configs (tools/configs/wan/).
  "2.1-t2v-1.3b": WanConfig(num_attention_heads=12, ffn_dim=8960, num_layers=30),
  "2.1-t2v-14b": WanConfig(**_14B),
  "2.1-i2v-14b": WanConfig(**_14B, in_channels=36, image_dim=1280, added_kv_proj_dim=5120),
  "2.1-flf2v-14b": WanConfig(
    **_14B, in_channels=36, image_dim=1280, added_kv_proj_dim=5120, pos_embed_seq_len=514
  ),
  "2.2-t2v-a14b": WanConfig(**_14B),  # both experts (transformer, transformer_2)
  "2.2-i2v-a14b": WanConfig(**_14B, in_channels=36),  # both experts; no CLIP image branch
  "2.2-ti2v-5b": WanConfig(
    num_attention_heads=24, ffn_dim=14336, num_layers=30, in_channels=48, out_channels=48
  ),
  # Test sizes (tools/fixtures/wan_transformer.py builds the same ones in diffusers).
  "tiny": WanConfig(
    num_attention_heads=4, attention_head_dim=12, in_channels=4, out_channels=4, text_dim=16,
    freq_dim=16, ffn_dim=32, num_layers=2,
  ),
  "tiny-i2v": WanConfig(
    num_attention_heads=4, attention_head_dim=12, in_channels=8, out_channels=4, text_dim=16,
    freq_dim=16, ffn_dim=32, num_layers=2, image_dim=20, added_kv_proj_dim=48,
  ),
  "tiny-ti2v": WanConfig(
    num_attention_heads=4, attention_head_dim=12, in_channels=6, out_channels=6, text_dim=16,
    freq_dim=16, ffn_dim=32, num_layers=2, cross_attn_norm=False,
  ),
}  # fmt: skip
