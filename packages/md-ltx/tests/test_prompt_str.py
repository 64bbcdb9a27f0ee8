"""A plain string is one prompt (LTX-Video's `encode_prompt` split it into characters: a batch of 5
for "a cat"); LTX-2's `prompt_embeds` too."""

import numpy as np

import md_ltx
from md_core import testing


def test_ltx_video_encode_prompt_str_is_one_prompt():
  pipe = md_ltx.load_pipeline(testing.fixture_path("ltx_pipeline") / "t2v")
  (one, one_mask), (listed, listed_mask) = (
    pipe.encode_prompt("a cat"),
    pipe.encode_prompt(["a cat"]),
  )
  assert one.shape[0] == 1 and one_mask.shape[0] == 1
  np.testing.assert_array_equal(np.asarray(one), np.asarray(listed))
  np.testing.assert_array_equal(np.asarray(one_mask), np.asarray(listed_mask))


def test_ltx2_prompt_embeds_str_is_one_prompt():
  pipe = md_ltx.load_pipeline(testing.fixture_path("ltx2_pipeline") / "pipe")
  one, listed = pipe.prompt_embeds("a cat", 16), pipe.prompt_embeds(["a cat"], 16)
  for a, b in zip(one, listed, strict=True):
    assert np.shape(a)[0] == 1
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
