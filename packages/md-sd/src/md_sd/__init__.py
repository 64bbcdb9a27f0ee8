"""md-sd: Stable Diffusion 1.x / 2.x / XL for md: the UNet, ControlNets, weight maps, loaders and pipelines."""

from md_sd._config import CONTROLNET_VARIANTS, VARIANTS, ControlNetConfig, UNetConfig
from md_sd._config import UNetConfig as Config
from md_sd._controlnet import (
  ControlNetConditioningEmbedding,
  ControlNetModel,
  MultiControlNetModel,
)
from md_sd._load import load_pipeline, load_unet_file
from md_sd._pipeline import StableDiffusionPipeline, check_size, rescale_noise_cfg
from md_sd._pipeline import StableDiffusionPipeline as Pipeline
from md_sd._refine import generate_with_refiner
from md_sd._unet import UNet2DConditionModel
from md_sd._weights import (
  convert_controlnet_key,
  convert_unet_key,
  load_controlnet,
  load_unet,
  unet_key_map,
)
from md_sd._weights import convert_unet_key as convert_key

__all__ = [
  "Config",
  "Pipeline",
  "convert_key",
  "CONTROLNET_VARIANTS",
  "ControlNetConditioningEmbedding",
  "ControlNetConfig",
  "ControlNetModel",
  "MultiControlNetModel",
  "StableDiffusionPipeline",
  "UNet2DConditionModel",
  "UNetConfig",
  "VARIANTS",
  "check_size",
  "convert_controlnet_key",
  "convert_unet_key",
  "generate_with_refiner",
  "load_controlnet",
  "load_pipeline",
  "load_unet",
  "load_unet_file",
  "rescale_noise_cfg",
  "unet_key_map",
]
