"""md-wan: Wan 2.1 / 2.2 video diffusion for md (transformer, weights, pipelines)."""

from md_core import REMAT_POLICIES
from md_wan._config import VARIANTS, WanConfig
from md_wan._config import WanConfig as Config
from md_wan._inputs import WanInputs, blend_first_frame, first_frame_mask, model_inputs
from md_wan._pipeline import (
  DEFAULT_NEGATIVE_PROMPT,
  WanVideoPipeline,
  clean_prompt,
  load_pipeline,
)
from md_wan._pipeline import WanVideoPipeline as Pipeline
from md_wan._sizes import check_wan_size
from md_wan._transformer import WanAttention, WanBlock, WanTransformer, rope_tables
from md_wan._transformer import WanTransformer as Transformer
from md_wan._weights import ALLOW_UNUSED, KEEP_F32, convert_key, load_transformer

__all__ = [
  "Config",
  "Pipeline",
  "Transformer",
  "ALLOW_UNUSED",
  "DEFAULT_NEGATIVE_PROMPT",
  "KEEP_F32",
  "REMAT_POLICIES",
  "VARIANTS",
  "WanAttention",
  "WanBlock",
  "WanConfig",
  "WanInputs",
  "WanTransformer",
  "WanVideoPipeline",
  "blend_first_frame",
  "check_wan_size",
  "clean_prompt",
  "convert_key",
  "first_frame_mask",
  "load_pipeline",
  "load_transformer",
  "model_inputs",
  "rope_tables",
]
