"""md-lora: LoRA files read into canonical adapters keyed by md parameter paths; merge, unmerge, extract, save.

A LoRA on a reference module `M` is a delta on its weight `M.weight`; the family's key map
(`convert_key(name) -> md_core.Target`) says which md parameter that weight is, in which layout, which
part of a fused tensor and which layer of a stack, so one reader serves every family.
"""

from md_lora._adapter import Adapter, GLoRAWeight, IA3Weight, LoRAWeight, OFTWeight, Site
from md_lora._extract import Extraction, extract_lora, save_peft
from md_lora._formats import FORMATS, LoRAFileError, detect_format, kohya_module_name
from md_lora._load import load_lora, lora_factors, lora_report
from md_lora._merge import merge, unmerge
from md_lora._runtime import DEFAULT_MAX_RANK, apply_runtime, to_slots
from md_lora.pipeline import LoRAPipeline

__all__ = [
  "DEFAULT_MAX_RANK",
  "FORMATS",
  "Adapter",
  "Extraction",
  "LoRAFileError",
  "LoRAPipeline",
  "LoRAWeight",
  "GLoRAWeight",
  "IA3Weight",
  "OFTWeight",
  "Site",
  "apply_runtime",
  "detect_format",
  "extract_lora",
  "kohya_module_name",
  "load_lora",
  "lora_factors",
  "lora_report",
  "merge",
  "save_peft",
  "to_slots",
  "unmerge",
]
