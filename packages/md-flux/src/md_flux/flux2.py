"""Flux.2 (Klein) under the names every md model namespace shares.

from md_flux import flux2
pipe = flux2.load_pipeline("black-forest-labs/FLUX.2-klein-4B")
"""

from md_flux._config import FLUX2_VARIANTS as VARIANTS
from md_flux._config import Flux2Config as Config
from md_flux._flux2 import Flux2Transformer as Transformer
from md_flux._inputs import flux2_model_inputs as model_inputs
from md_flux._pipeline2 import Flux2KleinPipeline as Pipeline
from md_flux._pipeline2 import load_klein as load_pipeline
from md_flux._pipeline_common import check_size
from md_flux._weights2 import convert_key_flux2 as convert_key
from md_flux._weights2 import load_flux2 as load_transformer

__all__ = [
  "VARIANTS",
  "Config",
  "Pipeline",
  "Transformer",
  "check_size",
  "convert_key",
  "load_pipeline",
  "load_transformer",
  "model_inputs",
]
