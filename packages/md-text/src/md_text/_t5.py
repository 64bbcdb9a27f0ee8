"""T5 and UMT5 text encoders (transformers' `T5EncoderModel` / `UMT5EncoderModel`).

One module serves both: T5 v1.1 (Flux, LTX: T5-XXL) learns one relative-position bias table in layer 0 and
reuses it in every layer; UMT5 (Wan: UMT5-XXL) learns one table per layer (`per_layer_bias=True`).
Otherwise they are the same pre-norm encoder: RMS layer norm in float32 without mean or bias, attention
without `1/sqrt(d)` scaling plus the bucketed relative bias, and a (gated) feed-forward.

The layers are scanned: one block is compiled and its parameters are stacked on a leading `layers` axis.
`output_hidden_states=True` also returns every layer's output, indexed as transformers' `hidden_states`.
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

import md_core
from md_core import nn, stack_layers

_F32 = jnp.float32

# Feed-forward activations by the name transformers derives from `feed_forward_proj`.
_ACTIVATIONS = {
  "relu": jax.nn.relu,
  "gelu": lambda x: nn.gelu(x, approximate=False),
  "gelu_new": lambda x: nn.gelu(x, approximate=True),
  "gelu_pytorch_tanh": lambda x: nn.gelu(x, approximate=True),
  "silu": jax.nn.silu,
  "swish": jax.nn.silu,
}

# Config keys that only concern the decoder, training or the tokenizer: they do not change the encoder.
_IGNORED_KEYS = {
  "architectures", "classifier_dropout", "decoder_start_token_id", "dense_act_fn", "dropout_rate",
  "eos_token_id", "initializer_factor", "is_encoder_decoder", "is_gated_act", "model_type",
  "n_positions", "num_decoder_layers", "output_past", "pad_token_id", "task_specific_params",
  "tie_word_embeddings", "tokenizer_class", "torch_dtype", "dtype", "transformers_version",
  "use_cache", "scalable_attention", "gradient_checkpointing", "bos_token_id", "is_decoder",
  "add_cross_attention", "tie_encoder_decoder", "use_return_dict", "return_dict",
  "output_hidden_states", "output_attentions", "name_or_path", "scale_decoder_outputs",
}  # fmt: skip


@dataclasses.dataclass(frozen=True)
class T5Config:
  """The encoder half of a T5 / UMT5 model.

  Attributes:
    vocab_size: rows of the shared token embedding.
    d_model: width of the residual stream.
    d_kv: width of one attention head.
    d_ff: feed-forward inner width.
    num_layers: encoder blocks.
    num_heads: attention heads.
    relative_attention_num_buckets: buckets of the relative-position bias (half per direction).
    relative_attention_max_distance: distances from here on share the last bucket.
    layer_norm_epsilon: epsilon of the RMS layer norms.
    feed_forward_proj: `"gated-gelu"` (tanh GELU, gated: T5 v1.1, UMT5), `"relu"` (original T5),
      or `"gated-<act>"` / `"<act>"` for act in relu, gelu, gelu_new, silu.
    per_layer_bias: every layer has its own bias table (UMT5) instead of sharing layer 0's (T5).
    remat: rematerialisation of each scanned block: "none", "full", "dots" (save matmul outputs) or
      "dots_no_batch".
  """

  vocab_size: int
  d_model: int
  d_kv: int
  d_ff: int
  num_layers: int
  num_heads: int
  relative_attention_num_buckets: int = 32
  relative_attention_max_distance: int = 128
  layer_norm_epsilon: float = 1e-6
  feed_forward_proj: str = "gated-gelu"
  per_layer_bias: bool = False
  remat: str = "none"

  def __post_init__(self):
    _ = self.activation  # raises for an unknown feed_forward_proj
    if self.remat not in md_core.REMAT_POLICIES:
      raise ValueError(f"T5Config.remat={self.remat!r} is not one of {md_core.REMAT_POLICIES}")
    if self.relative_attention_num_buckets < 4 or self.relative_attention_num_buckets % 2:
      raise ValueError(
        f"relative_attention_num_buckets={self.relative_attention_num_buckets} must be an even "
        "number >= 4 (half the buckets per direction)"
      )

  @property
  def gated(self) -> bool:
    return self.feed_forward_proj.startswith("gated-")

  @property
  def activation(self) -> str:
    parts = self.feed_forward_proj.split("-")
    if len(parts) > 2 or (len(parts) == 2 and parts[0] != "gated"):
      raise ValueError(
        f"feed_forward_proj={self.feed_forward_proj!r} must be 'gated-<act>' or '<act>' "
        f"with act in {sorted(_ACTIVATIONS)}"
      )
    # transformers maps "gated-gelu" to the tanh approximation (T5 v1.1 was trained with it).
    name = "gelu_new" if self.feed_forward_proj == "gated-gelu" else parts[-1]
    if name not in _ACTIVATIONS:
      raise ValueError(
        f"feed_forward_proj={self.feed_forward_proj!r}: unknown activation {name!r}; expected one "
        f"of {sorted(_ACTIVATIONS)}"
      )
    return name

  @classmethod
  def from_dict(cls, d: Mapping[str, Any], **overrides) -> T5Config:
    """Reads a transformers `config.json` of a T5 (`model_type` "t5") or UMT5 ("umt5") model."""
    d = dict(d)
    model_type = d.get("model_type")
    if model_type not in ("t5", "umt5", None):
      raise ValueError(
        f"config has model_type={model_type!r}; T5Config reads 't5' (T5EncoderModel) or 'umt5' "
        "(UMT5EncoderModel) configs"
      )
    if d.get("is_decoder"):
      raise ValueError("config has is_decoder=true; md's T5 encoder reads encoder configs only")
    fields = {f.name for f in dataclasses.fields(cls)}
    kwargs = {k: d[k] for k in fields if k in d}
    kwargs.setdefault("per_layer_bias", model_type == "umt5")
    kwargs.update(overrides)
    unknown = sorted(
      k for k in d if k not in fields and k not in _IGNORED_KEYS and not k.startswith("_")
    )
    if unknown:
      raise ValueError(
        f"T5 config keys {unknown} are not supported (md would silently ignore them); supported: "
        f"{sorted(fields)}"
      )
    missing = [
      k
      for k in ("vocab_size", "d_model", "d_kv", "d_ff", "num_layers", "num_heads")
      if k not in kwargs
    ]
    if missing:
      raise ValueError(f"T5 config lacks {missing}")
    return cls(**kwargs)

  @classmethod
  def from_json(cls, path: str | os.PathLike, **overrides) -> T5Config:
    """Reads `config.json` (a file, or the folder holding it)."""
    path = pathlib.Path(path)
    if path.is_dir():
      path = path / "config.json"
    return cls.from_dict(md_core.read_json(path), **overrides)


_XXL = dict(d_model=4096, d_kv=64, d_ff=10240, num_layers=24, num_heads=64)
T5_VARIANTS: dict[str, T5Config] = {
  # google/umt5-xxl encoder as Wan ships it (Wan-AI/Wan2.1-T2V-1.3B-Diffusers, text_encoder).
  "umt5-xxl": T5Config(vocab_size=256384, per_layer_bias=True, **_XXL),
  # google/t5-v1_1-xxl encoder (black-forest-labs/FLUX.1-dev text_encoder_2, LTX-Video text_encoder).
  "t5-v1_1-xxl": T5Config(vocab_size=32128, per_layer_bias=False, **_XXL),
  "tiny-umt5": T5Config(
    vocab_size=64, d_model=32, d_kv=8, d_ff=48, num_layers=3, num_heads=4,
    relative_attention_num_buckets=8, relative_attention_max_distance=16, per_layer_bias=True,
  ),
  "tiny-t5": T5Config(
    vocab_size=64, d_model=32, d_kv=8, d_ff=48, num_layers=3, num_heads=4,
    relative_attention_num_buckets=8, relative_attention_max_distance=16, per_layer_bias=False,
  ),
}  # fmt: skip


def relative_position_buckets(
  q_len: int, k_len: int, *, num_buckets: int, max_distance: int
) -> np.ndarray:
  """Bidirectional T5 buckets of `key - query` offsets: `[q_len, k_len]` int32 (a trace-time constant).

  Half of the buckets hold keys after the query. In each half, offsets below `num_buckets/4` get a
  bucket each; larger ones share logarithmically wider buckets up to `max_distance`. The float32 log
  mirrors the reference so offsets at bucket edges land in the same bucket.
  """
  rel = np.arange(k_len, dtype=np.int64)[None, :] - np.arange(q_len, dtype=np.int64)[:, None]
  half = num_buckets // 2
  buckets = (rel > 0).astype(np.int64) * half
  dist = np.abs(rel)
  exact = half // 2
  with np.errstate(divide="ignore"):
    scaled = np.log(dist.astype(np.float32) / np.float32(exact)) / np.float32(
      math.log(max_distance / exact)
    )
    scaled = scaled * np.float32(half - exact)
  large = exact + np.where(dist < exact, 0, scaled).astype(np.int64)
  large = np.minimum(large, half - 1)
  return (buckets + np.where(dist < exact, dist, large)).astype(np.int32)


class _T5LayerNorm(nn.RMSNorm):
  """T5's RMS norm, rounded as the reference rounds it: the normalised value is computed in float32 and,
  for half-precision weights, cast to the weight dtype before the scale multiplies it."""

  def __call__(self, x: jax.Array) -> jax.Array:
    scale = self.scale[...]
    h = x.astype(_F32)
    h = h * jax.lax.rsqrt(jnp.mean(jnp.square(h), axis=-1, keepdims=True) + self.eps)
    if scale.dtype in (jnp.float16, jnp.bfloat16):
      h = h.astype(scale.dtype)
    return scale.reshape((1,) * (h.ndim - 1) + (-1,)) * h


class _Block(nnx.Module):
  """One encoder layer: pre-norm self-attention and pre-norm feed-forward, residual adds in float32."""

  def __init__(self, cfg: T5Config, *, rngs: nnx.Rngs):
    inner = cfg.num_heads * cfg.d_kv
    kw = dict(use_bias=False, rngs=rngs)
    eps = cfg.layer_norm_epsilon
    self.attn_norm = _T5LayerNorm(cfg.d_model, eps=eps, rngs=rngs)
    self.q = nn.Dense(cfg.d_model, inner, axes=("embed", "heads"), **kw)
    self.k = nn.Dense(cfg.d_model, inner, axes=("embed", "heads"), **kw)
    self.v = nn.Dense(cfg.d_model, inner, axes=("embed", "heads"), **kw)
    self.o = nn.Dense(inner, cfg.d_model, axes=("heads", "embed"), **kw)
    if cfg.per_layer_bias:
      self.relative_attention_bias = nn.Embed(
        cfg.relative_attention_num_buckets, cfg.num_heads, axes=(None, "heads"), rngs=rngs
      )
    self.ff_norm = _T5LayerNorm(cfg.d_model, eps=eps, rngs=rngs)
    if cfg.gated:
      self.wi_0 = nn.Dense(cfg.d_model, cfg.d_ff, axes=("embed", "mlp"), **kw)
      self.wi_1 = nn.Dense(cfg.d_model, cfg.d_ff, axes=("embed", "mlp"), **kw)
    else:
      self.wi = nn.Dense(cfg.d_model, cfg.d_ff, axes=("embed", "mlp"), **kw)
    self.wo = nn.Dense(cfg.d_ff, cfg.d_model, axes=("mlp", "embed"), **kw)
    self.cfg = cfg

  def __call__(self, h, bias, buckets, key_bias):
    """`h [B, S, D]` residual stream; `bias [1, H, S, S]` float32 (shared) or None with `buckets [S, S]`
    (per-layer tables); `key_bias [B, 1, 1, S]` float32, very negative at padded keys."""
    cfg = self.cfg
    b, s, _ = h.shape
    x = self.attn_norm(
      h
    )  # in the norm weight's dtype when that is half precision, as the reference
    heads = lambda t: t.reshape(b, s, cfg.num_heads, cfg.d_kv)  # noqa: E731
    q, k, v = heads(self.q(x)), heads(self.k(x)), heads(self.v(x))
    if bias is None:
      bias = jnp.take(self.relative_attention_bias.embedding[...], buckets, axis=0)  # [S, S, H]
      bias = bias.transpose(2, 0, 1)[None].astype(_F32)
    # T5 folds the 1/sqrt(d) scale into its initialisation: scores are plain dot products. Scores and
    # softmax accumulate in float32.
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=_F32)
    probs = jax.nn.softmax(scores + bias + key_bias, axis=-1).astype(v.dtype)
    out = jnp.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, s, cfg.num_heads * cfg.d_kv)
    h = h + self.o(out).astype(h.dtype)

    x = self.ff_norm(h)
    act = _ACTIVATIONS[cfg.activation]
    if cfg.gated:
      x = act(self.wi_0(x)) * self.wi_1(x)
    else:
      x = act(self.wi(x))
    # `wo` runs in its own dtype (float32 when loaded so for float16, as transformers keeps it).
    x = self.wo(x.astype(self.wo.kernel[...].dtype))
    return h + x.astype(h.dtype)


class T5EncoderOutput(NamedTuple):
  """What `T5Encoder(..., output_hidden_states=True)` returns.

  Attributes:
    last_hidden_state: `[B, S, d_model]` after the final norm.
    hidden_states: `[L + 1, B, S, d_model]` as transformers' `output_hidden_states`: 0 the token embeddings,
      `i` the output of layer `i` (before the final norm), `L` the final normed output (equal to
      `last_hidden_state`; the reference returns no un-normed output of the last layer).
  """

  last_hidden_state: jax.Array
  hidden_states: jax.Array


class T5Encoder(nnx.Module):
  """T5 / UMT5 encoder: token ids `[B, S]` → last hidden state `[B, S, d_model]` (and, when asked, those of
  every layer).

  Activations follow the weights' dtype as in transformers (bf16 weights → bf16 matmuls and residual
  stream); norm statistics, attention scores and softmax are float32.
  """

  def __init__(self, cfg: T5Config, *, rngs: nnx.Rngs):
    self.cfg = cfg
    self.shared = nn.Embed(cfg.vocab_size, cfg.d_model, axes=("vocab", "embed"), rngs=rngs)
    if not cfg.per_layer_bias:
      self.relative_attention_bias = nn.Embed(
        cfg.relative_attention_num_buckets, cfg.num_heads, axes=(None, "heads"), rngs=rngs
      )
    self.blocks = stack_layers(lambda r: _Block(cfg, rngs=r), cfg.num_layers, rngs)
    self.final_layer_norm = _T5LayerNorm(cfg.d_model, eps=cfg.layer_norm_epsilon, rngs=rngs)

  def __call__(
    self,
    input_ids: jax.Array,
    attention_mask: jax.Array | None = None,
    *,
    output_hidden_states: bool = False,
  ) -> jax.Array | T5EncoderOutput:
    """Encodes token ids.

    Args:
      input_ids: `[B, S]` integer token ids.
      attention_mask: optional `[B, S]`, nonzero for real tokens; padded keys get no attention (padded
        query positions are still computed, as in the reference).
      output_hidden_states: also return every layer's hidden states (see `T5EncoderOutput`).

    Returns:
      `[B, S, d_model]` in the final norm weight's dtype (float32 for float32 weights); with
      `output_hidden_states=True` a `T5EncoderOutput` holding it and the `[L + 1, B, S, d_model]` stack of
      all hidden states (in the wider of the residual stream's and the final norm's dtypes).
    """
    cfg = self.cfg
    if input_ids.ndim != 2:
      raise ValueError(f"input_ids must be [B, S], got shape {input_ids.shape}")
    if not jnp.issubdtype(input_ids.dtype, jnp.integer):
      raise TypeError(f"input_ids must be integer token ids, got dtype {input_ids.dtype}")
    b, s = input_ids.shape
    if attention_mask is not None and attention_mask.shape != (b, s):
      raise ValueError(f"attention_mask must be [B, S] = {(b, s)}, got {attention_mask.shape}")
    table = self.shared.embedding[...]
    # The residual stream has the embedding's dtype, widened to `wo`'s if that is wider (the reference
    # adds the float32 `wo` output to a half-precision stream when loaded in float16).
    stream = jnp.promote_types(table.dtype, self.blocks.wo.kernel[...].dtype)
    h = jnp.take(table, input_ids, axis=0).astype(stream)  # [B, S, D]
    if attention_mask is None:
      key_bias = jnp.zeros((b, 1, 1, s), _F32)
    else:
      key_bias = jnp.where(attention_mask.astype(bool), 0.0, jnp.finfo(_F32).min)
      key_bias = key_bias.astype(_F32).reshape(b, 1, 1, s)
    buckets = jnp.asarray(
      relative_position_buckets(
        s,
        s,
        num_buckets=cfg.relative_attention_num_buckets,
        max_distance=cfg.relative_attention_max_distance,
      )
    )
    shared_bias = None
    if not cfg.per_layer_bias:
      shared_bias = jnp.take(self.relative_attention_bias.embedding[...], buckets, axis=0)
      shared_bias = shared_bias.transpose(2, 0, 1)[None].astype(_F32)  # [1, H, S, S]

    embeddings = h

    def body(block, h, _):
      h = block(h, shared_bias, buckets, key_bias)
      return h, (h if output_hidden_states else None)

    h, per_layer = md_core.scan_layers(self.blocks, body, h, remat=cfg.remat, hookable=False)
    last = self.final_layer_norm(h)
    if not output_hidden_states:
      return last
    # One stack in the wider of the residual stream's and the final norm's dtypes (they differ when a
    # float16 checkpoint keeps `wo` in float32); transformers returns each in its own.
    dtype = jnp.promote_types(h.dtype, last.dtype)
    states = [embeddings[None], per_layer[:-1], last[None]]
    return T5EncoderOutput(last, jnp.concatenate([x.astype(dtype) for x in states]))


def _block_target(name: str) -> tuple[str, ...] | None:
  return {
    "layer.0.layer_norm.weight": ("attn_norm", "scale"),
    "layer.0.SelfAttention.q.weight": ("q", "kernel"),
    "layer.0.SelfAttention.k.weight": ("k", "kernel"),
    "layer.0.SelfAttention.v.weight": ("v", "kernel"),
    "layer.0.SelfAttention.o.weight": ("o", "kernel"),
    "layer.0.SelfAttention.relative_attention_bias.weight": (
      "relative_attention_bias",
      "embedding",
    ),
    "layer.1.layer_norm.weight": ("ff_norm", "scale"),
    "layer.1.DenseReluDense.wi.weight": ("wi", "kernel"),
    "layer.1.DenseReluDense.wi_0.weight": ("wi_0", "kernel"),
    "layer.1.DenseReluDense.wi_1.weight": ("wi_1", "kernel"),
    "layer.1.DenseReluDense.wo.weight": ("wo", "kernel"),
  }.get(name)


def make_t5_keymap(cfg: T5Config):
  """The key map from transformers' T5/UMT5 encoder names to md's `T5Encoder` for `cfg`.

  T5 keeps its one bias table in layer 0 (`encoder.block.0.layer.0.SelfAttention.relative_attention_bias`),
  which goes to the encoder-level table; UMT5 has one per layer, stacked.
  """

  def convert_key(name: str) -> md_core.Target | None:
    if name == "shared.weight":
      return md_core.Target(("shared", "embedding"))
    if name == "encoder.final_layer_norm.weight":
      return md_core.Target(("final_layer_norm", "scale"))
    if not name.startswith("encoder.block."):
      return None
    index, _, rest = name[len("encoder.block.") :].partition(".")
    if not index.isdigit():
      return None
    layer = int(index)
    sub = _block_target(rest)
    if sub is None:
      return None
    if sub[0] == "relative_attention_bias" and not cfg.per_layer_bias:
      return md_core.Target(sub) if layer == 0 else None
    layout = "linear" if sub[-1] == "kernel" else "identity"
    return md_core.Target(("blocks",) + sub, layout, layer=layer)

  return convert_key


def convert_t5_key(name: str, *, per_layer_bias: bool = True) -> md_core.Target | None:
  """Maps one transformers T5/UMT5 encoder tensor name to md's parameter (None: not a parameter).

  `per_layer_bias` picks the UMT5 layout (True) or the T5 one (False); see `make_t5_keymap`.
  """
  cfg = T5_VARIANTS["tiny-umt5" if per_layer_bias else "tiny-t5"]
  return make_t5_keymap(cfg)(name)


# Tensors some files carry that the encoder does not use: the tied copy of `shared` (transformers may
# save it), a decoder and LM head (full T5 checkpoints).
T5_ALLOW_UNUSED = (r"encoder\.embed_tokens\.weight", r"decoder\..*", r"lm_head\.weight")
# transformers keeps `wo` in float32 when a model is loaded in float16 (`_keep_in_fp32_modules`, for range),
# not in bfloat16; `load_t5_encoder` does the same.
T5_KEEP_F32_FOR_FLOAT16 = (r"blocks/wo/kernel$",)


def load_t5_encoder(
  source: str | os.PathLike,
  *,
  subfolder: str | None = None,
  mesh: jax.sharding.Mesh | None = None,
  dtype: Any = None,
  rules: Any = None,
  remat: str | None = None,
  progress: bool = False,
) -> T5Encoder:
  """Loads a T5 or UMT5 encoder from a transformers checkpoint folder or hub id.

  Args:
    source: a folder with `config.json` and `*.safetensors`, a diffusers pipeline folder with
      `subfolder`, or a hub id (`"Wan-AI/Wan2.1-T2V-1.3B-Diffusers"`, `subfolder="text_encoder"`).
    subfolder: the component, e.g. "text_encoder" (Wan, LTX) or "text_encoder_2" (Flux).
    mesh: place parameters on this mesh (md-sharding rules over their logical axes).
    dtype: floating dtype of the parameters (default float32: a bfloat16 file is upcast); with float16
      `wo` stays float32, as transformers does.
    rules: md-sharding logical axis rules.
    remat: override `T5Config.remat`.
    progress: show a progress bar.

  Returns:
    The `T5Encoder` with the checkpoint's weights.
  """
  folder = md_core.resolve_source(source, subfolder=subfolder)
  overrides = {} if remat is None else {"remat": remat}
  cfg = T5Config.from_json(folder / "config.json", **overrides)
  ckpt = md_core.open_checkpoint(folder)
  return md_core.load_weights(
    lambda: T5Encoder(cfg, rngs=nnx.Rngs(0)),
    ckpt,
    make_t5_keymap(cfg),
    dtype=dtype,
    keep_f32=T5_KEEP_F32_FOR_FLOAT16
    if dtype is not None and jnp.dtype(dtype) == jnp.float16
    else (),
    mesh=mesh,
    rules=rules,
    allow_unused=T5_ALLOW_UNUSED,
    progress=progress,
  )
