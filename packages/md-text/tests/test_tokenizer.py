"""Tokenizer loading and fixed-length ids against transformers' own ids (tests/fixtures/clip/tokens.npz)."""

import shutil

import numpy as np
import pytest

import md_text
from md_core.testing import fixture_path, load_arrays

PROMPTS = ["a photo of a cat", "An astronaut riding a horse on the moon, highly detailed", ""]


@pytest.fixture(scope="module")
def ref():
  return load_arrays(fixture_path("clip") / "tokens.npz")


def test_ids_match_reference_and_truncation_warns(ref):
  tok = md_text.load_tokenizer(fixture_path("clip"))
  with pytest.warns(
    UserWarning, match=r"prompt 1 is 26 tokens long; 10 token\(s\) were cut"
  ) as rec:
    tokens = md_text.tokenize(tok, PROMPTS)
  assert len(rec) == 1  # only the long prompt
  assert tokens.ids.dtype == np.int32 and tokens.ids.shape == (3, 16)
  np.testing.assert_array_equal(tokens.ids, ref["ids"])
  # The mask covers start, text and end tokens; padding is 0.
  np.testing.assert_array_equal(tokens.mask.sum(-1), np.minimum(ref["full_lengths"], 16))


def test_single_prompt_and_explicit_length(ref):
  tok = md_text.load_tokenizer(fixture_path("clip") / "tokenizer", subfolder=None)
  tokens = md_text.tokenize(tok, "a photo of a cat", max_length=10)
  np.testing.assert_array_equal(tokens.ids, ref["ids"][:1, :10])


def test_pad_token_override(ref):
  # SDXL's tokenizer_2 pads with "!" (id 0).
  tok = md_text.load_tokenizer(fixture_path("clip"), pad_token="!")
  tokens = md_text.tokenize(tok, PROMPTS[:1])
  np.testing.assert_array_equal(tokens.ids, ref["ids_bang"][:1])


def test_vocab_merges_layout_loads(tmp_path, ref):
  # Older hub folders: vocab.json + merges.txt + tokenizer_config.json, no tokenizer.json.
  dst = tmp_path / "tokenizer"
  shutil.copytree(fixture_path("clip") / "tokenizer", dst)
  (dst / "tokenizer.json").unlink()
  tok = md_text.load_tokenizer(dst, subfolder=None)
  np.testing.assert_array_equal(md_text.tokenize(tok, PROMPTS[:1]).ids, ref["ids"][:1])


def test_errors(tmp_path):
  with pytest.raises(FileNotFoundError, match="checkpoint has no component 'tokenizer_2'"):
    md_text.load_tokenizer(fixture_path("clip"), subfolder="tokenizer_2")
  (tmp_path / "empty").mkdir()
  with pytest.raises(FileNotFoundError, match="no tokenizer files"):
    md_text.load_tokenizer(tmp_path / "empty", subfolder=None)
