"""The pipeline LoRA API: `load_lora`, `set_adapters`, `unload_lora`, `fuse_lora`, `unfuse_lora`, `loras`.

A family pipeline takes it by subclassing `LoRAPipeline` beside `md_core.pipeline.Pipeline`
(`class FluxPipeline(LoRAPipeline, Pipeline)`). What it needs from the pipeline is the family contract:
`lora_components` and `lora_key_map` (its LoRA targets), optional `lora_prefixes` (text encoders a file may
hold), and md-core's slot methods (`splits_of`, `add_lora_slots`, `set_lora`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

from md_lora import _runtime


class LoRAPipeline:
  """The LoRA API of a pipeline (a mixin over `md_core.pipeline.Pipeline`)."""

  # md-lora's registry of the adapters this pipeline holds (made at the first load).
  _lora_registry: Any = None

  def load_lora(
    self,
    file: str | os.PathLike,
    *,
    name: str | None = None,
    scale: float | Mapping[str, float] = 1.0,
    component: str | Sequence[str] | None = None,
    fuse: bool = False,
    max_rank: int | None = None,
    targets: Any = None,
    **read_options: Any,
  ) -> str:
    """Reads a LoRA file for this pipeline's denoiser(s) and applies it, active at once.

    At run time (the default) the adapter goes into LoRA slots that the compiled programs take as
    arguments: later loads, `set_adapters`, `unload_lora` never recompile. The slots are added at the
    first run-time load (one recompile then), `max_rank` (default 64) wide, on every Dense and Conv of
    each component unless `targets=` (layer-path suffixes or a predicate) narrows them; adapters active
    at once share `max_rank`.

    Args:
      file: a LoRA `.safetensors` file (any format md-lora reads).
      name: the adapter's name (default: the file's stem).
      scale: its multiplier, or `{component: scale}` (e.g. Wan 2.2's two experts).
      component: the component(s) to adapt (default: every one in `lora_components`; Wan 2.2:
        `"transformer"` for the high-noise expert, `"transformer_2"` for the low-noise one).
      fuse: merge it into the weights now (`W + s·B·A` on the weights' devices) instead of slots (a
        DoRA file at run time adds per-output gain slots beside them at its first load: one compile).
      max_rank: the slot rank (only at the first load).
      targets: which layers get slots (only at the first load).
      **read_options: passed to `md_lora.load_lora` (`prefix=`, `format=`, `allow_unmatched=`…).

    Returns:
      The adapter's name.

    Raises:
      ValueError / md_lora.LoRAFileError: a name in use, an unknown component, a file that does not
        fit (every key named), more rank than the slots hold.
    """
    return _runtime.load(self, file, name, scale, component, fuse, max_rank, targets, read_options)

  def set_adapters(self, adapters: Mapping[str, Any] | Sequence[str] | str) -> None:
    """The adapters used from now on, with their scales (`{name: scale or {component: scale}}`, or
    names at 1.0); the ones not named are disabled (kept loaded). `{}` disables every unfused adapter.
    Never recompiles."""
    _runtime.set_adapters(self, adapters)

  def unload_lora(self, name: str | Sequence[str] | None = None) -> None:
    """Forgets adapters (default: all), subtracting fused ones from the weights first."""
    _runtime.unload(self, name)

  def fuse_lora(self, names: str | Sequence[str] | None = None) -> None:
    """Merges the active adapters (or `names`) into the weights at their scales and takes them out of
    the slots (the programs keep running without recompiling)."""
    _runtime.fuse(self, names)

  def unfuse_lora(self, names: str | Sequence[str] | None = None) -> None:
    """Subtracts fused adapters from the weights again; they stay active, in the slots (a DoRA adapter's
    rescaling, which its factors cannot undo, is subtracted as its fuse added it)."""
    _runtime.unfuse(self, names)

  @property
  def loras(self) -> dict[str, dict[str, Any]]:
    """The loaded adapters: `{name: {"source", "scales", "active", "fused"}}`."""
    return _runtime.status(self)
