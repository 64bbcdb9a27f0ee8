"""LTX-2 (video with audio) under the names every md model namespace shares.

from md_ltx import ltx2
pipe = ltx2.load_pipeline("Lightricks/LTX-2")
"""

from md_ltx._ltx2_config import LTX2_VARIANTS as VARIANTS
from md_ltx._ltx2_config import LTX2Config as Config
from md_ltx._ltx2_load import load_ltx2_pipeline as load_pipeline
from md_ltx._ltx2_pipeline import LTX2VideoPipeline as Pipeline
from md_ltx._ltx2_transformer import LTX2Transformer as Transformer
from md_ltx._ltx2_weights import load_ltx2_transformer as load_transformer
from md_ltx._ltx2_weights import ltx2_convert_key as convert_key
from md_ltx._recipes import check_ltx2_size as check_size

__all__ = [
  "VARIANTS",
  "Config",
  "Pipeline",
  "Transformer",
  "check_size",
  "convert_key",
  "load_pipeline",
  "load_transformer",
]
