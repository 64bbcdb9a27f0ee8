"""The shapes analyser: what a picture of one shape shows, by plain image analysis (NumPy only).

For an image: the background is the median of the border pixels; the foreground is the largest connected
region that differs from it; its colour is the median of its core pixels. Each pixel's coverage is its
projection onto the foreground-minus-background colour (linear, so noise averages out), and the kind is read
from the coverage's radial profile around its centroid: the angular harmonics

  h_k = sum(cover · r² · e^{ikθ}) / sum(cover · r²)        (θ measured from +x, y pointing down)

A shape with k corners has a strong k-th harmonic and (nearly) none below it: a triangle standing on its
base |h3| ≈ 0.53, a five-pointed star |h5| ≈ 0.53, a diamond (corners on the axes) Re h4 ≈ +0.28, an
axis-aligned square Re h4 ≈ −0.28, a circle none. The kind is the one whose harmonic, divided by its ideal
value, is largest, or "circle" when none reaches 0.4.

The position is the grid cell of the centroid. For a video every frame is analysed; the kind is read from the
harmonics averaged over frames, the colours and position are the majority over frames, and the direction is the sign of the larger component of the
centroid's straight-line fit over time.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from md_data._grammar import BACKGROUNDS, COLOURS, POSITIONS, palette, parse_caption

# Ideal harmonics of the rendered kinds (module docstring) and the fraction of one a shape must reach.
_IDEAL = {"triangle": 0.53, "square": 0.28, "diamond": 0.28, "star": 0.53}
_MIN_HARMONIC = 0.4
# A pixel belongs to the foreground when it is this far (RGB distance, after a 3×3 mean) from the background.
_MIN_CONTRAST = 0.1
# A video's shape moves when its fitted displacement is at least this fraction of the frame.
_MIN_TRAVEL = 0.05


class ShapeFeatures(NamedTuple):
  """The numbers the kind is read from (module docstring): |h3|, Re h4, |h5|, and the area in pixels."""

  h3: float
  h4: float
  h5: float
  area: float


class Analysis(NamedTuple):
  """What the analyser sees. Names are None where no shape was found (or, for `direction`, in an image
  or a still video). `centroid` is (x, y) in pixels; for a video it is the mean over frames and `track`
  holds each frame's centroid, `[F, 2]`."""

  colour: str | None
  shape: str | None
  background: str | None
  position: str | None
  direction: str | None = None
  centroid: tuple[float, float] | None = None
  features: ShapeFeatures | None = None
  track: np.ndarray | None = None


class Scores(NamedTuple):
  """Rates of agreement between analyses and captions.

  Each rate is over the captions that name that attribute (None where none does); `counts` says how many
  did. `analyses` holds one `Analysis` per sample.
  """

  colour: float | None
  shape: float | None
  position: float | None
  direction: float | None
  background: float | None
  counts: dict[str, int]
  analyses: tuple[Analysis, ...]


def _as_pixels(x, ndim: int | tuple[int, ...], what: str) -> np.ndarray:
  x = np.asarray(x)
  ndims = (ndim,) if isinstance(ndim, int) else ndim
  if x.ndim not in ndims or x.shape[-1] != 3:
    raise ValueError(
      f"{what} must be an RGB image [H, W, 3] or video [F, H, W, 3], got shape {x.shape}"
    )
  if x.dtype == np.uint8:
    x = x.astype(np.float32) / 255.0
  elif np.issubdtype(x.dtype, np.floating):
    x = x.astype(np.float32)
    if not np.isfinite(x).all():
      raise ValueError(f"{what} has non-finite values (NaN or inf)")
  else:
    raise TypeError(f"{what} must be float in [0, 1] or uint8, got dtype {x.dtype}")
  if min(x.shape[-3:-1]) < 12:
    raise ValueError(
      f"{what} is too small to analyse: {x.shape[-3:-1]} pixels, need at least 12×12"
    )
  return x


def _mean3(a: np.ndarray) -> np.ndarray:
  """3×3 box mean over the first two axes, edges replicated."""
  p = np.pad(a, [(1, 1), (1, 1)] + [(0, 0)] * (a.ndim - 2), mode="edge")
  h, w = a.shape[:2]
  return sum(p[i : i + h, j : j + w] for i in range(3) for j in range(3)) / 9.0


def _components(mask: np.ndarray) -> np.ndarray:
  """8-connected component labels of a bool mask `[H, W]`; background pixels get label H·W."""
  h, w = mask.shape
  none = h * w
  flat = np.arange(none).reshape(h, w)
  lab = np.where(mask, flat, none)
  while True:
    p = np.pad(lab, 1, constant_values=none)
    nb = np.minimum.reduce(
      [p[1 + di : 1 + di + h, 1 + dj : 1 + dj + w] for di in (-1, 0, 1) for dj in (-1, 0, 1)]
    )
    nb = np.where(mask, nb, none)
    # Pointer jumping: a label is a pixel index of the same component, so look up that pixel's label.
    nb = np.where(mask, np.minimum(nb, np.append(nb.ravel(), none)[nb]), none)
    if np.array_equal(nb, lab):
      return lab
    lab = nb


def _kind(f: ShapeFeatures) -> str:
  strength = {
    "triangle": f.h3 / _IDEAL["triangle"],
    "square": -f.h4 / _IDEAL["square"],
    "diamond": f.h4 / _IDEAL["diamond"],
    "star": f.h5 / _IDEAL["star"],
  }
  best = max(strength, key=strength.get)
  return best if strength[best] >= _MIN_HARMONIC else "circle"


def _nearest(rgb: np.ndarray, names) -> str:
  names = tuple(names)
  return names[int(np.argmin(((palette(names) - rgb) ** 2).sum(-1)))]


def _analyse_image(x: np.ndarray) -> Analysis:
  h, w, _ = x.shape
  border = np.concatenate([x[0], x[-1], x[:, 0], x[:, -1]])
  bg = np.median(border, axis=0)
  background = _nearest(bg, BACKGROUNDS)
  # The mean, not the median, of the border pixels near the median: noise clipped at 0 or 1 biases the
  # background's mean, and the coverage below is linear in it.
  bg = border[np.abs(border - bg).max(-1) < 0.3].mean(0)
  dist = np.sqrt(((_mean3(x) - bg) ** 2).sum(-1))
  peak = np.percentile(dist, 99.5)
  if peak < _MIN_CONTRAST:
    return Analysis(None, None, background, None)
  lab = _components(dist > max(_MIN_CONTRAST, 0.5 * peak))
  ids, inv = np.unique(lab.ravel(), return_inverse=True)
  mass = np.bincount(inv, weights=dist.ravel())
  mass[ids == h * w] = -1
  comp = lab == ids[int(np.argmax(mass))]
  core = comp & (dist >= 0.8 * np.percentile(dist[comp], 90))
  fg = np.median(x[core], axis=0)
  colour = _nearest(fg, COLOURS)
  axis = fg - bg
  cover = ((x - bg) @ axis) / max(float(axis @ axis), 1e-6)  # [H, W], ~1 inside, ~0 outside
  ys, xs = np.nonzero(comp)
  y0, y1 = max(ys.min() - 2, 0), min(ys.max() + 3, h)
  x0, x1 = max(xs.min() - 2, 0), min(xs.max() + 3, w)
  win = cover[y0:y1, x0:x1]
  area = float(win.sum())
  if area <= 1.0:
    return Analysis(None, None, background, None)
  yy, xx = np.mgrid[y0:y1, x0:x1] + 0.5  # pixel centres
  weight = np.clip(win, 0.0, 1.0)
  cx, cy = float((weight * xx).sum() / weight.sum()), float((weight * yy).sum() / weight.sum())
  z = (xx - cx) + 1j * (yy - cy)
  r2 = np.abs(z) ** 2
  unit = z / np.maximum(np.abs(z), 1e-6)
  norm = float((win * r2).sum())
  harm = {k: complex((win * r2 * unit**k).sum()) / max(norm, 1e-6) for k in (3, 4, 5)}
  features = ShapeFeatures(h3=abs(harm[3]), h4=harm[4].real, h5=abs(harm[5]), area=area)
  row, col = min(int(cy * 3 / h), 2), min(int(cx * 3 / w), 2)
  return Analysis(
    colour, _kind(features), background, POSITIONS[3 * row + col], None, (cx, cy), features
  )


def _majority(values) -> str | None:
  values = [v for v in values if v is not None]
  return collections.Counter(values).most_common(1)[0][0] if values else None


def analyse(pixels) -> Analysis:
  """What one image or video of the shapes kind shows.

  Args:
    pixels: an image `[H, W, 3]` or a video `[F, H, W, 3]`, float in [0, 1] or uint8 (at least 12×12).

  Returns:
    An `Analysis`: the dominant shape's colour, kind, background, grid position, and for a video its
    motion direction.

  Raises:
    ValueError: for another shape, non-finite values or a picture under 12×12.
    TypeError: for a dtype other than floating or uint8.
  """
  x = _as_pixels(pixels, (3, 4), "analyse(pixels)")
  if x.ndim == 3:
    return _analyse_image(x)
  frames = [_analyse_image(f) for f in x]
  found = [a for a in frames if a.centroid is not None]
  if not found:
    return Analysis(None, None, _majority(a.background for a in frames), None)
  track = np.full((len(frames), 2), np.nan, np.float32)
  for i, a in enumerate(frames):
    if a.centroid is not None:
      track[i] = a.centroid
  t = np.nonzero(~np.isnan(track[:, 0]))[0]
  direction = None
  if len(t) >= 2:
    # Least-squares slope of x and y over the frame index; displacement across the whole clip.
    tc = t - t.mean()
    slope = (tc[:, None] * (track[t] - track[t].mean(0))).sum(0) / (tc**2).sum()
    dx, dy = slope * (len(frames) - 1)
    h, w = x.shape[1:3]
    if abs(dx) / w >= abs(dy) / h and abs(dx) >= _MIN_TRAVEL * w:
      direction = "right" if dx > 0 else "left"
    elif abs(dy) / h > abs(dx) / w and abs(dy) >= _MIN_TRAVEL * h:
      direction = "down" if dy > 0 else "up"
  cx, cy = (float(v) for v in np.nanmean(track, 0))
  features = ShapeFeatures(*(float(v) for v in np.mean([a.features for a in found], 0)))
  return Analysis(
    _majority(a.colour for a in frames),
    _kind(features),
    _majority(a.background for a in frames),
    _majority(a.position for a in frames),
    direction,
    (cx, cy),
    features,
    track,
  )


_FIELDS = ("colour", "shape", "position", "direction", "background")


def score(samples: Sequence | np.ndarray, captions: Sequence[str]) -> Scores:
  """How often the analyser agrees with the captions the samples were made from.

  Args:
    samples: images `[N, H, W, 3]` or videos `[N, F, H, W, 3]` (an array or a sequence of arrays).
    captions: N captions of the shapes grammar (`parse_caption`); an attribute a caption leaves out is not
      scored for that sample.

  Returns:
    `Scores` with the rate of correct colour, shape, position, direction and background.

  Raises:
    ValueError: for a count mismatch or a caption outside the grammar (naming the word).
  """
  if isinstance(captions, str):
    raise TypeError("captions must be a sequence of str, got one str")
  if len(samples) != len(captions):
    raise ValueError(f"score: {len(samples)} samples but {len(captions)} captions")
  parsed = [parse_caption(c) for c in captions]
  analyses = tuple(analyse(s) for s in samples)
  counts, rates = {}, {}
  for field in _FIELDS:
    pairs = [(getattr(p, field), getattr(a, field)) for p, a in zip(parsed, analyses)]
    pairs = [(want, got) for want, got in pairs if want is not None]
    counts[field] = len(pairs)
    rates[field] = sum(want == got for want, got in pairs) / len(pairs) if pairs else None
  return Scores(**rates, counts=counts, analyses=analyses)
