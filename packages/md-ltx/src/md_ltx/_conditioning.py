"""LTX-Video's conditioning items (`LTXCondition`: an image or a clip at a frame with a strength): their
checks, their pixels and their posterior noise, read before any encoding or compiling."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import numpy as np


@dataclasses.dataclass(frozen=True)
class LTXCondition:
  """One conditioning item: an image or a clip placed at `frame_index` with `strength` (1: kept as given).

  `image` is `[H, W, 3]` (uint8, or floats in [0, 1]), a PIL image or an image file; `video` (instead of
  `image`) is `[N, H, W, 3]` or a list of images, cut to `1 + 8k` frames that fit in the video after
  `frame_index`. Frames are resized to the video size when their size differs.
  """

  image: Any = None
  frame_index: int = 0
  strength: float = 1.0
  video: Any = None


def _image_array(image: Any, what: str) -> np.ndarray:
  """An image as float32 `[H, W, 3]` in [0, 1] (uint8 input is divided by 255)."""
  if isinstance(image, str | os.PathLike):
    try:
      import PIL.Image  # noqa: PLC0415 - only for images given as files

      with PIL.Image.open(image) as im:
        image = np.asarray(im.convert("RGB"))
    except (OSError, ValueError) as e:
      raise ValueError(f"{what}: cannot read the image file {os.fspath(image)!r}: {e}") from e
  elif hasattr(image, "convert"):  # PIL
    image = np.asarray(image.convert("RGB"))
  x = np.asarray(image)
  if x.ndim != 3 or x.shape[-1] != 3:
    raise ValueError(
      f"{what} must be one RGB image [H, W, 3] (uint8, or float in [0, 1]); got shape {x.shape}"
    )
  return x.astype(np.float32) / 255.0 if x.dtype == np.uint8 else x.astype(np.float32)


def lerp(a, b, w: float):
  """torch.lerp's two formulas (from the start below 0.5, from the end above), for identical rounding."""
  return a + w * (b - a) if w < 0.5 else b - (b - a) * (1.0 - w)


def check_conditions(conditions: list[LTXCondition], num_frames: int) -> None:
  """Raises a ValueError naming the first item that is not an `LTXCondition`, lies outside the video or
  has a strength outside [0, 1]."""
  for i, c in enumerate(conditions):
    if not isinstance(c, LTXCondition):
      raise ValueError(f"conditions[{i}] must be an LTXCondition, got {type(c).__name__}")
    if not 0 <= int(c.frame_index) < num_frames:
      raise ValueError(
        f"conditions[{i}].frame_index={c.frame_index} is outside the video (frames 0 … "
        f"{num_frames - 1})"
      )
    if not 0.0 <= float(c.strength) <= 1.0:
      raise ValueError(f"conditions[{i}].strength={c.strength} must be in [0, 1]")


def condition_noise(image_noise: Any, count: int) -> list[Any]:
  """The posterior noise of each of `count` items: `image_noise` (one array, or a list with one per
  item), or None each (drawn from the seed)."""
  if image_noise is None:
    return [None] * count
  noise = list(image_noise) if isinstance(image_noise, list | tuple) else [image_noise]
  if len(noise) != count:
    raise ValueError(
      f"image_noise has {len(noise)} arrays for {count} conditioning items; give one per "
      "item (one array for image=)"
    )
  return noise


def condition_pixels(
  conditions: list[LTXCondition], num_frames: int, temporal_ratio: int
) -> list[np.ndarray]:
  """Each item's frames `[N, H, W, 3]` in [0, 1]: an image as one frame, a clip cut to the `1 + 8k`
  frames that fit after its frame index (the reference's trim_conditioning_sequence)."""
  pics = []
  for i, c in enumerate(conditions):
    if (c.image is None) == (c.video is None):
      raise ValueError(f"conditions[{i}] needs exactly one of image= and video=")
    if c.image is not None:
      pics.append(_image_array(c.image, f"conditions[{i}].image")[None])
      continue
    frames = [_image_array(im, f"conditions[{i}].video[{j}]") for j, im in enumerate(c.video)]
    if len({fr.shape for fr in frames}) != 1:
      raise ValueError(f"conditions[{i}].video: frames of different sizes")
    n = min(len(frames), num_frames - int(c.frame_index))
    n = (n - 1) // temporal_ratio * temporal_ratio + 1
    pics.append(np.stack(frames[:n]))
  return pics
