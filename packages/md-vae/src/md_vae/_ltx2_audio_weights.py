"""LTX-2 audio VAE weights: diffusers `AutoencoderKLLTX2Audio` tensor names → md paths, and the loader."""

from __future__ import annotations

import os
import re
from typing import Any

import jax

import md_core
from md_vae._ltx2_audio import LTX2AudioVAE, LTX2AudioVAEConfig

_NAME = re.compile(r"(encoder|decoder)\.(.+)\.(weight|bias)")
_NORMS = ("norm", "norm1", "norm2", "norm_out")


def _path(text: str) -> tuple[str | int, ...]:
  return tuple(int(p) if p.isdigit() else p for p in text.split("."))


def vae_ltx2_audio_convert_key(name: str) -> md_core.Target | None:
  """Maps one diffusers `AutoencoderKLLTX2Audio` tensor name to md's `LTX2AudioVAE` path (None: unknown).

  Module names are the same in md (`decoder.up.1.block.0.conv1.conv.weight` →
  `decoder/up/1/block/0/conv1/conv/kernel`, conv2d layout); GroupNorm weights become `scale`; the latent
  statistics keep their names.

  >>> vae_ltx2_audio_convert_key("encoder.down.0.downsample.conv.bias")
  Target(path=('encoder', 'down', 0, 'downsample', 'conv', 'bias'), layout='identity', split=None, layer=None)
  """
  if name in ("latents_mean", "latents_std"):
    return md_core.Target((name,))
  m = _NAME.fullmatch(name)
  if not m:
    return None
  part, module, suffix = m.groups()
  path = (part, *_path(module))
  if path[-1] in _NORMS:
    return md_core.Target(path + ("scale" if suffix == "weight" else "bias",))
  if suffix == "weight":
    return md_core.Target(path + ("kernel",), "conv2d")
  return md_core.Target(path + ("bias",))


def load_vae_ltx2_audio(
  source: str | os.PathLike,
  *,
  subfolder: str | None = "audio_vae",
  mesh: jax.sharding.Mesh | None = None,
  dtype: Any = None,
  rules: Any = None,
  progress: bool = False,
) -> LTX2AudioVAE:
  """Loads the LTX-2 audio VAE from a diffusers checkpoint (folder or hub id, e.g. `"Lightricks/LTX-2"`).

  The latent statistics (`latents_mean`, `latents_std`) stay float32 whatever `dtype` is.

  Raises:
    md_core.WeightLoadError: unknown, missing or mis-shaped tensors (file, name and both shapes).
  """
  folder = md_core.resolve_source(source, subfolder=subfolder)
  cfg = LTX2AudioVAEConfig.from_json(folder / "config.json")
  return md_core.load_weights(
    lambda: LTX2AudioVAE(cfg),  # rngs=None: faster to trace
    md_core.open_checkpoint(folder),
    vae_ltx2_audio_convert_key,
    dtype=dtype,
    keep_f32=(r"^latents_(mean|std)$",),
    mesh=mesh,
    rules=rules,
    progress=progress,
  )
