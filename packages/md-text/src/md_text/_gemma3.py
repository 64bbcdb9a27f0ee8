"""Gemma 3 as a text encoder (the language model of transformers' `Gemma3ForConditionalGeneration`, or
`Gemma3ForCausalLM` / `Gemma3TextModel`): LTX-2's `text_encoder` (google/gemma-3-12b-it).

A decoder-only transformer run once over the whole prompt: token embeddings scaled by `sqrt(hidden_size)`,
then per layer a `(1 + w)` RMS norm (float32 statistics), grouped-query causal self-attention with a
`(1 + w)` RMS norm on each query and key head, half-split rotary embeddings and scores scaled by
`query_pre_attn_scalar ** -0.5`, a post-attention norm, then a pre-FFN norm, a GeGLU MLP (tanh GELU) and a
post-FFN norm, both branches residual; a final norm. Layers are either local ("sliding_attention": a query
sees the `sliding_window - 1` keys before it and itself, rotary base `rope_local_base_freq`) or global
("full_attention": the whole causal past, rotary base `rope_theta` with the config's rope scaling, linear in
Gemma 3 12B); the 12B model has five local layers per global one.

The layers are scanned: one block is compiled, its parameters stacked on a leading `layers` axis, and each
layer's kind picked per step (window and rotary table), so a 48-layer model compiles as fast as a 4-layer one.
Attention goes through md-attention (`Gemma3Config.attention` picks the implementation) with grouped
K/V as they are and the local layers' window as md-attention's `window`; a layer kind that differs
only in the window is picked per step with `lax.cond` (no cond when the window covers the prompt, as
in LTX-2: 1024 tokens, window 1024).

A query that sees no real key (a left-padded position) attends to nothing: by default its attention output
is zero, as transformers' SDPA attention gives (its default implementation, the one diffusers' LTX-2
pipelines load); `Gemma3Config.fully_masked_rows="mean"` averages every value there instead, as its eager
attention does. Only the padded positions' hidden states differ.

As an encoder it returns the hidden states of every layer, indexed as transformers' `output_hidden_states`
indexes them: 0 the (scaled) embeddings, `i` the output of layer `i`, `num_hidden_layers` the final normed
output. LTX-2 stacks all of them (`md_text.ltx2_pack_hidden_states`).
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import warnings
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import md_attention as mda
import md_core
from md_core import nn
from md_text._tokenizer import Tokens

_F32 = jnp.float32

# LTX-2's prompt length (the pipeline's `max_sequence_length`).
LTX2_MAX_LENGTH = 1024

LAYER_TYPES = ("sliding_attention", "full_attention")
# A fully masked query's attention output: transformers' SDPA (zeros) or eager (mean of the values).
FULLY_MASKED_ROWS = ("zeros", "mean")

# Config keys that do not change the encoder's forward pass (generation, training, bookkeeping).
_IGNORED_KEYS = {
  "architectures", "attention_dropout", "bos_token_id", "eos_token_id", "pad_token_id",
  "initializer_range", "model_type", "torch_dtype", "dtype", "transformers_version", "use_cache",
  "tie_word_embeddings", "name_or_path", "output_hidden_states", "return_dict", "output_attentions",
  "final_logit_softcapping", "cache_implementation", "generation_config", "is_decoder",
  "tokenizer_class", "chunk_size_feed_forward", "torchscript", "problem_type",
}  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Gemma3Config:
  """The Gemma 3 language model used as a text encoder (transformers `Gemma3TextConfig`).

  Attributes:
    vocab_size: rows of the token embedding.
    hidden_size: width of the residual stream.
    intermediate_size: GeGLU inner width.
    num_hidden_layers: decoder layers.
    num_attention_heads: query heads.
    num_key_value_heads: key/value heads (grouped-query attention; divides `num_attention_heads`).
    head_dim: width of one head (256 in Gemma 3, not `hidden_size / heads`).
    query_pre_attn_scalar: scores are scaled by `query_pre_attn_scalar ** -0.5`.
    layer_types: per layer "sliding_attention" (local) or "full_attention" (global).
    sliding_window: a local layer's query sees this many keys (itself and the `sliding_window - 1` before).
    rope_theta: rotary base of the global layers.
    rope_local_base_freq: rotary base of the local layers.
    rope_linear_factor: the global layers' linear rope scaling (positions divided by it; 8 in Gemma 3 12B);
      1.0 for none.
    rms_norm_eps: epsilon of every RMS norm.
    attn_logit_softcapping: `cap * tanh(scores / cap)` before the softmax when set (None in Gemma 3).
    max_position_embeddings: the longest sequence the model was trained for (informational).
    remat: rematerialisation of each scanned layer: "none", "full", "dots", "dots_no_batch".
    attention: the md-attention implementation and its settings (not used with
      `attn_logit_softcapping`, which is computed densely).
    fully_masked_rows: the attention output of a query that sees no real key (a left-padded position):
      "zeros" as transformers' SDPA attention (its default, and what diffusers' LTX-2 pipelines run), or
      "mean" of every value as its eager attention (the only one transformers runs with soft-capping).
  """

  vocab_size: int
  hidden_size: int
  intermediate_size: int
  num_hidden_layers: int
  num_attention_heads: int
  num_key_value_heads: int
  head_dim: int
  query_pre_attn_scalar: float
  layer_types: tuple[str, ...]
  sliding_window: int = 4096
  rope_theta: float = 1_000_000.0
  rope_local_base_freq: float = 10_000.0
  rope_linear_factor: float = 1.0
  rms_norm_eps: float = 1e-6
  attn_logit_softcapping: float | None = None
  max_position_embeddings: int = 131_072
  remat: str = "none"
  attention: mda.AttentionConfig = dataclasses.field(default_factory=mda.AttentionConfig)
  fully_masked_rows: str = "zeros"

  def __post_init__(self):
    object.__setattr__(self, "layer_types", tuple(self.layer_types))
    if self.fully_masked_rows not in FULLY_MASKED_ROWS:
      raise ValueError(
        f"Gemma3Config.fully_masked_rows={self.fully_masked_rows!r} is not one of {FULLY_MASKED_ROWS}"
      )
    if self.remat not in md_core.REMAT_POLICIES:
      raise ValueError(f"Gemma3Config.remat={self.remat!r} is not one of {md_core.REMAT_POLICIES}")
    if self.num_attention_heads % self.num_key_value_heads:
      raise ValueError(
        f"num_key_value_heads={self.num_key_value_heads} must divide "
        f"num_attention_heads={self.num_attention_heads}"
      )
    if self.head_dim % 2:
      raise ValueError(f"head_dim={self.head_dim} must be even for rotary embeddings")
    if len(self.layer_types) != self.num_hidden_layers:
      raise ValueError(
        f"layer_types has {len(self.layer_types)} entries for num_hidden_layers="
        f"{self.num_hidden_layers}"
      )
    bad = sorted(set(self.layer_types) - set(LAYER_TYPES))
    if bad:
      raise ValueError(f"layer_types {bad} are not supported; expected {LAYER_TYPES}")
    if self.sliding_window < 1:
      raise ValueError(f"sliding_window={self.sliding_window} must be positive")
    if self.rope_linear_factor <= 0:
      raise ValueError(f"rope_linear_factor={self.rope_linear_factor} must be positive")

  @staticmethod
  def pattern(num_layers: int, every: int = 6) -> tuple[str, ...]:
    """Gemma 3's default layer kinds: every `every`-th layer global, the others local."""
    return tuple(
      "full_attention" if (i + 1) % every == 0 else "sliding_attention" for i in range(num_layers)
    )

  @classmethod
  def from_dict(cls, d: Mapping[str, Any], *, where: str = "config", **overrides) -> Gemma3Config:
    """Reads a transformers Gemma 3 `config.json`: a `Gemma3ForConditionalGeneration` one (its
    `text_config`) or a `gemma3_text` one; the hub's `rope_theta` / `rope_local_base_freq` /
    `rope_scaling` / `sliding_window_pattern` keys or transformers 5's `rope_parameters` / `layer_types`."""
    d = dict(d)
    if d.get("model_type") == "gemma3" or "text_config" in d:
      # The multimodal wrapper: only its `text_config` concerns the encoder (the vision tower and
      # image-token settings are left to the unused weights).
      d = dict(d.get("text_config") or {})
      where = f"{where} (text_config)"
    if d.get("model_type", "gemma3_text") != "gemma3_text":
      raise ValueError(
        f"{where}: model_type={d['model_type']!r}; Gemma3Config reads 'gemma3' / 'gemma3_text' configs"
      )
    act = d.pop("hidden_activation", d.pop("hidden_act", "gelu_pytorch_tanh"))
    if act != "gelu_pytorch_tanh":
      raise ValueError(f"{where}: hidden_activation={act!r}; Gemma 3 uses 'gelu_pytorch_tanh'")
    if d.pop("attention_bias", False):
      raise ValueError(
        f"{where}: attention_bias=true is not supported (no Gemma 3 checkpoint has it)"
      )
    if d.pop("use_bidirectional_attention", False):
      raise ValueError(
        f"{where}: use_bidirectional_attention=true is not supported (causal encoder)"
      )
    # Defaults of transformers' Gemma3TextConfig where the hub file leaves them out.
    defaults = dict(
      vocab_size=262_208, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
      num_attention_heads=8, num_key_value_heads=4, head_dim=256, query_pre_attn_scalar=256,
      sliding_window=4096, rms_norm_eps=1e-6, max_position_embeddings=131_072,
    )  # fmt: skip
    pattern = d.pop("sliding_window_pattern", d.pop("_sliding_window_pattern", 6))
    rope = d.pop("rope_parameters", None) or {}
    scaling = d.pop("rope_scaling", None) or {}
    theta = d.pop("rope_theta", None)
    local_theta = d.pop("rope_local_base_freq", None)
    layer_types = d.pop("layer_types", None)
    fields = {f.name for f in dataclasses.fields(cls)} - {
      "attention",
      "fully_masked_rows",
      "remat",
      "layer_types",
      "rope_linear_factor",
    }
    unknown = sorted(
      k for k in d if k not in fields and k not in _IGNORED_KEYS and not k.startswith("_")
    )
    if unknown:
      raise ValueError(
        f"{where}: Gemma 3 config keys {unknown} are not supported (md would silently ignore them); "
        f"supported: {sorted(fields)}"
      )
    kwargs = {**defaults, **{k: d[k] for k in fields if k in d and d[k] is not None}}
    if d.get("attn_logit_softcapping") is None:
      kwargs["attn_logit_softcapping"] = None
    # Rotary: transformers 5 writes {"full_attention": {...}, "sliding_attention": {...}}; the hub files
    # rope_theta (global), rope_local_base_freq (local) and rope_scaling (global only).
    full = dict(rope.get("full_attention") or {})
    local = dict(rope.get("sliding_attention") or {})
    if scaling:
      full = {**scaling, **full}
    full.setdefault("rope_theta", 1_000_000.0 if theta is None else theta)
    local.setdefault("rope_theta", 10_000.0 if local_theta is None else local_theta)
    for kind, params in (("full_attention", full), ("sliding_attention", local)):
      rope_type = params.get("rope_type", params.get("type", "default"))
      if kind == "sliding_attention" and rope_type != "default":
        raise ValueError(f"{where}: local layers' rope type {rope_type!r} is not supported")
      if rope_type not in ("default", "linear"):
        raise ValueError(
          f"{where}: rope type {rope_type!r} is not supported; md's Gemma 3 has default and linear"
        )
    kwargs["rope_theta"] = float(full["rope_theta"])
    kwargs["rope_local_base_freq"] = float(local["rope_theta"])
    full_type = full.get("rope_type", full.get("type", "default"))
    kwargs["rope_linear_factor"] = float(full.get("factor", 1.0)) if full_type == "linear" else 1.0
    n = kwargs["num_hidden_layers"]
    kwargs["layer_types"] = tuple(layer_types) if layer_types else cls.pattern(n, int(pattern))
    kwargs.update(overrides)
    return cls(**kwargs)

  @classmethod
  def from_json(cls, path: str | os.PathLike, **overrides) -> Gemma3Config:
    """Reads `config.json` (a file, or the folder holding it)."""
    path = pathlib.Path(path)
    if path.is_dir():
      path = path / "config.json"
    return cls.from_dict(md_core.read_json(path), where=str(path), **overrides)


GEMMA3_VARIANTS: dict[str, Gemma3Config] = {
  # google/gemma-3-12b-it: Lightricks/LTX-2 `text_encoder` (48 layers, 5 local : 1 global, window 1024).
  "gemma-3-12b": Gemma3Config(
    vocab_size=262_208, hidden_size=3840, intermediate_size=15360, num_hidden_layers=48,
    num_attention_heads=16, num_key_value_heads=8, head_dim=256, query_pre_attn_scalar=256,
    layer_types=Gemma3Config.pattern(48), sliding_window=1024, rope_theta=1_000_000.0,
    rope_local_base_freq=10_000.0, rope_linear_factor=8.0,
  ),
  "tiny": Gemma3Config(
    vocab_size=128, hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=24,
    layer_types=Gemma3Config.pattern(4, 3), sliding_window=4, rope_theta=1000.0,
    rope_local_base_freq=100.0, rope_linear_factor=4.0, max_position_embeddings=256,
  ),
}  # fmt: skip


class Gemma3Output(NamedTuple):
  """What `Gemma3Encoder` returns.

  Attributes:
    last_hidden_state: `[B, S, hidden]` after the final norm.
    hidden_states: `[len(output_layers), B, S, hidden]`, in the order of `output_layers` (all
      `num_hidden_layers + 1` of them by default).
  """

  last_hidden_state: jax.Array
  hidden_states: jax.Array


def _norm(dim: int, eps: float, rngs: nnx.Rngs) -> nn.RMSNorm:
  # Gemma's norm: float32 statistics, scaled by (1 + w) in float32, cast back to the input dtype.
  return nn.RMSNorm(dim, eps=eps, scale_offset=1.0, rngs=rngs)


def gemma3_rope_tables(cfg: Gemma3Config, seq_len: int) -> tuple[jax.Array, jax.Array]:
  """Half-split rotary tables `(cos, sin)` `[2, S, head_dim]` for positions `0..S-1`, float32: index 0 for
  the local layers (base `rope_local_base_freq`), 1 for the global ones (base `rope_theta`, positions
  divided by `rope_linear_factor`)."""
  d = cfg.head_dim
  exponents = jnp.arange(0, d, 2, dtype=_F32) / d
  pos = jnp.arange(seq_len, dtype=_F32)[:, None]
  tables = []
  for theta, factor in ((cfg.rope_local_base_freq, 1.0), (cfg.rope_theta, cfg.rope_linear_factor)):
    inv_freq = 1.0 / (theta**exponents)
    if factor != 1.0:
      inv_freq = inv_freq / factor
    angles = pos * inv_freq[None, :]
    tables.append(jnp.concatenate([angles, angles], axis=-1))
  angles = jnp.stack(tables)
  return jnp.cos(angles), jnp.sin(angles)


def _concrete(x) -> np.ndarray | None:
  """`x` as numpy when it has values (not a tracer under jit / vmap / eval_shape), else None."""
  try:
    return np.asarray(x)
  except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
    return None


class _Layer(nnx.Module):
  """One decoder layer: sandwich-normed grouped-query attention and GeGLU MLP, both residual."""

  def __init__(self, cfg: Gemma3Config, *, rngs: nnx.Rngs):
    d, hd = cfg.hidden_size, cfg.head_dim
    kw = dict(use_bias=False, rngs=rngs)
    eps = cfg.rms_norm_eps
    self.input_layernorm = _norm(d, eps, rngs)
    self.q_proj = nn.Dense(d, cfg.num_attention_heads * hd, axes=("embed", "heads"), **kw)
    self.k_proj = nn.Dense(d, cfg.num_key_value_heads * hd, axes=("embed", "heads"), **kw)
    self.v_proj = nn.Dense(d, cfg.num_key_value_heads * hd, axes=("embed", "heads"), **kw)
    self.o_proj = nn.Dense(cfg.num_attention_heads * hd, d, axes=("heads", "embed"), **kw)
    self.q_norm = _norm(hd, eps, rngs)
    self.k_norm = _norm(hd, eps, rngs)
    self.post_attention_layernorm = _norm(d, eps, rngs)
    self.pre_feedforward_layernorm = _norm(d, eps, rngs)
    self.post_feedforward_layernorm = _norm(d, eps, rngs)
    self.gate_proj = nn.Dense(d, cfg.intermediate_size, axes=("embed", "mlp"), **kw)
    self.up_proj = nn.Dense(d, cfg.intermediate_size, axes=("embed", "mlp"), **kw)
    self.down_proj = nn.Dense(cfg.intermediate_size, d, axes=("mlp", "embed"), **kw)
    self.cfg = cfg

  def attention(self, x, cos, sin, mask, empty, local):
    """`x [B, S, D]` normed; `cos, sin [S, head_dim]`; `mask [B, S]` bool key mask or None; `empty`
    `[B, S]` bool, queries that see no real key, or None; `local` whether this layer is a sliding one
    (a traced bool under the layer scan, or a Python bool when every layer has the same window)."""
    cfg = self.cfg
    b, s, _ = x.shape
    h, kvh, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    q = self.q_norm(self.q_proj(x).reshape(b, s, h, hd))
    k = self.k_norm(self.k_proj(x).reshape(b, s, kvh, hd))
    v = self.v_proj(x).reshape(b, s, kvh, hd)
    q = nn.apply_rope(q, cos, sin, interleaved=False)
    k = nn.apply_rope(k, cos, sin, interleaved=False)
    scale = float(cfg.query_pre_attn_scalar) ** -0.5
    if cfg.attn_logit_softcapping is not None:
      out = self._softcapped(q, k, v, mask, local, scale)
    else:
      # Each key/value head serves `groups` consecutive query heads (transformers' repeat_kv order,
      # md-attention's grouped-query convention), so K/V go in with their own head count.
      def run(window):
        return mda.attention(
          q, k, v, mask=mask, causal=True, scale=scale, window=window, config=cfg.attention
        )

      if isinstance(local, bool):
        out = run(cfg.sliding_window if local else None)
      else:
        out = jax.lax.cond(local, lambda: run(cfg.sliding_window), lambda: run(None))
      if empty is not None and cfg.fully_masked_rows == "mean":
        # transformers' eager attention adds float32's lowest value to masked scores, so a query that
        # sees no key at all averages every value; md-attention gives zeros there, as SDPA does.
        mean = jnp.mean(v.astype(_F32), axis=1).astype(out.dtype)  # [B, kvh, hd]
        out = out.reshape(b, s, kvh, h // kvh, hd)
        out = jnp.where(empty[:, :, None, None, None], mean[:, None, :, None, :], out)
    return self.o_proj(out.reshape(b, s, h * hd))

  def _softcapped(self, q, k, v, mask, local, scale):
    """Dense attention with `cap * tanh(scores / cap)` (md-attention has no soft-capping)."""
    cfg = self.cfg
    b, s, h, hd = q.shape
    kvh = k.shape[2]
    i, j = jnp.arange(s)[:, None], jnp.arange(s)[None, :]
    allowed = (j <= i) & ((j > i - cfg.sliding_window) | jnp.logical_not(local))
    if mask is not None:
      allowed = allowed[None] & mask[:, None, :]
    else:
      allowed = jnp.broadcast_to(allowed[None], (b, s, s))
    qg = q.reshape(b, s, kvh, h // kvh, hd)
    scores = jnp.einsum("bqkgd,bskd->bkgqs", qg.astype(_F32), k.astype(_F32)) * scale
    cap = float(cfg.attn_logit_softcapping)
    scores = cap * jnp.tanh(scores / cap)
    # Masked scores take float32's lowest value, as transformers' eager attention adds it: a query that
    # sees no key at all (a left-padded position) then averages every value ("mean"), or gives zeros.
    scores = jnp.where(allowed[:, None, None], scores, jnp.finfo(_F32).min)
    probs = jax.nn.softmax(scores, axis=-1)
    if cfg.fully_masked_rows == "zeros":
      probs = jnp.where(jnp.any(allowed, axis=-1)[:, None, None, :, None], probs, 0.0)
    probs = probs.astype(v.dtype)
    return jnp.einsum("bkgqs,bskd->bqkgd", probs, v).reshape(b, s, h, hd)

  def __call__(self, h, cos, sin, mask, empty, local):
    a = self.attention(self.input_layernorm(h), cos, sin, mask, empty, local)
    h = h + self.post_attention_layernorm(a)
    x = self.pre_feedforward_layernorm(h)
    m = self.down_proj(nn.gelu(self.gate_proj(x), approximate=True) * self.up_proj(x))
    return h + self.post_feedforward_layernorm(m)


class Gemma3Encoder(nnx.Module):
  """Gemma 3 run as an encoder: token ids `[B, S]` → hidden states of every layer (see `__call__`).

  Activations follow the weights' dtype as in transformers; norm statistics, rotary embeddings, attention
  scores and softmax are float32.
  """

  def __init__(self, cfg: Gemma3Config, *, rngs: nnx.Rngs):
    self.cfg = cfg
    self.embed_tokens = nn.Embed(cfg.vocab_size, cfg.hidden_size, rngs=rngs)
    self.layers = md_core.stack_layers(lambda r: _Layer(cfg, rngs=r), cfg.num_hidden_layers, rngs)
    self.norm = _norm(cfg.hidden_size, cfg.rms_norm_eps, rngs)

  def output_index(self, index: int) -> int:
    """A hidden-state index (negative counts from the end) as `0..num_hidden_layers`; raises if invalid."""
    n = self.cfg.num_hidden_layers
    if not isinstance(index, int | np.integer) or not -(n + 1) <= index <= n:
      raise ValueError(
        f"output layer {index!r} is out of range: this Gemma 3 has {n} layers, so hidden states are "
        f"indexed 0 (embeddings) .. {n} (final norm output), or -{n + 1} .. -1 from the end"
      )
    return int(index) % (n + 1)

  def __call__(
    self,
    input_ids: jax.Array,
    attention_mask: jax.Array | None = None,
    *,
    output_layers: Sequence[int] | None = None,
  ) -> Gemma3Output:
    """Encodes token ids.

    Args:
      input_ids: `[B, S]` integer ids in `[0, vocab_size)`. Concrete arrays are checked; under jit an
        out-of-range id gives NaN features (the lookup fills them).
      attention_mask: optional `[B, S]`, nonzero for real tokens; padded keys get no attention. Positions
        are `0..S-1` whatever the padding, as LTX-2's pipeline runs the reference (left padding).
      output_layers: hidden-state indices to return (0 embeddings, `i` after layer `i`,
        `num_hidden_layers` the final normed output; negative from the end); all by default.

    Returns:
      `Gemma3Output(last_hidden_state [B, S, D], hidden_states [len(output_layers), B, S, D])`.

    Raises:
      ValueError: bad shapes, ids outside the vocabulary, or output layers out of range.
    """
    cfg = self.cfg
    if input_ids.ndim != 2:
      raise ValueError(f"input_ids must be [B, S], got shape {input_ids.shape}")
    if not jnp.issubdtype(input_ids.dtype, jnp.integer):
      raise TypeError(f"input_ids must be integer token ids, got dtype {input_ids.dtype}")
    b, s = input_ids.shape
    if attention_mask is not None and attention_mask.shape != (b, s):
      raise ValueError(f"attention_mask must be [B, S] = {(b, s)}, got {attention_mask.shape}")
    concrete = _concrete(input_ids)
    if concrete is not None and concrete.size:
      lo, hi = int(concrete.min()), int(concrete.max())
      if lo < 0 or hi >= cfg.vocab_size:
        bad = lo if lo < 0 else hi
        raise ValueError(
          f"token id {bad} is outside this Gemma 3's vocabulary [0, {cfg.vocab_size}); was the "
          "tokenizer made for another model?"
        )
    n = cfg.num_hidden_layers
    wanted = tuple(range(n + 1)) if output_layers is None else tuple(output_layers)
    wanted = tuple(self.output_index(i) for i in wanted)

    table = self.embed_tokens.embedding[...]
    h = jnp.take(table, input_ids, axis=0)
    # transformers scales by sqrt(hidden) rounded to the weights' dtype.
    h = h * jnp.asarray(cfg.hidden_size**0.5, dtype=h.dtype)
    embeddings = h

    cos, sin = gemma3_rope_tables(cfg, s)  # [2, S, hd]
    mask = None if attention_mask is None else attention_mask.astype(bool)
    # For "mean": queries that see no real key, per layer kind (none without a mask; with one, those whose
    # window or causal past holds no real token). md-attention already gives "zeros" there.
    empty = None
    if mask is not None and cfg.fully_masked_rows == "mean":
      seen = jnp.cumsum(mask, axis=1, dtype=jnp.int32)  # real keys among 0..i
      w = cfg.sliding_window
      before = jnp.pad(seen, ((0, 0), (w, 0)))[:, :s]  # real keys among 0..i-w
      empty = jnp.stack([seen - before == 0, seen == 0])  # [2, B, S]
    kinds = jnp.asarray([LAYER_TYPES.index(t) for t in cfg.layer_types], jnp.int32)
    # The window only matters for prompts longer than it; then the layer kind picks it per step.
    windowed = cfg.sliding_window < s and "sliding_attention" in cfg.layer_types
    mixed = windowed and "full_attention" in cfg.layer_types
    fixed_local = windowed and not mixed

    def body(layer, h, kind):
      local = (kind == 0) if mixed else fixed_local
      layer_empty = None if empty is None else empty[kind]
      h = layer(h, cos[kind], sin[kind], mask, layer_empty, local)
      return h, h

    h, per_layer = md_core.scan_layers(
      self.layers, body, h, per_layer=kinds, remat=cfg.remat, hookable=False
    )
    last = self.norm(h)
    picked = []
    for i in wanted:
      if i == 0:
        picked.append(embeddings)
      elif i == n:
        picked.append(last)
      else:
        picked.append(per_layer[i - 1])
    hidden = (
      jnp.stack([p.astype(h.dtype) for p in picked])
      if picked
      else jnp.zeros((0, b, s, cfg.hidden_size), h.dtype)
    )
    return Gemma3Output(last, hidden)


def gemma3_tokenize(
  tokenizer: Any,
  prompts: str | Sequence[str],
  *,
  max_length: int = LTX2_MAX_LENGTH,
  padding_side: str = "left",
) -> Tokens:
  """Token ids of prompts as LTX-2's pipeline builds them for Gemma 3: each prompt stripped of surrounding
  whitespace, `<bos>` first, padded on the left (the pipeline's choice for Gemma) and truncated to
  `max_length`; warns when a prompt loses tokens.

  Args:
    tokenizer: the checkpoint's transformers tokenizer (`md_text.load_tokenizer(source)`).
    prompts: one prompt or a list.
    max_length: the fixed length (1024 in LTX-2).
    padding_side: "left" as LTX-2's pipeline sets it; "right" for other uses.

  Returns:
    `Tokens` with `[B, max_length]` int32 ids and mask.

  Raises:
    ValueError: a bad `padding_side`, or a tokenizer with neither a pad nor an end token.
  """
  if padding_side not in ("left", "right"):
    raise ValueError(f"padding_side={padding_side!r}; expected 'left' or 'right'")
  if isinstance(prompts, str):
    prompts = [prompts]
  texts = [p.strip() for p in prompts]
  if tokenizer.pad_token_id is None:
    if tokenizer.eos_token is None:
      raise ValueError(f"{type(tokenizer).__name__} has neither a pad nor an end token to pad with")
    tokenizer.pad_token = tokenizer.eos_token  # as the pipeline does
  full = tokenizer(texts, truncation=False, padding=False, add_special_tokens=True).input_ids
  for i, ids in enumerate(full):
    if len(ids) > max_length:
      warnings.warn(
        f"prompt {i} is {len(ids)} tokens long; {len(ids) - max_length} token(s) were cut to fit "
        f"max_length={max_length}: {tokenizer.decode(ids[max_length:])!r}",
        stacklevel=2,
      )
  out = tokenizer(
    texts,
    padding="max_length",
    truncation=True,
    max_length=max_length,
    add_special_tokens=True,
    padding_side=padding_side,
    return_tensors="np",
  )
  return Tokens(np.asarray(out.input_ids, np.int32), np.asarray(out.attention_mask, np.int32))


_LAYER_NAMES = {
  "input_layernorm.weight": ("input_layernorm", "scale"),
  "post_attention_layernorm.weight": ("post_attention_layernorm", "scale"),
  "pre_feedforward_layernorm.weight": ("pre_feedforward_layernorm", "scale"),
  "post_feedforward_layernorm.weight": ("post_feedforward_layernorm", "scale"),
  "self_attn.q_proj.weight": ("q_proj", "kernel"),
  "self_attn.k_proj.weight": ("k_proj", "kernel"),
  "self_attn.v_proj.weight": ("v_proj", "kernel"),
  "self_attn.o_proj.weight": ("o_proj", "kernel"),
  "self_attn.q_norm.weight": ("q_norm", "scale"),
  "self_attn.k_norm.weight": ("k_norm", "scale"),
  "mlp.gate_proj.weight": ("gate_proj", "kernel"),
  "mlp.up_proj.weight": ("up_proj", "kernel"),
  "mlp.down_proj.weight": ("down_proj", "kernel"),
}

# Prefixes of the language model's tensors, longest first: Gemma3ForConditionalGeneration as transformers 5
# holds it (`model.language_model.`) and as the hub files store it (`language_model.model.`), then
# Gemma3ForCausalLM (`model.`) and Gemma3TextModel (none).
_PREFIXES = ("model.language_model.", "language_model.model.", "language_model.", "model.")


def convert_gemma3_key(name: str) -> md_core.Target | None:
  """Maps a transformers Gemma 3 tensor name to md's `Gemma3Encoder` parameter (None: not one of its).

  Accepts the language model of `Gemma3ForConditionalGeneration` (`language_model.model.layers.N…` in the
  hub files, `model.language_model.layers.N…` as transformers 5 names it), `Gemma3ForCausalLM`
  (`model.layers.N…`) and `Gemma3TextModel` (`layers.N…`). The vision tower, projector and LM head map to
  nothing (`GEMMA3_ALLOW_UNUSED`).
  """
  for prefix in _PREFIXES:
    if name.startswith(prefix):
      name = name[len(prefix) :]
      break
  if name == "embed_tokens.weight":
    return md_core.Target(("embed_tokens", "embedding"))
  if name == "norm.weight":
    return md_core.Target(("norm", "scale"))
  if not name.startswith("layers."):
    return None
  index, _, rest = name[len("layers.") :].partition(".")
  sub = _LAYER_NAMES.get(rest)
  if not index.isdigit() or sub is None:
    return None
  layout = "linear" if sub[-1] == "kernel" else "identity"
  return md_core.Target(("layers",) + sub, layout, layer=int(index))


# Tensors a Gemma 3 checkpoint may hold that the text encoder does not use: the SigLIP vision tower and the
# multimodal projector of Gemma3ForConditionalGeneration (either naming), and an LM head (Gemma 3 ties it to
# the embedding; a file that stores it anyway is accepted).
GEMMA3_ALLOW_UNUSED = (
  r"(model\.)?vision_tower\..*",
  r"(model\.)?multi_modal_projector\..*",
  r"(language_model\.)?lm_head\.weight",
)


def load_gemma3_encoder(
  source: str | os.PathLike,
  *,
  subfolder: str | None = "text_encoder",
  mesh: jax.sharding.Mesh | None = None,
  dtype: Any = None,
  rules: Any = None,
  remat: str | None = None,
  progress: bool = False,
  attention: mda.AttentionConfig | None = None,
  fully_masked_rows: str | None = None,
) -> Gemma3Encoder:
  """Loads a Gemma 3 text encoder from a transformers checkpoint folder or hub id.

  Args:
    source: a diffusers pipeline folder or hub id (`"Lightricks/LTX-2"`) with `subfolder`, or the model's
      own folder with `subfolder=None` (e.g. google/gemma-3-12b-it).
    subfolder: the component, "text_encoder" in the LTX-2 repos.
    mesh: place parameters on this mesh (md-sharding rules over their logical axes).
    dtype: floating dtype of the parameters (default float32: the hub's bfloat16 files are upcast).
    rules: md-sharding logical axis rules.
    remat: override `Gemma3Config.remat`.
    progress: show a progress bar.
    attention: override `Gemma3Config.attention`.
    fully_masked_rows: override `Gemma3Config.fully_masked_rows` ("zeros", transformers' SDPA, by default;
      "mean" as its eager attention).

  Returns:
    The `Gemma3Encoder` with the checkpoint's weights.

  Raises:
    FileNotFoundError: the folder, component or config is missing.
    ValueError: a config md cannot run.
    md_core.WeightLoadError: tensors that do not fit the config (all listed).
  """
  folder = md_core.resolve_source(source, subfolder=subfolder)
  overrides = {} if remat is None else {"remat": remat}
  if attention is not None:
    overrides["attention"] = attention
  if fully_masked_rows is not None:
    overrides["fully_masked_rows"] = fully_masked_rows
  cfg = Gemma3Config.from_json(folder / "config.json", **overrides)
  return md_core.load_weights(
    lambda: Gemma3Encoder(cfg, rngs=nnx.Rngs(0)),
    md_core.open_checkpoint(folder),
    convert_gemma3_key,
    dtype=dtype,
    mesh=mesh,
    rules=rules,
    allow_unused=GEMMA3_ALLOW_UNUSED,
    progress=progress,
  )
