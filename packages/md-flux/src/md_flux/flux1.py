"""Flux.1 (dev, schnell) under the names every md model namespace shares.

from md_flux import flux1
pipe = flux1.load_pipeline("black-forest-labs/FLUX.1-schnell")
"""

from md_flux._config import FLUX_VARIANTS as VARIANTS
from md_flux._config import FluxConfig as Config
from md_flux._flux1 import FluxTransformer as Transformer
from md_flux._inputs import flux1_model_inputs as model_inputs
from md_flux._pipeline import FluxPipeline as Pipeline
from md_flux._pipeline import load_flux1 as load_pipeline
from md_flux._pipeline_common import check_size
from md_flux._weights1 import convert_key
from md_flux._weights1 import load_flux as load_transformer

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
