"""Key maps from diffusers' UNet / ControlNet tensor names to md's parameter paths, and the loaders."""

from __future__ import annotations

import functools
import os
import re
from typing import Any

import jax

import md_core
from md_core import Target
from md_sd._config import ControlNetConfig, UNetConfig
from md_sd._controlnet import ControlNetModel
from md_sd._unet import UNet2DConditionModel

_BLOCK = r"(?:down_blocks\.\d+|up_blocks\.\d+|mid_block)"
_TRANSFORMER = _BLOCK + r"\.attentions\.\d+\.transformer_blocks\.\d+"

# Torch module names (without `.weight` / `.bias`) md knows, and what kind of module each is.
_MODULES = [
  (r"conv_in|conv_out", "conv"),
  (r"conv_norm_out", "norm"),
  (r"(?:time_embedding|add_embedding)\.linear_[12]", "linear"),
  (_BLOCK + r"\.resnets\.\d+\.(?:norm1|norm2)", "norm"),
  (_BLOCK + r"\.resnets\.\d+\.(?:conv1|conv2|conv_shortcut)", "conv"),
  (_BLOCK + r"\.resnets\.\d+\.time_emb_proj", "linear"),
  (_BLOCK + r"\.attentions\.\d+\.norm", "norm"),
  (_BLOCK + r"\.attentions\.\d+\.proj_(?:in|out)", "proj"),
  (_TRANSFORMER + r"\.norm[123]", "norm"),
  (_TRANSFORMER + r"\.attn[12]\.(?:to_q|to_k|to_v|to_out\.0)", "linear"),
  (_TRANSFORMER + r"\.ff\.net\.(?:0\.proj|2)", "linear"),
  (r"down_blocks\.\d+\.downsamplers\.0\.conv", "conv"),
  (r"up_blocks\.\d+\.upsamplers\.0\.conv", "conv"),
  # ControlNet only.
  (r"controlnet_cond_embedding\.(?:conv_in|conv_out|blocks\.\d+)", "conv"),
  (r"controlnet_down_blocks\.\d+|controlnet_mid_block", "conv"),
]
_MODULE_RE = [(re.compile(p), kind) for p, kind in _MODULES]

# Where md's module tree differs from the reference's.
_RENAMES = [
  (re.compile(r"^(time_embedding|add_embedding)\."), r"time.\1."),
  (re.compile(r"\.to_out\.0$"), ".to_out"),
  (re.compile(r"\.ff\.net\.0\.proj$"), ".ff.proj_in"),
  (re.compile(r"\.ff\.net\.2$"), ".ff.proj_out"),
  (re.compile(r"\.downsamplers\.0\.conv$"), ".downsampler.conv"),
  (re.compile(r"\.upsamplers\.0\.conv$"), ".upsampler.conv"),
]

_PARAM = {
  ("conv", "weight"): ("kernel", "conv2d"),
  ("linear", "weight"): ("kernel", "linear"),
  ("norm", "weight"): ("scale", "identity"),
}


def convert_unet_key(name: str, *, linear_projection: bool = False) -> Target | None:
  """Maps a diffusers UNet / ControlNet tensor name to md's parameter, or None if md does not know it.

  `down_blocks.1.attentions.0.transformer_blocks.0.attn1.to_q.weight` →
  `down_blocks/1/attentions/0/transformer_blocks/0/attn1/to_q/kernel` (transposed). `linear_projection` is
  the config's `use_linear_projection`: whether the spatial transformers' `proj_in`/`proj_out` are linear
  layers (SD 2.x, SDXL) or 1×1 convolutions (SD 1.x).
  """
  module, _, leaf = name.rpartition(".")
  if leaf not in ("weight", "bias"):
    return None
  kind = next((k for pattern, k in _MODULE_RE if pattern.fullmatch(module)), None)
  if kind is None:
    return None
  if kind == "proj":
    kind = "linear" if linear_projection else "conv"
  for pattern, repl in _RENAMES:
    module = pattern.sub(repl, module)
  param, layout = _PARAM.get((kind, leaf), ("bias", "identity"))
  path = tuple(int(p) if p.isdigit() else p for p in module.split(".")) + (param,)
  return Target(path, layout)


convert_controlnet_key = convert_unet_key
"""The ControlNet's tensors are named as the UNet's (plus `controlnet_*`): the same map serves both."""


def unet_key_map(cfg: UNetConfig | ControlNetConfig) -> md_core.KeyMap:
  """`convert_unet_key` for a model built from `cfg` (which decides how `proj_in`/`proj_out` are stored)."""
  ucfg = cfg.unet if isinstance(cfg, ControlNetConfig) else cfg
  return functools.partial(convert_unet_key, linear_projection=ucfg.use_linear_projection)


def _load(
  make_config,
  make_model,
  source: str | os.PathLike,
  *,
  subfolder: str | None,
  mesh: jax.sharding.Mesh | None,
  dtype: Any,
  rules: Any,
  variant: str | None,
  progress: bool,
):
  folder = md_core.resolve_source(source, subfolder=subfolder)
  cfg = make_config(folder / "config.json")
  checkpoint = md_core.open_checkpoint(folder, variant=variant)

  def factory():
    # No nnx.Rngs: under eval_shape its per-parameter state updates cost time quadratic in the model size.
    return make_model(cfg, rngs=None, dtype=dtype)

  return md_core.load_weights(
    factory,
    checkpoint,
    unet_key_map(cfg),
    dtype=dtype,
    mesh=mesh,
    rules=rules,
    progress=progress,
  )


def load_unet(
  source: str | os.PathLike,
  *,
  subfolder: str | None = "unet",
  mesh: jax.sharding.Mesh | None = None,
  dtype: Any = None,
  rules: Any = None,
  variant: str | None = None,
  progress: bool = True,
) -> UNet2DConditionModel:
  """Loads a diffusers UNet (`<source>/<subfolder>/config.json` + safetensors) as md's UNet.

  Args:
    source: a local folder or hub id (a pipeline, with `subfolder="unet"`; or the UNet's own folder with
      `subfolder=None`).
    subfolder: the UNet's component folder.
    mesh: place each parameter on this mesh by its logical axis names.
    dtype: parameter and compute dtype (default: the checkpoint's parameters as float32).
    rules: md-sharding logical axis rules.
    variant: the file variant (`"fp16"` reads `diffusion_pytorch_model.fp16.safetensors`).
    progress: show a progress bar.

  Raises:
    WeightLoadError: the files do not fit the config (every unknown, missing or mis-shaped tensor listed).
    ValueError: the config asks for something md does not implement.
  """
  return _load(
    UNetConfig.from_json,
    UNet2DConditionModel,
    source,
    subfolder=subfolder,
    mesh=mesh,
    dtype=dtype,
    rules=rules,
    variant=variant,
    progress=progress,
  )


def load_controlnet(
  source: str | os.PathLike,
  *,
  subfolder: str | None = None,
  mesh: jax.sharding.Mesh | None = None,
  dtype: Any = None,
  rules: Any = None,
  variant: str | None = None,
  progress: bool = True,
) -> ControlNetModel:
  """Loads a diffusers ControlNet (`config.json` + safetensors, e.g. `lllyasviel/sd-controlnet-canny`).

  Arguments as `load_unet`; ControlNets usually live at the top of their own repository (`subfolder=None`).
  """
  return _load(
    ControlNetConfig.from_json,
    ControlNetModel,
    source,
    subfolder=subfolder,
    mesh=mesh,
    dtype=dtype,
    rules=rules,
    variant=variant,
    progress=progress,
  )
