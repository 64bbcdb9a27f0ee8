"""CLIP image preprocessing on the host (transformers' `CLIPImageProcessor`): resize, crop, normalise.

The resize is PIL's, as the reference's: a resampling filter in JAX (antialiased bicubic) gives other
weights, skips PIL's rounding to uint8 and cropped half a pixel off (it rounded the crop offset), which
moved pixel values by 0.1 to 2.2 and the CLIP image tokens by 0.04 to 1.7 on the test images of
tests/fixtures/clip_preprocess. Here every step follows `CLIPImageProcessorPil`: the pixel values there are
identical and the tokens of a tiny CLIP agree to 1e-6.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import PIL.Image

# OpenAI CLIP's per-channel statistics (OpenCLIP ViT-H/14, Wan 2.1 I2V's encoder, uses the same).
CLIP_IMAGE_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_IMAGE_STD = (0.26862954, 0.26130258, 0.27577711)

# `resample` as named here or as PIL's / transformers' integer codes (preprocessor_config.json: 3).
_RESAMPLE = {
  "nearest": PIL.Image.Resampling.NEAREST,
  "bilinear": PIL.Image.Resampling.BILINEAR,
  "bicubic": PIL.Image.Resampling.BICUBIC,
  "lanczos": PIL.Image.Resampling.LANCZOS,
  "box": PIL.Image.Resampling.BOX,
  "hamming": PIL.Image.Resampling.HAMMING,
}


def _to_rgb_uint8(image: Any, where: str) -> np.ndarray:
  """One image as uint8 `[H, W, 3]`: PIL images converted as the reference converts them (transparency
  composited onto white), uint8 arrays as they are, float arrays in [0, 1] scaled by 255 and rounded."""
  if isinstance(image, PIL.Image.Image):
    if "A" in image.getbands() or image.info.get("transparency") is not None:
      white = PIL.Image.new("RGBA", image.size, (255, 255, 255, 255))
      image = PIL.Image.alpha_composite(white, image.convert("RGBA"))
    return np.asarray(image.convert("RGB"))
  x = np.asarray(image)
  if x.ndim != 3 or x.shape[-1] != 3:
    raise ValueError(
      f"{where} must be a PIL image or a channels-last RGB array [H, W, 3], got shape {x.shape}"
    )
  if x.dtype == np.uint8:
    return x
  if not np.issubdtype(x.dtype, np.floating):
    raise TypeError(f"{where} has dtype {x.dtype}; pass uint8 in [0, 255] or floats in [0, 1]")
  lo, hi = float(x.min()), float(x.max())
  if lo < 0.0 or hi > 1.0:
    raise ValueError(
      f"{where} is float with values in [{lo:.4g}, {hi:.4g}]; float images must lie in [0, 1] "
      "(uint8 arrays hold [0, 255])"
    )
  return np.round(x.astype(np.float64) * 255.0).astype(np.uint8)


def _as_list(images: Any) -> list[Any]:
  if isinstance(images, PIL.Image.Image):
    return [images]
  if isinstance(images, Sequence) and not isinstance(images, (str, bytes)):
    if not images:
      raise ValueError("images is an empty sequence; pass at least one image")
    return list(images)
  x = np.asarray(images)
  if x.ndim == 4:
    return list(x)
  if x.ndim == 3:
    return [x]
  raise ValueError(
    f"images must be a PIL image, an array [H, W, 3] or [N, H, W, 3], or a sequence of those; got "
    f"an array of shape {x.shape}"
  )


def _center_crop(x: np.ndarray, height: int, width: int) -> np.ndarray:
  """The reference's crop of `[H, W, C]`: top-left at `(H - height) // 2`, `(W - width) // 2`; an image
  smaller than the crop is first zero-padded around its centre."""
  h, w = x.shape[:2]
  if h < height or w < width:
    new_h, new_w = max(h, height), max(w, width)
    top, left = -(-(new_h - h) // 2), -(-(new_w - w) // 2)  # ceil
    padded = np.zeros((new_h, new_w) + x.shape[2:], x.dtype)
    padded[top : top + h, left : left + w] = x
    x, h, w = padded, new_h, new_w
  top, left = (h - height) // 2, (w - width) // 2
  return x[top : top + height, left : left + width]


def clip_image_preprocess(
  images: Any,
  *,
  size: int = 224,
  crop_size: int | tuple[int, int] | None = None,
  mean: Sequence[float] = CLIP_IMAGE_MEAN,
  std: Sequence[float] = CLIP_IMAGE_STD,
  resample: str | int = "bicubic",
) -> np.ndarray:
  """Images → CLIP `pixel_values`, as transformers' CLIP image processor makes them (on the host).

  Each image is converted to RGB uint8, resized with PIL so its shortest edge is `size` (the long edge
  `int(size * long / short)`), center cropped to `crop_size`, scaled to [0, 1] and normalised. This is
  `CLIPImageProcessorPil` step for step (and `CLIPImageProcessor` of transformers 4.x, or of 5.x without
  torchvision); the torchvision backend of 5.x resizes with its own uint8 kernel, which may differ from PIL
  by one level at some pixels (not measured here).

  Args:
    images: a PIL image (transparency is composited onto white, as the reference does), an array
      `[H, W, 3]` or `[N, H, W, 3]` (uint8 in [0, 255], or floats in [0, 1], which are scaled by 255 and
      rounded to uint8 first), or a sequence of PIL images / `[H, W, 3]` arrays of any sizes.
    size: the shortest edge after resizing (`size["shortest_edge"]` of preprocessor_config.json).
    crop_size: the crop, an int (square) or `(height, width)`; default `size`.
    mean: per-channel mean subtracted after scaling to [0, 1].
    std: per-channel std divided by.
    resample: the PIL filter, by name ("bicubic", ...) or PIL's integer code (3 = bicubic).

  Returns:
    `[N, crop_height, crop_width, 3]` float32 numpy array, channels-last for md's `CLIPVisionModel`.

  Raises:
    ValueError: for images that are not RGB `[H, W, 3]`, float images outside [0, 1], or bad settings.
    TypeError: for arrays that are neither uint8 nor float.
  """
  if isinstance(size, bool) or not isinstance(size, (int, np.integer)) or size < 1:
    raise ValueError(f"size={size!r} must be a positive int (the shortest edge after resizing)")
  crop = size if crop_size is None else crop_size
  crop_h, crop_w = (crop, crop) if isinstance(crop, (int, np.integer)) else tuple(crop)
  if min(crop_h, crop_w) < 1:
    raise ValueError(f"crop_size={crop_size!r} must be positive (an int or (height, width))")
  if isinstance(resample, str):
    if resample not in _RESAMPLE:
      raise ValueError(f"resample={resample!r} is not one of {sorted(_RESAMPLE)} (or a PIL code)")
    filt = _RESAMPLE[resample]
  else:
    filt = PIL.Image.Resampling(int(resample))
  mean32 = np.asarray(mean, np.float32).reshape(1, 1, -1)
  std32 = np.asarray(std, np.float32).reshape(1, 1, -1)
  if mean32.size != 3 or std32.size != 3:
    raise ValueError(f"mean {tuple(mean)} and std {tuple(std)} must have 3 entries (R, G, B)")

  out = []
  for i, image in enumerate(_as_list(images)):
    x = _to_rgb_uint8(image, f"images[{i}]")
    h, w = x.shape[:2]
    short, long = min(h, w), max(h, w)
    new_long = int(size * long / short)
    new_h, new_w = (size, new_long) if h <= w else (new_long, size)
    if (new_h, new_w) != (h, w):
      x = np.asarray(PIL.Image.fromarray(x).resize((new_w, new_h), resample=filt))
    x = _center_crop(x, crop_h, crop_w)
    # As the reference: rescale in float64, then float32, then normalise in float32.
    x = (x.astype(np.float64) * (1.0 / 255.0)).astype(np.float32)
    out.append((x - mean32) / std32)
  return np.stack(out)
