"""LTX latent upsampler weights: diffusers (= original single-file) tensor names → md paths, and the loader.

diffusers' conversion scripts load the original files (`ltxv-spatial-upscaler-0.9.7.safetensors`,
`ltx-2-spatial-upscaler-x2-1.0.safetensors`) into `LTXLatentUpsamplerModel` / `LTX2LatentUpsamplerModel` with
no renaming, so one key map serves both layouts. The original files carry no `config.json`: their settings
come from the file's `config` metadata when present, else from the tensor shapes.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
from typing import Any

import jax
from flax import nnx

import md_core
from md_ltx._upsampler import (
  RATIONAL_SCALES,
  LatentUpsampler,
  LatentUpsamplerConfig,
)

_BLOCK = re.compile(
  r"(res_blocks|post_upsample_res_blocks)\.(\d+)\.(conv1|conv2|norm1|norm2)\.(weight|bias)"
)
_CONV = {
  "initial_conv": "initial_conv",
  "final_conv": "final_conv",
  "upsampler.0": "upsampler/conv",  # plain sub-pixel conv (nn.Sequential(conv, shuffle))
  "upsampler.conv": "upsampler/conv",  # LTX-2's rational resampler
}
_NORM = {"initial_norm": "initial_norm"}
_MODULE = re.compile(r"(.+)\.(weight|bias)")
BLUR_KERNEL = "upsampler.blur_down.kernel"
# Float tensors that stay float32 whatever the load dtype.
KEEP_F32 = (r"blur_kernel$",)


def upsampler_keymap(cfg: LatentUpsamplerConfig) -> md_core.KeyMap:
  """The key map of an upsampler with settings `cfg` (its conv layouts depend on `dims` and the kind of
  upsampling layer): diffusers / original tensor name → `Target` (None for names the model lacks).

  >>> upsampler_keymap(LatentUpsamplerConfig())("res_blocks.2.conv1.weight")
  Target(path=('res_blocks', 'conv1', 'kernel'), layout='conv3d', split=None, layer=2)
  """
  conv = f"conv{cfg.dims}d"
  up_conv = "conv2d" if cfg.kind in ("spatial", "rational") else "conv3d"
  up_name = "upsampler.conv" if cfg.kind == "rational" else "upsampler.0"

  def convert_key(name: str) -> md_core.Target | None:
    if name == BLUR_KERNEL:
      return md_core.Target(("upsampler", "blur_kernel")) if cfg.kind == "rational" else None
    m = _BLOCK.fullmatch(name)
    if m:
      stack, layer, module, suffix = m.group(1), int(m.group(2)), m.group(3), m.group(4)
      if layer >= cfg.num_blocks_per_stage:
        return None
      if module.startswith("conv"):
        leaf, layout = ("kernel", conv) if suffix == "weight" else ("bias", "identity")
      else:
        leaf, layout = ("scale" if suffix == "weight" else "bias"), "identity"
      return md_core.Target((stack, module, leaf), layout, layer=layer)
    m = _MODULE.fullmatch(name)
    if not m:
      return None
    module, suffix = m.group(1), m.group(2)
    if module in _NORM:
      return md_core.Target((_NORM[module], "scale" if suffix == "weight" else "bias"))
    if module in _CONV and (not module.startswith("upsampler") or module == up_name):
      layout = up_conv if module == up_name else conv
      path = tuple(_CONV[module].split("/"))
      if suffix == "weight":
        return md_core.Target(path + ("kernel",), layout)
      return md_core.Target(path + ("bias",))
    return None

  return convert_key


def config_from_checkpoint(checkpoint, **overrides) -> LatentUpsamplerConfig:
  """The settings of an upsampler checkpoint without a `config.json` (an original single file).

  A `config` entry in the safetensors metadata (as the original files carry) wins; otherwise widths, depth,
  `dims` and the upsampling layer follow from the tensor shapes. A rational resampler by 3 (scale 1.5 or
  0.75) cannot be told apart by shapes: pass `rational_spatial_scale` then.

  Raises:
    ValueError: the checkpoint is not an LTX latent upsampler, or its scale is ambiguous.
  """
  name = getattr(checkpoint, "name", "checkpoint")
  files = getattr(checkpoint, "files", [])
  metadata = {}
  for f in files:
    metadata.update(getattr(f, "metadata", {}) or {})
  if "config" in metadata:
    try:
      config = json.loads(metadata["config"])
    except json.JSONDecodeError as e:
      raise ValueError(f"{name}: the `config` metadata is not valid JSON ({e})") from None
    if isinstance(config, dict) and "mid_channels" in config:
      return LatentUpsamplerConfig.from_dict(config, **overrides)

  def shape(key):
    if key not in checkpoint:
      raise ValueError(
        f"{name}: tensor {key!r} not found; is this an LTX latent upsampler "
        "(ltxv-spatial-upscaler-0.9.x / ltx-2-spatial-upscaler)?"
      )
    return tuple(checkpoint.shape(key))

  mid, in_channels, *window = shape("initial_conv.weight")
  dims = len(window)
  blocks = {int(m.group(1)) for k in checkpoint if (m := re.match(r"res_blocks\.(\d+)\.", k))}
  values: dict[str, Any] = dict(
    in_channels=in_channels, mid_channels=mid, num_blocks_per_stage=len(blocks), dims=dims
  )
  if "upsampler.conv.weight" in checkpoint:
    num = int(round((shape("upsampler.conv.weight")[0] / mid) ** 0.5))
    scales = [s for s, (n, _) in RATIONAL_SCALES.items() if n == num]
    if "rational_spatial_scale" not in overrides:
      if len(scales) != 1:
        raise ValueError(
          f"{name}: a rational resampler by {num} has scale {scales or '?'}; pass "
          "rational_spatial_scale="
        )
      values["rational_spatial_scale"] = scales[0]
    values["use_rational_resampler"] = True
  else:
    up = shape("upsampler.0.weight")
    factor = up[0] // mid
    if len(up) == 4:
      values.update(spatial_upsample=True, temporal_upsample=False)
    elif factor == 8:
      values.update(spatial_upsample=True, temporal_upsample=True)
    elif factor == 2:
      values.update(spatial_upsample=False, temporal_upsample=True)
    else:
      raise ValueError(f"{name}: upsampler.0.weight has shape {up}; not an LTX latent upsampler")
  values.update(overrides)
  return LatentUpsamplerConfig(**values)


def _is_upsampler_folder(path: pathlib.Path) -> bool:
  config = path / "config.json"
  if not config.is_file():
    return False
  try:
    return "LatentUpsampler" in str(json.loads(config.read_text()).get("_class_name", ""))
  except (json.JSONDecodeError, AttributeError):
    return False


def load_latent_upsampler(
  source: str | os.PathLike,
  *,
  subfolder: str | None = "latent_upsampler",
  mesh: jax.sharding.Mesh | None = None,
  dtype: Any = None,
  rules: Any = None,
  progress: bool = False,
  **overrides,
) -> LatentUpsampler:
  """Loads an LTX-Video or LTX-2 latent upsampler.

  Args:
    source: a diffusers pipeline folder or hub id holding `latent_upsampler/`
      (`"Lightricks/ltxv-spatial-upscaler-0.9.7"`, `"Lightricks/LTX-2"`), the upsampler's own folder
      (`config.json` + safetensors), or an original single `.safetensors` file
      (`ltxv-spatial-upscaler-0.9.7.safetensors`; settings from its metadata or shapes, see
      `config_from_checkpoint`).
    subfolder: the component folder in a pipeline (ignored for a single file, or when `source` is already
      the upsampler's folder).
    mesh: place parameters on this mesh (replicated: the convs' logical axes map to no mesh axis by default).
    dtype: floating dtype of the parameters (default float32: the bfloat16 files are upcast); the blur
      kernel stays float32.
    rules: md-sharding logical axis rules.
    progress: show a progress bar over tensors.
    **overrides: `LatentUpsamplerConfig` fields (e.g. `rational_spatial_scale=1.5` for an ambiguous file).

  Returns:
    The `LatentUpsampler` with the checkpoint's weights.

  Raises:
    md_core.WeightLoadError: unknown, missing or mis-shaped tensors (all listed, with file and shapes).
    FileNotFoundError: no upsampler at `source`.
  """
  path = pathlib.Path(os.fspath(source)).expanduser()
  if path.is_file():
    checkpoint = md_core.open_checkpoint(path)
    cfg = config_from_checkpoint(checkpoint, **overrides)
  else:
    if path.is_dir() and _is_upsampler_folder(path):
      folder = path
    else:
      folder = md_core.resolve_source(source, subfolder=subfolder)
    cfg = LatentUpsamplerConfig.from_json(folder / "config.json", **overrides)
    checkpoint = md_core.open_checkpoint(folder)
  return md_core.load_weights(
    lambda: LatentUpsampler(cfg, rngs=nnx.Rngs(0)),
    checkpoint,
    upsampler_keymap(cfg),
    dtype=dtype,
    keep_f32=KEEP_F32,
    mesh=mesh,
    rules=rules,
    progress=progress,
  )
