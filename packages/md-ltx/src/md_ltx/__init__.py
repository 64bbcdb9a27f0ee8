"""md-ltx: LTX-Video for md (transformer, weights, pipelines)."""

from md_ltx._config import REMAT_POLICIES, VARIANTS, LTXConfig
from md_ltx._pipeline import LTXCondition, LTXVideoPipeline, guidance_windows, load_pipeline
from md_ltx._transformer import (
  LTXAttention,
  LTXBlock,
  LTXTransformer,
  rope_tables,
  rope_tables_from_coords,
)
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
  "KEEP_F32",
  "ORIGINAL_ALLOW_UNUSED",
  "REMAT_POLICIES",
  "VARIANTS",
  "LTXAttention",
  "LTXBlock",
  "LTXCondition",
  "LTXConfig",
  "LTXTransformer",
  "LTXVideoPipeline",
  "convert_key",
  "convert_original_key",
  "guidance_windows",
  "load_pipeline",
  "load_transformer",
  "original_config",
  "original_to_diffusers",
  "rope_tables",
  "rope_tables_from_coords",
]
