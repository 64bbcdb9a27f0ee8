"""md-wan: Wan 2.1 / 2.2 video diffusion for md (transformer; pipelines follow)."""

from md_wan._config import REMAT_POLICIES, VARIANTS, WanConfig
from md_wan._transformer import WanAttention, WanBlock, WanTransformer, rope_tables
from md_wan._weights import ALLOW_UNUSED, KEEP_F32, convert_key, load_transformer

__all__ = [
  "ALLOW_UNUSED",
  "KEEP_F32",
  "REMAT_POLICIES",
  "VARIANTS",
  "WanAttention",
  "WanBlock",
  "WanConfig",
  "WanTransformer",
  "convert_key",
  "load_transformer",
  "rope_tables",
]
