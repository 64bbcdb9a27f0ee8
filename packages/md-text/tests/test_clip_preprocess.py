"""`clip_image_preprocess` against transformers' CLIP image processor on images of odd sizes, and the CLIP
image tokens (`hidden_states[-2]`) of a tiny vision model on them (tests/fixtures/clip_preprocess)."""

import jax
import jax.numpy as jnp
import numpy as np
import PIL.Image
import pytest

import md_text
from md_core.testing import fixture_path, load_arrays

FIXTURE = "clip_preprocess"
CASES = ("up_wide", "down_tall", "down_wide", "square", "rgba", "noise")
SIZE = 28


@pytest.fixture(scope="module")
def ref():
  return load_arrays(fixture_path(FIXTURE) / "cases.npz")


@pytest.fixture(scope="module")
def encoder():
  return md_text.load_clip_vision(
    fixture_path(FIXTURE), subfolder="image_encoder", with_projection=False, progress=False
  )


def _input(image):
  """The fixture's uint8 image as the reference got it (RGBA as a PIL image with transparency)."""
  return PIL.Image.fromarray(image) if image.shape[-1] == 4 else image


@jax.jit
def _tokens(model, pixels):
  return model(pixels, output_hidden_states=True).hidden_states[-2]


@pytest.mark.parametrize("case", CASES)
def test_pixel_values_and_tokens_match_the_reference(ref, encoder, case):
  pixels = md_text.clip_image_preprocess(_input(ref[f"{case}/image"]), size=SIZE)
  assert isinstance(pixels, np.ndarray) and pixels.dtype == np.float32
  want = np.transpose(ref[f"{case}/pixel_values"], (0, 2, 3, 1))
  assert pixels.shape == want.shape == (1, SIZE, SIZE, 3)
  np.testing.assert_allclose(pixels, want, atol=1e-5, rtol=0)  # measured: identical
  tokens = _tokens(encoder, jnp.asarray(pixels))
  np.testing.assert_allclose(np.asarray(tokens), ref[f"{case}/tokens"], atol=1e-4, rtol=0)


def test_batches_pil_and_float_inputs(ref):
  """A list of images of different sizes, a PIL image, and floats in [0, 1] all give the same values."""
  images = [ref[f"{c}/image"] for c in ("up_wide", "down_tall", "noise")]
  want = np.concatenate([np.transpose(ref[f"{c}/pixel_values"], (0, 2, 3, 1)) for c in
                         ("up_wide", "down_tall", "noise")])  # fmt: skip
  np.testing.assert_allclose(md_text.clip_image_preprocess(images, size=SIZE), want, atol=1e-5)
  pil = [PIL.Image.fromarray(x) for x in images]
  np.testing.assert_allclose(md_text.clip_image_preprocess(pil, size=SIZE), want, atol=1e-5)
  floats = [x.astype(np.float32) / 255.0 for x in images]
  np.testing.assert_allclose(md_text.clip_image_preprocess(floats, size=SIZE), want, atol=1e-5)
  # A stacked uint8 batch [N, H, W, 3], also as a JAX array.
  batch = np.stack([ref["noise/image"]] * 2)
  out = md_text.clip_image_preprocess(jnp.asarray(batch), size=SIZE)
  np.testing.assert_allclose(out, np.concatenate([want[2:]] * 2), atol=1e-5)


def test_crop_larger_than_the_resized_image_is_zero_padded():
  # 28 x 56 after resizing, a 40 x 40 crop: the reference pads zeros around the centre (ceil on top).
  image = np.full((28, 56, 3), 255, np.uint8)
  out = md_text.clip_image_preprocess(image, size=28, crop_size=40, mean=(0, 0, 0), std=(1, 1, 1))
  assert out.shape == (1, 40, 40, 3)
  rows = np.flatnonzero(out[0, :, 20, 0])
  assert (rows[0], rows[-1]) == (6, 33)


def test_bad_inputs():
  pre = md_text.clip_image_preprocess
  with pytest.raises(
    ValueError, match=r"images\[0\] must be a PIL image or .* got shape \(8, 8, 4\)"
  ):
    pre(np.zeros((8, 8, 4), np.uint8))
  with pytest.raises(ValueError, match=r"images must be .* got an array of shape \(8, 8\)"):
    pre(np.zeros((8, 8), np.uint8))
  with pytest.raises(ValueError, match=r"images\[1\] is float with values in \[2, 2\]"):
    pre([np.zeros((8, 8, 3), np.float32), np.full((8, 8, 3), 2.0, np.float32)])
  with pytest.raises(TypeError, match=r"images\[0\] has dtype int32"):
    pre(np.zeros((8, 8, 3), np.int32))
  with pytest.raises(ValueError, match="images is an empty sequence"):
    pre([])
  with pytest.raises(ValueError, match="size=0 must be a positive int"):
    pre(np.zeros((8, 8, 3), np.uint8), size=0)
  with pytest.raises(ValueError, match="resample='cubic' is not one of"):
    pre(np.zeros((8, 8, 3), np.uint8), resample="cubic")
