"""The canonical adapter: LoRA factors (or OFT rotations) in md's layout, keyed by md parameter paths."""

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


class OFTWeight(NamedTuple):
  """An orthogonal fine-tuning site (LyCORIS OFT / BOFT, PEFT's OFT). LyCORIS' rotate the adapted weight
  along its output axis, `W' = rescale · R W` in torch's layout `(out, in, …)`; in md's layout (`(in, out)`,
  `(*k, in, out)`) the rotation acts on the kernel's last axis. Not a low-rank delta: only `md_lora.merge`
  applies it.

  `R` comes from the blocks as LyCORIS makes it: each block's skew part `Q = B - Bᵀ`, scaled onto the
  Frobenius-norm bound `constraint` when all blocks' `Q` together exceed it, gives the Cayley rotation
  `(I + Q)(I - Q)⁻¹`; a user scale k takes each block (each stage's) to `k·R + (1 - k)·I`, and `rescale`
  multiplies the rotated weight whatever k is (LyCORIS' `get_merged_weight(multiplier=k)`).
  Diagonal OFT (`butterfly=False`, blocks `[1, num, b, b]`): the output axis split into `num` groups of `b`,
  group n mapped by block nᵀ (LyCORIS' `"k n m, k n ... -> k m ..."`). BOFT (`butterfly=True`, blocks
  `[stages, num, b, b]`): stage i gathers outputs `2^i · b/2` apart into blocks of `b` (the butterfly),
  applies block n to its group, and scatters them back; the stages apply in order.

  PEFT's OFT (`rule="peft"`): `blocks` `[1, num, b, b]` are the rotations R_n themselves (made from the file
  as PEFT makes them, see `md_lora.load_lora`), acting on the weight's input axis: `W' = W Rᵀ` in torch's
  layout (a convolution's inputs flattened as `(in, *kernel)`), `R K` in md's, with R block-diagonal;
  the user scale k takes each to `k·R + (1 - k)·I` (PEFT itself merges OFT at scale 1 only).
  """

  blocks: Any  # [stages, num, b, b] as the file stores them (diagonal OFT: stages = 1)
  constraint: float  # bound on the norm of the skew matrices (LyCORIS: alpha · out); <= 0: none
  rescale: Any = None  # [out] factors on the rotated weight, or None
  butterfly: bool = False  # BOFT (True) or diagonal OFT (False)
  rule: str = (
    "lycoris"  # "lycoris" (output axis, Cayley at merge) or "peft" (input axis, rotations)
  )

  @property
  def size(self) -> int:
    """The size the blocks tile (`num · b`): outputs, or (PEFT's rule) flattened inputs."""
    shape = np.shape(self.blocks)
    return int(shape[1] * shape[2])

  def __getattr__(self, name: str) -> Any:
    if name in LoRAWeight._fields or name in ("rank", "delta"):
      raise AttributeError(
        f"an OFT / BOFT site (OFTWeight) rotates the weight and has no LoRA {name!r}: it is not a "
        "low-rank delta (not for run-time slots, save_peft or LoRA training); merge it with "
        "md_lora.merge or pipe.load_lora(..., fuse=True)"
      )
    raise AttributeError(f"'OFTWeight' object has no attribute {name!r}")


class GLoRAWeight(NamedTuple):
  """A LyCORIS GLoRA site: `ΔW = γ (W a1 a2 + b1 b2)` in torch's layout (`a1 a2` mixing the weight's input
  channels, `b1 b2` a LoRA), so in md's layout `ΔK = γ (Pᵀ ⋆ K + down ⋅ up)` with `P = a1 a2` `[in, in]`
  acting on the kernel's input axis (`K[..., i, o]`, a convolution's taps untouched). The first part depends
  on the weight: only `md_lora.merge` applies it.

  `down` / `up` are the LoRA part in md's layout (as `LoRAWeight`'s), `mix_a` `[in, r]` / `mix_b` `[r, in]`
  LyCORIS' `a1` / `a2`; `scale` is γ = alpha / r (the user's scale multiplies it, as LyCORIS' multiplier)."""

  down: Any
  up: Any
  scale: float
  mix_a: Any
  mix_b: Any

  @property
  def rank(self) -> int:
    return int(np.shape(self.down)[-1])


class IA3Weight(NamedTuple):
  """A LyCORIS IA³ site: the weight's output (or, `on_input`, input) channels scaled, `W' = W · (1 + k·v)`
  (the layer's bias untouched, as LyCORIS' merged weight). Through the weight itself: merge only."""

  vector: Any  # [out] or [in]
  on_input: bool = False


class Adapter(NamedTuple):
  """One LoRA file read for one model.

  Attributes:
    weights: `{Site: LoRAWeight, OFTWeight or GLoRAWeight}` for every adapted md parameter (per layer
      for stacked ones); an `OFTWeight` is an OFT / BOFT rotation, a `GLoRAWeight` a LyCORIS GLoRA
      (both merge only).
    names: `{Site: reference module name}` it came from (`down_blocks.0.attentions.0.proj_in`).
    source: the file read (or a description, e.g. "extracted").
    format: the file format: "peft" (diffusers / PEFT `lora_A` / `lora_B`) or "kohya" (`lora_down` /
      `lora_up` / `.alpha`).
    skipped: file keys the caller allowed to stay unmatched (`allow_unmatched`).
  """

  weights: dict[Site, LoRAWeight | OFTWeight | GLoRAWeight | IA3Weight]
  names: dict[Site, str]
  source: str
  format: str
  skipped: tuple[str, ...] = ()

  def __repr__(self) -> str:
    lora = [w for w in self.weights.values() if isinstance(w, LoRAWeight)]
    ranks = sorted({w.rank for w in lora})
    dora = sum(w.magnitude is not None for w in lora)
    oft = sum(isinstance(w, OFTWeight) for w in self.weights.values())
    glora = sum(isinstance(w, GLoRAWeight) for w in self.weights.values())
    ia3 = sum(isinstance(w, IA3Weight) for w in self.weights.values())
    return (
      f"Adapter({self.source!r}, format={self.format!r}, {len(self.weights)} sites, ranks {ranks}"
      f"{f', {dora} DoRA' if dora else ''}{f', {oft} OFT' if oft else ''}"
      f"{f', {glora} GLoRA' if glora else ''}{f', {ia3} IA3' if ia3 else ''}, "
      f"{len(self.skipped)} skipped)"
    )

  @property
  def dora(self) -> bool:
    """Whether any site is a DoRA one (a `magnitude`): its run-time slots need gain slots, and it cannot be
    unmerged."""
    return any(isinstance(w, LoRAWeight) and w.magnitude is not None for w in self.weights.values())

  @property
  def glora(self) -> bool:
    """Whether any site is a LyCORIS GLoRA (`GLoRAWeight`): merge only, like OFT."""
    return any(isinstance(w, GLoRAWeight) for w in self.weights.values())

  @property
  def ia3(self) -> bool:
    """Whether any site is a LyCORIS IA³ (`IA3Weight`): merge only, like OFT."""
    return any(isinstance(w, IA3Weight) for w in self.weights.values())

  @property
  def oft(self) -> bool:
    """Whether any site is an OFT / BOFT rotation (`OFTWeight`): the adapter can only be merged (no
    run-time slots, no PEFT file, no LoRA training); `unmerge` takes the rotation back exactly."""
    return any(isinstance(w, OFTWeight) for w in self.weights.values())
