"""md-core: the pieces every md package shares.

Weights (safetensors reading, checkpoint sources, key maps, loading onto a mesh, Orbax save/restore), the
neural-network blocks the families share (`md_core.nn`), media I/O (`md_core.media`), pipeline image
inputs (`md_core.images`) and progress bars (`md_core.progress`).
"""

from md_core import apps, images, media, nn, pipeline, progress, quant
from md_core._abstract import param_key, shapes_only
from md_core._executables import ExecutableStore
from md_core._executables import default_store as executable_store
from md_core._executables import set_default_store as set_executable_store
from md_core._keymap import (
  LAYOUTS,
  KeyMap,
  Target,
  convert,
  path_str,
  rule_keymap,
  target_shape,
  torch_module_keymap,
)
from md_core._layers import stack_layers
from md_core._loading import LoadReport, WeightLoadError, coverage, load_weights, logical_axes
from md_core._lora import (
  LoRASlot,
  LoRAWeight,
  add_lora_slots,
  clear_lora,
  dense_layers,
  lora_gains,
  lora_layers,
  lora_paths,
  lora_rank,
  set_lora,
)
from md_core._numerics import torch_linspace_f32
from md_core._orbax import restore_converted, save_converted
from md_core._safetensors import (
  Checkpoint,
  SafetensorsError,
  SafetensorsFile,
  open_checkpoint,
  save_safetensors,
)
from md_core._scan import (
  REMAT_POLICIES,
  BlockHook,
  LayerViews,
  block_hook,
  deep_branch,
  layer_views,
  num_layers_of,
  remat,
  scan_layers,
)
from md_core._sources import (
  hub_cache_dir,
  hub_offline,
  load_config,
  read_json,
  resolve_source,
  shared_component,
)
from md_core.quant import QuantScale, quantize

__all__ = [
  "ExecutableStore",
  "set_executable_store",
  "executable_store",
  "LoRASlot",
  "LoRAWeight",
  "add_lora_slots",
  "clear_lora",
  "dense_layers",
  "lora_layers",
  "lora_gains",
  "lora_paths",
  "lora_rank",
  "set_lora",
  "QuantScale",
  "quant",
  "quantize",
  "apps",
  "BlockHook",
  "LayerViews",
  "block_hook",
  "deep_branch",
  "layer_views",
  "num_layers_of",
  "scan_layers",
  "LAYOUTS",
  "REMAT_POLICIES",
  "Checkpoint",
  "KeyMap",
  "LoadReport",
  "SafetensorsError",
  "SafetensorsFile",
  "Target",
  "WeightLoadError",
  "convert",
  "coverage",
  "hub_cache_dir",
  "hub_offline",
  "images",
  "load_config",
  "shared_component",
  "load_weights",
  "logical_axes",
  "media",
  "nn",
  "open_checkpoint",
  "param_key",
  "path_str",
  "pipeline",
  "progress",
  "read_json",
  "remat",
  "resolve_source",
  "restore_converted",
  "rule_keymap",
  "save_converted",
  "save_safetensors",
  "shapes_only",
  "stack_layers",
  "torch_linspace_f32",
  "target_shape",
  "torch_module_keymap",
]
