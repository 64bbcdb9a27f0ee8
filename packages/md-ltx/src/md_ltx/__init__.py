"""md-ltx: LTX-Video and LTX-2 for md (transformers, latent upsamplers, weights, pipelines)."""

from md_core import REMAT_POLICIES
from md_ltx._conditioning import LTXCondition
from md_ltx._config import VARIANTS, LTXConfig
from md_ltx._guidance import guidance_windows
from md_ltx._load import load_pipeline

# LTX-2 (audio + video) transformer.
from md_ltx._ltx2_config import LTX2_VARIANTS, LTX2Config
from md_ltx._ltx2_load import load_ltx2_pipeline, save_ltx2_video
from md_ltx._ltx2_pipeline import (
  LTX2_IMAGE_CRF,
  LTX2_PIPELINE_CLASSES,
  LTX2Output,
  LTX2VideoPipeline,
)
from md_ltx._ltx2_transformer import (
  LTX2Attention,
  LTX2Block,
  LTX2Rope,
  LTX2Transformer,
  ltx2_audio_coords,
  ltx2_rope_tables,
  ltx2_video_coords,
)
from md_ltx._ltx2_weights import (
  LTX2_KEEP_F32,
  LTX2_ORIGINAL_ALLOW_UNUSED,
  load_ltx2_transformer,
  ltx2_convert_key,
  ltx2_convert_original_key,
  ltx2_original_config,
  ltx2_original_to_diffusers,
)
from md_ltx._pipeline import MODES, LTXVideoPipeline
from md_ltx._recipes import (
  MultiscaleOutput,
  check_ltx2_size,
  check_ltx_size,
  generate_multiscale,
  ltx2_size_rules,
  ltx_size_rules,
)
from md_ltx._transformer import (
  LTXAttention,
  LTXBlock,
  LTXTransformer,
  rope_tables,
  rope_tables_from_coords,
)

# Latent upsamplers (LTX-Video 0.9.7/0.9.8 spatial upscalers, LTX-2) and the multi-scale upsample step.
from md_ltx._upsampler import VARIANTS as UPSAMPLER_VARIANTS
from md_ltx._upsampler import (
  LatentUpsampler,
  LatentUpsamplerConfig,
  adain_filter_latent,
  denormalize_latents,
  normalize_latents,
  tone_map_latents,
  unpack_latents,
  upsample_latents,
  upsample_latents_ltx2,
)
from md_ltx._upsampler_weights import config_from_checkpoint as upsampler_config_from_checkpoint
from md_ltx._upsampler_weights import load_latent_upsampler, upsampler_keymap
from md_ltx._video_tokens import pack_tokens, unpack_tokens
from md_ltx._weights import (
  KEEP_F32,
  ORIGINAL_ALLOW_UNUSED,
  convert_key,
  convert_original_key,
  load_transformer,
  original_config,
  original_to_diffusers,
)

__all__ = [
  "MultiscaleOutput",
  "check_ltx2_size",
  "check_ltx_size",
  "ltx_size_rules",
  "generate_multiscale",
  "ltx2_size_rules",
  "LTX2_IMAGE_CRF",
  "LTX2_PIPELINE_CLASSES",
  "LTX2Output",
  "LTX2VideoPipeline",
  "load_ltx2_pipeline",
  "save_ltx2_video",
  "KEEP_F32",
  "LTX2_KEEP_F32",
  "LTX2_ORIGINAL_ALLOW_UNUSED",
  "LTX2_VARIANTS",
  "MODES",
  "ORIGINAL_ALLOW_UNUSED",
  "REMAT_POLICIES",
  "UPSAMPLER_VARIANTS",
  "VARIANTS",
  "LTX2Attention",
  "LTX2Block",
  "LTX2Config",
  "LTX2Rope",
  "LTX2Transformer",
  "LTXAttention",
  "LTXBlock",
  "LTXCondition",
  "LTXConfig",
  "LTXTransformer",
  "LTXVideoPipeline",
  "LatentUpsampler",
  "LatentUpsamplerConfig",
  "adain_filter_latent",
  "convert_key",
  "convert_original_key",
  "denormalize_latents",
  "guidance_windows",
  "load_latent_upsampler",
  "load_ltx2_transformer",
  "load_pipeline",
  "load_transformer",
  "pack_tokens",
  "unpack_tokens",
  "ltx2_audio_coords",
  "ltx2_convert_key",
  "ltx2_convert_original_key",
  "ltx2_original_config",
  "ltx2_original_to_diffusers",
  "ltx2_rope_tables",
  "ltx2_video_coords",
  "normalize_latents",
  "original_config",
  "original_to_diffusers",
  "rope_tables",
  "rope_tables_from_coords",
  "tone_map_latents",
  "unpack_latents",
  "upsample_latents",
  "upsample_latents_ltx2",
  "upsampler_config_from_checkpoint",
  "upsampler_keymap",
]
