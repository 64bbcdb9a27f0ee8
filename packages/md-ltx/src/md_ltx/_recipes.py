"""LTX recipes built on the pipelines: multi-scale LTX-Video and the LTX-2 size rules read before loading."""

from __future__ import annotations

import math
import os
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from md_ltx._video_tokens import check_video_size


class MultiscaleOutput(NamedTuple):
  frames: jax.Array  # [B, F, height, width, 3] in [0, 1]
  passes: tuple[tuple[int, int], ...]  # (height, width) of the first and second pass


def generate_multiscale(
  pipe: Any,
  upsampler: Any,
  prompt: Any,
  negative_prompt: Any = None,
  *,
  height: int,
  width: int,
  downscale_factor: float = 2 / 3,
  adain_factor: float = 1.0,
  num_inference_steps: int = 30,
  timesteps: Any = None,
  image_cond_noise_scale: float = 0.15,
  second_pass_num_inference_steps: int = 10,
  second_pass_denoise_strength: float = 0.4,
  second_pass_image_cond_noise_scale: float = 0.025,
  **kwargs: Any,
) -> MultiscaleOutput:
  """LTX-Video multi-scale: a pass at `downscale_factor` of the size, the latent upsampler, a second pass.

  The first pass runs at the size scaled by `downscale_factor` rounded down to the VAE's multiple; its
  latents are upsampled (x2, AdaIN against the first pass with `adain_factor`), refined by a second
  pass with `second_pass_denoise_strength` over `second_pass_num_inference_steps`, and the frames
  resized to `height` x `width` (Lanczos); as diffusers' LTX-Video 0.9.7 multi-scale example.

  Args:
    pipe: an `LTXVideoPipeline`.
    upsampler: a `LatentUpsampler` (`load_latent_upsampler`).
    prompt: the prompt(s).
    negative_prompt: the negative prompt(s), or None.
    height: output height.
    width: output width.
    downscale_factor: the first pass's share of the size, in (0, 1].
    adain_factor: AdaIN strength of the upsampled latents against the first pass.
    num_inference_steps: the first pass's steps.
    timesteps: the first pass's custom timesteps (or None).
    image_cond_noise_scale: the first pass's conditioning-noise scale.
    second_pass_num_inference_steps: the second pass's steps.
    second_pass_denoise_strength: the share of the schedule the second pass runs.
    second_pass_image_cond_noise_scale: the second pass's conditioning-noise scale.
    **kwargs: the other call arguments, shared by both passes (`num_frames`, `guidance_scale`, ...).

  Returns:
    The frames and the sizes of both passes.
  """
  if not 0 < downscale_factor <= 1:
    raise ValueError(f"downscale_factor={downscale_factor} must be in (0, 1]")
  m = pipe.size_multiple
  h1 = max(m, int(height * downscale_factor) // m * m)
  w1 = max(m, int(width * downscale_factor) // m * m)
  latents = pipe(
    prompt, negative_prompt, height=h1, width=w1, output_type="latent",
    num_inference_steps=num_inference_steps, timesteps=timesteps,
    image_cond_noise_scale=image_cond_noise_scale, **kwargs,
  )  # fmt: skip
  vae = pipe.vae
  up = _upsample(upsampler, latents, vae, adain_factor)
  h2, w2 = h1 * (up.shape[3] // latents.shape[3]), w1 * (up.shape[4] // latents.shape[4])
  frames = pipe(
    prompt, negative_prompt, height=h2, width=w2, latents=up,
    denoise_strength=second_pass_denoise_strength,
    num_inference_steps=second_pass_num_inference_steps,
    image_cond_noise_scale=second_pass_image_cond_noise_scale, **kwargs,
  )  # fmt: skip
  if (h2, w2) != (height, width):
    b, f = frames.shape[:2]
    frames = jnp.clip(jax.image.resize(frames, (b, f, height, width, 3), method="lanczos3"), 0, 1)
  return MultiscaleOutput(frames, ((h1, w1), (h2, w2)))


def _upsample(upsampler, latents, vae, adain_factor):
  from md_ltx import upsample_latents

  return upsample_latents(
    upsampler, latents, vae.latents_mean[...], vae.latents_std[...],
    scaling_factor=vae.config.scaling_factor, adain_factor=adain_factor, layout="BCFHW",
  )  # fmt: skip


def _component_config(root, name: str):
  """`<name>/config.json` of checkpoint folder `root` (its subfolder, or the folder a pipeline shares it
  from: `md_core.shared_component`), or None when `root` is None or the file is not there."""
  import md_core

  if root is None:
    return None
  folder = root / name
  if not folder.is_dir() and (root / "model_index.json").is_file():
    index = md_core.read_json(root / "model_index.json")
    folder = md_core.shared_component(root, name, index) or folder
  path = folder / "config.json"
  return path if path.is_file() else None


def ltx2_size_rules(
  source: str | os.PathLike, *, transformer: str | os.PathLike | None = None
) -> tuple[int, int]:
  """(multiple of height and width, frame step) an LTX-2 checkpoint takes, read from its `vae/` and
  `transformer/` configs without loading weights (LTX-2's 32x spatial, 8x temporal, patch 1 where a
  config is not there; a separate `transformer` file keeps patch 1): `num_frames = 1 + step * k`."""
  from md_core import _sources

  spatial, temporal, patch, patch_t = 32, 8, 1, 1
  try:
    root = _sources.resolve_source(source, allow_patterns=["*.json"])
  except FileNotFoundError:
    root = None
  vae_file, tr_file = _component_config(root, "vae"), _component_config(root, "transformer")
  if vae_file is not None:
    vae = _sources.read_json(vae_file)
    spatial = int(vae.get("spatial_compression_ratio", spatial))
    temporal = int(vae.get("temporal_compression_ratio", temporal))
  if tr_file is not None and transformer is None:
    tr = _sources.read_json(tr_file)
    patch, patch_t = int(tr.get("patch_size", patch)), int(tr.get("patch_size_t", patch_t))
  return math.lcm(32, spatial * patch), temporal * patch_t


def check_ltx2_size(
  source: str | os.PathLike,
  height: int,
  width: int,
  num_frames: int,
  *,
  transformer: str | os.PathLike | None = None,
) -> None:
  """Raises ValueError naming the nearest valid sizes unless the LTX-2 checkpoint at `source` takes
  `height` x `width` and `num_frames` (see `ltx2_size_rules`); reads configs only."""
  multiple, step = ltx2_size_rules(source, transformer=transformer)
  check_video_size("LTX-2 VAE", height, width, num_frames, multiple, step)


def ltx_size_rules(
  source: str | os.PathLike, *, transformer: str | os.PathLike | None = None
) -> tuple[int, int]:
  """(multiple of height and width, frame step) an LTX-Video checkpoint takes, from its `vae/` and
  `transformer/` configs without loading weights: the VAE's compression (given, or from its patch size and
  scaling blocks, as md-vae computes it) times the transformer's patch; `num_frames = 1 + step * k`.
  Without readable configs, the published LTX-Video sizes (32, 8)."""
  import md_vae
  from md_core import _sources
  from md_ltx._config import LTXConfig

  spatial, temporal, patch, patch_t = 32, 8, 1, 1
  try:
    root = _sources.resolve_source(source, allow_patterns=["*.json"])
  except FileNotFoundError:
    root = None
  vae_file, tr_file = _component_config(root, "vae"), _component_config(root, "transformer")
  if vae_file is not None:
    vae = md_vae.LTXVideoVAEConfig.from_json(vae_file)
    spatial, temporal = vae.spatial_ratio, vae.temporal_ratio
  if tr_file is not None and transformer is None:
    tr = LTXConfig.from_json(tr_file)
    patch, patch_t = tr.patch_size, tr.patch_size_t
  return spatial * patch, temporal * patch_t


def check_ltx_size(
  source: str | os.PathLike,
  height: int,
  width: int,
  num_frames: int,
  *,
  transformer: str | os.PathLike | None = None,
) -> None:
  """Raises `SizeError` (a ValueError) naming the nearest valid sizes unless the LTX-Video checkpoint at
  `source` takes `height` x `width` and `num_frames` (see `ltx_size_rules`); reads configs only."""
  multiple, step = ltx_size_rules(source, transformer=transformer)
  check_video_size("LTX-Video VAE", height, width, num_frames, multiple, step)
