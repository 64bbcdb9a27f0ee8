"""md-text: text and image encoders for md (CLIP, OpenCLIP, T5/UMT5, Qwen3, Gemma 3 with LTX-2's connectors) and
tokenizer loading."""

# CLIP text / vision encoders (SD 1.x/2.x, SDXL, Flux; Wan 2.1 I2V image encoder) and tokenizers.
from md_text._clip import (
  CLIP_TEXT_VARIANTS,
  CLIP_VISION_VARIANTS,
  CLIPTextConfig,
  CLIPTextModel,
  CLIPTextModelWithProjection,
  CLIPTextOutput,
  CLIPVisionConfig,
  CLIPVisionModel,
  CLIPVisionModelWithProjection,
  CLIPVisionOutput,
  nchw_to_nhwc,
)
from md_text._clip_image import CLIP_IMAGE_MEAN, CLIP_IMAGE_STD, clip_image_preprocess
from md_text._clip_weights import (
  clip_text_convert_key,
  clip_vision_convert_key,
  load_clip_text,
  load_clip_vision,
)

# Gemma 3 text encoder (LTX-2: google/gemma-3-12b-it).
from md_text._gemma3 import (
  GEMMA3_ALLOW_UNUSED,
  GEMMA3_VARIANTS,
  LTX2_MAX_LENGTH,
  Gemma3Config,
  Gemma3Encoder,
  Gemma3Output,
  convert_gemma3_key,
  gemma3_rope_tables,
  gemma3_tokenize,
  load_gemma3_encoder,
)

# LTX-2 feature extractor and video / audio text connectors.
from md_text._ltx2_text import (
  LTX2_CONNECTORS_VARIANTS,
  LTX2Connector,
  LTX2ConnectorsConfig,
  LTX2TextConnectors,
  LTX2TextEmbeds,
  connector_rope_tables,
  encode_ltx2_prompt,
  ltx2_masked_mean_range_norm,
  ltx2_pack_hidden_states,
  ltx2_prompt_embeds,
  ltx2_token_rms_norm,
)
from md_text._ltx2_text_weights import (
  LTX2_CONNECTORS_ORIGINAL_ALLOW_UNUSED,
  convert_ltx2_connectors_key,
  convert_ltx2_connectors_original_key,
  load_ltx2_connectors,
  load_ltx2_connectors_original,
  ltx2_connectors_original_to_diffusers,
)

# Qwen3 text encoder (FLUX.2 [klein]: Qwen3-4B, Qwen3-8B).
from md_text._qwen3 import (
  FLUX2_KLEIN_LAYERS,
  FLUX2_KLEIN_MAX_LENGTH,
  QWEN3_ALLOW_UNUSED,
  QWEN3_PROMPT_FORMAT,
  QWEN3_VARIANTS,
  Qwen3Config,
  Qwen3Encoder,
  Qwen3Output,
  convert_qwen3_key,
  encode_flux2_prompt,
  flux2_prompt_embeds,
  load_qwen3_encoder,
  qwen3_tokenize,
)

# T5 / UMT5 encoders (Flux, LTX: T5-XXL; Wan: UMT5-XXL).
from md_text._t5 import (
  T5_ALLOW_UNUSED,
  T5_VARIANTS,
  T5Config,
  T5Encoder,
  T5EncoderOutput,
  convert_t5_key,
  load_t5_encoder,
  make_t5_keymap,
  relative_position_buckets,
)
from md_text._tokenizer import Tokens, load_tokenizer, tokenize

__all__ = [
  # CLIP and tokenizers
  "CLIP_IMAGE_MEAN",
  "CLIP_IMAGE_STD",
  "CLIP_TEXT_VARIANTS",
  "CLIP_VISION_VARIANTS",
  "CLIPTextConfig",
  "CLIPTextModel",
  "CLIPTextModelWithProjection",
  "CLIPTextOutput",
  "CLIPVisionConfig",
  "CLIPVisionModel",
  "CLIPVisionModelWithProjection",
  "CLIPVisionOutput",
  "Tokens",
  "clip_image_preprocess",
  "clip_text_convert_key",
  "clip_vision_convert_key",
  "load_clip_text",
  "load_clip_vision",
  "load_tokenizer",
  "nchw_to_nhwc",
  "tokenize",
  # T5 / UMT5
  "T5_ALLOW_UNUSED",
  "T5_VARIANTS",
  "T5Config",
  "T5Encoder",
  "T5EncoderOutput",
  "convert_t5_key",
  "load_t5_encoder",
  "make_t5_keymap",
  "relative_position_buckets",
  # Qwen3
  "FLUX2_KLEIN_LAYERS",
  "FLUX2_KLEIN_MAX_LENGTH",
  "QWEN3_ALLOW_UNUSED",
  "QWEN3_PROMPT_FORMAT",
  "QWEN3_VARIANTS",
  "Qwen3Config",
  "Qwen3Encoder",
  "Qwen3Output",
  "convert_qwen3_key",
  "encode_flux2_prompt",
  "flux2_prompt_embeds",
  "load_qwen3_encoder",
  "qwen3_tokenize",
  # Gemma 3 and LTX-2's text connectors
  "GEMMA3_ALLOW_UNUSED",
  "GEMMA3_VARIANTS",
  "LTX2_CONNECTORS_ORIGINAL_ALLOW_UNUSED",
  "LTX2_CONNECTORS_VARIANTS",
  "LTX2_MAX_LENGTH",
  "Gemma3Config",
  "Gemma3Encoder",
  "Gemma3Output",
  "LTX2Connector",
  "LTX2ConnectorsConfig",
  "LTX2TextConnectors",
  "LTX2TextEmbeds",
  "connector_rope_tables",
  "convert_gemma3_key",
  "convert_ltx2_connectors_key",
  "convert_ltx2_connectors_original_key",
  "encode_ltx2_prompt",
  "gemma3_rope_tables",
  "gemma3_tokenize",
  "load_gemma3_encoder",
  "load_ltx2_connectors",
  "load_ltx2_connectors_original",
  "ltx2_connectors_original_to_diffusers",
  "ltx2_masked_mean_range_norm",
  "ltx2_pack_hidden_states",
  "ltx2_prompt_embeds",
  "ltx2_token_rms_norm",
]
