"""md-ltx: LTX-Video for md (transformer, weights)."""

from md_ltx._config import REMAT_POLICIES, VARIANTS, LTXConfig
from md_ltx._transformer import LTXAttention, LTXBlock, LTXTransformer, rope_tables
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
  "LTXConfig",
  "LTXTransformer",
  "convert_key",
  "convert_original_key",
  "load_transformer",
  "original_config",
  "original_to_diffusers",
  "rope_tables",
]
