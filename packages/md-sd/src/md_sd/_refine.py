"""SDXL's ensemble of experts: the base pipeline denoises the high-noise share, the refiner the rest."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax


def generate_with_refiner(
  base: Any,
  refiner: Any,
  prompt: str | Sequence[str],
  negative_prompt: str | Sequence[str] | None = None,
  *,
  refiner_start: float = 0.8,
  num_images_per_prompt: int = 1,
  aesthetic_score: float = 6.0,
  negative_aesthetic_score: float = 2.5,
  **kwargs: Any,
) -> jax.Array:
  """Text-to-image with an SDXL base and refiner pipeline handing over at `refiner_start`.

  The base runs the steps up to `denoising_end=refiner_start` and returns latents; the refiner continues
  from them with `denoising_start=refiner_start` (diffusers' "ensemble of expert denoisers"). Both see
  the same prompts, steps, guidance and seed.

  Args:
    base: a text-to-image `StableDiffusionPipeline` (SDXL base).
    refiner: an SDXL refiner `StableDiffusionPipeline` (`requires_aesthetics_score`).
    prompt: one prompt or a list.
    negative_prompt: the negative prompt(s), or None.
    refiner_start: the share of the schedule the base denoises, in (0, 1).
    num_images_per_prompt: images per prompt (the refiner refines each once).
    aesthetic_score: the refiner's aesthetic micro-conditioning.
    negative_aesthetic_score: the same for the negative branch.
    **kwargs: shared call arguments (`height`, `width`, `num_inference_steps`, `guidance_scale`, `seed`,
      `scheduler`, ...); the refiner ignores `height` / `width` (the latents set them).

  Returns:
    Images `[B, H, W, 3]` in [0, 1], B = prompts × `num_images_per_prompt`.

  Raises:
    ValueError: `refiner_start` outside (0, 1), or an image-to-image / ControlNet argument.
  """
  if not 0.0 < refiner_start < 1.0:
    raise ValueError(f"refiner_start={refiner_start} must be in (0, 1)")
  extra = [
    k for k in ("image", "image_latents", "control_image", "latents") if kwargs.get(k) is not None
  ]
  if extra:
    raise ValueError(
      f"the base + refiner ensemble is text-to-image without ControlNet; got {', '.join(extra)}"
    )
  latents = base(
    prompt,
    negative_prompt,
    denoising_end=refiner_start,
    output_type="latent",
    num_images_per_prompt=num_images_per_prompt,
    **kwargs,
  )
  rows = latents.shape[0]
  prompts = [prompt] * rows if isinstance(prompt, str) else _repeat(prompt, rows)
  negatives = None
  if negative_prompt is not None:
    negatives = (
      [negative_prompt] * rows
      if isinstance(negative_prompt, str)
      else _repeat(negative_prompt, rows)
    )
  refine = {k: v for k, v in kwargs.items() if k not in ("height", "width")}
  return refiner(
    prompts,
    negatives,
    image_latents=latents,
    denoising_start=refiner_start,
    num_images_per_prompt=1,
    aesthetic_score=aesthetic_score,
    negative_aesthetic_score=negative_aesthetic_score,
    **refine,
  )


def _repeat(items: Sequence[str], rows: int) -> list[str]:
  """Each prompt repeated for its images (the base orders rows prompt-major)."""
  per = rows // len(items)
  return [p for p in items for _ in range(per)]
