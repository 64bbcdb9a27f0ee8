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


# The original single files (`ltxv-2b-0.9.x.safetensors`, `ltxv-13b-…`) hold the VAE as `vae.…` next to the
# transformer, with flat block lists. Per version, original block prefix → diffusers prefix, as diffusers'
# `convert_ltx_vae_checkpoint_to_diffusers` renames them.
_ORIGINAL_DECODER = {
  "0.9.0": {
    "up_blocks.0": "mid_block", "up_blocks.1": "up_blocks.0", "up_blocks.2": "up_blocks.1.upsamplers.0",
    "up_blocks.3": "up_blocks.1", "up_blocks.4": "up_blocks.2.conv_in",
    "up_blocks.5": "up_blocks.2.upsamplers.0", "up_blocks.6": "up_blocks.2",
    "up_blocks.7": "up_blocks.3.conv_in", "up_blocks.8": "up_blocks.3.upsamplers.0",
    "up_blocks.9": "up_blocks.3",
  },
  "0.9.1": {
    "up_blocks.0": "mid_block", "up_blocks.1": "up_blocks.0.upsamplers.0", "up_blocks.2": "up_blocks.0",
    "up_blocks.3": "up_blocks.1.upsamplers.0", "up_blocks.4": "up_blocks.1",
    "up_blocks.5": "up_blocks.2.upsamplers.0", "up_blocks.6": "up_blocks.2",
    "up_blocks.7": "up_blocks.3.upsamplers.0", "up_blocks.8": "up_blocks.3",
  },
}  # fmt: skip
_ORIGINAL_DECODER["0.9.5"] = _ORIGINAL_DECODER["0.9.1"]
_ORIGINAL_ENCODER = {
  "0.9.0": {
    "down_blocks.0": "down_blocks.0", "down_blocks.1": "down_blocks.0.downsamplers.0",
    "down_blocks.2": "down_blocks.0.conv_out", "down_blocks.3": "down_blocks.1",
    "down_blocks.4": "down_blocks.1.downsamplers.0", "down_blocks.5": "down_blocks.1.conv_out",
    "down_blocks.6": "down_blocks.2", "down_blocks.7": "down_blocks.2.downsamplers.0",
    "down_blocks.8": "down_blocks.3", "down_blocks.9": "mid_block",
  },
  "0.9.5": {
    "down_blocks.0": "down_blocks.0", "down_blocks.1": "down_blocks.0.downsamplers.0",
    "down_blocks.2": "down_blocks.1", "down_blocks.3": "down_blocks.1.downsamplers.0",
    "down_blocks.4": "down_blocks.2", "down_blocks.5": "down_blocks.2.downsamplers.0",
    "down_blocks.6": "down_blocks.3", "down_blocks.7": "down_blocks.3.downsamplers.0",
    "down_blocks.8": "mid_block",
  },
}  # fmt: skip
_ORIGINAL_ENCODER["0.9.1"] = _ORIGINAL_ENCODER["0.9.0"]
_ORIGINAL_RENAMES = (
  ("conv_shortcut", "conv_shortcut.conv"),
  ("res_blocks", "resnets"),
  ("norm3.norm", "norm3"),
  ("last_time_embedder", "time_embedder"),
  ("last_scale_shift_table", "scale_shift_table"),
)
# Statistics the reference drops on conversion.
VAE_LTX_ORIGINAL_ALLOW_UNUSED = (
  r"vae\.per_channel_statistics\.(channel|mean-of-stds)",
  r"model\.diffusion_model\..*",  # the transformer, in the same file
)


def vae_ltx_original_version(checkpoint) -> str:
  """Which VAE an original single file holds: "0.9.5" (space-to-depth encoder, 2048-wide `conv_out` input),
  "0.9.1" (timestep-conditioned decoder) or "0.9.0", as diffusers decides."""
  if "vae.encoder.conv_out.conv.weight" not in checkpoint:
    raise ValueError(
      f"{getattr(checkpoint, 'name', 'checkpoint')}: no 'vae.encoder.conv_out.conv.weight'; is this an "
      "original LTX-Video single file (ltxv-*.safetensors with the VAE inside)?"
    )
  shape = (
    checkpoint.shape("vae.encoder.conv_out.conv.weight") if hasattr(checkpoint, "shape") else None
  )
  shape = shape or checkpoint["vae.encoder.conv_out.conv.weight"].shape
  if shape[1] == 2048:
    return "0.9.5"
  if "vae.decoder.last_time_embedder.timestep_embedder.linear_1.weight" in checkpoint:
    return "0.9.1"
  return "0.9.0"


def vae_ltx_original_to_diffusers(name: str, version: str) -> str | None:
  """An original single-file VAE tensor name (`vae.…`) → its diffusers name (None: not a VAE tensor).

  >>> vae_ltx_original_to_diffusers("vae.decoder.up_blocks.2.res_blocks.0.conv1.conv.weight", "0.9.1")
  'decoder.up_blocks.0.resnets.0.conv1.conv.weight'
  """
  if not name.startswith("vae."):
    return None
  name = name[len("vae.") :]
  if name == "per_channel_statistics.mean-of-means":
    return "latents_mean"
  if name == "per_channel_statistics.std-of-means":
    return "latents_std"
  part, _, rest = name.partition(".")
  table = {"decoder": _ORIGINAL_DECODER, "encoder": _ORIGINAL_ENCODER}.get(part, {}).get(version)
  if table is not None:
    m = re.match(r"(up_blocks|down_blocks)\.(\d+)(?=\.|$)", rest)
    if m and m.group(0) in table:
      rest = table[m.group(0)] + rest[m.end() :]
  name = f"{part}.{rest}"
  for old, new in _ORIGINAL_RENAMES:
    name = name.replace(old, new)
  return name


def vae_ltx_original_keymap(version: str) -> md_core.KeyMap:
  """The key map for an original single file's VAE tensors of `version` (see `vae_ltx_original_version`)."""

  def convert(name: str) -> md_core.Target | None:
    diffusers = vae_ltx_original_to_diffusers(name, version)
    return None if diffusers is None else vae_ltx_convert_key(diffusers)

  return convert


def load_vae_ltx_original(
  path: str | os.PathLike,
  *,
  config: LTXVideoVAEConfig | None = None,
  version: str | None = None,
  mesh: jax.sharding.Mesh | None = None,
  dtype: Any = None,
  rules: Any = None,
  progress: bool = False,
) -> LTXVideoVAE:
  """Loads the VAE of an original single LTX-Video file (`ltxv-2b-0.9.x.safetensors`, `ltxv-13b-…`); the
  version (0.9.0 / 0.9.1 / 0.9.5+) and so the config follow from the tensors unless given (`version` picks
  the name layout, `config` the sizes)."""
  from md_vae._ltx_vae import LTX_VAE_VARIANTS

  checkpoint = md_core.open_checkpoint(path)
  version = version or vae_ltx_original_version(checkpoint)
  if version not in _ORIGINAL_DECODER:
    raise ValueError(f"version={version!r} must be one of {sorted(_ORIGINAL_DECODER)}")
  cfg = config or LTX_VAE_VARIANTS[version]
  return md_core.load_weights(
    lambda: LTXVideoVAE(cfg, rngs=nnx.Rngs(0)),
    checkpoint,
    vae_ltx_original_keymap(version),
    dtype=dtype,
    keep_f32=(r"^latents_(mean|std)$", r"timestep_scale_multiplier$", r"scale_shift_table$"),
    mesh=mesh,
    rules=rules,
    allow_unused=VAE_LTX_ORIGINAL_ALLOW_UNUSED,
    progress=progress,
  )
