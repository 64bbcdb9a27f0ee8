"""The canonical adapter: LoRA factors in md's layout, keyed by md parameter paths."""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from md_core import path_str

Path = tuple[str | int, ...]


class Site(NamedTuple):
  """One md parameter a LoRA adapts: its path, and for a stacked (scanned) parameter the layer index."""

  path: Path  # e.g. ("transformer_blocks", "attn", "to_q", "kernel")
  layer: int | None = None

  def __str__(self) -> str:
    text = path_str(self.path)
    return text if self.layer is None else f"{text}[{self.layer}]"


class LoRAWeight(NamedTuple):
  """A low-rank delta `scale · tensordot(down, up, 1)` with the shape of the adapted parameter (one layer);
  with a `magnitude`, a DoRA site.

  In md's layout: for a linear kernel `(in, out)`, `down` is `[in, r]` and `up` is `[r, out]` (torch's
  `lora_A` `[r, in]` and `lora_B` `[out, r]` transposed); for a conv kernel `(*k, in, out)`, `down` is
  `[*k, in, r]` (the `lora_A` / `lora_down` conv permuted as the kernel) and `up` is `[r, out]` (the 1×1
  `lora_B` / `lora_up`). A parameter md keeps in the reference's own layout (`identity`) has `down = lora_B`
  `[out, r]` and `up = lora_A` `[r, *in]`.

  DoRA (weight-decomposed LoRA): `magnitude` holds the norms `m` the adapted weight is rescaled to, shaped
  to broadcast against the weight in md's layout (size 1 on every axis but one: the output axis, or the
  input axis for LyCORIS files made with `wd_on_out=False`), and the norm of `W + Δ` runs over the size-1
  axes. With a user scale k, `dora_rule` "peft" (`lora_magnitude_vector`) merges `m / ||W + kΔ|| · (W + kΔ)`;
  "lycoris" (`dora_scale`) merges `(W + Δ) · (k (g - 1) + 1)` with `g = m / (||W + Δ|| + eps)`, LyCORIS'
  `get_merged_weight`. The rescaling is not a low-rank delta: at run time (`to_slots`) it rides on a
  per-output gain slot of the layer, for norms along the output axis.
  """

  down: Any  # [*in_dims, r]
  up: Any  # [r, *out_dims]
  scale: float  # alpha / r as the file defines it (the user's multiplier comes at merge time)
  magnitude: Any = None  # DoRA: the norms, broadcastable against the weight (md layout)
  dora_rule: str = "peft"  # how a scale applies: "peft" (inside Δ) or "lycoris" (on the rescaling)

  @property
  def rank(self) -> int:
    return int(np.shape(self.down)[-1])

  def delta(self) -> np.ndarray:
    """The dense delta (float32, host): for tests and small layers."""
    down = np.asarray(self.down, np.float32)
    up = np.asarray(self.up, np.float32)
    return np.float32(self.scale) * np.tensordot(down, up, 1)


class Adapter(NamedTuple):
  """One LoRA file read for one model.

  Attributes:
    weights: `{Site: LoRAWeight}` for every adapted md parameter (per layer for stacked ones).
    names: `{Site: reference module name}` it came from (`down_blocks.0.attentions.0.proj_in`).
    source: the file read (or a description, e.g. "extracted").
    format: the file format: "peft" (diffusers / PEFT `lora_A` / `lora_B`) or "kohya" (`lora_down` /
      `lora_up` / `.alpha`).
    skipped: file keys the caller allowed to stay unmatched (`allow_unmatched`).
  """

  weights: dict[Site, LoRAWeight]
  names: dict[Site, str]
  source: str
  format: str
  skipped: tuple[str, ...] = ()

  def __repr__(self) -> str:
    ranks = sorted({w.rank for w in self.weights.values()})
    dora = sum(w.magnitude is not None for w in self.weights.values())
    return (
      f"Adapter({self.source!r}, format={self.format!r}, {len(self.weights)} sites, ranks {ranks}"
      f"{f', {dora} DoRA' if dora else ''}, {len(self.skipped)} skipped)"
    )

  @property
  def dora(self) -> bool:
    """Whether any site is a DoRA one (a `magnitude`): its run-time slots need gain slots, and it cannot be
    unmerged."""
    return any(w.magnitude is not None for w in self.weights.values())
