"""`LTX2Config`: the LTX-2 audio+video transformer's settings, read from diffusers' `config.json`."""

from __future__ import annotations

import dataclasses
import os
import pathlib
from collections.abc import Mapping
from typing import Any

import md_attention as mda
import md_core

LTX2_ROPE_TYPES = ("interleaved", "split")

# Keys diffusers writes that do not change the model.
_IGNORED_KEYS = {"_class_name", "_diffusers_version", "_name_or_path", "_use_default_values"}


@dataclasses.dataclass(frozen=True)
class LTX2Config:
  """The `LTX2VideoTransformer3DModel` of LTX-2 (19B) and its later variants (LTX-2.3 options).

  All attributes but the last three are diffusers' config keys (same names, same defaults); the last three
  are md's run-time settings.

  Attributes:
    in_channels: channels of one packed video latent token (128).
    out_channels: predicted channels per video token (None: `in_channels`).
    patch_size: spatial patch of the video packing (rotary positions step by it).
    patch_size_t: temporal patch of the video packing.
    num_attention_heads: video heads; the video width is `num_attention_heads * attention_head_dim`.
    attention_head_dim: width of one video head.
    cross_attention_dim: width of the video text states the video cross-attention reads.
    vae_scale_factors: `(time, height, width)` VAE compression, mapping latent to pixel positions.
    pos_embed_max_pos: rotary normalisation of video time positions (seconds).
    base_height: rotary normalisation of pixel rows.
    base_width: rotary normalisation of pixel columns.
    gated_attn: per-head sigmoid gates on the video attentions (LTX-2.3).
    cross_attn_mod: adaLN modulation of the video text cross-attention query and of the text states (2.3).
    audio_in_channels: channels of one packed audio latent token (128).
    audio_out_channels: predicted channels per audio token (None: `audio_in_channels`).
    audio_patch_size: kept for the config; audio tokens are packed by the pipeline.
    audio_patch_size_t: temporal patch of the audio packing.
    audio_num_attention_heads: audio heads (also of the audio<->video cross-attentions).
    audio_attention_head_dim: width of one audio head.
    audio_cross_attention_dim: width of the audio text states; also the rotary width of the audio<->video
      cross-attentions, so it must equal the audio width.
    audio_scale_factor: audio VAE time compression (latent frames → mel frames).
    audio_pos_embed_max_pos: rotary normalisation of audio time positions (seconds).
    audio_sampling_rate: mel sampling rate of the audio VAE.
    audio_hop_length: mel hop length of the audio VAE.
    audio_gated_attn: per-head gates on the audio attentions.
    audio_cross_attn_mod: adaLN modulation of the audio text cross-attention query and text states.
    num_layers: transformer blocks.
    activation_fn: feed-forward activation; must be "gelu-approximate".
    qk_norm: must be "rms_norm_across_heads".
    norm_elementwise_affine: learned scales on the blocks' RMS norms (False in the real models).
    norm_eps: epsilon of the blocks' RMS norms.
    caption_channels: width of the text connector outputs the caption projections read (3840).
    attention_bias: biases on q/k/v projections.
    attention_out_bias: bias on attention output projections.
    rope_theta: rotary base.
    rope_double_precision: rotary frequencies computed in float64 (then cast to float32).
    causal_offset: first-frame shift of the causal VAE's time positions.
    timestep_scale_multiplier: the factor the pipeline's timesteps are already scaled by (1000).
    cross_attn_timestep_scale_multiplier: the audio<->video gate timesteps are scaled by this over
      `timestep_scale_multiplier`.
    rope_type: "split" (the real models: per head, first half pairs with second half) or "interleaved".
    use_prompt_embeddings: project the text states in the transformer (LTX-2.0; 2.3 projects them in the
      connectors).
    perturbed_attn: self-attentions that spatio-temporal guidance can skip (`stg_blocks`).
    ff_bias: biases in the video feed-forward.
    audio_ff_bias: biases in the audio feed-forward.
    use_prompt_adaln_single: with `cross_attn_mod`, the text-state modulation follows `sigma` through its
      own adaLN-single (else only the static per-block tables).
    use_keyframes_abs_pos_embedding: a learned embedding added to tokens marked by `video_keyframes_mask`.
    attention: md-attention implementation ("auto", "dot_product", "blockwise", "cudnn", "splash", or
      context-parallel "ring", "ulysses", "ulysses_ring") for every attention.
    attention_config: further md-attention settings; its `implementation` is replaced by `attention`.
    remat: rematerialisation of each scanned block: "none", "full", "dots", "dots_no_batch".
  """

  in_channels: int = 128
  out_channels: int | None = 128
  patch_size: int = 1
  patch_size_t: int = 1
  num_attention_heads: int = 32
  attention_head_dim: int = 128
  cross_attention_dim: int = 4096
  vae_scale_factors: tuple[int, int, int] = (8, 32, 32)
  pos_embed_max_pos: int = 20
  base_height: int = 2048
  base_width: int = 2048
  gated_attn: bool = False
  cross_attn_mod: bool = False
  audio_in_channels: int = 128
  audio_out_channels: int | None = 128
  audio_patch_size: int = 1
  audio_patch_size_t: int = 1
  audio_num_attention_heads: int = 32
  audio_attention_head_dim: int = 64
  audio_cross_attention_dim: int = 2048
  audio_scale_factor: int = 4
  audio_pos_embed_max_pos: int = 20
  audio_sampling_rate: int = 16000
  audio_hop_length: int = 160
  audio_gated_attn: bool = False
  audio_cross_attn_mod: bool = False
  num_layers: int = 48
  activation_fn: str = "gelu-approximate"
  qk_norm: str = "rms_norm_across_heads"
  norm_elementwise_affine: bool = False
  norm_eps: float = 1e-6
  caption_channels: int = 3840
  attention_bias: bool = True
  attention_out_bias: bool = True
  rope_theta: float = 10000.0
  rope_double_precision: bool = True
  causal_offset: int = 1
  timestep_scale_multiplier: int = 1000
  cross_attn_timestep_scale_multiplier: int = 1000
  rope_type: str = "interleaved"
  use_prompt_embeddings: bool = True
  perturbed_attn: bool = False
  ff_bias: bool = True
  audio_ff_bias: bool = True
  use_prompt_adaln_single: bool = True
  use_keyframes_abs_pos_embedding: bool = False
  attention: str = "auto"
  attention_config: mda.AttentionConfig | None = None
  remat: str = "none"

  def __post_init__(self):
    if self.out_channels is None:
      object.__setattr__(self, "out_channels", self.in_channels)
    if self.audio_out_channels is None:
      object.__setattr__(self, "audio_out_channels", self.audio_in_channels)
    object.__setattr__(self, "vae_scale_factors", tuple(int(s) for s in self.vae_scale_factors))
    if len(self.vae_scale_factors) != 3:
      raise ValueError(
        f"LTX2Config.vae_scale_factors={self.vae_scale_factors} must be (time, height, width)"
      )
    if self.qk_norm != "rms_norm_across_heads":
      raise ValueError(
        f"LTX2Config.qk_norm={self.qk_norm!r} is not supported; LTX-2 implements only "
        "'rms_norm_across_heads'"
      )
    if self.activation_fn != "gelu-approximate":
      raise ValueError(
        f"LTX2Config.activation_fn={self.activation_fn!r} is not supported; LTX-2 uses "
        "'gelu-approximate' (tanh GELU)"
      )
    if self.rope_type not in LTX2_ROPE_TYPES:
      raise ValueError(f"LTX2Config.rope_type={self.rope_type!r} is not one of {LTX2_ROPE_TYPES}")
    for name in ("patch_size", "patch_size_t", "audio_patch_size_t", "num_layers"):
      if getattr(self, name) < 1:
        raise ValueError(f"LTX2Config.{name}={getattr(self, name)} must be positive")
    if self.audio_cross_attention_dim != self.audio_dim:
      raise ValueError(
        f"audio_cross_attention_dim={self.audio_cross_attention_dim} must equal the audio width "
        f"audio_num_attention_heads * audio_attention_head_dim = {self.audio_dim}: it is the rotary width "
        "of the audio<->video cross-attentions (2048 in LTX-2)"
      )
    if (
      self.use_prompt_embeddings or self.prompt_modulation
    ) and self.cross_attention_dim != self.dim:
      raise ValueError(
        f"cross_attention_dim={self.cross_attention_dim} must equal the video width "
        f"num_attention_heads * attention_head_dim = {self.dim} when the text states are projected "
        "(use_prompt_embeddings) or modulated (cross_attn_mod) to that width"
      )
    if self.rope_type == "split":
      for name, width, heads in (
        ("video", self.dim, self.num_attention_heads),
        ("audio", self.audio_dim, self.audio_num_attention_heads),
        ("audio<->video", self.audio_dim, self.num_attention_heads),
      ):
        if (width // 2) % heads:
          raise ValueError(
            f"split rotary embedding: half the {name} width {width} // 2 is not divisible by {heads} heads"
          )
    if self.attention not in mda.IMPLEMENTATIONS:
      raise ValueError(
        f"LTX2Config.attention={self.attention!r} is not one of {', '.join(mda.IMPLEMENTATIONS)}"
      )
    if self.remat not in md_core.REMAT_POLICIES:
      raise ValueError(f"LTX2Config.remat={self.remat!r} is not one of {md_core.REMAT_POLICIES}")

  @property
  def dim(self) -> int:
    """The video width."""
    return self.num_attention_heads * self.attention_head_dim

  @property
  def audio_dim(self) -> int:
    """The audio width."""
    return self.audio_num_attention_heads * self.audio_attention_head_dim

  @property
  def prompt_modulation(self) -> bool:
    """Whether the text cross-attentions are modulated (LTX-2.3's `cross_attn_mod` on either stream)."""
    return self.cross_attn_mod or self.audio_cross_attn_mod

  @property
  def attention_settings(self) -> mda.AttentionConfig:
    base = self.attention_config or mda.AttentionConfig()
    return dataclasses.replace(base, implementation=self.attention)

  @classmethod
  def from_dict(cls, d: Mapping[str, Any], **overrides) -> LTX2Config:
    """Reads diffusers' `LTX2VideoTransformer3DModel` config (keys as in `transformer/config.json`).

    Raises:
      ValueError: for another model class or keys md does not implement (named, with the supported ones).
    """
    d = dict(d)
    name = d.get("_class_name")
    if name not in (None, "LTX2VideoTransformer3DModel"):
      raise ValueError(
        f"config is for {name!r}; LTX2Config reads LTX2VideoTransformer3DModel configs (LTX-Video "
        "0.9.x is LTXVideoTransformer3DModel, read by LTXConfig)"
      )
    fields = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(k for k in d if k not in fields and k not in _IGNORED_KEYS)
    if unknown:
      raise ValueError(
        f"LTX-2 transformer config keys {unknown} are not supported (they would change the model); "
        f"supported keys: {sorted(fields)}"
      )
    kwargs = {k: v for k, v in d.items() if k in fields}
    kwargs.update(overrides)
    return cls(**kwargs)

  @classmethod
  def from_json(cls, path: str | os.PathLike, **overrides) -> LTX2Config:
    """Reads `config.json` (the file, or the folder holding it)."""
    path = pathlib.Path(path)
    if path.is_dir():
      path = path / "config.json"
    return cls.from_dict(md_core.read_json(path), **overrides)


_REAL = dict(rope_type="split")

LTX2_VARIANTS: dict[str, LTX2Config] = {
  # Lightricks/LTX-2 `transformer/config.json` (tools/configs/ltx/ltx2_transformer.json).
  "2.0": LTX2Config(**_REAL),
  # Lightricks/LTX-2.3 (tools/configs/ltx/ltx2_transformer_2.3.json).
  "2.3": LTX2Config(
    **_REAL, gated_attn=True, cross_attn_mod=True, audio_gated_attn=True, audio_cross_attn_mod=True,
    use_prompt_embeddings=False, perturbed_attn=True,
  ),
  # Test size (tools/fixtures/ltx2_transformer.py builds the same one in diffusers).
  "tiny": LTX2Config(
    in_channels=8, out_channels=8, num_attention_heads=4, attention_head_dim=8,
    cross_attention_dim=32, audio_in_channels=6, audio_out_channels=6, audio_num_attention_heads=2,
    audio_attention_head_dim=12, audio_cross_attention_dim=24, num_layers=2, caption_channels=20,
    rope_type="split",
  ),
}  # fmt: skip
