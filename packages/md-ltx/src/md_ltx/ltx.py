"""LTX-Video under the names every md model namespace shares.

from md_ltx import ltx
pipe = ltx.load_pipeline("Lightricks/LTX-Video-0.9.5")
"""

from md_ltx._config import VARIANTS
from md_ltx._config import LTXConfig as Config
from md_ltx._load import load_pipeline
from md_ltx._pipeline import LTXVideoPipeline as Pipeline
from md_ltx._recipes import check_ltx_size as check_size
from md_ltx._transformer import LTXTransformer as Transformer
from md_ltx._weights import convert_key, load_transformer

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
