"""md-wan: Wan 2.1 / 2.2 video diffusion for md (transformer, weights, pipelines)."""

from md_core import REMAT_POLICIES
from md_wan._config import VARIANTS, WanConfig
from md_wan._pipeline import (
  DEFAULT_NEGATIVE_PROMPT,
  WanVideoPipeline,
  clean_prompt,
  load_pipeline,
)
from md_wan._transformer import WanAttention, WanBlock, WanTransformer, rope_tables
from md_wan._weights import ALLOW_UNUSED, KEEP_F32, convert_key, load_transformer

__all__ = [
  "ALLOW_UNUSED",
  "DEFAULT_NEGATIVE_PROMPT",
  "KEEP_F32",
  "REMAT_POLICIES",
  "VARIANTS",
  "WanAttention",
  "WanBlock",
  "WanConfig",
  "WanTransformer",
  "WanVideoPipeline",
  "clean_prompt",
  "convert_key",
  "load_pipeline",
  "load_transformer",
  "rope_tables",
]
