import json

import numpy as np
import pytest

import md_data as mdd

VIDEO = mdd.ShapesConfig(size=32, frames=5)


@pytest.mark.parametrize("config", [mdd.ShapesConfig(), VIDEO], ids=["image", "video"])
def test_same_seed_same_arrays_other_seed_differs(config):
  a = [mdd.shapes_sample(config, 3, i) for i in range(8)]
  b = [mdd.shapes_sample(config, 3, i) for i in range(8)]
  c = [mdd.shapes_sample(config, 4, i) for i in range(8)]
  for x, y in zip(a, b):
    np.testing.assert_array_equal(x.pixels, y.pixels)
    assert x.caption == y.caption and x.label == y.label
  assert any(not np.array_equal(x.pixels, z.pixels) for x, z in zip(a, c))
  assert [x.caption for x in a] != [z.caption for z in c]


def test_pixels_layout():
  image = mdd.shapes_sample(mdd.ShapesConfig(size=48), 0, 0).pixels
  video = mdd.shapes_sample(VIDEO, 0, 0).pixels
  assert image.shape == (48, 48, 3) and video.shape == (5, 32, 32, 3)
  for x in (image, video):
    assert x.dtype == np.float32 and 0.0 <= x.min() and x.max() <= 1.0
  # Anti-aliased: some edge pixels lie strictly between the background and the shape.
  bg = np.asarray(
    mdd.BACKGROUNDS[mdd.shapes_sample(mdd.ShapesConfig(size=48), 0, 0).label.background]
  )
  far = np.abs(image - bg).max(-1)
  assert ((far > 0.05) & (far < 0.5 * far.max())).any()


def test_caption_matches_label():
  for config in (mdd.ShapesConfig(split="all"), mdd.ShapesConfig(size=32, frames=3, split="all")):
    for i in range(100):
      s = mdd.shapes_sample(config, 1, i)
      assert mdd.parse_caption(s.caption) == mdd.Caption(*s.label)
      video = config.frames is not None
      assert (s.label.position is None) == video and (s.label.direction is None) != video


def test_split_is_respected():
  train = {
    (s.label.colour, s.label.shape)
    for s in (mdd.shapes_sample(mdd.ShapesConfig(size=24), 0, i) for i in range(400))
  }
  held = {
    (s.label.colour, s.label.shape)
    for s in (
      mdd.shapes_sample(mdd.ShapesConfig(size=24, split="held_out"), 0, i) for i in range(50)
    )
  }
  assert not train & mdd.HELD_OUT
  assert train == set(mdd.split("train"))  # 400 draws cover all 20 training pairs
  assert held == mdd.HELD_OUT


def test_iterator_batches_are_the_samples():
  it = mdd.ShapesIterator(VIDEO, seed=5, batch_size=3)
  next(it)
  batch = next(it)
  assert batch.pixels.shape == (3, 5, 32, 32, 3)
  for j, i in enumerate(range(3, 6)):
    s = mdd.shapes_sample(VIDEO, 5, i)
    np.testing.assert_array_equal(batch.pixels[j], s.pixels)
    assert batch.captions[j] == s.caption and batch.labels[j] == s.label


def test_iterator_resumes_exactly():
  config = mdd.ShapesConfig(size=32)
  straight = mdd.ShapesIterator(config, seed=9, batch_size=4)
  expected = [next(straight) for _ in range(5)]
  first = mdd.ShapesIterator(config, seed=9, batch_size=4)
  for _ in range(2):
    next(first)
  saved = json.loads(json.dumps(first.state()))  # survives a round trip through a checkpoint file
  resumed = mdd.ShapesIterator(config, seed=9, batch_size=4)
  resumed.restore(saved)
  for want in expected[2:]:
    got = next(resumed)
    np.testing.assert_array_equal(got.pixels, want.pixels)
    assert got.captions == want.captions and got.labels == want.labels


def test_restore_rejects_another_dataset():
  state = mdd.ShapesIterator(mdd.ShapesConfig(size=32), seed=1, batch_size=2).state()
  with pytest.raises(ValueError, match="seed=2 from a state with seed=1"):
    mdd.ShapesIterator(mdd.ShapesConfig(size=32), seed=2, batch_size=2).restore(state)
  with pytest.raises(ValueError, match="batch_size=4 from a state with batch_size=2"):
    mdd.ShapesIterator(mdd.ShapesConfig(size=32), seed=1, batch_size=4).restore(state)
  with pytest.raises(ValueError, match="cannot restore a shapes iterator with config="):
    mdd.ShapesIterator(mdd.ShapesConfig(size=48), seed=1, batch_size=2).restore(state)
  with pytest.raises(ValueError, match="index=-1"):
    mdd.ShapesIterator(mdd.ShapesConfig(size=32), seed=1, batch_size=2).restore(
      {**state, "index": -1}
    )


@pytest.mark.parametrize(
  "kwargs, match",
  [
    ({"size": 16}, "size=16 must be an int >= 24"),
    ({"frames": 1}, "frames=1 must be None"),
    ({"split": "test"}, "unknown split 'test'"),
    ({"extent": (0.9, 0.5)}, "extent=.* must satisfy"),
    ({"extent": (0.5, 1.2)}, r"extent=.* <= 0.9 for images"),
    ({"frames": 9, "extent": (0.5, 1.6)}, r"extent=.* <= 1.5 for videos"),
    ({"travel": (0.1, 0.9)}, "travel=.* must satisfy"),
    ({"start": "centre"}, "start='centre' must be 'fit' or 'shared'"),
  ],
)
def test_config_errors(kwargs, match):
  with pytest.raises(ValueError, match=match):
    mdd.ShapesConfig(**kwargs)


def _first_frame_tells_the_sign(config, n=160):
  """How well the best threshold on the first frame's x separates "right" clips from "left" ones (0.5:
  not at all), and the analyser's direction accuracy over the same clips."""
  xs, right, correct = [], [], 0
  for i in range(n):
    s = mdd.shapes_sample(config, 3, i)
    a = mdd.analyse(s.pixels)
    correct += a.direction == s.label.direction
    if s.label.direction in ("left", "right"):
      xs.append(a.track[0, 0])
      right.append(s.label.direction == "right")
  xs, right = np.asarray(xs), np.asarray(right)
  best = max(np.mean((xs < t) == right) for t in np.unique(xs))
  return max(best, 1 - best), correct / n


def test_shared_start_hides_the_direction_in_the_first_frame():
  """With the default start a shape near an edge can only move away from it, so the first frame tells
  left from right almost always; with start="shared" it does not, and the clips still show the caption's
  motion inside the frame."""
  fit, fit_ok = _first_frame_tells_the_sign(mdd.ShapesConfig(size=64, frames=9, split="all"))
  shared, shared_ok = _first_frame_tells_the_sign(
    mdd.ShapesConfig(size=64, frames=9, split="all", start="shared")
  )
  assert fit >= 0.9 and shared <= 0.65, (fit, shared)
  assert fit_ok == 1.0 and shared_ok == 1.0
  assert mdd.ShapesConfig().start == "fit"


@pytest.mark.parametrize("start", ["fit", "shared"])
def test_large_video_shapes_stay_in_the_frame_and_read_back(start):
  """Video shapes may be up to half the frame (extent 1.5 of a third): no frame cuts the shape off (its
  ink, the summed distance from the background, is the same in every frame), and the analyser reads
  colour, shape and direction as drawn."""
  config = mdd.ShapesConfig(size=64, frames=9, split="all", extent=(1.3, 1.5), start=start)
  for i in range(24):
    sample = mdd.shapes_sample(config, 0, i)
    background = np.asarray(mdd.BACKGROUNDS[sample.label.background], np.float32)
    ink = np.abs(sample.pixels - background).sum(axis=(1, 2, 3))
    assert ink.min() > 0.97 * ink.max(), (i, ink)
    got = mdd.analyse(sample.pixels)
    want = sample.label
    assert (got.colour, got.shape, got.direction) == (want.colour, want.shape, want.direction), i


def test_shared_start_draws_every_clip_when_the_travel_is_capped():
  """At 24 px the shared start cuts most travels to half the room, where both ends of the start's range
  meet; every clip is drawn (numpy refused the rounding of the ends for 107 of the first 1000) and its
  shape still moves the caption's way (ink-weighted centroid, first frame to last)."""
  config = mdd.ShapesConfig(size=24, frames=9, split="all", start="shared")
  step = {"right": (1, 0), "left": (-1, 0), "down": (0, 1), "up": (0, -1)}
  yy, xx = np.mgrid[0:24, 0:24]
  for i in range(200):
    sample = mdd.shapes_sample(config, 0, i)
    ink = np.abs(sample.pixels - np.asarray(mdd.BACKGROUNDS[sample.label.background])).sum(-1)
    centre = (
      np.stack([(ink * xx).sum((1, 2)), (ink * yy).sum((1, 2))], -1) / ink.sum((1, 2))[:, None]
    )
    moved = centre[-1] - centre[0]
    assert np.dot(moved, step[sample.label.direction]) > 1.0, (i, sample.label.direction, moved)


def test_bad_seed_index_and_batch():
  with pytest.raises(ValueError, match="index=-1 must be a non-negative int"):
    mdd.shapes_sample(mdd.ShapesConfig(), 0, -1)
  with pytest.raises(ValueError, match="batch_size=0 must be a positive int"):
    mdd.ShapesIterator(mdd.ShapesConfig(), seed=0, batch_size=0)
  with pytest.raises(ValueError, match="seed=-3 must be a non-negative int"):
    mdd.ShapesIterator(mdd.ShapesConfig(), seed=-3, batch_size=1)


@pytest.mark.parametrize("shape", list(mdd.SHAPES))
def test_render_shape_is_read_back_by_the_analyser(shape):
  """A hand-drawn still reads back as drawn: colour, shape, background and grid cell."""
  image = mdd.render_shape("blue", shape, "white", center=(53.0, 10.0), extent=16.0, size=64)
  assert image.shape == (64, 64, 3) and image.dtype == np.float32
  got = mdd.analyse(image)
  assert (got.colour, got.shape, got.background, got.position) == (
    "blue", shape, "white", "top right"
  )  # fmt: skip


def test_render_shape_names_unknown_words():
  with pytest.raises(ValueError, match="shape='hexagon'; expected one of circle, square"):
    mdd.render_shape("red", "hexagon", "black", center=(8, 8), extent=8, size=16)
  with pytest.raises(ValueError, match="background='pink'; expected one of black"):
    mdd.render_shape("red", "star", "pink", center=(8, 8), extent=8, size=16)
