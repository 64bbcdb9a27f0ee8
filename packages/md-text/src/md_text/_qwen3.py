"""Qwen3 as a text encoder (transformers' `Qwen3Model` / `Qwen3ForCausalLM` weights): FLUX.2 [klein].

A pre-norm decoder-only transformer run once over the whole prompt: token embeddings, then per layer an RMS
norm (float32 statistics), grouped-query causal self-attention with a per-head RMS norm on queries and keys
and half-split rotary embeddings, and a SwiGLU MLP; a final RMS norm. As an encoder it returns the hidden
states of chosen layers, indexed as transformers' `output_hidden_states` indexes them: 0 is the embedding
output, `i` the output of layer `i`, `num_hidden_layers` the final (normed) output. FLUX.2 [klein] stacks
hidden states (9, 18, 27) along the features (`flux2_prompt_embeds`).

The layers are scanned: one block is compiled and its parameters are stacked on a leading `layers` axis.
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
from md_core import nn, stack_layers
from md_text._tokenizer import Tokens

_F32 = jnp.float32

# FLUX.2 [klein]'s choice of hidden states (diffusers' `text_encoder_out_layers`) and prompt length.
FLUX2_KLEIN_LAYERS = (9, 18, 27)
FLUX2_KLEIN_MAX_LENGTH = 512

# Config keys that do not change the encoder's forward pass (generation, training, bookkeeping).
_IGNORED_KEYS = {
  "architectures", "attention_dropout", "bos_token_id", "eos_token_id", "pad_token_id",
  "initializer_range", "model_type", "torch_dtype", "dtype", "transformers_version", "use_cache",
  "tie_word_embeddings", "max_window_layers", "use_sliding_window", "sliding_window", "layer_types",
  "rope_scaling", "rope_parameters", "name_or_path", "output_hidden_states", "return_dict",
  "output_attentions", "tokenizer_class", "is_decoder", "generation_config",
}  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Qwen3Config:
  """A Qwen3 language model used as a text encoder (transformers `config.json`).

  Attributes:
    vocab_size: rows of the token embedding.
    hidden_size: width of the residual stream.
    intermediate_size: SwiGLU inner width.
    num_hidden_layers: decoder layers.
    num_attention_heads: query heads.
    num_key_value_heads: key/value heads (grouped-query attention; divides `num_attention_heads`).
    head_dim: width of one head (Qwen3: 128, not `hidden_size / heads`).
    rms_norm_eps: epsilon of every RMS norm.
    rope_theta: rotary base.
    max_position_embeddings: the longest sequence the model was trained for (checked, not needed).
    tie_word_embeddings: the LM head reuses the embedding (Qwen3-4B); informational for an encoder.
    remat: rematerialisation of each scanned layer: "none", "full", "dots", "dots_no_batch".
    attention: the md-attention implementation and its settings.
  """

  vocab_size: int
  hidden_size: int
  intermediate_size: int
  num_hidden_layers: int
  num_attention_heads: int
  num_key_value_heads: int
  head_dim: int
  rms_norm_eps: float = 1e-6
  rope_theta: float = 1_000_000.0
  max_position_embeddings: int = 40960
  tie_word_embeddings: bool = False
  remat: str = "none"
  attention: mda.AttentionConfig = dataclasses.field(default_factory=mda.AttentionConfig)

  def __post_init__(self):
    if self.remat not in md_core.REMAT_POLICIES:
      raise ValueError(f"Qwen3Config.remat={self.remat!r} is not one of {md_core.REMAT_POLICIES}")
    if self.num_attention_heads % self.num_key_value_heads:
      raise ValueError(
        f"num_key_value_heads={self.num_key_value_heads} must divide "
        f"num_attention_heads={self.num_attention_heads}"
      )
    if self.head_dim % 2:
      raise ValueError(f"head_dim={self.head_dim} must be even for rotary embeddings")

  @classmethod
  def from_dict(cls, d: Mapping[str, Any], *, where: str = "config", **overrides) -> Qwen3Config:
    """Reads a transformers Qwen3 `config.json` (the hub's `rope_theta` or transformers 5's
    `rope_parameters`)."""
    d = dict(d)
    if d.get("model_type", "qwen3") != "qwen3":
      raise ValueError(
        f"{where}: model_type={d['model_type']!r}; Qwen3Config reads 'qwen3' configs"
      )
    if d.get("hidden_act", "silu") != "silu":
      raise ValueError(f"{where}: hidden_act={d['hidden_act']!r}; Qwen3 uses 'silu' (SwiGLU)")
    if d.get("attention_bias"):
      raise ValueError(
        f"{where}: attention_bias=true is not supported (no Qwen3 checkpoint has it)"
      )
    if d.get("use_sliding_window"):
      raise ValueError(f"{where}: use_sliding_window=true is not supported by md's Qwen3 encoder")
    rope = dict(d.get("rope_parameters") or {})
    scaling = d.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", scaling.get("rope_type", scaling.get("type", "default")))
    if rope_type != "default":
      raise ValueError(
        f"{where}: rope type {rope_type!r} is not supported; md's Qwen3 encoder has the default rotary"
      )
    fields = {f.name for f in dataclasses.fields(cls)} - {"attention", "remat"}
    unknown = sorted(
      k
      for k in d
      if k not in fields
      and k not in _IGNORED_KEYS
      and k not in ("hidden_act", "attention_bias")
      and not k.startswith("_")
    )
    if unknown:
      raise ValueError(
        f"{where}: Qwen3 config keys {unknown} are not supported (md would silently ignore them); "
        f"supported: {sorted(fields)}"
      )
    kwargs = {k: d[k] for k in fields if k in d}
    if "rope_theta" in rope:
      kwargs.setdefault("rope_theta", rope["rope_theta"])
    if kwargs.get("head_dim") is None and "hidden_size" in d and "num_attention_heads" in d:
      kwargs["head_dim"] = d["hidden_size"] // d["num_attention_heads"]
    kwargs.setdefault("num_key_value_heads", d.get("num_attention_heads"))
    kwargs.update(overrides)
    needed = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers")
    missing = [k for k in needed + ("num_attention_heads",) if kwargs.get(k) is None]
    if missing:
      raise ValueError(f"{where}: Qwen3 config lacks {missing}")
    return cls(**kwargs)

  @classmethod
  def from_json(cls, path: str | os.PathLike, **overrides) -> Qwen3Config:
    """Reads `config.json` (a file, or the folder holding it)."""
    path = pathlib.Path(path)
    if path.is_dir():
      path = path / "config.json"
    return cls.from_dict(md_core.read_json(path), where=str(path), **overrides)


_QWEN3 = dict(
  num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
  vocab_size=151936, rope_theta=1_000_000.0, rms_norm_eps=1e-6,
)  # fmt: skip
QWEN3_VARIANTS: dict[str, Qwen3Config] = {
  # Qwen/Qwen3-4B: black-forest-labs/FLUX.2-klein-4B `text_encoder` (tied embeddings, no lm_head stored).
  "qwen3-4b": Qwen3Config(
    hidden_size=2560, intermediate_size=9728, tie_word_embeddings=True, **_QWEN3
  ),
  # Qwen/Qwen3-8B: black-forest-labs/FLUX.2-klein-9B `text_encoder` (stores lm_head.weight).
  "qwen3-8b": Qwen3Config(hidden_size=4096, intermediate_size=12288, **_QWEN3),
  "tiny": Qwen3Config(
    vocab_size=320, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, rope_theta=1000.0,
    max_position_embeddings=128, tie_word_embeddings=True,
  ),
}  # fmt: skip


class Qwen3Output(NamedTuple):
  """What `Qwen3Encoder` returns.

  Attributes:
    last_hidden_state: `[B, S, hidden]` after the final norm (None when the encoder stopped early).
    hidden_states: `[len(output_layers), B, S, hidden]`, in the order of `output_layers`.
  """

  last_hidden_state: jax.Array | None
  hidden_states: jax.Array


class _RMSNorm(nn.RMSNorm):
  """Qwen3's RMS norm, rounded as the reference rounds it: statistics in float32, the normalised value cast
  back to the input dtype before the scale multiplies it (the product then follows type promotion)."""

  def __call__(self, x: jax.Array) -> jax.Array:
    h = x.astype(_F32)
    h = h * jax.lax.rsqrt(jnp.mean(jnp.square(h), axis=-1, keepdims=True) + self.eps)
    scale = self.scale[...]
    return scale.reshape((1,) * (h.ndim - 1) + (-1,)) * h.astype(x.dtype)


def rope_tables(head_dim: int, seq_len: int, theta: float) -> tuple[jax.Array, jax.Array]:
  """Half-split rotary tables `(cos, sin)` `[S, head_dim]` for positions `0..S-1`, float32.

  Feature `i` and `i + head_dim/2` share frequency `theta ** (-2i / head_dim)` (transformers' `rotate_half`
  convention), computed in float32 as the reference computes them.
  """
  inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=_F32) / head_dim))  # [D/2]
  angles = jnp.arange(seq_len, dtype=_F32)[:, None] * inv_freq[None, :]  # [S, D/2]
  angles = jnp.concatenate([angles, angles], axis=-1)  # [S, D]
  return jnp.cos(angles), jnp.sin(angles)


def _concrete(x) -> np.ndarray | None:
  """`x` as numpy when it has values (not a tracer under jit / vmap / eval_shape), else None."""
  try:
    return np.asarray(x)
  except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
    return None


class _Layer(nnx.Module):
  """One decoder layer: pre-norm grouped-query attention and pre-norm SwiGLU MLP, both residual."""

  def __init__(self, cfg: Qwen3Config, *, rngs: nnx.Rngs):
    d, hd = cfg.hidden_size, cfg.head_dim
    kw = dict(use_bias=False, rngs=rngs)
    eps = cfg.rms_norm_eps
    self.input_layernorm = _RMSNorm(d, eps=eps, rngs=rngs)
    self.q_proj = nn.Dense(d, cfg.num_attention_heads * hd, axes=("embed", "heads"), **kw)
    self.k_proj = nn.Dense(d, cfg.num_key_value_heads * hd, axes=("embed", "heads"), **kw)
    self.v_proj = nn.Dense(d, cfg.num_key_value_heads * hd, axes=("embed", "heads"), **kw)
    self.o_proj = nn.Dense(cfg.num_attention_heads * hd, d, axes=("heads", "embed"), **kw)
    self.q_norm = _RMSNorm(hd, eps=eps, rngs=rngs)
    self.k_norm = _RMSNorm(hd, eps=eps, rngs=rngs)
    self.post_attention_layernorm = _RMSNorm(d, eps=eps, rngs=rngs)
    self.gate_proj = nn.Dense(d, cfg.intermediate_size, axes=("embed", "mlp"), **kw)
    self.up_proj = nn.Dense(d, cfg.intermediate_size, axes=("embed", "mlp"), **kw)
    self.down_proj = nn.Dense(cfg.intermediate_size, d, axes=("mlp", "embed"), **kw)
    self.cfg = cfg

  def __call__(self, h, cos, sin, mask):
    """`h [B, S, D]`; `cos, sin [S, head_dim]` float32; `mask [B, S]` bool key mask or None."""
    cfg = self.cfg
    b, s, _ = h.shape
    x = self.input_layernorm(h)
    q = self.q_norm(self.q_proj(x).reshape(b, s, cfg.num_attention_heads, cfg.head_dim))
    k = self.k_norm(self.k_proj(x).reshape(b, s, cfg.num_key_value_heads, cfg.head_dim))
    v = self.v_proj(x).reshape(b, s, cfg.num_key_value_heads, cfg.head_dim)
    q = nn.apply_rope(q, cos, sin, interleaved=False)
    k = nn.apply_rope(k, cos, sin, interleaved=False)
    # Grouped-query attention: each key/value head serves `groups` consecutive query heads
    # (transformers' repeat_kv order), which md-attention does without repeating K/V.
    out = mda.attention(
      q, k, v, mask=mask, causal=True, scale=cfg.head_dim**-0.5, config=cfg.attention
    )  # [B, S, H, head_dim]
    h = h + self.o_proj(out.reshape(b, s, cfg.num_attention_heads * cfg.head_dim))
    x = self.post_attention_layernorm(h)
    return h + self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


class Qwen3Encoder(nnx.Module):
  """Qwen3 run as an encoder: token ids `[B, S]` → chosen hidden states (see `__call__`).

  Activations follow the weights' dtype as in transformers; norm statistics, rotary embeddings, attention
  scores and softmax are float32.
  """

  def __init__(self, cfg: Qwen3Config, *, rngs: nnx.Rngs):
    self.cfg = cfg
    self.embed_tokens = nn.Embed(cfg.vocab_size, cfg.hidden_size, rngs=rngs)
    self.layers = stack_layers(lambda r: _Layer(cfg, rngs=r), cfg.num_hidden_layers, rngs)
    self.norm = _RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, rngs=rngs)

  def output_index(self, index: int) -> int:
    """A hidden-state index (negative counts from the end) as `0..num_hidden_layers`; raises if invalid."""
    n = self.cfg.num_hidden_layers
    if not isinstance(index, int | np.integer) or not -(n + 1) <= index <= n:
      raise ValueError(
        f"output layer {index!r} is out of range: this Qwen3 has {n} layers, so hidden states are "
        f"indexed 0 (embeddings) .. {n} (final norm output), or -{n + 1} .. -1 from the end"
      )
    return int(index) % (n + 1)

  def __call__(
    self,
    input_ids: jax.Array,
    attention_mask: jax.Array | None = None,
    *,
    output_layers: Sequence[int] = (),
    stop_early: bool = False,
  ) -> Qwen3Output:
    """Encodes token ids.

    Args:
      input_ids: `[B, S]` integer ids in `[0, vocab_size)`. Concrete arrays are checked; under jit an
        out-of-range id gives NaN features (the lookup fills them).
      attention_mask: optional `[B, S]`, nonzero for real tokens. Attention is causal; padded keys get no
        attention. Positions are `0..S-1` whatever the padding (as the reference with right padding).
        A query that sees no real key (left padding) gets zeros from md-attention, where the reference
        averages the masked keys; only padded positions differ.
      output_layers: hidden-state indices to return (transformers' convention: 0 embeddings, `i` after
        layer `i`, `num_hidden_layers` the final normed output; negative from the end).
      stop_early: run only as many layers as the deepest requested index needs; `last_hidden_state` is
        then None unless the final output was requested (FLUX.2 [klein] needs 27 of Qwen3's 36 layers).

    Returns:
      `Qwen3Output(last_hidden_state [B, S, D] | None, hidden_states [len(output_layers), B, S, D])`.

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
          f"token id {bad} is outside this Qwen3's vocabulary [0, {cfg.vocab_size}); was the tokenizer "
          "made for another model?"
        )
    n = cfg.num_hidden_layers
    wanted = tuple(self.output_index(i) for i in output_layers)
    depth = max(wanted, default=0) if stop_early else n
    inner = sorted({i for i in wanted if 1 <= i <= min(depth, n - 1)})

    table = self.embed_tokens.embedding[...]
    h = jnp.take(table, input_ids, axis=0)  # [B, S, D]
    embeddings = h
    mask = None if attention_mask is None else attention_mask.astype(bool)
    cos, sin = rope_tables(cfg.head_dim, s, cfg.rope_theta)

    # Hidden states of layers 1..n-1 are written into a buffer carried through the scan, one slot per
    # requested layer plus one scratch slot the other layers write to, so only what is asked for is kept.
    slot_of = np.full((n,), len(inner), np.int32)
    for j, i in enumerate(inner):
      slot_of[i - 1] = j
    run = depth if depth < n else n
    layers = self.layers
    if run < n:  # only the layers up to the deepest one asked for
      graphdef, params = nnx.split(layers)
      layers = nnx.merge(graphdef, jax.tree.map(lambda p: p[:run], params))

    def body(layer, carry, slot):
      h, buf = carry
      h = layer(h, cos, sin, mask)
      buf = jax.lax.dynamic_update_index_in_dim(buf, h.astype(buf.dtype), slot, 0)
      return (h, buf), None

    buf = jnp.zeros((len(inner) + 1, b, s, cfg.hidden_size), h.dtype)
    if run:
      (h, buf), _ = md_core.scan_layers(
        layers, body, (h, buf), per_layer=jnp.asarray(slot_of[:run]), remat=cfg.remat,
        hookable=False,
      )  # fmt: skip
    last = self.norm(h) if run == n else None
    picked = []
    for i in wanted:
      if i == 0:
        picked.append(embeddings)
      elif i == n:
        picked.append(last)
      else:
        picked.append(buf[inner.index(i)])
    hidden = (
      jnp.stack([p.astype(h.dtype) for p in picked])
      if picked
      else jnp.zeros((0, b, s, cfg.hidden_size), h.dtype)
    )
    return Qwen3Output(last, hidden)


def flux2_prompt_embeds(hidden_states: jax.Array) -> jax.Array:
  """FLUX.2's text features: hidden states `[N, B, S, D]` → `[B, S, N * D]`, layer-major per token (as
  diffusers' Flux2KleinPipeline stacks `hidden_states[9], [18], [27]`)."""
  if hidden_states.ndim != 4:
    raise ValueError(f"hidden_states must be [N, B, S, D], got shape {hidden_states.shape}")
  n, b, s, d = hidden_states.shape
  return hidden_states.transpose(1, 2, 0, 3).reshape(b, s, n * d)


def encode_flux2_prompt(
  encoder: Qwen3Encoder,
  input_ids: jax.Array,
  attention_mask: jax.Array | None,
  *,
  layers: Sequence[int] = FLUX2_KLEIN_LAYERS,
) -> jax.Array:
  """FLUX.2 [klein] prompt embeddings `[B, S, len(layers) * hidden]` from chat-templated ids
  (`qwen3_tokenize`); runs only the layers the deepest of `layers` needs."""
  out = encoder(input_ids, attention_mask, output_layers=tuple(layers), stop_early=True)
  return flux2_prompt_embeds(out.hidden_states)


# What Qwen3's chat template writes for one user message with `add_generation_prompt=True,
# enable_thinking=False` (the empty think block tells the model not to reason), as the Klein pipeline calls it.
QWEN3_PROMPT_FORMAT = (
  "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
)


def qwen3_tokenize(
  tokenizer: Any,
  prompts: str | Sequence[str],
  *,
  max_length: int = FLUX2_KLEIN_MAX_LENGTH,
  chat_template: str | None = "qwen3",
) -> Tokens:
  """Token ids of prompts as FLUX.2 [klein] builds them: each prompt as one user message in Qwen3's chat
  format (`add_generation_prompt=True, enable_thinking=False`), right-padded and truncated to
  `max_length`; warns when a prompt loses tokens.

  Args:
    tokenizer: the checkpoint's transformers tokenizer (`md_text.load_tokenizer(source)`).
    prompts: one prompt or a list.
    max_length: the fixed length (512 in the Klein pipeline).
    chat_template: "qwen3": Qwen3's format written out (`QWEN3_PROMPT_FORMAT`; what the hub template
      renders for one user message, without needing jinja2); "tokenizer": the tokenizer's own template
      through transformers' `apply_chat_template` (needs jinja2); None: the raw prompts.

  Returns:
    `Tokens` with `[B, max_length]` int32 ids and mask.

  Raises:
    ValueError: an unknown `chat_template`, a tokenizer without a chat template (with "tokenizer") or
      without a pad token.
  """
  if isinstance(prompts, str):
    prompts = [prompts]
  prompts = list(prompts)
  if chat_template == "qwen3":
    texts = [QWEN3_PROMPT_FORMAT.format(p) for p in prompts]
  elif chat_template == "tokenizer":
    if not getattr(tokenizer, "chat_template", None):
      raise ValueError(
        f"{type(tokenizer).__name__} has no chat template (tokenizer_config.json / "
        "chat_template.jinja); load the checkpoint's `tokenizer` folder or pass chat_template='qwen3'"
      )
    texts = [
      tokenizer.apply_chat_template(
        [{"role": "user", "content": p}],
        tokenize=False,
        add_generation_prompt=True,
        enable_thinking=False,
      )
      for p in prompts
    ]
  elif chat_template is None:
    texts = prompts
  else:
    raise ValueError(f"chat_template={chat_template!r}; expected 'qwen3', 'tokenizer' or None")
  if tokenizer.pad_token_id is None:
    raise ValueError(f"{type(tokenizer).__name__} has no pad token; Qwen3 pads with <|endoftext|>")
  full = tokenizer(texts, truncation=False, padding=False).input_ids
  for i, ids in enumerate(full):
    if len(ids) > max_length:
      warnings.warn(
        f"prompt {i} is {len(ids)} tokens long in the chat format; {len(ids) - max_length} "
        f"token(s) were cut to fit max_length={max_length}: {tokenizer.decode(ids[max_length:])!r}",
        stacklevel=2,
      )
  out = tokenizer(
    texts,
    padding="max_length",
    truncation=True,
    max_length=max_length,
    padding_side="right",
    return_tensors="np",
  )
  return Tokens(np.asarray(out.input_ids, np.int32), np.asarray(out.attention_mask, np.int32))


_LAYER_NAMES = {
  "input_layernorm.weight": ("input_layernorm", "scale"),
  "post_attention_layernorm.weight": ("post_attention_layernorm", "scale"),
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


def convert_qwen3_key(name: str) -> md_core.Target | None:
  """Maps a transformers Qwen3 tensor name to md's `Qwen3Encoder` parameter (None: not one of its).

  Accepts `Qwen3ForCausalLM` names (`model.layers.N.self_attn.q_proj.weight`, as the hub files store
  them) and bare `Qwen3Model` ones (`layers.N…`). `lm_head.weight` maps to nothing: the encoder has no
  head (`QWEN3_ALLOW_UNUSED`).
  """
  name = name.removeprefix("model.")
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


# Tensors a Qwen3 file may hold that the encoder does not use: the LM head (Qwen3-8B stores it; Qwen3-4B
# ties it to the embedding and stores nothing).
QWEN3_ALLOW_UNUSED = (r"lm_head\.weight",)


def load_qwen3_encoder(
  source: str | os.PathLike,
  *,
  subfolder: str | None = "text_encoder",
  mesh: jax.sharding.Mesh | None = None,
  dtype: Any = None,
  rules: Any = None,
  remat: str | None = None,
  attention: mda.AttentionConfig | None = None,
  progress: bool = False,
) -> Qwen3Encoder:
  """Loads a Qwen3 encoder from a transformers checkpoint folder or hub id.

  Args:
    source: a diffusers pipeline folder or hub id (`"black-forest-labs/FLUX.2-klein-4B"`) with
      `subfolder`, or the model's own folder with `subfolder=None`.
    subfolder: the component, "text_encoder" in the FLUX.2 [klein] repos.
    mesh: place parameters on this mesh (md-sharding rules over their logical axes).
    dtype: floating dtype of the parameters (default float32: the hub's bfloat16 files are upcast).
    rules: md-sharding logical axis rules.
    remat: override `Qwen3Config.remat`.
    attention: override `Qwen3Config.attention`.
    progress: show a progress bar.

  Returns:
    The `Qwen3Encoder` with the checkpoint's weights.

  Raises:
    FileNotFoundError: the folder, component or config is missing.
    md_core.WeightLoadError: tensors that do not fit the config (all listed).
  """
  folder = md_core.resolve_source(source, subfolder=subfolder)
  overrides = {}
  if remat is not None:
    overrides["remat"] = remat
  if attention is not None:
    overrides["attention"] = attention
  cfg = Qwen3Config.from_json(folder / "config.json", **overrides)
  return md_core.load_weights(
    lambda: Qwen3Encoder(cfg, rngs=nnx.Rngs(0)),
    md_core.open_checkpoint(folder),
    convert_qwen3_key,
    dtype=dtype,
    mesh=mesh,
    rules=rules,
    allow_unused=QWEN3_ALLOW_UNUSED,
    progress=progress,
  )
