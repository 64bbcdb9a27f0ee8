"""AutoencoderKL weights: diffusers' tensor names → md parameter paths, and the loader.

md's module tree mirrors diffusers' (`encoder.down_blocks.0.resnets.1.conv1` → `encoder/down_blocks/0/resnets/1/
conv1`), so the map is mostly a rename of leaf kinds. The mid-block attention is accepted under both its current
names (`to_q`, `to_k`, `to_v`, `to_out.0`) and the legacy ones many hub files still carry (`query`, `key`,
`value`, `proj_attn`), which diffusers renames at load time.
"""

from __future__ import annotations

import os
import re
from typing import Any

import jax
from flax import nnx

import md_core
from md_vae._kl import AutoencoderKL, AutoencoderKLConfig

_LEGACY_ATTENTION = {"query": "to_q", "key": "to_k", "value": "to_v", "proj_attn": "to_out"}
_ATTENTION = re.compile(
  r"(.*\.attentions\.\d+)\.(to_q|to_k|to_v|to_out\.0|query|key|value|proj_attn)"
)
_NAME = re.compile(r"(encoder|decoder|quant_conv|post_quant_conv)(\.[A-Za-z0-9_.]+)?")


def _path(dotted: str) -> tuple:
  return tuple(int(p) if p.isdigit() else p for p in dotted.split("."))


def vae_kl_convert_key(name: str) -> md_core.Target | None:
  """Maps a diffusers `AutoencoderKL` tensor name to md's parameter; None for names it does not know."""
  module, dot, leaf = name.rpartition(".")
  if not dot or leaf not in ("weight", "bias") or not _NAME.fullmatch(module):
    return None
  attention = _ATTENTION.fullmatch(module)
  if attention:
    proj = attention.group(2)
    proj = _LEGACY_ATTENTION.get(proj, proj.removesuffix(".0"))
    path = _path(attention.group(1)) + (proj,)
    return md_core.Target(
      path + ("kernel" if leaf == "weight" else "bias",),
      "linear" if leaf == "weight" else "identity",
    )
  last = module.rsplit(".", 1)[-1]
  if "norm" in last:
    return md_core.Target(_path(module) + ("scale" if leaf == "weight" else "bias",))
  if "conv" in last:
    if leaf == "weight":
      return md_core.Target(_path(module) + ("kernel",), "conv2d")
    return md_core.Target(_path(module) + ("bias",))
  return None


def load_vae_kl(
  source: str | os.PathLike,
  *,
  subfolder: str | None = "vae",
  mesh: jax.sharding.Mesh | None = None,
  dtype: Any = None,
  rules: Any = None,
  progress: bool = True,
) -> AutoencoderKL:
  """Loads an `AutoencoderKL` (SD, SDXL, Flux VAE) from a checkpoint folder or hub id.

  Args:
    source: a diffusers pipeline folder / hub id, or the VAE's own folder with `subfolder=None`.
    subfolder: the component folder holding `config.json` and `diffusion_pytorch_model.safetensors`.
    mesh: place parameters on this mesh (conv output channels over `tensor` with the default rules).
    dtype: parameter dtype (default float32). With `force_upcast` in the config the VAE still computes in
      float32.
    rules: md-sharding logical axis rules (default rules when None).
    progress: show a progress bar while loading.

  Returns:
    The model with its weights.

  Raises:
    FileNotFoundError: the folder, component or config is missing.
    md_core.WeightLoadError: tensors that do not fit the config (all listed).
    md_core.SafetensorsError: a damaged weights file.
  """
  folder = md_core.resolve_source(source, subfolder=subfolder)
  if not (folder / "config.json").is_file():
    raise FileNotFoundError(f"{folder}: no config.json (expected a diffusers AutoencoderKL folder)")
  config = AutoencoderKLConfig.from_json(folder / "config.json")
  checkpoint = md_core.open_checkpoint(folder)
  return md_core.load_weights(
    lambda: AutoencoderKL(config, rngs=nnx.Rngs(0)),
    checkpoint,
    vae_kl_convert_key,
    dtype=dtype,
    mesh=mesh,
    rules=rules,
    progress=progress,
  )
