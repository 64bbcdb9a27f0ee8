"""md-core: the pieces every md package shares.

Weights (safetensors reading, checkpoint sources, key maps, loading onto a mesh, Orbax save/restore), the
neural-network blocks the families share (`md_core.nn`), media I/O (`md_core.media`), pipeline image
inputs (`md_core.images`) and progress bars (`md_core.progress`).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the same names for static readers (type checkers, the API docs)
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
    LoRASlotWeight,
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
    LayerViews,
    deep_branch,
    layer_views,
    num_layers_of,
    remat,
    scan_layers,
  )
  from md_core._sources import (
    ConfigError,
    check_config_types,
    hub_cache_dir,
    hub_offline,
    load_config,
    read_json,
    resolve_source,
    shared_component,
  )
  from md_core.hooks import BlockHook, block_hook
  from md_core.quant import QuantScale, quantize

# Names load on first use (PEP 562): `import md_core` costs nothing, and a package that uses only the
# light modules (`md_core.progress`, `md_core.hooks`, `md_core.resolve_source`: md-schedulers) needs none
# of md-core's model dependencies (the `md-core[models]` extra: flax, orbax, huggingface_hub, media I/O,
# absl, ml-collections).
_MODULES = ("apps", "images", "media", "nn", "pipeline", "progress", "quant")
_NAMES: dict[str, tuple[str, str]] = {
  "shared_component": ("md_core._sources", "shared_component"),
  "torch_linspace_f32": ("md_core._numerics", "torch_linspace_f32"),
  "param_key": ("md_core._abstract", "param_key"),
  "shapes_only": ("md_core._abstract", "shapes_only"),
  "ExecutableStore": ("md_core._executables", "ExecutableStore"),
  "executable_store": ("md_core._executables", "default_store"),
  "set_executable_store": ("md_core._executables", "set_default_store"),
  "LAYOUTS": ("md_core._keymap", "LAYOUTS"),
  "KeyMap": ("md_core._keymap", "KeyMap"),
  "Target": ("md_core._keymap", "Target"),
  "convert": ("md_core._keymap", "convert"),
  "path_str": ("md_core._keymap", "path_str"),
  "rule_keymap": ("md_core._keymap", "rule_keymap"),
  "target_shape": ("md_core._keymap", "target_shape"),
  "torch_module_keymap": ("md_core._keymap", "torch_module_keymap"),
  "stack_layers": ("md_core._layers", "stack_layers"),
  "LoadReport": ("md_core._loading", "LoadReport"),
  "WeightLoadError": ("md_core._loading", "WeightLoadError"),
  "coverage": ("md_core._loading", "coverage"),
  "load_weights": ("md_core._loading", "load_weights"),
  "logical_axes": ("md_core._loading", "logical_axes"),
  "LoRASlot": ("md_core._lora", "LoRASlot"),
  "LoRASlotWeight": ("md_core._lora", "LoRASlotWeight"),
  "add_lora_slots": ("md_core._lora", "add_lora_slots"),
  "clear_lora": ("md_core._lora", "clear_lora"),
  "dense_layers": ("md_core._lora", "dense_layers"),
  "lora_gains": ("md_core._lora", "lora_gains"),
  "lora_layers": ("md_core._lora", "lora_layers"),
  "lora_paths": ("md_core._lora", "lora_paths"),
  "lora_rank": ("md_core._lora", "lora_rank"),
  "set_lora": ("md_core._lora", "set_lora"),
  "restore_converted": ("md_core._orbax", "restore_converted"),
  "save_converted": ("md_core._orbax", "save_converted"),
  "Checkpoint": ("md_core._safetensors", "Checkpoint"),
  "SafetensorsError": ("md_core._safetensors", "SafetensorsError"),
  "SafetensorsFile": ("md_core._safetensors", "SafetensorsFile"),
  "open_checkpoint": ("md_core._safetensors", "open_checkpoint"),
  "save_safetensors": ("md_core._safetensors", "save_safetensors"),
  "REMAT_POLICIES": ("md_core._scan", "REMAT_POLICIES"),
  "BlockHook": ("md_core.hooks", "BlockHook"),
  "LayerViews": ("md_core._scan", "LayerViews"),
  "block_hook": ("md_core.hooks", "block_hook"),
  "deep_branch": ("md_core._scan", "deep_branch"),
  "layer_views": ("md_core._scan", "layer_views"),
  "num_layers_of": ("md_core._scan", "num_layers_of"),
  "remat": ("md_core._scan", "remat"),
  "scan_layers": ("md_core._scan", "scan_layers"),
  "ConfigError": ("md_core._sources", "ConfigError"),
  "check_config_types": ("md_core._sources", "check_config_types"),
  "hub_cache_dir": ("md_core._sources", "hub_cache_dir"),
  "hub_offline": ("md_core._sources", "hub_offline"),
  "load_config": ("md_core._sources", "load_config"),
  "read_json": ("md_core._sources", "read_json"),
  "resolve_source": ("md_core._sources", "resolve_source"),
  "QuantScale": ("md_core.quant", "QuantScale"),
  "quantize": ("md_core.quant", "quantize"),
}


def __getattr__(name: str) -> Any:
  if name in _MODULES:
    return importlib.import_module(f"md_core.{name}")
  if name not in _NAMES:
    raise AttributeError(f"module 'md_core' has no attribute {name!r}")
  module, attr = _NAMES[name]
  value = getattr(importlib.import_module(module), attr)
  globals()[name] = value
  return value


def __dir__() -> list[str]:
  return sorted(set(globals()) | set(__all__))


__all__ = [
  "shared_component",
  "torch_linspace_f32",
  "ExecutableStore",
  "set_executable_store",
  "executable_store",
  "LoRASlot",
  "LoRASlotWeight",
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
  "ConfigError",
  "check_config_types",
  "convert",
  "coverage",
  "hub_cache_dir",
  "hub_offline",
  "images",
  "load_config",
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
  "target_shape",
  "torch_module_keymap",
]
