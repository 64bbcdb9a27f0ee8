"""md-flux: the Flux.1 (dev, schnell) and Flux.2 (Klein) transformers, their configs and weight maps."""

from md_flux._config import FLUX2_VARIANTS, FLUX_VARIANTS, Flux2Config, FluxConfig
from md_flux._flux1 import BlockKV, FluxTransformer
from md_flux._weights1 import (
  bfl_view,
  bfl_virtual_names,
  config_from_bfl,
  convert_key,
  convert_key_bfl,
  load_flux,
  single_file_layout,
)

__all__ = [
  "FLUX2_VARIANTS",
  "FLUX_VARIANTS",
  "BlockKV",
  "Flux2Config",
  "FluxConfig",
  "FluxTransformer",
  "bfl_view",
  "bfl_virtual_names",
  "config_from_bfl",
  "convert_key",
  "convert_key_bfl",
  "load_flux",
  "single_file_layout",
]
