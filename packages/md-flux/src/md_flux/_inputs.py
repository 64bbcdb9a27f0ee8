"""The Flux.1 and Flux.2 model inputs: what each pipeline's denoiser and md-train's loss (`flux_loss`,
`klein_loss`) both hand the transformer, made by one function per model so the two cannot drift apart.

Both take packed latent tokens and σ (the transformers multiply by 1000 inside); the pipelines divide
the scheduler's timesteps by 1000, the losses pass the σ they noise with.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


class FluxInputs(NamedTuple):
  """The Flux.1 transformer's positional inputs: `model(*inputs)`."""

  hidden_states: jax.Array  # [B, S, 4C] packed latents
  encoder_hidden_states: jax.Array  # [B, S_txt, D] T5 states
  pooled_projections: jax.Array  # [B, P] CLIP pooled
  timestep: jax.Array  # [B] σ
  img_ids: jax.Array  # [S, 3]
  txt_ids: jax.Array  # [S_txt, 3] or [B, S_txt, 3]
  guidance: jax.Array | None  # [B] embedded guidance (dev) or None (schnell)


class Flux2Inputs(NamedTuple):
  """The Flux.2 transformer's positional inputs: `model(*inputs)`."""

  hidden_states: jax.Array  # [B, S (+ R), C] packed latents (and appended reference tokens)
  encoder_hidden_states: jax.Array  # [B, S_txt, D] stacked Qwen3 states
  timestep: jax.Array  # [B] σ
  img_ids: jax.Array  # [S (+ R), 4]
  txt_ids: jax.Array  # [S_txt, 4]
  guidance: jax.Array | None  # [B] or None (Klein has no guidance embedder)


def _guidance(batch: int, guidance: float | jax.Array | None) -> jax.Array | None:
  return None if guidance is None else jnp.full((batch,), guidance, jnp.float32)


def flux1_model_inputs(
  latents: jax.Array,
  timestep: jax.Array,
  context: jax.Array,
  pooled: jax.Array,
  *,
  img_ids: jax.Array,
  txt_ids: jax.Array | None = None,
  guidance: float | jax.Array | None = None,
) -> FluxInputs:
  """Flux.1's inputs for packed latents `[B, S, 4C]` (`pack_latents`) at σ `timestep [B]`.

  Args:
    latents: the packed noisy latents.
    timestep: σ per row (the transformer scales it by 1000).
    context, pooled: the T5 states `[B, S_txt, D]` and CLIP pooled embeddings `[B, P]`.
    img_ids: the packed tokens' position ids `[S, 3]` (`image_ids(h / 2, w / 2)`).
    txt_ids: the text tokens' ids (default zeros `[S_txt, 3]`, as the reference's).
    guidance: the embedded guidance scale of guidance-distilled (dev) models, one per row; None for
      schnell-style models.
  """
  if txt_ids is None:
    txt_ids = jnp.zeros((context.shape[1], 3), jnp.float32)
  g = _guidance(latents.shape[0], guidance)
  return FluxInputs(latents, context, pooled, timestep, img_ids, txt_ids, g)


def flux2_model_inputs(
  latents: jax.Array,
  timestep: jax.Array,
  context: jax.Array,
  *,
  img_ids: jax.Array,
  txt_ids: jax.Array,
  references: jax.Array | None = None,
  guidance: float | jax.Array | None = None,
) -> Flux2Inputs:
  """Flux.2's inputs for packed latents `[B, S, C]` at σ `timestep [B]`.

  Args:
    latents: the packed noisy latents (row-major tokens of the patchified grid).
    timestep: σ per row (the transformer scales it by 1000).
    context: the stacked Qwen3 states `[B, S_txt, D]`.
    img_ids: position ids `[S (+ R), 4]` of the tokens (with `references`, theirs after the target's).
    txt_ids: the text tokens' ids `[S_txt, 4]` (`text_ids(S_txt)`).
    references: reference images' tokens `[b, R, C]` (the same for each guidance branch: repeated to
      the rows of `latents`), appended after the target's tokens; None without references.
    guidance: the embedded guidance scale for guidance-distilled models; None for Klein.
  """
  x = latents
  if references is not None:
    reps = latents.shape[0] // references.shape[0]
    x = jnp.concatenate([latents, jnp.concatenate([references] * reps)], axis=1)
  g = _guidance(latents.shape[0], guidance)
  return Flux2Inputs(x, context, timestep, img_ids, txt_ids, g)
