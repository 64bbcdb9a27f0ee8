"""Flux.1 weights: key maps for the diffusers layout and BFL's single file, and the loader.

BFL's original file (`flux1-dev.safetensors`, `flux1-schnell.safetensors`) names tensors as the
reference training code did: fused `qkv` projections (split here into three equal parts), a fused
`linear1` in single blocks holding q, k, v *and* the MLP input (unequal parts, exposed by `bfl_view`
as two virtual tensors `...linear1.weight[qkv]` and `...linear1.weight[mlp]`), and a final
modulation whose halves are `[shift, scale]` where diffusers stores `[scale, shift]` (md keeps the
two projections apart, so either order is a plain split).
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import re
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np
from flax import nnx

import md_core
from md_core import Target
from md_flux._config import FluxConfig
from md_flux._flux1 import FluxTransformer

_BFL_PREFIX = "model.diffusion_model."
_DOUBLE = "transformer_blocks"
_SINGLE = "single_transformer_blocks"


def _param(path: tuple, suffix: str, layout_if_weight: str = "linear", **kw) -> Target:
  """`.weight` of a linear → `kernel` (transposed), `.bias` → `bias`."""
  if suffix == "weight":
    return Target(path + ("kernel",), layout_if_weight, **kw)
  return Target(path + ("bias",), **kw)


def _halves(path_first: tuple, path_second: tuple, suffix: str) -> list[Target]:
  return [
    _param(path_first, suffix, split=(0, 2, 0)),
    _param(path_second, suffix, split=(1, 2, 0)),
  ]


# diffusers names inside a double block → md module path.
_DOUBLE_LINEARS = {
  "norm1.linear": ("norm1", "linear"),
  "norm1_context.linear": ("norm1_context", "linear"),
  "attn.to_q": ("attn", "to_q"),
  "attn.to_k": ("attn", "to_k"),
  "attn.to_v": ("attn", "to_v"),
  "attn.add_q_proj": ("attn", "add_q_proj"),
  "attn.add_k_proj": ("attn", "add_k_proj"),
  "attn.add_v_proj": ("attn", "add_v_proj"),
  "attn.to_out.0": ("attn", "to_out"),
  "attn.to_add_out": ("attn", "to_add_out"),
  "ff.net.0.proj": ("ff", "proj_in"),
  "ff.net.2": ("ff", "proj_out"),
  "ff_context.net.0.proj": ("ff_context", "proj_in"),
  "ff_context.net.2": ("ff_context", "proj_out"),
}
_DOUBLE_NORMS = ("norm_q", "norm_k", "norm_added_q", "norm_added_k")
_SINGLE_LINEARS = {
  "norm.linear": ("norm", "linear"),
  "proj_mlp": ("proj_mlp",),
  "proj_out": ("proj_out",),
  "attn.to_q": ("attn", "to_q"),
  "attn.to_k": ("attn", "to_k"),
  "attn.to_v": ("attn", "to_v"),
}
_TOP_LINEARS = {
  "x_embedder": ("x_embedder",),
  "context_embedder": ("context_embedder",),
  "proj_out": ("proj_out",),
  **{
    f"time_text_embed.{e}.{lin}": ("time_text_embed", e, lin)
    for e in ("timestep_embedder", "guidance_embedder", "text_embedder")
    for lin in ("linear_1", "linear_2")
  },
}
_KEY = re.compile(
  r"(?:(transformer_blocks|single_transformer_blocks)\.(\d+)\.)?(.+)\.(weight|bias)"
)


def convert_key(name: str) -> Target | list[Target] | None:
  """diffusers `FluxTransformer2DModel` tensor name → md target(s); None for unknown names."""
  m = _KEY.fullmatch(name)
  if not m:
    return None
  stack, layer, module, suffix = m.groups()
  if stack is None:
    if module in _TOP_LINEARS:
      return _param(_TOP_LINEARS[module], suffix)
    if module == "norm_out.linear":
      return _halves(("norm_out", "scale"), ("norm_out", "shift"), suffix)
    return None
  i = int(layer)
  linears = _DOUBLE_LINEARS if stack == _DOUBLE else _SINGLE_LINEARS
  if module in linears:
    return _param((stack,) + linears[module], suffix, layer=i)
  norms = _DOUBLE_NORMS if stack == _DOUBLE else _DOUBLE_NORMS[:2]
  if suffix == "weight" and module.startswith("attn.") and module[5:] in norms:
    return Target((stack, "attn", module[5:], "scale"), layer=i)
  return None


# BFL names → md module path (per block for double/single blocks).
_BFL_TOP = {
  "img_in": ("x_embedder",),
  "txt_in": ("context_embedder",),
  "time_in.in_layer": ("time_text_embed", "timestep_embedder", "linear_1"),
  "time_in.out_layer": ("time_text_embed", "timestep_embedder", "linear_2"),
  "guidance_in.in_layer": ("time_text_embed", "guidance_embedder", "linear_1"),
  "guidance_in.out_layer": ("time_text_embed", "guidance_embedder", "linear_2"),
  "vector_in.in_layer": ("time_text_embed", "text_embedder", "linear_1"),
  "vector_in.out_layer": ("time_text_embed", "text_embedder", "linear_2"),
  "final_layer.linear": ("proj_out",),
}
_BFL_DOUBLE = {
  "img_mod.lin": ("norm1", "linear"),
  "txt_mod.lin": ("norm1_context", "linear"),
  "img_attn.proj": ("attn", "to_out"),
  "txt_attn.proj": ("attn", "to_add_out"),
  "img_mlp.0": ("ff", "proj_in"),
  "img_mlp.2": ("ff", "proj_out"),
  "txt_mlp.0": ("ff_context", "proj_in"),
  "txt_mlp.2": ("ff_context", "proj_out"),
}
_BFL_DOUBLE_QKV = {
  "img_attn.qkv": ("to_q", "to_k", "to_v"),
  "txt_attn.qkv": ("add_q_proj", "add_k_proj", "add_v_proj"),
}
_BFL_DOUBLE_NORMS = {
  "img_attn.norm.query_norm": "norm_q",
  "img_attn.norm.key_norm": "norm_k",
  "txt_attn.norm.query_norm": "norm_added_q",
  "txt_attn.norm.key_norm": "norm_added_k",
}
_BFL_SINGLE = {
  "modulation.lin": ("norm", "linear"),
  "linear2": ("proj_out",),
  "linear1[mlp]": ("proj_mlp",),
}
_BFL_SINGLE_NORMS = {"norm.query_norm": "norm_q", "norm.key_norm": "norm_k"}
_BFL_KEY = re.compile(
  r"(?:(double_blocks|single_blocks)\.(\d+)\.)?(.+)\.(weight|bias|scale)(\[\w+\])?"
)


def convert_key_bfl(name: str) -> Target | list[Target] | None:
  """BFL single-file tensor name (as exposed by `bfl_view`) → md target(s); None for unknown names."""
  m = _BFL_KEY.fullmatch(name)
  if not m:
    return None
  stack, layer, module, suffix, part = m.groups()
  if part:
    module += part
  if stack is None:
    if suffix == "scale":
      return None
    if module in _BFL_TOP:
      return _param(_BFL_TOP[module], suffix)
    if module == "final_layer.adaLN_modulation.1":
      # BFL keeps [shift, scale]; diffusers swaps the halves to [scale, shift].
      return _halves(("norm_out", "shift"), ("norm_out", "scale"), suffix)
    return None
  i = int(layer)
  if stack == "double_blocks":
    if suffix == "scale":
      norm = _BFL_DOUBLE_NORMS.get(module)
      return None if norm is None else Target((_DOUBLE, "attn", norm, "scale"), layer=i)
    if module in _BFL_DOUBLE:
      return _param((_DOUBLE,) + _BFL_DOUBLE[module], suffix, layer=i)
    if module in _BFL_DOUBLE_QKV:
      names = _BFL_DOUBLE_QKV[module]
      return [
        _param((_DOUBLE, "attn", n), suffix, layer=i, split=(j, 3, 0)) for j, n in enumerate(names)
      ]
    return None
  if suffix == "scale":
    norm = _BFL_SINGLE_NORMS.get(module)
    return None if norm is None else Target((_SINGLE, "attn", norm, "scale"), layer=i)
  if module in _BFL_SINGLE:
    return _param((_SINGLE,) + _BFL_SINGLE[module], suffix, layer=i)
  if module == "linear1[qkv]":
    return [
      _param((_SINGLE, "attn", n), suffix, layer=i, split=(j, 3, 0))
      for j, n in enumerate(("to_q", "to_k", "to_v"))
    ]
  return None


_LINEAR1 = re.compile(r"single_blocks\.\d+\.linear1\.(weight|bias)")


def bfl_virtual_names(
  shapes: Mapping[str, Sequence[int]], inner_dim: int
) -> dict[str, tuple[str, slice, tuple[int, ...]]]:
  """BFL names as `convert_key_bfl` sees them: `virtual name → (file name, rows, shape)`.

  Strips the `model.diffusion_model.` prefix some files carry and splits each single block's fused
  `linear1` (rows `[q; k; v; mlp]`, `3 * inner_dim + mlp_hidden_dim` of them) into `linear1.*[qkv]`
  and `linear1.*[mlp]`.
  """
  out = {}
  for name, shape in shapes.items():
    shape = tuple(int(d) for d in shape)
    short = name.removeprefix(_BFL_PREFIX)
    if _LINEAR1.fullmatch(short):
      qkv = 3 * inner_dim
      if shape[0] <= qkv:
        raise ValueError(
          f"{name}: shape {shape} leaves no MLP rows after the 3 x {inner_dim} q/k/v rows"
        )
      base, suffix = short.rsplit(".", 1)
      out[f"{base}.{suffix}[qkv]"] = (name, slice(0, qkv), (qkv,) + shape[1:])
      out[f"{base}.{suffix}[mlp]"] = (name, slice(qkv, shape[0]), (shape[0] - qkv,) + shape[1:])
    else:
      out[short] = (name, slice(None), shape)
  return out


class _BflView(Mapping[str, np.ndarray]):
  """A BFL checkpoint seen through `bfl_virtual_names` (row slices of the memory-mapped tensors)."""

  def __init__(self, checkpoint: md_core.Checkpoint, inner_dim: int):
    self._ckpt = checkpoint
    self.name = checkpoint.name
    self._names = bfl_virtual_names({k: checkpoint.shape(k) for k in checkpoint}, inner_dim)

  def __getitem__(self, key: str) -> np.ndarray:
    real, rows, _ = self._names[key]
    return self._ckpt[real][rows]

  def __iter__(self) -> Iterator[str]:
    return iter(self._names)

  def __len__(self) -> int:
    return len(self._names)

  def shape(self, key: str) -> tuple[int, ...]:
    return self._names[key][2]

  def file_of(self, key: str) -> pathlib.Path:
    return self._ckpt.file_of(self._names[key][0])


def bfl_view(checkpoint: md_core.Checkpoint, inner_dim: int) -> Mapping[str, np.ndarray]:
  """`checkpoint` (a BFL single file) with the names `convert_key_bfl` maps (see `bfl_virtual_names`)."""
  return _BflView(checkpoint, inner_dim)


def single_file_layout(names: Sequence[str]) -> str:
  """ "bfl" or "diffusers" from a single file's tensor names; ValueError for anything else."""
  names = [n.removeprefix(_BFL_PREFIX) for n in names]
  if any(n.startswith("double_blocks.") for n in names) and "img_in.weight" in names:
    return "bfl"
  if any(n.startswith(_DOUBLE + ".") for n in names) and "x_embedder.weight" in names:
    return "diffusers"
  shown = sorted(names)[:8]
  raise ValueError(
    f"unknown Flux.1 single-file layout: expected BFL names (img_in.weight, double_blocks.N.…) or "
    f"diffusers names (x_embedder.weight, transformer_blocks.N.…); the file has {len(names)} tensors, "
    f"e.g. {shown}"
  )


def config_from_bfl(shapes: Mapping[str, Sequence[int]], **overrides: Any) -> FluxConfig:
  """A `FluxConfig` read off a BFL file's tensor shapes (its header holds no config).

  The rotary split `axes_dims_rope` is not in the file: (16, 56, 56) is used for 128-d heads (every
  released Flux.1); pass `axes_dims_rope=` otherwise.
  """
  s = {k.removeprefix(_BFL_PREFIX): tuple(v) for k, v in shapes.items()}

  def count(prefix):
    return len({k.split(".")[1] for k in s if k.startswith(prefix)})

  try:
    inner, in_channels = s["img_in.weight"]
    head_dim = s["double_blocks.0.img_attn.norm.query_norm.scale"][0]
    kw = dict(
      in_channels=in_channels,
      out_channels=s["final_layer.linear.weight"][0],
      num_layers=count("double_blocks."),
      num_single_layers=count("single_blocks."),
      attention_head_dim=head_dim,
      num_attention_heads=inner // head_dim,
      joint_attention_dim=s["txt_in.weight"][1],
      pooled_projection_dim=s["vector_in.in_layer.weight"][1],
      guidance_embeds="guidance_in.in_layer.weight" in s,
    )
  except KeyError as e:
    raise ValueError(f"not a Flux.1 BFL checkpoint: tensor {e} is missing") from None
  if "axes_dims_rope" not in overrides:
    if head_dim != 128:
      raise ValueError(
        f"heads of {head_dim} features: the rotary split is not in the file; pass "
        "config=FluxConfig(...) or axes_dims_rope=(...)"
      )
  kw.update(overrides)
  if kw["out_channels"] == kw["in_channels"]:
    kw["out_channels"] = None
  return FluxConfig(**kw)


def _component_folder(source, subfolder):
  path = pathlib.Path(os.fspath(source)).expanduser()
  if path.is_dir() and (path / "config.json").is_file() and not (path / subfolder).is_dir():
    return path
  return md_core.resolve_source(source, subfolder=subfolder)


def load_flux(
  source: str | os.PathLike,
  *,
  subfolder: str = "transformer",
  config: FluxConfig | None = None,
  mesh=None,
  dtype: Any = None,
  rules=None,
  attention=None,
  remat: str | None = None,
  progress: bool = False,
) -> FluxTransformer:
  """Loads a Flux.1 transformer from a diffusers checkpoint or BFL's single file.

  Args:
    source: a diffusers pipeline folder or hub id (its `subfolder` is read), the transformer's own
      folder, or a single `.safetensors` file in BFL's layout (`flux1-dev.safetensors`) or diffusers'.
    subfolder: the transformer's component folder in a pipeline.
    config: the model's config; read from `config.json` for folders, from the tensor shapes for BFL
      files (`config_from_bfl`). Required for a single file in diffusers' layout.
    mesh: place parameters on this mesh by their logical axes (md-sharding rules `rules`).
    dtype: dtype of floating parameters (default: float32 as built).
    rules: md-sharding logical axis rules.
    attention: an `md_attention.AttentionConfig` replacing `config.attention`.
    remat: replaces `config.remat`.
    progress: show a progress bar while loading.

  Returns:
    The `FluxTransformer` with its weights.

  Raises:
    ValueError: an unknown single-file layout or a config that cannot be inferred.
    md_core.WeightLoadError: tensors that do not fit the model (all listed).
  """
  path = pathlib.Path(os.fspath(source)).expanduser()
  if path.is_file():
    ckpt = md_core.open_checkpoint(path)
    layout = single_file_layout(list(ckpt))
    if layout == "bfl":
      cfg = config or config_from_bfl({k: ckpt.shape(k) for k in ckpt})
      checkpoint, key_map = bfl_view(ckpt, cfg.inner_dim), convert_key_bfl
    else:
      if config is None:
        raise ValueError(
          f"{path}: a single file in diffusers' layout carries no config; pass config=FluxConfig(...)"
        )
      cfg, checkpoint, key_map = config, ckpt, convert_key
  else:
    folder = _component_folder(source, subfolder)
    cfg = config or FluxConfig.from_json(folder / "config.json")
    checkpoint, key_map = md_core.open_checkpoint(folder), convert_key
  changes = {}
  if attention is not None:
    changes["attention"] = attention
  if remat is not None:
    changes["remat"] = remat
  cfg = dataclasses.replace(cfg, **changes) if changes else cfg
  return md_core.load_weights(
    lambda: FluxTransformer(cfg, rngs=nnx.Rngs(0)),
    checkpoint,
    key_map,
    dtype=dtype,
    mesh=mesh,
    rules=rules,
    progress=progress,
  )
