"""CLIP text and vision encoders (OpenAI CLIP, OpenCLIP H / bigG) as transformers' `CLIP*Model` classes.

Pre-LN transformers whose layers are stacked on a leading `layers` axis and run with `md_core.scan_layers` (one layer
compiled). The text encoder is causal and pools at the end-of-text token; the vision encoder embeds patches with
a strided conv, prepends a class token and pools it. Every hidden state is returned stacked (`[L + 1, B, S, D]`),
so SDXL's penultimate layer, `clip_skip` and Wan I2V's `hidden_states[-2]` are one index away.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

import md_attention as mda
import md_core
import md_sharding as mds
from md_core import nn

# Config keys that do not change inference (training-only settings, bookkeeping, token ids the model ignores).
_IGNORED_KEYS = frozenset(
  {
    "_name_or_path",
    "_commit_hash",
    "architectures",
    "attention_dropout",
    "dropout",
    "bos_token_id",
    "pad_token_id",
    "dtype",
    "torch_dtype",
    "transformers_version",
    "model_type",
    "initializer_factor",
    "initializer_range",
    "gradient_checkpointing",
    "output_hidden_states",
    "output_attentions",
    "return_dict",
    "use_return_dict",
    "torchscript",
    "use_bfloat16",
    "id2label",
    "label2id",
    "tie_word_embeddings",
    "is_encoder_decoder",
    "problem_type",
    "chunk_size_feed_forward",
    "tokenizer_class",
    "prefix",
    "task_specific_params",
    "finetuning_task",
    "add_cross_attention",
    "is_decoder",
    "cross_attention_hidden_size",
    "decoder_start_token_id",
    "sep_token_id",
    "pruned_heads",
    "tf_legacy_loss",
    "_attn_implementation_autoset",
  }
)
# Generation settings older configs carry; they mean nothing to an encoder.
_GENERATION_KEYS = frozenset(
  {
    "bad_words_ids",
    "begin_suppress_tokens",
    "diversity_penalty",
    "do_sample",
    "early_stopping",
    "encoder_no_repeat_ngram_size",
    "exponential_decay_length_penalty",
    "forced_bos_token_id",
    "forced_eos_token_id",
    "length_penalty",
    "max_length",
    "min_length",
    "no_repeat_ngram_size",
    "num_beam_groups",
    "num_beams",
    "num_return_sequences",
    "output_scores",
    "remove_invalid_values",
    "repetition_penalty",
    "return_dict_in_generate",
    "suppress_tokens",
    "temperature",
    "top_k",
    "top_p",
    "typical_p",
  }
)

ACTIVATIONS = ("quick_gelu", "gelu", "gelu_new", "gelu_pytorch_tanh")


def _activation(name: str):
  if name == "quick_gelu":
    return lambda x: x * jax.nn.sigmoid(1.702 * x)
  if name == "gelu":
    return lambda x: nn.gelu(x, approximate=False)
  if name in ("gelu_new", "gelu_pytorch_tanh"):
    return lambda x: nn.gelu(x, approximate=True)
  raise ValueError(f"hidden_act={name!r} is not supported; expected one of {ACTIVATIONS}")


def _fields_from_dict(cls, d: Mapping[str, Any], where: str) -> dict[str, Any]:
  """The dataclass fields of `cls` found in a transformers config dict; unknown keys are an error."""
  names = {f.name for f in dataclasses.fields(cls)}
  unknown = sorted(
    k for k in d if k not in names and k not in _IGNORED_KEYS and k not in _GENERATION_KEYS
  )
  if unknown:
    raise ValueError(
      f"{where}: config keys {unknown} are not supported by md's {cls.__name__} (supported: "
      f"{sorted(names)}; ignored as inference-neutral: see md_text._clip._IGNORED_KEYS)"
    )
  return {k: d[k] for k in names if k in d}


def _read_json(path: str | os.PathLike) -> dict:
  with open(path) as f:
    return json.load(f)


@dataclasses.dataclass(frozen=True)
class CLIPTextConfig:
  """A CLIP text encoder (transformers `CLIPTextConfig`).

  Defaults are transformers' (so a config.json that omits a key means the same here).

  Attributes:
    vocab_size: token vocabulary.
    hidden_size: model width.
    intermediate_size: MLP width.
    num_hidden_layers: transformer layers.
    num_attention_heads: attention heads (`hidden_size` must divide evenly).
    max_position_embeddings: longest sequence (77 for every released CLIP).
    hidden_act: MLP activation, `quick_gelu` (OpenAI CLIP) or `gelu` (OpenCLIP).
    layer_norm_eps: LayerNorm epsilon.
    projection_dim: width of `text_embeds` (`CLIPTextModelWithProjection` only).
    eos_token_id: the end-of-text id the pooled output is taken at; 2 (old configs, e.g. every SD checkpoint)
      means "the position of the largest id", as transformers keeps for those configs.
    remat: recompute each layer's activations in the backward pass (training).
  """

  vocab_size: int = 49408
  hidden_size: int = 512
  intermediate_size: int = 2048
  num_hidden_layers: int = 12
  num_attention_heads: int = 8
  max_position_embeddings: int = 77
  hidden_act: str = "quick_gelu"
  layer_norm_eps: float = 1e-5
  projection_dim: int = 512
  eos_token_id: int = 49407
  remat: bool = False

  def __post_init__(self):
    if self.hidden_size % self.num_attention_heads:
      raise ValueError(
        f"num_attention_heads={self.num_attention_heads} must divide hidden_size={self.hidden_size}"
      )
    _activation(self.hidden_act)
    if not isinstance(self.eos_token_id, int):
      raise ValueError(
        f"eos_token_id={self.eos_token_id!r}: md pools at a single end-of-text id; give one int"
      )

  @classmethod
  def from_dict(cls, d: Mapping[str, Any], *, where: str = "config") -> CLIPTextConfig:
    """From a transformers `config.json` dict (a `CLIPTextConfig`, or a `CLIPConfig`'s `text_config`)."""
    if d.get("model_type") == "clip" or "text_config" in d:
      d = d.get("text_config") or {}
    return cls(**_fields_from_dict(cls, d, where))

  @classmethod
  def from_json(cls, path: str | os.PathLike) -> CLIPTextConfig:
    """From a `config.json` file."""
    return cls.from_dict(_read_json(path), where=os.fspath(path))


@dataclasses.dataclass(frozen=True)
class CLIPVisionConfig:
  """A CLIP vision encoder (transformers `CLIPVisionConfig`).

  Attributes:
    hidden_size: model width.
    intermediate_size: MLP width.
    num_hidden_layers: transformer layers.
    num_attention_heads: attention heads.
    num_channels: image channels.
    image_size: square input size in pixels.
    patch_size: square patch size (the embedding conv's kernel and stride).
    hidden_act: MLP activation.
    layer_norm_eps: LayerNorm epsilon.
    projection_dim: width of `image_embeds` (`CLIPVisionModelWithProjection` only).
    remat: recompute each layer's activations in the backward pass.
  """

  hidden_size: int = 768
  intermediate_size: int = 3072
  num_hidden_layers: int = 12
  num_attention_heads: int = 12
  num_channels: int = 3
  image_size: int = 224
  patch_size: int = 32
  hidden_act: str = "quick_gelu"
  layer_norm_eps: float = 1e-5
  projection_dim: int = 512
  remat: bool = False

  def __post_init__(self):
    if self.hidden_size % self.num_attention_heads:
      raise ValueError(
        f"num_attention_heads={self.num_attention_heads} must divide hidden_size={self.hidden_size}"
      )
    for name in ("image_size", "patch_size"):
      if not isinstance(getattr(self, name), int):
        raise ValueError(f"{name}={getattr(self, name)!r}: md supports square sizes (one int)")
    if self.image_size % self.patch_size:
      raise ValueError(f"patch_size={self.patch_size} must divide image_size={self.image_size}")
    _activation(self.hidden_act)

  @property
  def num_positions(self) -> int:
    """Patches plus the class token (257 for 224 px and 14 px patches)."""
    return (self.image_size // self.patch_size) ** 2 + 1

  @classmethod
  def from_dict(cls, d: Mapping[str, Any], *, where: str = "config") -> CLIPVisionConfig:
    """From a transformers `config.json` dict (a `CLIPVisionConfig`, or a `CLIPConfig`'s `vision_config`)."""
    if d.get("model_type") == "clip" or "vision_config" in d:
      d = d.get("vision_config") or {}
    return cls(**_fields_from_dict(cls, d, where))

  @classmethod
  def from_json(cls, path: str | os.PathLike) -> CLIPVisionConfig:
    """From a `config.json` file."""
    return cls.from_dict(_read_json(path), where=os.fspath(path))


# Real sizes from the published config.json files (see tools/configs/sd/ for the full files and sources).
CLIP_TEXT_VARIANTS: dict[str, CLIPTextConfig] = {
  # openai/clip-vit-large-patch14: SD 1.x text_encoder, SDXL text_encoder, Flux text_encoder.
  "clip-l": CLIPTextConfig(
    hidden_size=768,
    intermediate_size=3072,
    num_attention_heads=12,
    projection_dim=768,
    eos_token_id=2,
  ),
  # OpenCLIP ViT-H/14 text tower as SD 2.x ships it (23 of its 24 layers).
  "openclip-h": CLIPTextConfig(
    hidden_size=1024,
    intermediate_size=4096,
    num_hidden_layers=23,
    num_attention_heads=16,
    hidden_act="gelu",
    projection_dim=512,
    eos_token_id=2,
  ),
  # OpenCLIP ViT-bigG/14: SDXL text_encoder_2 (CLIPTextModelWithProjection).
  "openclip-bigg": CLIPTextConfig(
    hidden_size=1280,
    intermediate_size=5120,
    num_hidden_layers=32,
    num_attention_heads=20,
    hidden_act="gelu",
    projection_dim=1280,
    eos_token_id=2,
  ),
  "tiny": CLIPTextConfig(
    vocab_size=1000,
    hidden_size=32,
    intermediate_size=37,
    num_hidden_layers=3,
    num_attention_heads=4,
    max_position_embeddings=16,
    projection_dim=12,
    eos_token_id=2,
  ),
}

CLIP_VISION_VARIANTS: dict[str, CLIPVisionConfig] = {
  # openai/clip-vit-large-patch14 vision tower.
  "clip-l": CLIPVisionConfig(
    hidden_size=1024,
    intermediate_size=4096,
    num_hidden_layers=24,
    num_attention_heads=16,
    patch_size=14,
    projection_dim=768,
  ),
  # OpenCLIP ViT-H/14 (laion2B): Wan 2.1 I2V's image_encoder.
  "openclip-h": CLIPVisionConfig(
    hidden_size=1280,
    intermediate_size=5120,
    num_hidden_layers=32,
    num_attention_heads=16,
    patch_size=14,
    hidden_act="gelu",
    projection_dim=1024,
  ),
  "tiny": CLIPVisionConfig(
    hidden_size=32,
    intermediate_size=37,
    num_hidden_layers=3,
    num_attention_heads=4,
    image_size=28,
    patch_size=7,
    hidden_act="gelu",
    projection_dim=12,
  ),
}


class CLIPTextOutput(NamedTuple):
  """What the text encoders return.

  Attributes:
    last_hidden_state: `[B, S, D]` after the final LayerNorm.
    pooler_output: `[B, D]`, the last hidden state at each sequence's end-of-text token.
    hidden_states: `[L + 1, B, S, D]`: the embeddings, then each layer's output (before the final LayerNorm);
      `hidden_states[-2]` is SDXL's penultimate layer. None when not asked for.
    text_embeds: `[B, projection_dim]` (`CLIPTextModelWithProjection` only, else None).
  """

  last_hidden_state: jax.Array
  pooler_output: jax.Array
  hidden_states: jax.Array | None
  text_embeds: jax.Array | None = None


class CLIPVisionOutput(NamedTuple):
  """What the vision encoders return.

  Attributes:
    last_hidden_state: `[B, 1 + P, D]`, the last layer's output (no final norm, as the reference).
    pooler_output: `[B, D]`, the class token after `post_layernorm`.
    hidden_states: `[L + 1, B, 1 + P, D]`: the pre-normed embeddings, then each layer's output; Wan 2.1 I2V
      uses `hidden_states[-2]`. None when not asked for.
    image_embeds: `[B, projection_dim]` (`CLIPVisionModelWithProjection` only, else None).
  """

  last_hidden_state: jax.Array
  pooler_output: jax.Array
  hidden_states: jax.Array | None
  image_embeds: jax.Array | None = None


class CLIPAttention(nnx.Module):
  """Multi-head self-attention with separate q/k/v/out projections (biases on all four)."""

  def __init__(self, dim: int, num_heads: int, *, rngs: nnx.Rngs):
    self.num_heads = num_heads
    self.q_proj = nn.Dense(dim, dim, axes=("embed", "heads"), rngs=rngs)
    self.k_proj = nn.Dense(dim, dim, axes=("embed", "heads"), rngs=rngs)
    self.v_proj = nn.Dense(dim, dim, axes=("embed", "heads"), rngs=rngs)
    self.out_proj = nn.Dense(dim, dim, axes=("heads", "embed"), rngs=rngs)

  def __call__(self, x: jax.Array, *, mask: jax.Array | None, causal: bool) -> jax.Array:
    b, s, d = x.shape  # [B, S, D]
    heads = lambda t: t.reshape(b, s, self.num_heads, d // self.num_heads)  # noqa: E731
    q, k, v = heads(self.q_proj(x)), heads(self.k_proj(x)), heads(self.v_proj(x))
    out = mda.attention(q, k, v, mask=mask, causal=causal)  # [B, S, H, Dh]
    return self.out_proj(out.reshape(b, s, d))


class CLIPMLP(nnx.Module):
  """`fc2(act(fc1(x)))`."""

  def __init__(self, dim: int, hidden: int, act: str, *, rngs: nnx.Rngs):
    self.act = _activation(act)
    self.fc1 = nn.Dense(dim, hidden, axes=("embed", "mlp"), rngs=rngs)
    self.fc2 = nn.Dense(hidden, dim, axes=("mlp", "embed"), rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    return self.fc2(self.act(self.fc1(x)))


class CLIPEncoderLayer(nnx.Module):
  """Pre-LN block: `x + attn(ln1(x))`, then `x + mlp(ln2(x))`."""

  def __init__(self, dim: int, hidden: int, heads: int, act: str, eps: float, *, rngs: nnx.Rngs):
    self.self_attn = CLIPAttention(dim, heads, rngs=rngs)
    self.layer_norm1 = nn.LayerNorm(dim, eps=eps, rngs=rngs)
    self.mlp = CLIPMLP(dim, hidden, act, rngs=rngs)
    self.layer_norm2 = nn.LayerNorm(dim, eps=eps, rngs=rngs)

  def __call__(self, x: jax.Array, *, mask: jax.Array | None, causal: bool) -> jax.Array:
    x = x + self.self_attn(self.layer_norm1(x), mask=mask, causal=causal)
    return x + self.mlp(self.layer_norm2(x))


def _prepend_layers_axis(module: nnx.Module) -> None:
  """Gives every parameter of a vmapped stack the logical name `layers` on its new leading axis."""
  for _, var in nnx.to_flat_state(nnx.state(module)):
    meta = var.get_metadata() if hasattr(var, "get_metadata") else {}
    axes = meta.get("logical_axes") if isinstance(meta, Mapping) else None
    if axes is not None:
      var.set_metadata(logical_axes=("layers",) + tuple(axes))


class CLIPEncoder(nnx.Module):
  """`num_layers` identical pre-LN layers, stored stacked (`encoder/layers/...` with a leading layers axis)."""

  def __init__(
    self,
    num_layers: int,
    dim: int,
    hidden: int,
    heads: int,
    act: str,
    eps: float,
    *,
    remat: bool = False,
    rngs: nnx.Rngs,
  ):
    self.num_layers, self.remat = num_layers, remat

    @nnx.split_rngs(splits=num_layers)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def build(r):
      return CLIPEncoderLayer(dim, hidden, heads, act, eps, rngs=r)

    self.layers = build(rngs)
    _prepend_layers_axis(self.layers)

  def __call__(
    self, x: jax.Array, *, mask: jax.Array | None, causal: bool, keep_all: bool
  ) -> tuple[jax.Array, jax.Array | None]:
    """Runs the stack over `x [B, S, D]`; returns the output and, with `keep_all`, `[L + 1, B, S, D]`."""

    def body(layer, h, _):
      h = layer(h, mask=mask, causal=causal)
      return h, (h if keep_all else None)

    remat = "full" if self.remat else "none"
    out, per_layer = md_core.scan_layers(self.layers, body, x, remat=remat, hookable=False)
    if not keep_all:
      return out, None
    return out, jnp.concatenate([x[None], per_layer], axis=0)


def _constrain(x: jax.Array) -> jax.Array:
  # Batch over data/fsdp, sequence over context where a mesh is set; a no-op otherwise.
  return mds.with_logical_constraint(
    x, ("activation_batch", "activation_length", "activation_embed")
  )


class CLIPTextModel(nnx.Module):
  """The CLIP text encoder (transformers `CLIPTextModel`): last and all hidden states, pooled output.

  Call with `input_ids [B, S]` (int, `S <= max_position_embeddings`) and an optional `attention_mask [B, S]`
  (1 for real tokens); SD pipelines pass none and rely on the causal mask alone.
  """

  def __init__(self, config: CLIPTextConfig, *, rngs: nnx.Rngs):
    c = self.config = config
    self.embeddings = nnx.Dict(
      token_embedding=nn.Embed(c.vocab_size, c.hidden_size, rngs=rngs),
      position_embedding=nn.Embed(
        c.max_position_embeddings, c.hidden_size, axes=(None, "embed"), rngs=rngs
      ),
    )
    self.encoder = CLIPEncoder(
      c.num_hidden_layers,
      c.hidden_size,
      c.intermediate_size,
      c.num_attention_heads,
      c.hidden_act,
      c.layer_norm_eps,
      remat=c.remat,
      rngs=rngs,
    )
    self.final_layer_norm = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps, rngs=rngs)

  def _encode(self, input_ids, attention_mask, output_hidden_states):
    c = self.config
    if input_ids.ndim != 2 or not jnp.issubdtype(input_ids.dtype, jnp.integer):
      raise ValueError(f"input_ids must be integer [B, S], got {input_ids.dtype} {input_ids.shape}")
    b, s = input_ids.shape
    if s > c.max_position_embeddings:
      raise ValueError(
        f"input_ids have {s} tokens but max_position_embeddings={c.max_position_embeddings}; "
        "truncate when tokenizing (md_text.tokenize does)"
      )
    if attention_mask is not None and attention_mask.shape != (b, s):
      raise ValueError(f"attention_mask must be [B, S] = {(b, s)}, got {attention_mask.shape}")
    tokens = self.embeddings["token_embedding"](input_ids)  # [B, S, D]
    positions = self.embeddings["position_embedding"].embedding[:s]  # [S, D]
    h = _constrain(tokens + positions[None].astype(tokens.dtype))
    h, all_h = self.encoder(h, mask=attention_mask, causal=True, keep_all=output_hidden_states)
    last = self.final_layer_norm(h)
    if c.eos_token_id == 2:
      # Old configs: the end-of-text token has the largest id in OpenAI's vocabulary.
      eos = jnp.argmax(input_ids, axis=-1)
    else:
      eos = jnp.argmax((input_ids == c.eos_token_id).astype(jnp.int32), axis=-1)
    pooled = jnp.take_along_axis(last, eos[:, None, None], axis=1)[:, 0]  # [B, D]
    return last, pooled, all_h

  def __call__(
    self,
    input_ids: jax.Array,
    *,
    attention_mask: jax.Array | None = None,
    output_hidden_states: bool = True,
  ) -> CLIPTextOutput:
    """Encodes `input_ids [B, S]`; see `CLIPTextOutput`."""
    last, pooled, all_h = self._encode(input_ids, attention_mask, output_hidden_states)
    return CLIPTextOutput(last, pooled, all_h)


class CLIPTextModelWithProjection(CLIPTextModel):
  """`CLIPTextModel` plus `text_projection` of the pooled output (OpenCLIP bigG as SDXL's text_encoder_2)."""

  def __init__(self, config: CLIPTextConfig, *, rngs: nnx.Rngs):
    super().__init__(config, rngs=rngs)
    self.text_projection = nn.Dense(
      config.hidden_size, config.projection_dim, use_bias=False, axes=("embed", None), rngs=rngs
    )

  def __call__(
    self,
    input_ids: jax.Array,
    *,
    attention_mask: jax.Array | None = None,
    output_hidden_states: bool = True,
  ) -> CLIPTextOutput:
    """Encodes `input_ids [B, S]`; `text_embeds` is the projected pooled output."""
    last, pooled, all_h = self._encode(input_ids, attention_mask, output_hidden_states)
    return CLIPTextOutput(last, pooled, all_h, self.text_projection(pooled))


class CLIPVisionModel(nnx.Module):
  """The CLIP vision encoder (transformers `CLIPVisionModel`) over channels-last images.

  Call with `pixel_values [B, H, W, C]` already resized and normalised as CLIP's image processor does
  (`H = W = image_size`); `md_text.nchw_to_nhwc` converts the reference layout.
  """

  def __init__(self, config: CLIPVisionConfig, *, rngs: nnx.Rngs):
    c = self.config = config
    p = c.patch_size
    self.embeddings = nnx.Dict(
      class_embedding=nnx.Param(
        jax.random.normal(md_core.param_key(rngs), (c.hidden_size,)), logical_axes=("embed",)
      ),
      patch_embedding=nn.Conv(
        c.num_channels,
        c.hidden_size,
        (p, p),
        stride=p,
        use_bias=False,
        axes=("conv_in", "embed"),
        rngs=rngs,
      ),
      position_embedding=nn.Embed(c.num_positions, c.hidden_size, axes=(None, "embed"), rngs=rngs),
    )
    self.pre_layrnorm = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps, rngs=rngs)
    self.encoder = CLIPEncoder(
      c.num_hidden_layers,
      c.hidden_size,
      c.intermediate_size,
      c.num_attention_heads,
      c.hidden_act,
      c.layer_norm_eps,
      remat=c.remat,
      rngs=rngs,
    )
    self.post_layernorm = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps, rngs=rngs)

  def _encode(self, pixel_values, output_hidden_states):
    c = self.config
    want = (c.image_size, c.image_size, c.num_channels)
    if pixel_values.ndim != 4 or tuple(pixel_values.shape[1:]) != want:
      raise ValueError(
        f"pixel_values must be channels-last [B, {c.image_size}, {c.image_size}, {c.num_channels}], got "
        f"{pixel_values.shape}; resize to image_size={c.image_size} first (a [B, C, H, W] array converts "
        "with md_text.nchw_to_nhwc)"
      )
    emb = self.embeddings
    patch = emb["patch_embedding"]
    x = patch(pixel_values.astype(patch.kernel.dtype))  # [B, H/p, W/p, D]
    b = x.shape[0]
    x = x.reshape(b, -1, c.hidden_size)  # row-major patches, as torch's flatten(2)
    cls = jnp.broadcast_to(emb["class_embedding"][...].astype(x.dtype), (b, 1, c.hidden_size))
    x = jnp.concatenate([cls, x], axis=1)
    x = x + emb["position_embedding"].embedding[...][None].astype(x.dtype)
    h = _constrain(self.pre_layrnorm(x))
    last, all_h = self.encoder(h, mask=None, causal=False, keep_all=output_hidden_states)
    pooled = self.post_layernorm(last[:, 0])
    return last, pooled, all_h

  def __call__(
    self, pixel_values: jax.Array, *, output_hidden_states: bool = True
  ) -> CLIPVisionOutput:
    """Encodes `pixel_values [B, H, W, C]`; see `CLIPVisionOutput`."""
    return CLIPVisionOutput(*self._encode(pixel_values, output_hidden_states))


class CLIPVisionModelWithProjection(CLIPVisionModel):
  """`CLIPVisionModel` plus `visual_projection` of the pooled output."""

  def __init__(self, config: CLIPVisionConfig, *, rngs: nnx.Rngs):
    super().__init__(config, rngs=rngs)
    self.visual_projection = nn.Dense(
      config.hidden_size, config.projection_dim, use_bias=False, axes=("embed", None), rngs=rngs
    )

  def __call__(
    self, pixel_values: jax.Array, *, output_hidden_states: bool = True
  ) -> CLIPVisionOutput:
    """Encodes `pixel_values [B, H, W, C]`; `image_embeds` is the projected pooled output."""
    last, pooled, all_h = self._encode(pixel_values, output_hidden_states)
    return CLIPVisionOutput(last, pooled, all_h, self.visual_projection(pooled))


def nchw_to_nhwc(x: jax.Array) -> jax.Array:
  """`[B, C, H, W]` (the reference's layout) → `[B, H, W, C]` (md's)."""
  if x.ndim != 4:
    raise ValueError(f"expected a [B, C, H, W] array, got shape {x.shape}")
  return jnp.transpose(x, (0, 2, 3, 1))
