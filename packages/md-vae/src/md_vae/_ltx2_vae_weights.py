"""LTX-2 video VAE weights: diffusers `AutoencoderKLLTX2Video` names (and the original single file's `vae.…`
names) → md paths, and the loaders."""

from __future__ import annotations

import os
import re
from typing import Any

import jax
from flax import nnx

import md_core
from md_vae._ltx2_vae import LTX2_VAE_VARIANTS, LTX2VideoVAE, LTX2VideoVAEConfig
from md_vae._ltx_vae_weights import vae_ltx_convert_key

_KEEP_F32 = (r"^latents_(mean|std)$", r"timestep_scale_multiplier$", r"scale_shift_table$")


def vae_ltx2_convert_key(name: str) -> md_core.Target | None:
  """Maps one diffusers `AutoencoderKLLTX2Video` tensor name to md's `LTX2VideoVAE` parameter (None: unknown).

  The names are LTX-Video's (see `vae_ltx_convert_key`) except the resnets' 1x1 shortcut, a plain conv in
  LTX-2 (`…conv_shortcut.weight`, md: `…conv_shortcut/conv/kernel`).

  >>> vae_ltx2_convert_key("decoder.up_blocks.0.conv_in.conv_shortcut.weight").path[-3:]
  ('conv_shortcut', 'conv', 'kernel')
  """
  m = re.fullmatch(r"(.+\.conv_shortcut)\.(weight|bias)", name)
  if m:
    name = f"{m.group(1)}.conv.{m.group(2)}"
  elif re.search(r"\.conv_shortcut\.conv\.", name):
    return None  # LTX-Video's name for it: not in an LTX-2 file
  return vae_ltx_convert_key(name)


def load_vae_ltx2(
  source: str | os.PathLike,
  *,
  subfolder: str | None = "vae",
  mesh: jax.sharding.Mesh | None = None,
  dtype: Any = None,
  rules: Any = None,
  progress: bool = False,
) -> LTX2VideoVAE:
  """Loads the LTX-2 video VAE from a diffusers checkpoint (folder or hub id, e.g. `"Lightricks/LTX-2"`).

  The per-channel latent statistics (and a conditioned decoder's timestep multiplier and tables) stay float32
  whatever `dtype` is.
  """
  folder = md_core.resolve_source(source, subfolder=subfolder)
  cfg = LTX2VideoVAEConfig.from_json(folder / "config.json")
  return md_core.load_weights(
    lambda: LTX2VideoVAE(cfg, rngs=nnx.Rngs(0)),
    md_core.open_checkpoint(folder),
    vae_ltx2_convert_key,
    dtype=dtype,
    keep_f32=_KEEP_F32,
    mesh=mesh,
    rules=rules,
    progress=progress,
  )


# The original single files (`ltx-2-19b-dev.safetensors`, `…-distilled…`) hold the video VAE as `vae.…` beside
# the transformer, the audio VAE and the vocoder, with flat block lists: original block → diffusers block, as
# diffusers' `convert_ltx2_vae_to_diffusers` (scripts/convert_ltx2_to_diffusers.py) renames them.
_ORIGINAL_BLOCKS = {
  "encoder": {
    "down_blocks.0": "down_blocks.0", "down_blocks.1": "down_blocks.0.downsamplers.0",
    "down_blocks.2": "down_blocks.1", "down_blocks.3": "down_blocks.1.downsamplers.0",
    "down_blocks.4": "down_blocks.2", "down_blocks.5": "down_blocks.2.downsamplers.0",
    "down_blocks.6": "down_blocks.3", "down_blocks.7": "down_blocks.3.downsamplers.0",
    "down_blocks.8": "mid_block",
  },
  "decoder": {
    "up_blocks.0": "mid_block", "up_blocks.1": "up_blocks.0.upsamplers.0", "up_blocks.2": "up_blocks.0",
    "up_blocks.3": "up_blocks.1.upsamplers.0", "up_blocks.4": "up_blocks.1",
    "up_blocks.5": "up_blocks.2.upsamplers.0", "up_blocks.6": "up_blocks.2",
  },
}  # fmt: skip
_ORIGINAL_STATS = {
  "per_channel_statistics.mean-of-means": "latents_mean",
  "per_channel_statistics.std-of-means": "latents_std",
}
# What the single file holds besides the video VAE, and the statistics the reference drops on conversion.
VAE_LTX2_ORIGINAL_ALLOW_UNUSED = (
  r"vae\.per_channel_statistics\.(channel|mean-of-stds)",
  r"(?!vae\.).*",  # the transformer, audio VAE, vocoder, text projection in the same file
)


def vae_ltx2_original_to_diffusers(name: str) -> str | None:
  """An original LTX-2 single-file video VAE tensor name (`vae.…`) → its diffusers name (None: not one).

  >>> vae_ltx2_original_to_diffusers("vae.decoder.up_blocks.3.conv.conv.weight")
  'decoder.up_blocks.1.upsamplers.0.conv.conv.weight'
  """
  if not name.startswith("vae."):
    return None
  name = name[len("vae.") :]
  if name in _ORIGINAL_STATS:
    return _ORIGINAL_STATS[name]
  part, _, rest = name.partition(".")
  table = _ORIGINAL_BLOCKS.get(part)
  if table is not None:
    m = re.match(r"(up_blocks|down_blocks)\.(\d+)(?=\.|$)", rest)
    if m and m.group(0) in table:
      rest = table[m.group(0)] + rest[m.end() :]
  return f"{part}.{rest}".replace("res_blocks", "resnets")


def vae_ltx2_original_keymap(name: str) -> md_core.Target | None:
  """The key map for the video VAE tensors of an original LTX-2 single file."""
  diffusers = vae_ltx2_original_to_diffusers(name)
  return None if diffusers is None else vae_ltx2_convert_key(diffusers)


def load_vae_ltx2_original(
  path: str | os.PathLike,
  *,
  config: LTX2VideoVAEConfig | None = None,
  mesh: jax.sharding.Mesh | None = None,
  dtype: Any = None,
  rules: Any = None,
  progress: bool = False,
) -> LTX2VideoVAE:
  """Loads the video VAE of an original LTX-2 single file (`ltx-2-19b-dev.safetensors`, …); `config`
  defaults to the released VAE's (`LTX2_VAE_VARIANTS["2.0"]`)."""
  checkpoint = md_core.open_checkpoint(path)
  if "vae.per_channel_statistics.mean-of-means" not in checkpoint:
    raise ValueError(
      f"{path}: no 'vae.per_channel_statistics.mean-of-means'; is this an original LTX-2 single file "
      "(ltx-2-*.safetensors with the video VAE inside)?"
    )
  cfg = config or LTX2_VAE_VARIANTS["2.0"]
  return md_core.load_weights(
    lambda: LTX2VideoVAE(cfg, rngs=nnx.Rngs(0)),
    checkpoint,
    vae_ltx2_original_keymap,
    dtype=dtype,
    keep_f32=_KEEP_F32,
    mesh=mesh,
    rules=rules,
    allow_unused=VAE_LTX2_ORIGINAL_ALLOW_UNUSED,
    progress=progress,
  )
