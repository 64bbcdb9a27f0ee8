"""LoRA settings for apps: `--config.loras` (`file[:scale][@component],…`), checked before any weight
loads and loaded into a pipeline at run time (`LoRAPipeline.load_lora`)."""

from __future__ import annotations

import pathlib
from typing import Any, NamedTuple

from md_core.apps import Problems, UsageError


class LoRAEntryError(UsageError, ValueError):
  """A `--config.loras` file that cannot be loaded (its format, layout or reading), in one line naming it:
  a ValueError, and a usage error the apps report without a traceback."""


class LoRASpec(NamedTuple):
  """One `--config.loras` entry."""

  file: str
  scale: float = 1.0
  component: str | None = None  # None: every denoiser of the pipeline


def add_lora_config(config: Any) -> Any:
  """Adds `config.loras` to an app config and returns it: comma-separated `file[:scale][@component]`
  entries (`style.safetensors:0.8,detail.safetensors`; Wan 2.2 experts: `high.safetensors:1@transformer,
  low.safetensors:1@transformer_2`), loaded at run time by `load_loras`."""
  config.loras = ""
  return config


def parse_loras(value: str | None) -> list[LoRASpec]:
  """The entries of a `--config.loras` value.

  Raises:
    ValueError: an empty entry or a scale that is not a finite number, naming the entry.
  """
  out = []
  for i, entry in enumerate((value or "").split(",")):
    text = entry.strip()
    if not text:
      if value and value.strip():
        raise ValueError(
          f"loras entry {i + 1} of {value!r} is empty (entries: file[:scale][@component])"
        )
      continue
    body, _, component = text.partition("@")
    file, scale = body, 1.0
    if ":" in body:
      file, _, scale_text = body.rpartition(":")
      try:
        scale = float(scale_text)
      except ValueError:
        raise ValueError(
          f"loras entry {text!r}: scale {scale_text!r} is not a number (entries: file[:scale][@component])"
        ) from None
      if scale != scale or scale in (float("inf"), float("-inf")):
        raise ValueError(f"loras entry {text!r}: scale {scale_text!r} is not finite")
    if not file:
      raise ValueError(f"loras entry {text!r} names no file")
    out.append(LoRASpec(file, scale, component.strip() or None))
  return out


def check_loras(problems: Problems, config: Any) -> list[LoRASpec]:
  """Reports bad `--config.loras` entries and missing files (before any weight loads)."""
  specs = problems.call(parse_loras, config.get("loras")) or []
  for spec in specs:
    if not pathlib.Path(spec.file).expanduser().is_file():
      problems.add(f"loras entry {spec.file!r}: no such file")
  return specs


def load_loras(pipe: Any, config: Any) -> list[str]:
  """Loads every `--config.loras` entry into `pipe` at run time (`pipe.load_lora`); returns the names.

  Raises:
    ValueError: as `parse_loras`.
    LoRAEntryError: the file's own problems (`md_lora.LoRAFileError`, an unreadable or
      truncated file), in one line naming it.
  """
  names = []
  for i, spec in enumerate(parse_loras(config.get("loras"))):
    name = f"{i}_{pathlib.Path(spec.file).stem}"
    try:
      names.append(
        pipe.load_lora(
          pathlib.Path(spec.file).expanduser(),
          name=name,
          scale=spec.scale,
          component=spec.component,
        )
      )
    except (ValueError, TypeError, OSError) as e:
      # The file's own problem (format, layout, reading): a settings problem the app reports in one line.
      first = str(e).splitlines()[0] if str(e) else type(e).__name__
      raise LoRAEntryError(f"loras entry {spec.file!r}: {first}") from e
  return names
