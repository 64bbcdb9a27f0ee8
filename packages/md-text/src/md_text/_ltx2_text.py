"""LTX-2's text path after Gemma 3: the feature extractor and the video / audio text connectors
(diffusers `LTX2TextConnectors`, the `connectors/` folder of the LTX-2 repos).

1. Packing: the pipeline stacks Gemma's `num_hidden_layers + 1` hidden states behind each feature,
   `[B, S, C * L]` with the layer index fastest (`ltx2_pack_hidden_states`); these are LTX-2's
   `prompt_embeds`.
2. Feature extraction, by version:
   - LTX-2.0: per prompt and per layer, the hidden states are centred on their mean over the real tokens
     and all features and divided by their range (max - min) over the same, times `scale_factor` (8);
     padded tokens become zero (`ltx2_masked_mean_range_norm`); one shared linear `text_proj_in` to the
     caption width.
   - LTX-2.3 (`per_modality_projections`): each token and layer RMS-normalised over the features, padded
     tokens zeroed, scaled by `sqrt(hidden_dim / caption_channels)` of each stream and projected by
     per-stream linears (`video_text_proj_in`, `audio_text_proj_in`, with bias).
3. Connectors, one per stream: the real tokens moved to the front (order kept) and the tail filled with
   learnable registers (tiled over the sequence, indexed by absolute position), then pre-norm transformer
   blocks (RMS norms without weights; self-attention with biased projections, RMS norms with weights on the
   whole query / key width, 1-D rotary embeddings over fractional positions `i / rope_base_seq_len` mapped to
   `[-1, 1)`, "interleaved" over the whole width or "split" per head, optional per-head sigmoid gates; a tanh
   GELU MLP), and a final RMS norm. Without registers the padded keys are masked instead.

The connectors' returned mask is all ones: with registers every position holds a token, and the reference's
mask conversion marks every position valid without them too (reproduced as is).
"""

from __future__ import annotations

import dataclasses
import math
import os
import pathlib
from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import md_attention as mda
import md_core
from md_core import nn
from md_text._gemma3 import Gemma3Encoder

_F32 = jnp.float32

ROPE_TYPES = ("interleaved", "split")
# Config keys with no effect on the forward pass (diffusers bookkeeping; `causal_temporal_positioning` is
# stored by the reference but not read by its forward).
_IGNORED_KEYS = {
  "_class_name",
  "_diffusers_version",
  "_name_or_path",
  "causal_temporal_positioning",
}


@dataclasses.dataclass(frozen=True)
class LTX2ConnectorsConfig:
  """diffusers `LTX2TextConnectors` config (`connectors/config.json`); defaults are diffusers'.

  Attributes:
    caption_channels: Gemma's hidden size (3840 for Gemma 3 12B).
    text_proj_in_factor: stacked hidden states per feature (Gemma's layers + 1: 49).
    video_connector_num_attention_heads, video_connector_attention_head_dim: the video connector's heads
      (its width is their product).
    video_connector_num_layers: video connector blocks.
    video_connector_num_learnable_registers: registers that fill the padding (None: mask it instead).
    video_gated_attn: per-head sigmoid gates on the video connector's attention output.
    audio_*: the same for the audio connector.
    connector_rope_base_seq_len: positions are `i / connector_rope_base_seq_len`.
    rope_theta: rotary base.
    rope_double_precision: rotary frequencies computed in float64 (then rounded to float32).
    rope_type: "interleaved" (pairs of adjacent features over the whole width) or "split" (per head, first
      half with second half).
    per_modality_projections: LTX-2.3's per-token RMS normalisation and per-stream projections; else
      LTX-2.0's masked mean/range normalisation and one shared projection.
    video_hidden_dim, audio_hidden_dim: widths of the per-stream projections (LTX-2.3).
    proj_bias: the projections have a bias.
  """

  caption_channels: int = 3840
  text_proj_in_factor: int = 49
  video_connector_num_attention_heads: int = 30
  video_connector_attention_head_dim: int = 128
  video_connector_num_layers: int = 2
  video_connector_num_learnable_registers: int | None = 128
  video_gated_attn: bool = False
  audio_connector_num_attention_heads: int = 30
  audio_connector_attention_head_dim: int = 128
  audio_connector_num_layers: int = 2
  audio_connector_num_learnable_registers: int | None = 128
  audio_gated_attn: bool = False
  connector_rope_base_seq_len: int = 4096
  rope_theta: float = 10000.0
  rope_double_precision: bool = True
  rope_type: str = "interleaved"
  per_modality_projections: bool = False
  video_hidden_dim: int = 4096
  audio_hidden_dim: int = 2048
  proj_bias: bool = False

  def __post_init__(self):
    if self.rope_type not in ROPE_TYPES:
      raise ValueError(f"rope_type={self.rope_type!r} is not one of {ROPE_TYPES}")
    for stream in ("video", "audio"):
      heads, head_dim, _, registers, _ = self.stream(stream)
      if head_dim % 2:
        raise ValueError(
          f"{stream}_connector_attention_head_dim={head_dim} must be even for rotary"
        )
      if registers is not None and registers < 1:
        raise ValueError(f"{stream}_connector_num_learnable_registers={registers} must be positive")
      width = self.projection_width(stream)
      if heads * head_dim != width:
        raise ValueError(
          f"the {stream} connector is {heads} heads x {head_dim} = {heads * head_dim} wide but its input "
          f"projection gives {width} features"
        )

  def stream(self, name: str) -> tuple[int, int, int, int | None, bool]:
    """`(heads, head_dim, layers, registers, gated)` of the "video" or "audio" connector."""
    p = f"{name}_connector_"
    return (
      getattr(self, p + "num_attention_heads"),
      getattr(self, p + "attention_head_dim"),
      getattr(self, p + "num_layers"),
      getattr(self, p + "num_learnable_registers"),
      getattr(self, f"{name}_gated_attn"),
    )

  def projection_width(self, name: str) -> int:
    """Features the input projection gives the `name` connector."""
    if self.per_modality_projections:
      return getattr(self, f"{name}_hidden_dim")
    return self.caption_channels

  @classmethod
  def from_dict(
    cls, d: Mapping[str, Any], *, where: str = "config", **overrides
  ) -> LTX2ConnectorsConfig:
    """Reads a diffusers `LTX2TextConnectors` config; unknown keys are an error."""
    d = dict(d)
    name = d.get("_class_name", "LTX2TextConnectors")
    if name != "LTX2TextConnectors":
      raise ValueError(f"{where}: _class_name={name!r}; expected 'LTX2TextConnectors'")
    fields = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(
      k for k in d if k not in fields and k not in _IGNORED_KEYS and not k.startswith("_")
    )
    if unknown:
      raise ValueError(
        f"{where}: LTX2TextConnectors config keys {unknown} are not supported; supported: "
        f"{sorted(fields)}"
      )
    kwargs = {k: d[k] for k in fields if k in d}
    kwargs.update(overrides)
    try:
      return cls(**kwargs)
    except ValueError as e:
      raise ValueError(f"{where}: {e}") from None

  @classmethod
  def from_json(cls, path: str | os.PathLike, **overrides) -> LTX2ConnectorsConfig:
    """Reads `config.json` (a file, or the folder holding it)."""
    path = pathlib.Path(path)
    if path.is_dir():
      path = path / "config.json"
    return cls.from_dict(md_core.read_json(path), where=str(path), **overrides)


LTX2_CONNECTORS_VARIANTS: dict[str, LTX2ConnectorsConfig] = {
  # Lightricks/LTX-2 `connectors` (LTX-2.0).
  "ltx-2": LTX2ConnectorsConfig(rope_type="split"),
  # LTX-2.3: per-modality projections, gated attention, 8-layer connectors, 64-wide audio heads.
  "ltx-2.3": LTX2ConnectorsConfig(
    video_connector_num_attention_heads=32, video_connector_num_layers=8, video_gated_attn=True,
    audio_connector_num_attention_heads=32, audio_connector_attention_head_dim=64,
    audio_connector_num_layers=8, audio_gated_attn=True, rope_type="split",
    per_modality_projections=True, proj_bias=True,
  ),
}  # fmt: skip


class LTX2TextEmbeds(NamedTuple):
  """What `LTX2TextConnectors` returns.

  Attributes:
    video: `[B, S, video width]` text embeddings for the video stream.
    audio: `[B, S, audio width]` text embeddings for the audio stream.
    mask: `[B, S]` int32, the mask the transformer takes with them (all ones, as the reference returns).
  """

  video: jax.Array
  audio: jax.Array
  mask: jax.Array


def ltx2_pack_hidden_states(hidden_states: jax.Array) -> jax.Array:
  """LTX-2's `prompt_embeds`: Gemma's hidden states `[L, B, S, C]` (all layers, embeddings first) →
  `[B, S, C * L]`, the layer index fastest (the pipeline stacks them on a last axis and flattens)."""
  if hidden_states.ndim != 4:
    raise ValueError(f"hidden_states must be [L, B, S, C], got shape {hidden_states.shape}")
  n, b, s, c = hidden_states.shape
  return hidden_states.transpose(1, 2, 3, 0).reshape(b, s, c * n)


def _valid_tokens(lengths: jax.Array, seq_len: int, padding_side: str) -> jax.Array:
  """`[B, S]` bool: the first `lengths` tokens (right padding) or the last ones (left padding)."""
  pos = jnp.arange(seq_len)[None, :]
  if padding_side == "right":
    return pos < lengths[:, None]
  if padding_side == "left":
    return pos >= seq_len - lengths[:, None]
  raise ValueError(f"padding_side must be 'left' or 'right', got {padding_side!r}")


def ltx2_masked_mean_range_norm(
  hidden_states: jax.Array,
  lengths: jax.Array,
  *,
  padding_side: str = "left",
  scale_factor: float = 8.0,
  eps: float = 1e-6,
) -> jax.Array:
  """LTX-2.0's feature extractor normalisation: `[B, S, C, L]` stacked hidden states → `[B, S, C * L]`.

  Per prompt and layer: `(x - mean) / (max - min + eps) * scale_factor` with mean, min and max over the
  prompt's real tokens and all features; padded tokens become zero. The real tokens are the last `lengths`
  (left padding) or the first (right padding), as the reference derives them from the mask's sums.
  Computed in float32, returned in the input dtype.
  """
  if hidden_states.ndim != 4:
    raise ValueError(f"hidden_states must be [B, S, C, L], got shape {hidden_states.shape}")
  b, s, c, n = hidden_states.shape
  x = hidden_states.astype(_F32)
  valid = _valid_tokens(lengths, s, padding_side)[:, :, None, None]
  total = jnp.sum(jnp.where(valid, x, 0.0), axis=(1, 2), keepdims=True)
  mean = total / (lengths.astype(_F32) * c + eps).reshape(b, 1, 1, 1)
  lo = jnp.min(jnp.where(valid, x, jnp.inf), axis=(1, 2), keepdims=True)
  hi = jnp.max(jnp.where(valid, x, -jnp.inf), axis=(1, 2), keepdims=True)
  out = (x - mean) / (hi - lo + eps) * scale_factor
  out = jnp.where(valid, out, 0.0).reshape(b, s, c * n)
  return out.astype(hidden_states.dtype)


def ltx2_token_rms_norm(hidden_states: jax.Array, eps: float = 1e-6) -> jax.Array:
  """LTX-2.3's feature extractor normalisation: each token and layer of `[B, S, C, L]` divided by its RMS
  over the C features (no weight)."""
  x = hidden_states
  return x * jax.lax.rsqrt(jnp.mean(jnp.square(x), axis=2, keepdims=True) + eps)


def connector_rope_tables(
  cfg: LTX2ConnectorsConfig, heads: int, head_dim: int, seq_len: int
) -> tuple[np.ndarray, np.ndarray]:
  """The connectors' rotary tables `(cos, sin)` `[S, heads, head_dim]` float32 for positions `0..S-1`.

  Frequencies `theta ** linspace(0, 1, width / 2) * pi / 2` (float64 when `rope_double_precision`, then
  float32; else float32 as torch computes them) over the whole width `heads * head_dim`; angles `(2 i / rope_base_seq_len - 1) * freq` in
  float32, as the reference computes them. "interleaved": each frequency covers two adjacent features;
  "split": head `h` takes frequencies `h * head_dim/2 ..` for its first half and again its second half.
  Constants of the shapes: computed with numpy at trace time.
  """
  width = heads * head_dim
  if cfg.rope_double_precision:
    steps = np.linspace(0.0, 1.0, width // 2, dtype=np.float64)
    freqs = (np.power(cfg.rope_theta, steps) * np.pi / 2.0).astype(np.float32)
  else:
    # torch's float32 linspace, and its float32 pow rounded once (NumPy's float32 pow is often 1 ulp off,
    # 1e-3 radians at theta 10000), then each product rounded to float32 as torch does.
    steps = md_core.torch_linspace_f32(0.0, 1.0, width // 2)
    powers = np.power(np.float64(cfg.rope_theta), steps.astype(np.float64)).astype(np.float32)
    freqs = powers * np.float32(np.pi) / np.float32(2.0)
  grid = np.arange(seq_len, dtype=np.float32) / np.float32(cfg.connector_rope_base_seq_len)
  angles = (grid[:, None] * np.float32(2.0) - np.float32(1.0)) * freqs[None, :]  # [S, width/2]
  cos, sin = np.cos(angles.astype(np.float64)), np.sin(angles.astype(np.float64))
  if cfg.rope_type == "interleaved":
    cos, sin = np.repeat(cos, 2, axis=-1), np.repeat(sin, 2, axis=-1)
    cos, sin = cos.reshape(seq_len, heads, head_dim), sin.reshape(seq_len, heads, head_dim)
  else:
    cos = cos.reshape(seq_len, heads, head_dim // 2)
    sin = sin.reshape(seq_len, heads, head_dim // 2)
    cos, sin = np.concatenate([cos, cos], -1), np.concatenate([sin, sin], -1)
  return cos.astype(np.float32), sin.astype(np.float32)


def _rotate(x: jax.Array, cos: jax.Array, sin: jax.Array, interleaved: bool) -> jax.Array:
  """`x [B, S, H, D]` rotated by per-head tables `[S, H, D]`, in float32, returned in x's dtype."""
  h = x.astype(_F32)
  if interleaved:
    pairs = h.reshape(h.shape[:-1] + (-1, 2))
    rotated = jnp.stack([-pairs[..., 1], pairs[..., 0]], axis=-1).reshape(h.shape)
  else:
    first, second = jnp.split(h, 2, axis=-1)
    rotated = jnp.concatenate([-second, first], axis=-1)
  return (h * cos[None] + rotated * sin[None]).astype(x.dtype)


class _Attention(nnx.Module):
  """The connectors' self-attention (diffusers `LTX2Attention` with its processor, no cross-attention)."""

  def __init__(self, dim: int, heads: int, head_dim: int, gated: bool, *, rngs: nnx.Rngs):
    inner = heads * head_dim
    self.heads, self.head_dim = heads, head_dim
    self.to_q = nn.Dense(dim, inner, axes=("embed", "heads"), rngs=rngs)
    self.to_k = nn.Dense(dim, inner, axes=("embed", "heads"), rngs=rngs)
    self.to_v = nn.Dense(dim, inner, axes=("embed", "heads"), rngs=rngs)
    self.norm_q = nn.RMSNorm(inner, eps=1e-6, rngs=rngs)
    self.norm_k = nn.RMSNorm(inner, eps=1e-6, rngs=rngs)
    self.to_out = nn.Dense(inner, dim, axes=("heads", "embed"), rngs=rngs)
    self.to_gate_logits = nn.Dense(dim, heads, axes=("embed", None), rngs=rngs) if gated else None

  def __call__(self, x, cos, sin, mask, interleaved: bool, config: mda.AttentionConfig):
    b, s, _ = x.shape
    shape = (b, s, self.heads, self.head_dim)
    q = _rotate(self.norm_q(self.to_q(x)).reshape(shape), cos, sin, interleaved)
    k = _rotate(self.norm_k(self.to_k(x)).reshape(shape), cos, sin, interleaved)
    v = self.to_v(x).reshape(shape)
    out = mda.attention(q, k, v, mask=mask, config=config)  # [B, S, H, D]
    if self.to_gate_logits is not None:
      out = out * (2.0 * jax.nn.sigmoid(self.to_gate_logits(x)))[..., None].astype(out.dtype)
    return self.to_out(out.reshape(b, s, self.heads * self.head_dim))


class _Block(nnx.Module):
  """Pre-norm self-attention and tanh-GELU MLP, both residual; the norms have no weights."""

  def __init__(self, dim: int, heads: int, head_dim: int, gated: bool, *, rngs: nnx.Rngs):
    self.norm1 = nn.RMSNorm(dim, eps=1e-6, elementwise_affine=False, rngs=rngs)
    self.attn = _Attention(dim, heads, head_dim, gated, rngs=rngs)
    self.norm2 = nn.RMSNorm(dim, eps=1e-6, elementwise_affine=False, rngs=rngs)
    self.ff = nn.FeedForward(dim, activation="gelu-approximate", rngs=rngs)

  def __call__(self, h, cos, sin, mask, interleaved, config):
    h = h + self.attn(self.norm1(h), cos, sin, mask, interleaved, config)
    return h + self.ff(self.norm2(h))


class LTX2Connector(nnx.Module):
  """One stream's connector (diffusers `LTX2ConnectorTransformer1d`): `[B, S, width]` → `[B, S, width]`."""

  def __init__(
    self,
    cfg: LTX2ConnectorsConfig,
    stream: str,
    *,
    attention: mda.AttentionConfig | None = None,
    rngs: nnx.Rngs,
  ):
    heads, head_dim, layers, registers, gated = cfg.stream(stream)
    width = heads * head_dim
    self.cfg, self.stream_name = cfg, stream
    self.heads, self.head_dim, self.num_layers = heads, head_dim, layers
    self.attention = attention or mda.AttentionConfig()
    if registers is not None:
      init = jax.random.uniform(md_core.param_key(rngs), (registers, width), _F32, -1.0, 1.0)
      self.learnable_registers = nnx.Param(init, logical_axes=(None, "embed"))
    else:
      self.learnable_registers = None
    self.blocks = md_core.stack_layers(
      lambda r: _Block(width, heads, head_dim, gated, rngs=r), layers, rngs
    )
    self.norm_out = nn.RMSNorm(width, eps=1e-6, elementwise_affine=False, rngs=rngs)

  def __call__(self, h: jax.Array, mask: jax.Array) -> jax.Array:
    """`h [B, S, width]`, `mask [B, S]` (nonzero for real tokens) → `[B, S, width]`."""
    b, s, _ = h.shape
    valid = mask.astype(bool)
    key_mask = valid
    if self.learnable_registers is not None:
      regs = self.learnable_registers[...]
      n = regs.shape[0]
      if s % n:
        raise ValueError(
          f"the {self.stream_name} connector's sequence length {s} must be a multiple of its "
          f"{n} learnable registers (LTX-2 pads prompts to 1024 tokens)"
        )
      regs = jnp.tile(regs, (s // n, 1)).astype(h.dtype)  # [S, width], by absolute position
      # Real tokens first in their order (a stable sort of the padding flags), registers after them.
      order = jnp.argsort((~valid).astype(jnp.int32), axis=1, stable=True)
      front = jnp.take_along_axis(h, order[:, :, None], axis=1)
      count = jnp.sum(valid, axis=1, keepdims=True)
      h = jnp.where((jnp.arange(s)[None, :] < count)[..., None], front, regs[None])
      key_mask = None
    cos, sin = connector_rope_tables(self.cfg, self.heads, self.head_dim, s)
    cos, sin = jnp.asarray(cos), jnp.asarray(sin)
    interleaved = self.cfg.rope_type == "interleaved"

    def body(block, h, _):
      return block(h, cos, sin, key_mask, interleaved, self.attention), None

    if self.num_layers:
      h, _ = md_core.scan_layers(self.blocks, body, h, hookable=False)
    return self.norm_out(h)


class LTX2TextConnectors(nnx.Module):
  """LTX-2's feature extractor and video / audio text connectors (diffusers `LTX2TextConnectors`)."""

  def __init__(
    self,
    cfg: LTX2ConnectorsConfig,
    *,
    attention: mda.AttentionConfig | None = None,
    rngs: nnx.Rngs,
  ):
    self.cfg = cfg
    features = cfg.caption_channels * cfg.text_proj_in_factor
    kw = dict(use_bias=cfg.proj_bias, axes=("mlp", "embed"), rngs=rngs)
    if cfg.per_modality_projections:
      self.video_text_proj_in = nn.Dense(features, cfg.video_hidden_dim, **kw)
      self.audio_text_proj_in = nn.Dense(features, cfg.audio_hidden_dim, **kw)
    else:
      self.text_proj_in = nn.Dense(features, cfg.caption_channels, **kw)
    self.video_connector = LTX2Connector(cfg, "video", attention=attention, rngs=rngs)
    self.audio_connector = LTX2Connector(cfg, "audio", attention=attention, rngs=rngs)

  def __call__(
    self,
    text_embeds: jax.Array,
    attention_mask: jax.Array,
    *,
    padding_side: str = "left",
    scale_factor: float = 8.0,
  ) -> LTX2TextEmbeds:
    """Text embeddings of both streams from Gemma's stacked hidden states.

    Args:
      text_embeds: `[B, S, C * L]` packed as the pipeline packs them (`ltx2_pack_hidden_states`), or
        `[B, S, C, L]`.
      attention_mask: `[B, S]`, 1 for real tokens.
      padding_side: where the tokenizer padded ("left" for LTX-2's Gemma); LTX-2.0 derives the real
        tokens from it and the mask's sums.
      scale_factor: LTX-2.0's normalisation scale (8).

    Returns:
      `LTX2TextEmbeds(video, audio, mask)`.

    Raises:
      ValueError: shapes that do not fit the config, a bad `padding_side`, or a sequence length the
        registers do not divide.
    """
    cfg = self.cfg
    c, n = cfg.caption_channels, cfg.text_proj_in_factor
    if text_embeds.ndim == 3:
      if text_embeds.shape[-1] != c * n:
        raise ValueError(
          f"text_embeds has {text_embeds.shape[-1]} features; these connectors take "
          f"caption_channels x text_proj_in_factor = {c} x {n} = {c * n}"
        )
      text_embeds = text_embeds.reshape(text_embeds.shape[:2] + (c, n))
    if text_embeds.ndim != 4 or text_embeds.shape[2:] != (c, n):
      raise ValueError(
        f"text_embeds must be [B, S, {c * n}] or [B, S, {c}, {n}], got shape {text_embeds.shape}"
      )
    b, s = text_embeds.shape[:2]
    if attention_mask.shape != (b, s):
      raise ValueError(f"attention_mask must be [B, S] = {(b, s)}, got {attention_mask.shape}")
    if padding_side not in ("left", "right"):
      raise ValueError(f"padding_side must be 'left' or 'right', got {padding_side!r}")
    valid = attention_mask.astype(bool)
    if cfg.per_modality_projections:
      x = ltx2_token_rms_norm(text_embeds).reshape(b, s, c * n)
      x = jnp.where(valid[..., None], x, jnp.zeros((), x.dtype))
      video_in = self.video_text_proj_in(x * math.sqrt(cfg.video_hidden_dim / c))
      audio_in = self.audio_text_proj_in(x * math.sqrt(cfg.audio_hidden_dim / c))
    else:
      lengths = jnp.sum(attention_mask.astype(jnp.int32), axis=-1)
      x = ltx2_masked_mean_range_norm(
        text_embeds, lengths, padding_side=padding_side, scale_factor=scale_factor
      )
      video_in = audio_in = self.text_proj_in(x)
    video = self.video_connector(video_in, valid)
    audio = self.audio_connector(audio_in, valid)
    return LTX2TextEmbeds(video, audio, jnp.ones((b, s), jnp.int32))


def ltx2_prompt_embeds(
  encoder: Gemma3Encoder, input_ids: jax.Array, attention_mask: jax.Array
) -> jax.Array:
  """LTX-2's `prompt_embeds` `[B, S, C * (layers + 1)]`: every Gemma 3 hidden state, packed."""
  return ltx2_pack_hidden_states(encoder(input_ids, attention_mask).hidden_states)


def encode_ltx2_prompt(
  encoder: Gemma3Encoder,
  connectors: LTX2TextConnectors,
  input_ids: jax.Array,
  attention_mask: jax.Array,
  *,
  padding_side: str = "left",
) -> LTX2TextEmbeds:
  """Token ids (`md_text.gemma3_tokenize`) → the video / audio text embeddings LTX-2's transformer takes:
  Gemma 3, packing, the feature extractor and the connectors, as the pipeline runs them."""
  embeds = ltx2_prompt_embeds(encoder, input_ids, attention_mask)
  return connectors(embeds, attention_mask, padding_side=padding_side)
