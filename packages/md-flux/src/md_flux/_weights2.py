"""Flux.2 weights: the diffusers key map and the loader (Klein 4B / 9B share both)."""

from __future__ import annotations

import dataclasses
import os
import re
from typing import Any

from flax import nnx

import md_core
from md_core import Target
from md_flux._config import Flux2Config
from md_flux._flux2 import Flux2Transformer
from md_flux._weights1 import _component_folder

_TOP_LINEARS = {
  "x_embedder",
  "context_embedder",
  "proj_out",
  "double_stream_modulation_img.linear",
  "double_stream_modulation_txt.linear",
  "single_stream_modulation.linear",
  *(
    f"time_guidance_embed.{e}.{lin}"
    for e in ("timestep_embedder", "guidance_embedder")
    for lin in ("linear_1", "linear_2")
  ),
}
_DOUBLE_LINEARS = {
  "attn.to_q",
  "attn.to_k",
  "attn.to_v",
  "attn.add_q_proj",
  "attn.add_k_proj",
  "attn.add_v_proj",
  "attn.to_out.0",
  "attn.to_add_out",
  "ff.linear_in",
  "ff.linear_out",
  "ff_context.linear_in",
  "ff_context.linear_out",
}
_DOUBLE_NORMS = {"attn.norm_q", "attn.norm_k", "attn.norm_added_q", "attn.norm_added_k"}
_SINGLE_LINEARS = {"attn.to_qkv_mlp_proj", "attn.to_out"}
_SINGLE_NORMS = {"attn.norm_q", "attn.norm_k"}
_KEY = re.compile(
  r"(?:(transformer_blocks|single_transformer_blocks)\.(\d+)\.)?(.+)\.(weight|bias)"
)


def _path(module: str) -> tuple[str, ...]:
  return tuple(module.removesuffix(".0").split("."))  # attn.to_out.0 → attn/to_out


def convert_key_flux2(name: str) -> Target | list[Target] | None:
  """diffusers `Flux2Transformer2DModel` tensor name → md target(s); None for unknown names.

  Every projection is bias-free, so only `.weight` names map.
  """
  m = _KEY.fullmatch(name)
  if not m or m.group(4) != "weight":
    return None
  stack, layer, module, _ = m.groups()
  if stack is None:
    if module in _TOP_LINEARS:
      return Target(_path(module) + ("kernel",), "linear")
    if module == "norm_out.linear":  # [scale; shift] rows
      return [
        Target(("norm_out", "scale", "kernel"), "linear", split=(0, 2, 0)),
        Target(("norm_out", "shift", "kernel"), "linear", split=(1, 2, 0)),
      ]
    return None
  i = int(layer)
  double = stack == "transformer_blocks"
  linears, norms = (_DOUBLE_LINEARS, _DOUBLE_NORMS) if double else (_SINGLE_LINEARS, _SINGLE_NORMS)
  if module in linears:
    return Target((stack, *_path(module), "kernel"), "linear", layer=i)
  if module in norms:
    return Target((stack, *_path(module), "scale"), layer=i)
  return None


def load_flux2(
  source: str | os.PathLike,
  *,
  subfolder: str = "transformer",
  config: Flux2Config | None = None,
  mesh=None,
  dtype: Any = None,
  rules=None,
  attention=None,
  remat: str | None = None,
  progress: bool = False,
) -> Flux2Transformer:
  """Loads a Flux.2 transformer from a diffusers checkpoint (folder or hub id).

  Args:
    source: a diffusers pipeline folder or hub id (its `subfolder` is read), or the transformer's
      own folder (`config.json` + safetensors).
    subfolder: the transformer's component folder in a pipeline.
    config: the model's config (default: its `config.json`).
    mesh: place parameters on this mesh by their logical axes (md-sharding rules `rules`).
    dtype: dtype of floating parameters (default: float32 as built).
    rules: md-sharding logical axis rules.
    attention: an `md_attention.AttentionConfig` replacing `config.attention`.
    remat: replaces `config.remat`.
    progress: show a progress bar while loading.

  Returns:
    The `Flux2Transformer` with its weights.

  Raises:
    md_core.WeightLoadError: tensors that do not fit the model (all listed).
  """
  folder = _component_folder(source, subfolder)
  cfg = config or Flux2Config.from_json(folder / "config.json")
  changes = {}
  if attention is not None:
    changes["attention"] = attention
  if remat is not None:
    changes["remat"] = remat
  cfg = dataclasses.replace(cfg, **changes) if changes else cfg
  return md_core.load_weights(
    lambda: Flux2Transformer(cfg, rngs=nnx.Rngs(0)),
    md_core.open_checkpoint(folder),
    convert_key_flux2,
    dtype=dtype,
    mesh=mesh,
    rules=rules,
    progress=progress,
  )
