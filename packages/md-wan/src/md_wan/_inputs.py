"""Wan's model inputs: what the pipeline's denoiser and the training loss (md-train's `wan_loss`) both
hand the transformer, made by one function so the two cannot drift apart.

Three kinds of checkpoint condition the latents differently:
- text to video: the latents and one timestep per row, as they are;
- image to video (Wan 2.1 I2V / FLF2V, Wan 2.2 I2V A14B): the condition (frame mask and image latents)
  concatenated after the latents on the channels;
- Wan 2.2 TI2V (`expand_timesteps`): the image's clean latent frame replaces the first frame, and each
  token gets its own timestep, 0 on that frame (`frame_mask`).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np


class WanInputs(NamedTuple):
  """The transformer's positional inputs: `model(*inputs, layout="BFHWC")`."""

  hidden_states: jax.Array  # [B, F, H, W, C_in] channels-last
  timestep: jax.Array  # [B], [B, F / pt] (per frame) or [B, tokens] (per token), float32
  encoder_hidden_states: jax.Array  # [B, S, D_text]
  encoder_hidden_states_image: jax.Array | None  # [B, T, D_img] (Wan 2.1 I2V) or None


def first_frame_mask(latent_shape: tuple[int, ...], *, clean_first: bool) -> np.ndarray:
  """The TI2V frame mask `[1, f, h, w, 1]` float32 for latents `[B, f, h, w, C]`: 0 on the first latent
  frame when it holds a clean image (`clean_first`), 1 elsewhere."""
  _, f, h, w = latent_shape[:4]
  mask = np.ones((1, f, h, w, 1), np.float32)
  if clean_first:
    mask[:, 0] = 0.0
  return mask


def blend_first_frame(
  latents: jax.Array, condition: jax.Array | None, frame_mask: jax.Array
) -> jax.Array:
  """TI2V latents: `condition` (the image's latent frame `[B, 1, h, w, C]`) where `frame_mask` is 0,
  `latents` where it is 1; `latents` as they are without a condition."""
  if condition is None:
    return latents
  mixed = (1 - frame_mask) * condition.astype(latents.dtype) + frame_mask * latents
  return mixed.astype(latents.dtype)


def model_inputs(
  latents: jax.Array,
  timestep: jax.Array,
  context: jax.Array,
  *,
  condition: jax.Array | None = None,
  frame_mask: jax.Array | None = None,
  image_tokens: jax.Array | None = None,
  patch_size: tuple[int, int, int] | None = None,
) -> WanInputs:
  """Turns noisy latents, their timestep and the conditioning into the Wan transformer's inputs.

  Args:
    latents: the noisy latents `[B, F, H, W, C]` (channels-last).
    timestep: `[B]` (1000 σ), or `[B, F / pt]` per-frame timesteps.
    context: the UMT5 states `[B, S, D]`.
    condition: image to video: the condition channels `[B, F, H, W, Cy]` (frame mask and image
      latents), concatenated after the latents; TI2V (with `frame_mask`): the image's latent frame
      `[B, 1, H, W, C]`, or None when there is no image.
    frame_mask: TI2V's `[1, F, H, W, 1]` (`first_frame_mask`): the latents take `condition` where it is
      0, and each token gets the timestep times the mask at its patch (per-token timesteps
      `[B, tokens]`). None for the other checkpoints.
    image_tokens: Wan 2.1 I2V's CLIP image tokens `[B, T, D_img]`, or None.
    patch_size: the transformer's `(pt, ph, pw)` (needed with `frame_mask`).

  Returns:
    A `WanInputs`.
  """
  timestep = jnp.asarray(timestep).astype(jnp.float32)
  if frame_mask is not None:
    if patch_size is None:
      raise ValueError("model_inputs: frame_mask (per-token timesteps) needs the patch_size")
    x = blend_first_frame(latents, condition, frame_mask)
    _, ph, pw = patch_size
    per_token = frame_mask[0, :, ::ph, ::pw, 0].reshape(-1)  # [tokens]
    timestep = per_token[None] * timestep[:, None]  # [B, tokens]
  elif condition is not None:
    x = jnp.concatenate([latents, condition.astype(latents.dtype)], axis=-1)
  else:
    x = latents
  return WanInputs(x, timestep, context, image_tokens)
