"""Wan VAE weights: the diffusers `AutoencoderKLWan` key map and loader."""

from __future__ import annotations

import os
import pathlib
import re
from typing import Any

import jax
from flax import nnx

import md_core
from md_vae._wan import WanVAE
from md_vae._wan_config import WanVAEConfig

# Every module name the reference's state dict uses; md's modules carry the same names, except that the spatial
# conv of a resampler (`resample.1` in torch's Sequential after a parameter-free up/pad) is `resample` in md.
_NAMES = {
  "encoder", "decoder", "quant_conv", "post_quant_conv", "conv_in", "conv_out", "norm_out", "down_blocks",
  "up_blocks", "mid_block", "resnets", "attentions", "upsamplers", "upsampler", "downsampler", "norm1", "norm2",
  "conv1", "conv2", "conv_shortcut", "norm", "to_qkv", "proj", "resample", "time_conv",
}  # fmt: skip
_NAME = re.compile(r"(?P<path>[a-z0-9_.]+)\.(?P<leaf>weight|bias|gamma)")
_CONV2D = ("to_qkv", "proj", "resample")  # per-frame convs: torch Conv2d weights


def vae_wan_convert_key(name: str) -> md_core.Target | None:
  """Maps a diffusers `AutoencoderKLWan` tensor name to md's `WanVAE` parameter (None if unknown).

  `*.weight` of causal convs (OIDHW) → `kernel` as conv3d, of per-frame convs (`to_qkv`, `proj`, `resample.1`,
  OIHW) → `kernel` as conv2d; `*.bias` → `bias`; `*.gamma` of RMS norms → `scale`, channels moved last
  (`(C, 1, 1, 1)` → `(1, 1, 1, C)`, the attention norm's `(C, 1, 1)` → `(1, 1, C)`).
  """
  m = _NAME.fullmatch(name)
  if m is None:
    return None
  parts = m["path"].replace("resample.1", "resample").split(".")
  if not all(p.isdigit() or p in _NAMES for p in parts) or parts[0] not in (
    "encoder",
    "decoder",
    "quant_conv",
    "post_quant_conv",
  ):
    return None
  path = tuple(int(p) if p.isdigit() else p for p in parts)
  leaf, owner = m["leaf"], parts[-1]
  if leaf == "gamma":
    if not owner.startswith("norm"):
      return None
    layout = "conv1d" if "attentions" in parts else "conv2d"  # (C,1,1)→(1,1,C); (C,1,1,1)→(1,1,1,C)
    return md_core.Target(path + ("scale",), layout)
  if owner.startswith("norm"):
    return None
  if leaf == "bias":
    return md_core.Target(path + ("bias",))
  return md_core.Target(path + ("kernel",), "conv2d" if owner in _CONV2D else "conv3d")


def load_vae_wan(
  source: str | os.PathLike,
  *,
  subfolder: str | None = "vae",
  mesh: jax.sharding.Mesh | None = None,
  dtype: Any = None,
  rules: Any = None,
  progress: bool = False,
) -> WanVAE:
  """Loads a Wan VAE (2.1 or 2.2, read from its `config.json`) from a diffusers checkpoint.

  Args:
    source: a diffusers pipeline folder or hub id (`"Wan-AI/Wan2.1-T2V-1.3B-Diffusers"`), or the VAE's own
      folder (`config.json` + `diffusion_pytorch_model.safetensors`), which is used as is when it has no
      `subfolder` inside.
    subfolder: the VAE component of a pipeline (None: `source` is the VAE folder).
    mesh: place parameters on this mesh (md-sharding logical axis rules).
    dtype: parameter dtype (default: as stored, float32 for the released VAEs).
    rules: md-sharding logical axis rules (default rules when None).
    progress: show a progress bar over tensors.

  Raises:
    FileNotFoundError: no such folder, component or cached hub snapshot.
    ValueError: an unsupported config.
    md_core.WeightLoadError: tensors that do not fit, all listed with file, name and shapes.
  """
  path = pathlib.Path(os.fspath(source)).expanduser()
  if (
    subfolder
    and path.is_dir()
    and not (path / subfolder).is_dir()
    and (path / "config.json").is_file()
  ):
    subfolder = None
  folder = md_core.resolve_source(source, subfolder=subfolder)
  config = WanVAEConfig.from_json(folder / "config.json")
  checkpoint = md_core.open_checkpoint(folder)
  return md_core.load_weights(
    lambda: WanVAE(config, rngs=nnx.Rngs(0)),
    checkpoint,
    vae_wan_convert_key,
    dtype=dtype,
    mesh=mesh,
    rules=rules,
    progress=progress,
  )
