import numpy as np
import pytest

import md_data as mdd

FIELDS = ("colour", "shape", "position", "direction", "background")


def _samples(config, n, *, seed=11, noise=0.0, blur=False):
  rng = np.random.default_rng(0)
  pixels, captions = [], []
  for i in range(n):
    s = mdd.shapes_sample(config, seed, i)
    x = s.pixels
    if blur:  # a [1, 2, 1] / 4 filter along height and width
      for ax in (-3, -2):
        p = np.concatenate([np.take(x, [0], ax), x, np.take(x, [-1], ax)], ax)
        n_ = x.shape[ax]
        x = (
          np.take(p, range(n_), ax)
          + 2 * np.take(p, range(1, n_ + 1), ax)
          + np.take(p, range(2, n_ + 2), ax)
        ) / 4
    if noise:
      x = np.clip(x + rng.normal(0.0, noise, x.shape), 0.0, 1.0).astype(np.float32)
    pixels.append(x)
    captions.append(s.caption)
  return pixels, captions


def _rates(scores):
  return {f: getattr(scores, f) for f in FIELDS if getattr(scores, f) is not None}


@pytest.mark.parametrize(
  "noise, blur, floor",
  [(0.0, False, 0.99), (0.05, False, 0.95), (0.0, True, 0.95), (0.05, True, 0.95)],
  ids=["clean", "noise", "blur", "blur+noise"],
)
def test_images(noise, blur, floor):
  pixels, captions = [], []
  for split, n in (("train", 200), ("held_out", 100)):
    p, c = _samples(mdd.ShapesConfig(split=split), n, noise=noise, blur=blur)
    pixels += p
    captions += c
  scores = mdd.score(np.stack(pixels), captions)
  assert scores.counts == {
    "colour": 300,
    "shape": 300,
    "position": 300,
    "direction": 0,
    "background": 300,
  }
  assert scores.direction is None
  assert all(r >= floor for r in _rates(scores).values()), _rates(scores)


@pytest.mark.parametrize("noise, floor", [(0.0, 0.99), (0.05, 0.95)], ids=["clean", "noise"])
def test_videos(noise, floor):
  pixels, captions = [], []
  for split, n in (("train", 40), ("held_out", 20)):
    p, c = _samples(mdd.ShapesConfig(frames=9, split=split), n, noise=noise)
    pixels += p
    captions += c
  scores = mdd.score(pixels, captions)
  assert scores.counts["direction"] == 60 and scores.counts["position"] == 0
  assert all(r >= floor for r in _rates(scores).values()), _rates(scores)


def test_other_sizes():
  for config in (mdd.ShapesConfig(size=32), mdd.ShapesConfig(size=128, extent=(0.4, 0.9))):
    scores = mdd.score(*_samples(config, 60, seed=2))
    assert all(r >= 0.98 for r in _rates(scores).values()), (config, _rates(scores))


def test_analysis_record():
  s = mdd.shapes_sample(mdd.ShapesConfig(size=64, frames=5), 0, 3)
  a = mdd.analyse(s.pixels)
  assert (a.colour, a.shape, a.background, a.direction) == (
    s.label.colour,
    s.label.shape,
    s.label.background,
    s.label.direction,
  )
  assert a.track.shape == (5, 2) and np.isfinite(a.track).all()
  image = mdd.shapes_sample(mdd.ShapesConfig(), 0, 0)
  a = mdd.analyse(image.pixels)
  assert a.features.area > 20 and a.track is None and a.direction is None
  # uint8 reads the same as float.
  assert mdd.analyse((image.pixels * 255).round().astype(np.uint8))[:5] == a[:5]


def test_blank_and_still():
  blank = np.zeros((32, 32, 3), np.float32)
  assert mdd.analyse(blank)[:4] == (None, None, "black", None)
  still = np.repeat(mdd.shapes_sample(mdd.ShapesConfig(), 0, 0).pixels[None], 4, 0)
  a = mdd.analyse(still)
  assert a.direction is None and a.shape is not None


@pytest.mark.parametrize(
  "x, error, match",
  [
    (
      np.zeros((32, 32)),
      ValueError,
      r"RGB image \[H, W, 3\] or video \[F, H, W, 3\], got shape \(32, 32\)",
    ),
    (np.zeros((32, 32, 4)), ValueError, r"got shape \(32, 32, 4\)"),
    (np.zeros((32, 32, 3), np.int32), TypeError, "float in \\[0, 1\\] or uint8, got dtype int32"),
    (np.full((32, 32, 3), np.nan, np.float32), ValueError, "non-finite"),
    (np.zeros((8, 8, 3), np.float32), ValueError, "too small to analyse"),
  ],
)
def test_analyse_errors(x, error, match):
  with pytest.raises(error, match=match):
    mdd.analyse(x)


def test_score_errors():
  x = np.zeros((2, 32, 32, 3), np.float32)
  with pytest.raises(ValueError, match="2 samples but 1 captions"):
    mdd.score(x, ["a red circle"])
  with pytest.raises(ValueError, match="unknown word 'hexagon'"):
    mdd.score(x, ["a red circle", "a red hexagon"])
  with pytest.raises(TypeError, match="sequence of str"):
    mdd.score(x[:1], "a red circle")
