"""md_core.images: pipeline image inputs read on diffusers' scale, and refused when the scale is unclear."""

import jax.numpy as jnp
import numpy as np
import pytest
from PIL import Image

from md_core import images, media


@pytest.fixture
def pixels():
  return np.random.default_rng(0).integers(0, 256, (2, 8, 12, 3), dtype=np.uint8)


def test_pil_uint8_and_float_agree(pixels):
  """PIL and uint8 are scaled by 1/255 (diffusers' `pil_to_numpy`), floats are taken as they are."""
  want = pixels.astype(np.float32) / 255.0
  got = {
    "uint8": images.image_batch(pixels),
    "float": images.image_batch(want),
    "bf16 jax": images.image_batch(jnp.asarray(want[:1], jnp.bfloat16)),
    "PIL list": images.image_batch([Image.fromarray(p) for p in pixels]),
    "PIL": images.image_batch(Image.fromarray(pixels[0])),
    "one array": images.image_batch(pixels[0]),
  }
  for name, x in got.items():
    assert x.dtype == np.float32 and x.ndim == 4 and x.shape[1:] == (8, 12, 3), name
  np.testing.assert_array_equal(got["uint8"], want)
  np.testing.assert_array_equal(got["float"], want)
  np.testing.assert_array_equal(got["PIL list"], want)
  np.testing.assert_array_equal(got["PIL"], want[:1])
  np.testing.assert_array_equal(got["one array"], want[:1])
  assert np.abs(got["bf16 jax"] - want[:1]).max() < 4e-3


def test_pil_modes_and_files(pixels, tmp_path):
  rgba = Image.fromarray(np.concatenate([pixels[0], pixels[0][..., :1]], -1), "RGBA")
  np.testing.assert_array_equal(images.image_batch(rgba), pixels[:1] / np.float32(255))
  path = media.save_image(tmp_path / "a.png", pixels[0])
  np.testing.assert_array_equal(images.image_batch(path), pixels[:1] / np.float32(255))
  assert images.image_batch([path, path]).shape == (2, 8, 12, 3)


def test_tolerance_and_errors(pixels):
  x = pixels[0] / np.float32(255)
  assert images.image_batch(x + 5e-4).max() > 1.0  # within the tolerance: kept as given
  cases = [
    (x * 2 - 1, ValueError, r"control_image: float pixels must be in \[0, 1\].*\(x \+ 1\) / 2"),
    (x * 255, ValueError, r"\[0, 255\]\? pass them as uint8"),
    (pixels[0].astype(np.int64), TypeError, r"control_image: .*dtype int64.*astype\(np.uint8\)"),
    (pixels[0] > 128, TypeError, "dtype bool"),
    (x.astype(np.complex64), TypeError, "dtype complex64"),
    (np.where(x > 0.5, np.nan, x), ValueError, "are NaN"),
    (x[..., :1], ValueError, r"shape \(1, 8, 12, 1\); grey or RGBA"),
    (x[..., 0], ValueError, r"shape \(8, 12\)"),
    (np.transpose(x[None], (0, 3, 1, 2)), ValueError, "channels-first"),
    (x[None, None], ValueError, r"shape \(1, 1, 8, 12, 3\)"),
    ({"image": x}, TypeError, "got dict"),
    (3.0, TypeError, "got float"),
    ([], ValueError, "an empty list"),
    ([x, x[:4]], ValueError, r"one size, got \(H, W\) \[\(4, 12\), \(8, 12\)\]"),
    ([x, "missing.png"], FileNotFoundError, r"control_image\[1\]: missing.png"),
  ]
  for value, error, match in cases:
    with pytest.raises(error, match=match):
      images.image_batch(value, what="control_image")


def test_pixel_values_keeps_shape():
  grey = np.full((4, 5), 51, np.uint8)
  np.testing.assert_array_equal(images.pixel_values(grey), np.full((4, 5), 0.2, np.float32))
  with pytest.raises(ValueError, match=r"image: float pixels must be in \[0, 1\]"):
    images.pixel_values(np.full((4, 5), 1.5))
