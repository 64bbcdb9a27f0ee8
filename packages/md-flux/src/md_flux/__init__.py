"""md-flux: the Flux.1 (dev, schnell) and Flux.2 (Klein) transformers, weight maps and pipelines."""

from md_flux._config import FLUX2_VARIANTS, FLUX_VARIANTS, Flux2Config, FluxConfig
from md_flux._flux1 import BlockKV, FluxTransformer
from md_flux._flux2 import Flux2Transformer
from md_flux._inputs import Flux2Inputs, FluxInputs, flux1_model_inputs, flux2_model_inputs
from md_flux._load import load_pipeline
from md_flux._pipeline import FluxPipeline
from md_flux._pipeline2 import (
  MAX_REFERENCE_IMAGES,
  Flux2KleinPipeline,
  prepare_reference_image,
  text_ids,
)
from md_flux._pipeline_common import check_size, image_ids, pack_latents, unpack_latents
from md_flux._weights1 import (
  bfl_view,
  bfl_virtual_names,
  config_from_bfl,
  convert_key,
  convert_key_bfl,
  load_flux,
  single_file_layout,
)
from md_flux._weights2 import convert_key_flux2, load_flux2

__all__ = [
  "FLUX2_VARIANTS",
  "FLUX_VARIANTS",
  "MAX_REFERENCE_IMAGES",
  "BlockKV",
  "Flux2Config",
  "Flux2Inputs",
  "Flux2KleinPipeline",
  "Flux2Transformer",
  "FluxConfig",
  "FluxInputs",
  "FluxPipeline",
  "FluxTransformer",
  "bfl_view",
  "bfl_virtual_names",
  "check_size",
  "config_from_bfl",
  "convert_key",
  "convert_key_bfl",
  "convert_key_flux2",
  "flux1_model_inputs",
  "flux2_model_inputs",
  "image_ids",
  "load_pipeline",
  "load_flux",
  "load_flux2",
  "pack_latents",
  "prepare_reference_image",
  "single_file_layout",
  "text_ids",
  "unpack_latents",
]
