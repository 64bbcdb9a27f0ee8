"""A plain string is one prompt (it used to be split into characters: a batch of 5 for "a cat")."""

import numpy as np

import md_wan
from md_core import testing


def test_encode_prompt_str_is_one_prompt():
  pipe = md_wan.load_pipeline(testing.fixture_path("wan_pipeline") / "t2v")
  one = np.asarray(pipe.encode_prompt("a cat"))
  listed = np.asarray(pipe.encode_prompt(["a cat"]))
  assert one.shape[0] == 1
  np.testing.assert_array_equal(one, listed)
