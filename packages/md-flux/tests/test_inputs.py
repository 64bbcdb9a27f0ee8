"""A plain string is one prompt in every Flux pipeline (Flux.1's `encode_prompt` split it into
characters: a batch of 5 for "a cat")."""

import numpy as np

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
