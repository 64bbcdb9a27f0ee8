"""FLUX.2 VAE weights: diffusers' `AutoencoderKLFlux2` tensor names → md parameter paths, and the loader.

The encoder, decoder and quant convs are named as in `AutoencoderKL` (`vae_kl_convert_key`, current and
legacy attention names); the batch norm's running statistics go to `bn/running_mean` and `bn/running_var`
(kept float32 whatever the load dtype), and its int64 `bn.num_batches_tracked` counter is ignored.
"""

from __future__ import annotations

import os
from typing import Any

import jax
from flax import nnx

import md_core
from md_vae._flux2 import AutoencoderKLFlux2, AutoencoderKLFlux2Config
from md_vae._kl_weights import vae_kl_convert_key

# Tensors the file holds that md does not use: the batch norm's training counter (int64).
FLUX2_VAE_ALLOW_UNUSED = (r"bn\.num_batches_tracked",)
# The latent statistics stay float32 (the pipeline normalises with them in the latents' dtype after).
FLUX2_VAE_KEEP_F32 = (r"^bn/",)


def vae_flux2_convert_key(name: str) -> md_core.Target | None:
  """Maps a diffusers `AutoencoderKLFlux2` tensor name to md's parameter; None for names it does not know."""
  if name in ("bn.running_mean", "bn.running_var"):
    return md_core.Target(("bn", name.split(".")[1]))
  return vae_kl_convert_key(name)


def load_vae_flux2(
  source: str | os.PathLike,
  *,
  subfolder: str | None = "vae",
  mesh: jax.sharding.Mesh | None = None,
  dtype: Any = None,
  rules: Any = None,
  progress: bool = True,
) -> AutoencoderKLFlux2:
  """Loads the FLUX.2 VAE from a checkpoint folder or hub id.

  Args:
    source: a diffusers pipeline folder / hub id (`"black-forest-labs/FLUX.2-klein-4B"`), or the VAE's own
      folder with `subfolder=None`.
    subfolder: the component folder holding `config.json` and `diffusion_pytorch_model.safetensors`.
    mesh: place parameters on this mesh (conv output channels over `tensor` with the default rules).
    dtype: parameter dtype (default float32: a bfloat16 file is upcast); the batch-norm statistics stay
      float32 and with `force_upcast` (the default) the VAE computes in float32.
    rules: md-sharding logical axis rules (default rules when None).
    progress: show a progress bar while loading.

  Returns:
    The model with its weights.

  Raises:
    FileNotFoundError: the folder, component or config is missing.
    md_core.WeightLoadError: tensors that do not fit the config (all listed).
  """
  folder = md_core.resolve_source(source, subfolder=subfolder)
  if not (folder / "config.json").is_file():
    raise FileNotFoundError(
      f"{folder}: no config.json (expected a diffusers AutoencoderKLFlux2 folder)"
    )
  config = AutoencoderKLFlux2Config.from_json(folder / "config.json")
  return md_core.load_weights(
    lambda: AutoencoderKLFlux2(config, rngs=nnx.Rngs(0)),
    md_core.open_checkpoint(folder),
    vae_flux2_convert_key,
    dtype=dtype,
    keep_f32=FLUX2_VAE_KEEP_F32,
    mesh=mesh,
    rules=rules,
    allow_unused=FLUX2_VAE_ALLOW_UNUSED,
    progress=progress,
  )
