"""Attention configuration: which implementation, block sizes, and how the context axis is split."""

from __future__ import annotations

import dataclasses

IMPLEMENTATIONS = (
  "auto",
  "dot_product",
  "blockwise",
  "cudnn",
  "splash",
  "ring",
  "ulysses",
  "ulysses_ring",
)
"""Names accepted by `AttentionConfig.implementation` and `attention(implementation=...)`."""

LOCAL_IMPLEMENTATIONS = ("dot_product", "blockwise", "cudnn", "splash")
CONTEXT_PARALLEL_IMPLEMENTATIONS = ("ring", "ulysses", "ulysses_ring")

ACTIVATION_AXES = ("batch", "activation_length", "activation_heads", "activation_kv")
"""Logical names of the `[B, S, H, D]` attention activations (md-sharding's DEFAULT_RULES map them to
`(data, fsdp)`, `context`, `tensor` and nothing)."""


@dataclasses.dataclass(frozen=True)
class AttentionConfig:
  """How `attention` computes.

  Attributes:
    implementation: one of `IMPLEMENTATIONS`.
    block_q: query block of `blockwise` (and of each ring step) and of `splash`.
    block_kv: key/value block of `blockwise` and `splash`.
    min_seq_length: `auto` uses a flash kernel (blockwise on CPU) from this key length on, `dot_product`
      below it.
    local_implementation: what each device runs inside `ulysses` and for cross-attention under context
      parallelism: "auto" (by `min_seq_length`), "dot_product" or "blockwise".
    ulysses_degree: Ulysses part of the context axis for `ulysses_ring` (None: the largest degree that
      divides the heads). `ulysses` uses the whole context axis, `ring` none of it.
    ulysses_chunks: head groups whose all-to-alls are issued separately so that one group's
      communication can overlap another group's attention.
    context_axis: mesh axis that shards the sequence for ring / Ulysses.
    rules: md-sharding logical axis rules that place the batch and heads of the activations
      (`ACTIVATION_AXES`) on the mesh; None uses `md_sharding.DEFAULT_RULES` (batch over
      `(data, fsdp)`, heads over `tensor`). Axes that do not divide a dimension are left out.
    tune: take the block sizes from the on-disk tuner cache (`tune_block_sizes` fills it, eagerly).
      Under a trace only a lookup: a miss keeps `block_q` / `block_kv` and warns once.
    tuner_cache_dir: where the tuner keeps its winners (None: `$MD_ATTENTION_CACHE` or
      `~/.cache/md_attention`).
  """

  implementation: str = "auto"
  block_q: int = 512
  block_kv: int = 512
  min_seq_length: int = 2048
  local_implementation: str = "auto"
  ulysses_degree: int | None = None
  ulysses_chunks: int = 1
  context_axis: str = "context"
  rules: tuple | None = None
  tune: bool = False
  tuner_cache_dir: str | None = None

  def __post_init__(self):
    if self.implementation not in IMPLEMENTATIONS:
      raise ValueError(
        f"implementation={self.implementation!r} is not one of {', '.join(IMPLEMENTATIONS)}"
      )
    if self.local_implementation not in ("auto", "dot_product", "blockwise"):
      raise ValueError(
        f"local_implementation={self.local_implementation!r}, expected 'auto', 'dot_product' or "
        "'blockwise'"
      )
    for name in ("block_q", "block_kv", "ulysses_chunks"):
      value = getattr(self, name)
      if not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}={value!r} must be a positive int")
    if self.ulysses_degree is not None and self.ulysses_degree < 1:
      raise ValueError(f"ulysses_degree={self.ulysses_degree} must be a positive int or None")
