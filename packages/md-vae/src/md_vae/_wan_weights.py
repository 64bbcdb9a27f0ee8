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
    dtype: parameter dtype (default float32, as the released VAEs store it; other files are cast).
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


# --- the original Wan 2.1 VAE file (Wan-AI's `Wan2.1_VAE.pth`, ComfyUI's `wan_2.1_vae.safetensors`) -----------

# Inside a residual block the original keeps torch's Sequential indices: norm, SiLU, conv, norm, SiLU, dropout, conv.
_ORIGINAL_RESIDUAL = {
  "residual.0": "norm1",
  "residual.2": "conv1",
  "residual.3": "norm2",
  "residual.6": "conv2",
}
_ORIGINAL_FIXED = {
  "conv1": "quant_conv",
  "conv2": "post_quant_conv",
  "encoder.conv1": "encoder.conv_in",
  "decoder.conv1": "decoder.conv_in",
  "encoder.head.0": "encoder.norm_out",
  "encoder.head.2": "encoder.conv_out",
  "decoder.head.0": "decoder.norm_out",
  "decoder.head.2": "decoder.conv_out",
}


def wan_original_to_diffusers_name(name: str, config: WanVAEConfig) -> str | None:
  """The diffusers name of a tensor of the original Wan 2.1 VAE file (None if not one of its names).

  The original names residual-block layers by Sequential index (`residual.2` = conv1), the mid block `middle.0/1/2`,
  the heads `head.0/2`, the quant convs `conv1`/`conv2`, and lists the decoder's resnets and upsamplers in one flat
  `upsamples.{k}` (per level `num_res_blocks + 1` resnets, then the upsampler), as diffusers' own converter reads.
  """
  if config.is_residual:
    return None
  m = re.fullmatch(r"(?P<module>.+)\.(?P<leaf>weight|bias|gamma)", name)
  if m is None:
    return None
  module, leaf = m["module"], m["leaf"]
  if module in _ORIGINAL_FIXED:
    return f"{_ORIGINAL_FIXED[module]}.{leaf}"
  m = re.fullmatch(r"(encoder|decoder)\.middle\.([012])\.(.+)", module)
  if m:
    side, index, rest = m.groups()
    if index == "1":
      return f"{side}.mid_block.attentions.0.{rest}.{leaf}"
    inner = _residual_part(rest)
    return inner and f"{side}.mid_block.resnets.{int(index) // 2}.{inner}.{leaf}"
  m = re.fullmatch(r"encoder\.downsamples\.(\d+)\.(.+)", module)
  if m:  # the same flat list as diffusers' non-residual encoder
    index, rest = m.groups()
    inner = _residual_part(rest) or (rest if rest in ("resample.1", "time_conv") else None)
    return inner and f"encoder.down_blocks.{index}.{inner}.{leaf}"
  m = re.fullmatch(r"decoder\.upsamples\.(\d+)\.(.+)", module)
  if m:
    index, rest = int(m[1]), m[2]
    levels = len(config.dim_mult)
    for level in range(levels):
      size = config.num_res_blocks + 1 + (level < levels - 1)
      if index < size:
        break
      index -= size
    else:
      return None
    if index <= config.num_res_blocks:
      inner = _residual_part(rest)
      return inner and f"decoder.up_blocks.{level}.resnets.{index}.{inner}.{leaf}"
    if rest in ("resample.1", "time_conv"):
      return f"decoder.up_blocks.{level}.upsamplers.0.{rest}.{leaf}"
  return None


def _residual_part(rest: str) -> str | None:
  if rest == "shortcut":
    return "conv_shortcut"
  return _ORIGINAL_RESIDUAL.get(rest)


def wan_original_keymap(config: WanVAEConfig):
  """A key map for the original Wan 2.1 VAE file's tensor names (for `md_core.load_weights`)."""

  def convert_key(name: str) -> md_core.Target | None:
    diffusers_name = wan_original_to_diffusers_name(name, config)
    return None if diffusers_name is None else vae_wan_convert_key(diffusers_name)

  return convert_key


def load_vae_wan_original(
  path: str | os.PathLike,
  *,
  config: WanVAEConfig | None = None,
  mesh: jax.sharding.Mesh | None = None,
  dtype: Any = None,
  rules: Any = None,
  progress: bool = False,
) -> WanVAE:
  """Loads the original Wan 2.1 VAE single file (safetensors, e.g. ComfyUI's `wan_2.1_vae.safetensors`;
  convert a `.pth` to safetensors first).

  Args:
    path: the `.safetensors` file.
    config: the architecture (default: `WAN_VARIANTS["wan2.1"]`); Wan 2.2's original file is not supported.
    mesh, dtype, rules, progress: as `load_vae_wan`.
  """
  from md_vae._wan_config import WAN_VARIANTS

  config = config or WAN_VARIANTS["wan2.1"]
  if config.is_residual:
    raise ValueError(
      "the original-file key map covers the Wan 2.1 VAE only; load Wan 2.2 from the diffusers layout "
      "(Wan-AI/Wan2.2-TI2V-5B-Diffusers, subfolder 'vae') with load_vae_wan"
    )
  return md_core.load_weights(
    lambda: WanVAE(config, rngs=nnx.Rngs(0)),
    md_core.open_checkpoint(path),
    wan_original_keymap(config),
    dtype=dtype,
    mesh=mesh,
    rules=rules,
    progress=progress,
  )
