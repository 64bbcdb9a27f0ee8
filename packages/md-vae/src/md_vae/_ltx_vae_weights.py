"""LTX-Video VAE weights: diffusers `AutoencoderKLLTXVideo` tensor names → md paths, and the loader."""

from __future__ import annotations

import os
import re
from typing import Any

import jax
from flax import nnx

import md_core
from md_vae._ltx_vae import LTXVideoVAE, LTXVideoVAEConfig

_SUFFIX = re.compile(r"(.+)\.(weight|bias)")


def _path(text: str) -> tuple[str | int, ...]:
  return tuple(int(p) if p.isdigit() else p for p in text.split("."))


def vae_ltx_convert_key(name: str) -> md_core.Target | None:
  """Maps one diffusers `AutoencoderKLLTXVideo` tensor name to md's `LTXVideoVAE` parameter (None: unknown).

  Module names are the same in md (`down_blocks.0.resnets.1.conv1.conv.weight` →
  `down_blocks/0/resnets/1/conv1/conv/kernel`); convolutions take the conv3d layout, linears the linear one,
  the shortcut LayerNorm's weight becomes `scale`; tables, noise scales and the latent statistics keep theirs.

  >>> vae_ltx_convert_key("decoder.conv_in.conv.weight")
  Target(path=('decoder', 'conv_in', 'conv', 'kernel'), layout='conv3d', split=None, layer=None)
  """
  if name in ("latents_mean", "latents_std"):
    return md_core.Target((name,))
  if not name.startswith(("encoder.", "decoder.")):
    return None
  last = name.rsplit(".", 1)[-1]
  if last in ("scale_shift_table", "per_channel_scale1", "per_channel_scale2") or name == (
    "decoder.timestep_scale_multiplier"
  ):
    return md_core.Target(_path(name))
  m = _SUFFIX.fullmatch(name)
  if not m:
    return None
  module, suffix = m.groups()
  tail = module.rsplit(".", 1)[-1]
  if tail == "conv":
    layout = "conv3d"
  elif tail in ("linear_1", "linear_2"):
    layout = "linear"
  elif tail == "norm3":
    return md_core.Target(_path(module) + ("scale" if suffix == "weight" else "bias",))
  else:
    return None
  if suffix == "weight":
    return md_core.Target(_path(module) + ("kernel",), layout)
  return md_core.Target(_path(module) + ("bias",))


def load_vae_ltx(
  source: str | os.PathLike,
  *,
  subfolder: str | None = "vae",
  mesh: jax.sharding.Mesh | None = None,
  dtype: Any = None,
  rules: Any = None,
  progress: bool = False,
) -> LTXVideoVAE:
  """Loads the LTX-Video VAE from a diffusers checkpoint (folder or hub id, e.g. `"Lightricks/LTX-Video"`).

  The per-channel latent statistics (`latents_mean`, `latents_std`) and the decoder's timestep multiplier
  stay float32 whatever `dtype` is.
  """
  folder = md_core.resolve_source(source, subfolder=subfolder)
  cfg = LTXVideoVAEConfig.from_json(folder / "config.json")
  return md_core.load_weights(
    lambda: LTXVideoVAE(cfg, rngs=nnx.Rngs(0)),
    md_core.open_checkpoint(folder),
    vae_ltx_convert_key,
    dtype=dtype,
    keep_f32=(r"^latents_(mean|std)$", r"timestep_scale_multiplier$", r"scale_shift_table$"),
    mesh=mesh,
    rules=rules,
    progress=progress,
  )
