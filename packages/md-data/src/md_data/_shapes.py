"""The procedural shapes dataset: one coloured shape per image or video, captioned by the grammar.

Sample `i` of a seed is drawn from its own generator, `np.random.default_rng([seed, i])`, so a sample never
depends on the batch size or on what came before it, and an iterator resumes from one integer.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import numpy as np

from md_data._grammar import BACKGROUNDS, DIRECTIONS, POSITIONS, ShapeLabel, caption, split
from md_data._render import compose, coverage


@dataclasses.dataclass(frozen=True)
class ShapesConfig:
  """What the samples look like.

  Attributes:
    size: height and width in pixels (at least 24).
    frames: frames per video; None draws still images.
    split: which colour × shape combinations are drawn: "train", "held_out" or "all" (see `split`).
    extent: range of the shape's longer side, as a fraction of a grid cell (images, at most 0.9) or of a
      third of the frame (videos, at most 1.5: half the frame).
    travel: range of the distance a video's shape moves, as a fraction of the frame.
    start: where a video's shape starts. "fit" (the default): anywhere its whole track fits, so a shape
      that starts near an edge moves away from it and the first frame mostly tells the direction.
      "shared": every direction draws the first frame's position from the same central range (the
      travel is cut to half the room where it would not fit), so the first frame alone does not tell
      which way the shape goes; the caption does.
  """

  size: int = 64
  frames: int | None = None
  split: str = "train"
  extent: tuple[float, float] = (0.55, 0.8)
  travel: tuple[float, float] = (0.3, 0.5)
  start: str = "fit"

  def __post_init__(self):
    if not isinstance(self.size, int) or self.size < 24:
      raise ValueError(f"ShapesConfig.size={self.size!r} must be an int >= 24")
    if self.frames is not None and (not isinstance(self.frames, int) or self.frames < 2):
      raise ValueError(f"ShapesConfig.frames={self.frames!r} must be None (images) or an int >= 2")
    split(self.split)  # raises on an unknown name
    lo, hi = self.extent
    top = 0.9 if self.frames is None else 1.5
    if not 0.2 <= lo <= hi <= top:
      kind = "images" if self.frames is None else "videos"
      raise ValueError(
        f"ShapesConfig.extent={self.extent} must satisfy 0.2 <= low <= high <= {top} for {kind}"
      )
    lo, hi = self.travel
    if not 0.1 <= lo <= hi <= 0.6:
      raise ValueError(f"ShapesConfig.travel={self.travel} must satisfy 0.1 <= low <= high <= 0.6")
    if self.start not in ("fit", "shared"):
      raise ValueError(f"ShapesConfig.start={self.start!r} must be 'fit' or 'shared'")


class ShapesSample(NamedTuple):
  pixels: np.ndarray  # [H, W, 3] or [F, H, W, 3], float32 in [0, 1]
  caption: str
  label: ShapeLabel


class ShapesBatch(NamedTuple):
  pixels: np.ndarray  # [B, H, W, 3] or [B, F, H, W, 3], float32 in [0, 1]
  captions: list[str]
  labels: list[ShapeLabel]


def shapes_sample(config: ShapesConfig, seed: int, index: int) -> ShapesSample:
  """Sample `index` of the dataset `seed`: the same arrays on every call and machine.

  Args:
    config: sizes and split.
    seed: the dataset's seed, a non-negative int.
    index: the sample's position, a non-negative int.

  Returns:
    A `ShapesSample` with its pixels, caption and label.
  """
  for name, v in (("seed", seed), ("index", index)):
    if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v < 0:
      raise ValueError(f"{name}={v!r} must be a non-negative int")
  rng = np.random.default_rng([int(seed), int(index)])
  pairs = split(config.split)
  colour, shape = pairs[rng.integers(len(pairs))]
  background = tuple(BACKGROUNDS)[rng.integers(len(BACKGROUNDS))]
  n = config.size
  if config.frames is None:
    cell = rng.integers(len(POSITIONS))
    row, col = divmod(int(cell), 3)
    w = n / 3
    extent = w * rng.uniform(*config.extent)
    # Jitter the centre while keeping the whole bounding box (hence the centroid) inside the cell.
    slack = (w - extent) / 2 * 0.9
    cx, cy = (
      (col + 0.5) * w + rng.uniform(-slack, slack),
      (row + 0.5) * w + rng.uniform(-slack, slack),
    )
    pixels = compose(coverage(shape, (cx, cy), extent, n), colour, background)
    label = ShapeLabel(colour, shape, background, position=POSITIONS[cell])
  else:
    direction = DIRECTIONS[rng.integers(len(DIRECTIONS))]
    extent = n / 3 * rng.uniform(*config.extent)
    travel = n * rng.uniform(*config.travel)
    lo, hi = extent / 2 + 1, n - extent / 2 - 1
    backwards = direction in ("left", "up")
    t = np.linspace(0.0, 1.0, config.frames)
    if config.start == "shared":
      travel = min(travel, (hi - lo) / 2)
      # max(): at the cap the two ends are equal up to rounding, which numpy would refuse as high < low.
      start = rng.uniform(lo + travel, max(lo + travel, hi - travel))
      along = start + (-travel if backwards else travel) * t
    else:
      travel = min(travel, hi - lo)  # only large shapes (extent > 0.9) need it
      start = rng.uniform(lo, max(lo, hi - travel))
      along = start + travel * t
      if backwards:
        along = lo + hi - along
    across = rng.uniform(lo, hi)
    xs, ys = (
      (along, np.full_like(t, across))
      if direction in ("left", "right")
      else (np.full_like(t, across), along)
    )
    alpha = np.stack([coverage(shape, (x, y), extent, n) for x, y in zip(xs, ys)])
    pixels = compose(alpha, colour, background)
    label = ShapeLabel(colour, shape, background, direction=direction)
  return ShapesSample(pixels, caption(label), label)


class ShapesIterator:
  """Batches of the shapes dataset, resumable from `state()`.

  Batch `b` holds samples `start + b·batch_size …` of `shapes_sample(config, seed, ·)`.

  Args:
    config: sizes and split.
    seed: the dataset's seed, a non-negative int.
    batch_size: samples per batch.
    start: index of the first sample.

  >>> it = ShapesIterator(ShapesConfig(size=32), seed=0, batch_size=2)
  >>> batch = next(it)
  >>> batch.pixels.shape, len(batch.captions)
  ((2, 32, 32, 3), 2)
  """

  def __init__(self, config: ShapesConfig, *, seed: int, batch_size: int, start: int = 0):
    if not isinstance(batch_size, int) or batch_size < 1:
      raise ValueError(f"batch_size={batch_size!r} must be a positive int")
    if not isinstance(seed, int) or seed < 0:
      raise ValueError(f"seed={seed!r} must be a non-negative int")
    self.config, self.seed, self.batch_size = config, seed, batch_size
    self._index = int(start)

  def __iter__(self) -> ShapesIterator:
    return self

  def __next__(self) -> ShapesBatch:
    samples = [
      shapes_sample(self.config, self.seed, i)
      for i in range(self._index, self._index + self.batch_size)
    ]
    self._index += self.batch_size
    return ShapesBatch(
      np.stack([s.pixels for s in samples]),
      [s.caption for s in samples],
      [s.label for s in samples],
    )

  def state(self) -> dict[str, Any]:
    """The position: a small JSON-able dict (seed, next sample index, batch size, config)."""
    return {
      "seed": self.seed,
      "index": self._index,
      "batch_size": self.batch_size,
      "config": dataclasses.asdict(self.config),
    }

  def restore(self, state: dict[str, Any]) -> None:
    """Continues from a `state()`: the next batch equals the one the saved iterator would have made.

    Raises:
      ValueError: if the state belongs to another seed, batch size or config.
    """
    want = self.state()
    for key in ("seed", "batch_size", "config"):
      got = state.get(key)
      if key == "config" and isinstance(got, dict):
        got = {k: tuple(v) if isinstance(v, list) else v for k, v in got.items()}
      if got != want[key]:
        raise ValueError(
          f"cannot restore a shapes iterator with {key}={want[key]!r} from a state with {key}={got!r}"
        )
    index = state.get("index")
    if not isinstance(index, int) or index < 0:
      raise ValueError(f"shapes iterator state has index={index!r}, expected a non-negative int")
    self._index = index
