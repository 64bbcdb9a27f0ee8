"""CLIP weights: transformers' tensor names → md parameter paths, and the loaders.

Both layouts are accepted: the hub's (`text_model.` / `vision_model.` before every encoder tensor, as every SD,
SDXL, Flux and Wan checkpoint stores them) and the one transformers 5 writes for a freshly built
`CLIPTextModel` / `CLIPVisionModel` (no prefix).
"""

from __future__ import annotations

import os
import re
from typing import Any

import jax
from flax import nnx

import md_core
from md_text._clip import (
  CLIPTextConfig,
  CLIPTextModel,
  CLIPTextModelWithProjection,
  CLIPVisionConfig,
  CLIPVisionModel,
  CLIPVisionModelWithProjection,
)

_LAYER = re.compile(
  r"encoder\.layers\.(\d+)\.(self_attn\.(?:q|k|v|out)_proj|layer_norm[12]|mlp\.fc[12])\.(weight|bias)"
)
_TEXT = {
  "embeddings.token_embedding.weight": (("embeddings", "token_embedding", "embedding"), "identity"),
  "embeddings.position_embedding.weight": (
    ("embeddings", "position_embedding", "embedding"),
    "identity",
  ),
  "final_layer_norm.weight": (("final_layer_norm", "scale"), "identity"),
  "final_layer_norm.bias": (("final_layer_norm", "bias"), "identity"),
}
_VISION = {
  "embeddings.class_embedding": (("embeddings", "class_embedding"), "identity"),
  "embeddings.patch_embedding.weight": (("embeddings", "patch_embedding", "kernel"), "conv2d"),
  "embeddings.position_embedding.weight": (
    ("embeddings", "position_embedding", "embedding"),
    "identity",
  ),
  "pre_layrnorm.weight": (("pre_layrnorm", "scale"), "identity"),
  "pre_layrnorm.bias": (("pre_layrnorm", "bias"), "identity"),
  "post_layernorm.weight": (("post_layernorm", "scale"), "identity"),
  "post_layernorm.bias": (("post_layernorm", "bias"), "identity"),
}
# Buffers older transformers saved with the weights; the model recomputes them.
TEXT_ALLOW_UNUSED = (r"(text_model\.)?embeddings\.position_ids",)
VISION_ALLOW_UNUSED = (r"(vision_model\.)?embeddings\.position_ids",)


def _layer_target(name: str) -> md_core.Target | None:
  m = _LAYER.fullmatch(name)
  if m is None:
    return None
  layer, module, kind = int(m.group(1)), m.group(2), m.group(3)
  path = ("encoder", "layers", *module.split("."))
  is_norm = module.startswith("layer_norm")
  if kind == "weight":
    return md_core.Target(
      path + ("scale" if is_norm else "kernel",), "identity" if is_norm else "linear", layer=layer
    )
  return md_core.Target(path + ("bias",), layer=layer)


def _convert(name: str, prefix: str, table: dict, projection: str) -> md_core.Target | None:
  if name == f"{projection}.weight":
    return md_core.Target((projection, "kernel"), "linear")
  name = name.removeprefix(prefix)
  if name in table:
    path, layout = table[name]
    return md_core.Target(path, layout)
  return _layer_target(name)


def clip_text_convert_key(name: str) -> md_core.Target | None:
  """Maps a transformers CLIP text tensor name (with or without `text_model.`) to md's parameter.

  `text_projection.weight` maps to `CLIPTextModelWithProjection`'s projection. Unknown names give None.
  """
  return _convert(name, "text_model.", _TEXT, "text_projection")


def clip_vision_convert_key(name: str) -> md_core.Target | None:
  """Maps a transformers CLIP vision tensor name (with or without `vision_model.`) to md's parameter.

  `visual_projection.weight` maps to `CLIPVisionModelWithProjection`'s projection. Unknown names give None.
  """
  return _convert(name, "vision_model.", _VISION, "visual_projection")


def _architectures(folder) -> list[str]:
  return list(md_core.read_json(folder / "config.json").get("architectures") or [])


def _without(convert_key, skipped: str):
  """`convert_key` that leaves one tensor unmapped (a projection the chosen class does not have)."""

  def convert(name: str):
    return None if name == skipped else convert_key(name)

  return convert


def _load(
  source,
  subfolder,
  config_cls,
  plain_cls,
  projected_cls,
  convert_key,
  projection,
  allow_unused,
  with_projection,
  mesh,
  dtype,
  rules,
  progress,
):
  folder = md_core.resolve_source(source, subfolder=subfolder)
  config_path = folder / "config.json"
  if not config_path.is_file():
    raise FileNotFoundError(
      f"{folder}: no config.json (expected a transformers {plain_cls.__name__})"
    )
  config = config_cls.from_json(config_path)
  if with_projection is None:
    with_projection = projected_cls.__name__ in _architectures(folder)
  cls = projected_cls if with_projection else plain_cls
  allow = list(allow_unused)
  if not with_projection:
    # A checkpoint with a projection loads into the plain class too (e.g. Wan I2V reads hidden states only).
    convert_key = _without(convert_key, f"{projection}.weight")
    allow.append(re.escape(f"{projection}.weight"))
  checkpoint = md_core.open_checkpoint(folder)
  return md_core.load_weights(
    lambda: cls(config, rngs=nnx.Rngs(0)),
    checkpoint,
    convert_key,
    dtype=dtype,
    mesh=mesh,
    rules=rules,
    allow_unused=allow,
    progress=progress,
  )


def load_clip_text(
  source: str | os.PathLike,
  *,
  subfolder: str | None = "text_encoder",
  with_projection: bool | None = None,
  mesh: jax.sharding.Mesh | None = None,
  dtype: Any = None,
  rules: Any = None,
  progress: bool = True,
) -> CLIPTextModel:
  """Loads a CLIP text encoder from a checkpoint folder or hub id.

  Args:
    source: a diffusers pipeline folder / hub id (then `subfolder` names the component, e.g. `"text_encoder_2"`
      for SDXL's bigG), or the component's own folder with `subfolder=None`.
    subfolder: the component folder holding `config.json` and `model.safetensors`.
    with_projection: build `CLIPTextModelWithProjection` (True) or `CLIPTextModel` (False); by default what
      the config's `architectures` says.
    mesh: place parameters on this mesh (md-sharding rules over their logical axes).
    dtype: parameter dtype (default: float32, as built).
    rules: md-sharding logical axis rules (default rules when None).
    progress: show a progress bar while loading.

  Returns:
    The model, with its weights.

  Raises:
    FileNotFoundError: the folder, component or config is missing.
    md_core.WeightLoadError: tensors that do not fit the config (all listed).
    md_core.SafetensorsError: a damaged weights file.
  """
  return _load(
    source,
    subfolder,
    CLIPTextConfig,
    CLIPTextModel,
    CLIPTextModelWithProjection,
    clip_text_convert_key,
    "text_projection",
    TEXT_ALLOW_UNUSED,
    with_projection,
    mesh,
    dtype,
    rules,
    progress,
  )


def load_clip_vision(
  source: str | os.PathLike,
  *,
  subfolder: str | None = "image_encoder",
  with_projection: bool | None = None,
  mesh: jax.sharding.Mesh | None = None,
  dtype: Any = None,
  rules: Any = None,
  progress: bool = True,
) -> CLIPVisionModel:
  """Loads a CLIP vision encoder (e.g. Wan 2.1 I2V's `image_encoder`); arguments as `load_clip_text`."""
  return _load(
    source,
    subfolder,
    CLIPVisionConfig,
    CLIPVisionModel,
    CLIPVisionModelWithProjection,
    clip_vision_convert_key,
    "visual_projection",
    VISION_ALLOW_UNUSED,
    with_projection,
    mesh,
    dtype,
    rules,
    progress,
  )
