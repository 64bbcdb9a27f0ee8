"""LTX-2 vocoder weights: diffusers `LTX2Vocoder` / `LTX2VocoderWithBWE` tensor names → md paths, loader."""

from __future__ import annotations

import os
import re
from typing import Any

import jax

import md_core
from md_vae._ltx2_vocoder import (
  LTX2Vocoder,
  LTX2VocoderBWEConfig,
  LTX2VocoderWithBWE,
  vocoder_config_from_json,
)

_NAME = re.compile(r"(.+)\.(weight|bias|alpha|beta|filter)")
_BUFFERS = ("mel_stft.mel_basis", "mel_stft.stft_fn.inverse_basis")


def _path(text: str) -> tuple[str | int, ...]:
  return tuple(int(p) if p.isdigit() else p for p in text.split("."))


def vocoder_ltx2_convert_key(name: str) -> md_core.Target | None:
  """Maps one diffusers `LTX2Vocoder` / `LTX2VocoderWithBWE` tensor name to md's path (None: unknown).

  Names are the same in md; conv and transposed-conv weights become `kernel` in the conv1d layout (a
  transposed conv's `(in, out, k)` lands as `(k, out, in)`), the STFT's forward basis too; snake
  `alpha`/`beta`, low-pass `filter`s and the mel basis keep their shapes.

  >>> vocoder_ltx2_convert_key("upsamplers.0.weight")
  Target(path=('upsamplers', 0, 'kernel'), layout='conv1d', split=None, layer=None)
  """
  if name == "mel_stft.stft_fn.forward_basis":
    return md_core.Target(_path(name), "conv1d")
  if name in _BUFFERS:
    return md_core.Target(_path(name))
  m = _NAME.fullmatch(name)
  if not m:
    return None
  module, suffix = m.groups()
  if suffix == "weight":
    return md_core.Target(_path(module) + ("kernel",), "conv1d")
  return md_core.Target(_path(module) + (suffix,))


def load_vocoder_ltx2(
  source: str | os.PathLike,
  *,
  subfolder: str | None = "vocoder",
  mesh: jax.sharding.Mesh | None = None,
  dtype: Any = None,
  rules: Any = None,
  progress: bool = False,
) -> LTX2Vocoder | LTX2VocoderWithBWE:
  """Loads an LTX-2 vocoder from a diffusers checkpoint (folder or hub id): `LTX2Vocoder` (LTX-2.0) or
  `LTX2VocoderWithBWE` (LTX-2.3), as `vocoder/config.json`'s `_class_name` says.

  Snake parameters, low-pass filters and the STFT / mel bases stay float32 whatever `dtype` is.

  Raises:
    md_core.WeightLoadError: unknown, missing or mis-shaped tensors (file, name and both shapes).
  """
  folder = md_core.resolve_source(source, subfolder=subfolder)
  cfg = vocoder_config_from_json(folder / "config.json")
  cls = LTX2VocoderWithBWE if isinstance(cfg, LTX2VocoderBWEConfig) else LTX2Vocoder
  return md_core.load_weights(
    lambda: cls(cfg),  # rngs=None: abstract init is much faster to trace
    md_core.open_checkpoint(folder),
    vocoder_ltx2_convert_key,
    dtype=dtype,
    keep_f32=(r"/(alpha|beta|filter)$", r"^mel_stft/"),
    mesh=mesh,
    rules=rules,
    progress=progress,
  )
