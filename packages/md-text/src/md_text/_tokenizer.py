"""Tokenizers: loading a checkpoint's `tokenizer/` folder with transformers, fixed-length ids for the encoders."""

from __future__ import annotations

import os
import warnings
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

import md_core


class Tokens(NamedTuple):
  """Token ids of a batch of prompts, padded to one length.

  Attributes:
    ids: `[B, L]` int32 token ids.
    mask: `[B, L]` int32, 1 for real tokens (start, text, end) and 0 for padding.
  """

  ids: np.ndarray
  mask: np.ndarray


def load_tokenizer(
  source: str | os.PathLike, *, subfolder: str | None = "tokenizer", **kwargs: Any
) -> Any:
  """Loads a checkpoint's tokenizer with transformers' `AutoTokenizer` (no download for a local folder).

  Args:
    source: a pipeline folder or hub id (then `subfolder`, e.g. `"tokenizer_2"`), or the tokenizer's own
      folder with `subfolder=None`. Both the `tokenizer.json` layout and the older `vocab.json` +
      `merges.txt` one load.
    subfolder: the component folder.
    **kwargs: passed to `AutoTokenizer.from_pretrained` (e.g. `pad_token="!"`).

  Returns:
    The transformers tokenizer.

  Raises:
    FileNotFoundError: the folder or component is missing, or holds no tokenizer files.
  """
  import transformers

  folder = md_core.resolve_source(source, subfolder=subfolder)
  known = (
    "tokenizer.json",
    "tokenizer_config.json",
    "vocab.json",
    "spiece.model",
    "tokenizer.model",
  )
  if not any((folder / name).is_file() for name in known):
    raise FileNotFoundError(
      f"{folder}: no tokenizer files (looked for {', '.join(known)}); pass the checkpoint's tokenizer folder"
    )
  return transformers.AutoTokenizer.from_pretrained(str(folder), **kwargs)


def tokenize(
  tokenizer: Any, prompts: str | Sequence[str], *, max_length: int | None = None
) -> Tokens:
  """Token ids padded and truncated to `max_length`, warning when a prompt loses tokens.

  Args:
    tokenizer: a transformers tokenizer (`load_tokenizer`).
    prompts: one prompt or a list.
    max_length: the fixed length (default: the tokenizer's `model_max_length`, 77 for CLIP).

  Returns:
    `Tokens` with `[B, max_length]` ids and mask.
  """
  if isinstance(prompts, str):
    prompts = [prompts]
  prompts = list(prompts)
  if max_length is None:
    max_length = int(tokenizer.model_max_length)
    if max_length > 1_000_000:  # transformers' "no limit" sentinel
      raise ValueError(
        f"{type(tokenizer).__name__} sets no model_max_length; pass max_length (77 for CLIP)"
      )
  full = tokenizer(prompts, truncation=False, padding=False).input_ids
  for i, ids in enumerate(full):
    if len(ids) > max_length:
      cut = len(ids) - max_length
      # The end token stays: the cut falls on the text just before it.
      removed = tokenizer.decode(ids[max_length - 1 : -1], skip_special_tokens=True)
      warnings.warn(
        f"prompt {i} is {len(ids)} tokens long; {cut} token(s) were cut to fit max_length={max_length}: "
        f"{removed!r}",
        stacklevel=2,
      )
  out = tokenizer(
    prompts, padding="max_length", truncation=True, max_length=max_length, return_tensors="np"
  )
  return Tokens(np.asarray(out.input_ids, np.int32), np.asarray(out.attention_mask, np.int32))
