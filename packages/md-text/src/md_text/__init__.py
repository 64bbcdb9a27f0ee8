"""md-text: text and image encoders for md (CLIP, OpenCLIP, T5/UMT5, Qwen3, Gemma) and tokenizer loading."""

# T5 / UMT5 encoders (Flux, LTX: T5-XXL; Wan: UMT5-XXL).
from md_text._t5 import (
  T5_ALLOW_UNUSED,
  T5_VARIANTS,
  T5Config,
  T5Encoder,
  convert_t5_key,
  load_t5_encoder,
  make_t5_keymap,
  relative_position_buckets,
)

__all__ = [
  # T5 / UMT5
  "T5_ALLOW_UNUSED",
  "T5_VARIANTS",
  "T5Config",
  "T5Encoder",
  "convert_t5_key",
  "load_t5_encoder",
  "make_t5_keymap",
  "relative_position_buckets",
]
