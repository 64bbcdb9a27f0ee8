"""Anti-aliased drawing of one shape: a coverage mask drawn 4× larger with PIL, box-filtered down."""

from __future__ import annotations

import functools

import numpy as np
from PIL import Image, ImageDraw

from md_data._grammar import BACKGROUNDS, COLOURS, SHAPES

_SUPERSAMPLE = 4


@functools.cache
def _outline(shape: str) -> np.ndarray | None:
  """Polygon vertices of a shape whose bounding box is [-1, 1]² (x right, y down); None for the circle."""
  if shape == "circle":
    return None
  if shape == "square":
    pts = [(-1, -1), (1, -1), (1, 1), (-1, 1)]
  elif shape == "triangle":  # apex up, base at the bottom
    pts = [(0, -1), (1, 1), (-1, 1)]
  elif shape == "diamond":
    pts = [(0, -1), (1, 0), (0, 1), (-1, 0)]
  elif shape == "star":  # five points, one up; inner radius 0.45 of the outer keeps the arms thick
    angles = np.pi / 2 + np.arange(10) * np.pi / 5
    radii = np.where(np.arange(10) % 2 == 0, 1.0, 0.45)
    pts = np.stack([radii * np.cos(angles), -radii * np.sin(angles)], -1)
    lo, hi = pts.min(0), pts.max(0)
    pts = (pts - (lo + hi) / 2) / ((hi - lo).max() / 2)
  else:
    raise ValueError(f"unknown shape {shape!r}; expected one of {SHAPES}")
  return np.asarray(pts, np.float64)


def coverage(shape: str, center: tuple[float, float], extent: float, size: int) -> np.ndarray:
  """Fraction of each pixel a shape covers.

  Args:
    shape: one of `SHAPES`.
    center: (x, y) of the shape's bounding-box centre in pixels; pixel (i, j) spans [j, j+1) × [i, i+1).
    extent: the longer side of the bounding box, in pixels.
    size: the image's height and width.

  Returns:
    `[size, size]` float32 in [0, 1].
  """
  s = _SUPERSAMPLE
  canvas = Image.new("L", (size * s, size * s), 0)
  draw = ImageDraw.Draw(canvas)
  cx, cy, r = center[0] * s, center[1] * s, extent * s / 2
  pts = _outline(shape)
  if pts is None:
    draw.ellipse([cx - r, cy - r, cx + r - 1, cy + r - 1], fill=255)
  else:
    # PIL fills a pixel when its centre is inside; shift by half a pixel so vertices sit on pixel corners.
    draw.polygon([(cx + r * x - 0.5, cy + r * y - 0.5) for x, y in pts], fill=255)
  small = canvas.resize((size, size), Image.Resampling.BOX)
  return np.asarray(small, np.float32) / 255.0


def compose(alpha: np.ndarray, colour: str, background: str) -> np.ndarray:
  """A shape's coverage `[..., H, W]` painted in `colour` over `background`: `[..., H, W, 3]` float32."""
  fg = np.asarray(COLOURS[colour], np.float32)
  bg = np.asarray(BACKGROUNDS[background], np.float32)
  return bg + alpha[..., None] * (fg - bg)


def render_shape(
  colour: str,
  shape: str,
  background: str,
  *,
  center: tuple[float, float],
  extent: float,
  size: int,
) -> np.ndarray:
  """One still of the shapes kind drawn as the dataset draws it: `shape` in `colour` over `background`,
  its bounding box `extent` pixels wide centred at `center` (x, y) on a `size`² image; `[size, size, 3]`
  float32 in [0, 1]. For instance images of one subject (Dreambooth) or hand-made test inputs.

  Raises:
    ValueError: an unknown colour, shape or background (the known ones named).
  """
  for what, name, known in (
    ("colour", colour, COLOURS), ("shape", shape, SHAPES), ("background", background, BACKGROUNDS),
  ):  # fmt: skip
    if name not in known:
      raise ValueError(f"{what}={name!r}; expected one of {', '.join(known)}")
  return compose(coverage(shape, center, float(extent), int(size)), colour, background)
