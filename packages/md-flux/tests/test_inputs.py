"""Flux inputs: a plain string is one prompt in every pipeline (Flux.1's `encode_prompt` split it into
characters: a batch of 5 for "a cat"); Flux.2 reference-image arrays on an unclear scale are refused
(they were clipped)."""

import numpy as np
import pytest

import md_flux
from md_core import testing


def test_flux1_encode_prompt_str_is_one_prompt():
  pipe = md_flux.load_pipeline(testing.fixture_path("flux_pipeline") / "dev")
  one, listed = pipe.encode_prompt("a cat", 8), pipe.encode_prompt(["a cat"], 8)
  for a, b in zip(one, listed, strict=True):
    assert a.shape[0] == 1
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_klein_encode_prompt_str_is_one_prompt():
  pipe = md_flux.load_pipeline(testing.fixture_path("flux2_pipeline") / "klein")
  one = pipe.encode_prompt("a cat", max_sequence_length=40, text_encoder_out_layers=(1, 2, 3))
  listed = pipe.encode_prompt(["a cat"], max_sequence_length=40, text_encoder_out_layers=(1, 2, 3))
  assert one.shape[0] == 1
  np.testing.assert_array_equal(np.asarray(one), np.asarray(listed))


def test_reference_image_arrays_on_an_unclear_scale_are_refused():
  x = np.random.default_rng(0).random((64, 64, 3), np.float32)
  u = np.round(x * 255).astype(np.uint8)
  np.testing.assert_array_equal(  # uint8 and the same pixels as floats agree
    md_flux.prepare_reference_image(u), md_flux.prepare_reference_image(u / np.float32(255))
  )
  cases = [
    (x * 2 - 1, ValueError, r"reference image 0: float pixels must be in \[0, 1\].*\(x \+ 1\) / 2"),
    (x * 255, ValueError, r"reference image 0: .*\[0, 255\]"),
    (u.astype(np.int32), TypeError, r"reference image 0: .*dtype int32"),
    (u > 128, TypeError, "dtype bool"),
  ]
  for value, error, match in cases:
    with pytest.raises(error, match=match):
      md_flux.prepare_reference_image(value, what="reference image 0")
