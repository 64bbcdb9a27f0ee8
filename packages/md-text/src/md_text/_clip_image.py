"""CLIP image preprocessing (transformers' `CLIPImageProcessor`): resize, center crop, normalise, in JAX."""

from __future__ import annotations

import jax
import jax.numpy as jnp

# OpenAI CLIP's per-channel statistics (OpenCLIP ViT-H/14, Wan 2.1 I2V's encoder, uses the same).
CLIP_IMAGE_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_IMAGE_STD = (0.26862954, 0.26130258, 0.27577711)


def clip_image_preprocess(
  images: jax.Array,
  *,
  size: int = 224,
  mean: tuple[float, float, float] = CLIP_IMAGE_MEAN,
  std: tuple[float, float, float] = CLIP_IMAGE_STD,
) -> jax.Array:
  """Images → CLIP `pixel_values`, as `CLIPImageProcessor` does (shortest edge to `size`, center crop).

  The resize is antialiased bicubic (`jax.image.resize`), the filter PIL and torchvision use; the reference
  also rounds the resized image to uint8, so values agree to about 1e-2 after normalisation, not exactly.

  Args:
    images: `[B, H, W, 3]`, uint8 in [0, 255] or floats in [0, 1].
    size: the shortest edge after resizing and the side of the square crop (224 for every released CLIP).
    mean: per-channel mean subtracted after scaling to [0, 1].
    std: per-channel std divided by.

  Returns:
    `[B, size, size, 3]` float32, ready for `CLIPVisionModel`.
  """
  if images.ndim != 4 or images.shape[-1] != 3:
    raise ValueError(f"images must be channels-last RGB [B, H, W, 3], got shape {images.shape}")
  x = images.astype(jnp.float32)
  if images.dtype == jnp.uint8:
    x = x / 255.0
  b, h, w, _ = x.shape
  short, long = min(h, w), max(h, w)
  new_long = int(size * long / short)
  new_h, new_w = (size, new_long) if h <= w else (new_long, size)
  x = jax.image.resize(x, (b, new_h, new_w, 3), method="bicubic", antialias=True)
  top, left = int(round((new_h - size) / 2.0)), int(round((new_w - size) / 2.0))
  x = x[:, top : top + size, left : left + size]
  m = jnp.asarray(mean, jnp.float32).reshape(1, 1, 1, 3)
  s = jnp.asarray(std, jnp.float32).reshape(1, 1, 1, 3)
  return (x - m) / s
