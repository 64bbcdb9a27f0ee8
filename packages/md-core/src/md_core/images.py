"""Pipeline image inputs: PIL images, files, uint8 or float arrays → float32 pixels in [0, 1].

diffusers' `VaeImageProcessor` takes PIL images (scaled by 1/255), arrays and tensors whose floats it
reads as [0, 1]. md's pipelines accept the same and refuse what would be read with another scale
without a word: integer arrays other than uint8, bool and complex dtypes, floats outside [0, 1] (e.g.
[-1, 1] or [0, 255]), NaN, and shapes that are not channels-last RGB.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np
from PIL import Image

from md_core import media

# Floats this far outside [0, 1] are still taken as they are (rounding in a caller's own processing).
TOLERANCE = 1e-3

_EXPECTED = (
  "a PIL image, an image file, or an array [B, H, W, 3] / [H, W, 3] (uint8, or floats in [0, 1])"
)


def pixel_values(x: Any, *, what: str = "image") -> np.ndarray:
  """Checks an array's pixel scale: uint8 is divided by 255, floats must lie in [0, 1].

  Args:
    x: a numpy or jax array (any shape), uint8 or any float dtype (bf16 included).
    what: the argument's name, for errors.

  Returns:
    float32 pixels in [0, 1] (floats within `TOLERANCE` outside are kept as they are), same shape.

  Raises:
    TypeError: a dtype whose scale is ambiguous or meaningless (other integers, bool, complex, object).
    ValueError: NaN, or floats outside [0, 1].
  """
  arr = np.asarray(x)
  if arr.dtype == np.uint8:
    return arr.astype(np.float32) / 255.0
  # jnp.issubdtype also knows the ml_dtypes floats (bfloat16), which numpy's does not.
  if not jnp.issubdtype(arr.dtype, jnp.floating):
    hint = ""
    if jnp.issubdtype(arr.dtype, jnp.integer):
      hint = "; for 8-bit pixels pass .astype(np.uint8), else scale to floats in [0, 1]"
    raise TypeError(
      f"{what}: pixels must be uint8 or floats in [0, 1], got dtype {arr.dtype}{hint}"
    )
  arr = arr.astype(np.float32)
  if arr.size == 0:
    raise ValueError(f"{what}: the image is empty (shape {arr.shape})")
  nans = int(np.isnan(arr).sum())
  if nans:
    raise ValueError(f"{what}: {nans} of {arr.size} pixel values are NaN (shape {arr.shape})")
  lo, hi = float(arr.min()), float(arr.max())
  if lo < -TOLERANCE or hi > 1.0 + TOLERANCE:
    if lo >= -1.0 - TOLERANCE and lo < 0 and hi <= 1.0 + TOLERANCE:
      hint = "; values in [-1, 1]? pass (x + 1) / 2"
    elif hi > 1.0 + TOLERANCE and lo >= -TOLERANCE and hi <= 255.0:
      hint = "; values in [0, 255]? pass them as uint8 or divide by 255"
    else:
      hint = ""
    raise ValueError(
      f"{what}: float pixels must be in [0, 1], got values in [{lo:.4g}, {hi:.4g}]{hint}"
    )
  return arr


def _is_image_item(x: Any) -> bool:
  return isinstance(x, Image.Image | str | os.PathLike) or (
    hasattr(x, "__array__") and np.ndim(x) >= 3
  )


def _one(image: Any, what: str) -> np.ndarray:
  """One input (not a list) → float32 `[B, H, W, 3]`."""
  if isinstance(image, str | os.PathLike):
    try:
      return media.load_image(image)[None]
    except FileNotFoundError as e:
      raise FileNotFoundError(f"{what}: {e}") from None
    except ValueError as e:
      raise ValueError(f"{what}: {e}") from None
  if isinstance(image, Image.Image):
    # As diffusers' processors: RGB, 8 bits scaled by 1/255.
    return (np.asarray(image.convert("RGB"), np.float32) / 255.0)[None]
  if not hasattr(image, "__array__") and not isinstance(image, list | tuple):
    raise TypeError(f"{what}: expected {_EXPECTED}; got {type(image).__name__}")
  try:
    arr = np.asarray(image)
  except (TypeError, ValueError) as e:
    raise TypeError(f"{what}: expected {_EXPECTED}; got {type(image).__name__} ({e})") from None
  if arr.ndim == 3:
    arr = arr[None]
  if arr.ndim != 4 or arr.shape[-1] != 3:
    hint = ""
    if arr.ndim == 4 and arr.shape[1] == 3:
      hint = "; this looks channels-first [B, 3, H, W]: transpose to [B, H, W, 3]"
    elif arr.ndim in (2, 3) or (arr.ndim == 4 and arr.shape[-1] in (1, 4)):
      hint = "; grey or RGBA pixels: convert to RGB first"
    raise ValueError(f"{what}: expected {_EXPECTED}; got an array of shape {arr.shape}{hint}")
  return pixel_values(arr, what=what)


def image_batch(image: Any, *, what: str = "image") -> np.ndarray:
  """A pipeline's image input as float32 `[B, H, W, 3]` in [0, 1], read as diffusers reads it.

  Args:
    image: a `PIL.Image.Image` (converted to RGB, scaled by 1/255), a path to an image file (decoded as
      `md_core.media.load_image` does), a numpy / jax array `[H, W, 3]` or `[B, H, W, 3]` (uint8 scaled
      by 1/255, floats taken as they are and required in [0, 1]), or a list of these of one size (a
      batch, in order).
    what: the argument's name, for errors.

  Returns:
    float32 `[B, H, W, 3]`.

  Raises:
    TypeError: an object that is not an image, or a dtype whose scale is ambiguous.
    ValueError: a wrong shape (rank, channels), floats outside [0, 1], NaN, images of different sizes in
      a list, or a file that cannot be decoded.
    FileNotFoundError: a path that does not exist.
  """
  if isinstance(image, Sequence) and not isinstance(image, str) and len(image) > 0:
    if all(_is_image_item(x) for x in image):
      parts = [_one(x, f"{what}[{i}]") for i, x in enumerate(image)]
      sizes = sorted({p.shape[1:3] for p in parts})
      if len(sizes) > 1:
        raise ValueError(f"{what}: the images of a list must have one size, got (H, W) {sizes}")
      return np.concatenate(parts, axis=0)
  if isinstance(image, Sequence) and not isinstance(image, str) and len(image) == 0:
    raise ValueError(f"{what}: an empty list; expected {_EXPECTED}")
  return _one(image, what)
