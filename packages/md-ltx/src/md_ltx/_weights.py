"""LTX-Video transformer weights: diffusers and original single-file tensor names → md paths, and loaders."""

from __future__ import annotations

import os
import pathlib
import re
from typing import Any

import jax
from flax import nnx

import md_core
from md_ltx._config import LTXConfig
from md_ltx._transformer import LTXTransformer

# Per-block modules: diffusers name → (md path, kind).
_BLOCK_MODULES = {
  f"attn{i}.{name}": (f"attn{i}/{md}", kind)
  for i in (1, 2)
  for name, md, kind in (
    ("to_q", "to_q", "linear"),
    ("to_k", "to_k", "linear"),
    ("to_v", "to_v", "linear"),
    ("to_out.0", "to_out", "linear"),
    ("norm_q", "norm_q", "norm"),
    ("norm_k", "norm_k", "norm"),
  )
} | {
  "norm1": ("norm1", "norm"),  # only with norm_elementwise_affine
  "norm2": ("norm2", "norm"),
  "ff.net.0.proj": ("ff/proj_in", "linear"),
  "ff.net.2": ("ff/proj_out", "linear"),
}

_TOP_MODULES = {
  "proj_in": ("proj_in", "linear"),
  "time_embed.emb.timestep_embedder.linear_1": ("time_embedder/linear_1", "linear"),
  "time_embed.emb.timestep_embedder.linear_2": ("time_embedder/linear_2", "linear"),
  "time_embed.linear": ("time_proj", "linear"),
  "caption_projection.linear_1": ("caption_projection/proj_in", "linear"),
  "caption_projection.linear_2": ("caption_projection/proj_out", "linear"),
  "proj_out": ("proj_out", "linear"),
}

_BLOCK = re.compile(r"transformer_blocks\.(\d+)\.(.+)\.(weight|bias)")
_MODULE = re.compile(r"(.+)\.(weight|bias)")

# The modulation tables stay float32 whatever the load dtype (they are added to the timestep projection).
KEEP_F32 = (r"scale_shift_table$",)

# The original single-file names (`ltxv-2b-0.9.x.safetensors`, `ltxv-13b-0.9.7-dev.safetensors`), in the
# order diffusers' `convert_ltx_transformer_checkpoint_to_diffusers` renames them.
_ORIGINAL_RENAMES = (
  ("patchify_proj", "proj_in"),
  ("adaln_single", "time_embed"),
  ("q_norm", "norm_q"),
  ("k_norm", "norm_k"),
)
ORIGINAL_PREFIX = "model.diffusion_model."
# The original files also hold the VAE (`vae.…`), which the transformer does not read.
ORIGINAL_ALLOW_UNUSED = (r"vae\..*",)


def _leaf(kind: str, suffix: str) -> tuple[str, str]:
  if kind == "linear":
    return ("kernel", "linear") if suffix == "weight" else ("bias", "identity")
  return ("scale" if suffix == "weight" else "bias"), "identity"


def _path(text: str) -> tuple[str, ...]:
  return tuple(text.split("/"))


def convert_key(name: str) -> md_core.Target | None:
  """Maps one diffusers `LTXVideoTransformer3DModel` tensor name to md's `LTXTransformer` parameter.

  Block tensors `transformer_blocks.<i>.…` go to layer `i` of the stacked (scanned) parameter. Returns None
  for names that are not parameters of the model.

  >>> convert_key("transformer_blocks.3.attn1.to_q.weight")
  Target(path=('blocks', 'attn1', 'to_q', 'kernel'), layout='linear', split=None, layer=3)
  """
  if name == "scale_shift_table":
    return md_core.Target(("scale_shift_table",))
  m = re.fullmatch(r"transformer_blocks\.(\d+)\.scale_shift_table", name)
  if m:
    return md_core.Target(("blocks", "scale_shift_table"), layer=int(m.group(1)))
  m = _BLOCK.fullmatch(name)
  if m:
    layer, module, suffix = int(m.group(1)), m.group(2), m.group(3)
    if module not in _BLOCK_MODULES:
      return None
    path, kind = _BLOCK_MODULES[module]
    leaf, layout = _leaf(kind, suffix)
    return md_core.Target(("blocks",) + _path(path) + (leaf,), layout, layer=layer)
  m = _MODULE.fullmatch(name)
  if m and m.group(1) in _TOP_MODULES:
    path, kind = _TOP_MODULES[m.group(1)]
    leaf, layout = _leaf(kind, m.group(2))
    return md_core.Target(_path(path) + (leaf,), layout)
  return None


def original_to_diffusers(name: str) -> str | None:
  """An original LTX-Video single-file transformer name → its diffusers name (None: not the transformer).

  >>> original_to_diffusers("model.diffusion_model.adaln_single.linear.weight")
  'time_embed.linear.weight'
  """
  if not name.startswith(ORIGINAL_PREFIX):
    return None
  name = name[len(ORIGINAL_PREFIX) :]
  for old, new in _ORIGINAL_RENAMES:
    name = name.replace(old, new)
  return name


def convert_original_key(name: str) -> md_core.Target | None:
  """Maps one original single-file tensor name (`model.diffusion_model.…`) to md's parameter."""
  diffusers = original_to_diffusers(name)
  return None if diffusers is None else convert_key(diffusers)


def original_config(checkpoint, **overrides) -> LTXConfig:
  """The `LTXConfig` of an original single-file checkpoint, read from its tensor shapes.

  The files carry no diffusers config; widths, depth and caption width follow from the shapes. The head count
  does not, so it is 32 (every released LTX-Video model) unless `num_attention_heads` is given.
  """
  p = ORIGINAL_PREFIX

  def shape(key):
    if key not in checkpoint:
      raise ValueError(
        f"{getattr(checkpoint, 'name', 'checkpoint')}: tensor {key!r} not found; is this an original "
        "LTX-Video single file (ltxv-2b-0.9.x / ltxv-13b-0.9.x)?"
      )
    return tuple(checkpoint.shape(key)) if hasattr(checkpoint, "shape") else checkpoint[key].shape

  dim, in_channels = shape(p + "patchify_proj.weight")
  out_channels = shape(p + "proj_out.weight")[0]
  caption = shape(p + "caption_projection.linear_1.weight")[1]
  layers = {
    int(m.group(1))
    for k in checkpoint
    if (m := re.match(re.escape(p) + r"transformer_blocks\.(\d+)\.", k))
  }
  heads = overrides.pop("num_attention_heads", 32)
  if dim % heads:
    raise ValueError(f"model width {dim} is not divisible by num_attention_heads={heads}")
  affine = any(k.startswith(p + "transformer_blocks.0.norm1.") for k in checkpoint)
  return LTXConfig(
    in_channels=in_channels,
    out_channels=out_channels,
    num_attention_heads=heads,
    attention_head_dim=dim // heads,
    cross_attention_dim=dim,
    num_layers=len(layers),
    caption_channels=caption,
    norm_elementwise_affine=affine,
    **overrides,
  )


def load_transformer(
  source: str | os.PathLike,
  *,
  subfolder: str | None = "transformer",
  mesh: jax.sharding.Mesh | None = None,
  dtype: Any = None,
  rules: Any = None,
  progress: bool = False,
  **overrides,
) -> LTXTransformer:
  """Loads an LTX-Video transformer onto `mesh` from diffusers weights or an original single file.

  Args:
    source: a diffusers pipeline folder or hub id (`"Lightricks/LTX-Video"`), a transformer folder with
      `subfolder=None`, or an original single `.safetensors` file (`ltxv-2b-0.9.6-dev.safetensors`,
      `ltxv-13b-0.9.7-dev.safetensors`; its config is read from the tensor shapes, see `original_config`).
    subfolder: the component folder (ignored for a single file).
    mesh: place parameters on this mesh (md-sharding rules over their logical axes).
    dtype: floating dtype of the parameters (default float32: a bfloat16 file is upcast); the
      modulation tables stay float32.
    rules: md-sharding logical axis rules.
    progress: show a progress bar over tensors.
    **overrides: `LTXConfig` run-time settings, e.g. `attention="ring"`, `remat="full"`.

  Returns:
    The `LTXTransformer` with the checkpoint's weights.

  Raises:
    md_core.WeightLoadError: unknown, missing or mis-shaped tensors (all listed, with file and shapes).
  """
  path = pathlib.Path(os.fspath(source)).expanduser()
  if path.is_file():
    checkpoint = md_core.open_checkpoint(path)
    cfg = original_config(checkpoint, **overrides)
    convert, allow_unused = convert_original_key, ORIGINAL_ALLOW_UNUSED
  else:
    folder = md_core.resolve_source(source, subfolder=subfolder)
    cfg = LTXConfig.from_json(folder / "config.json", **overrides)
    checkpoint = md_core.open_checkpoint(folder)
    convert, allow_unused = convert_key, ()
  return md_core.load_weights(
    lambda: LTXTransformer(cfg, rngs=nnx.Rngs(0)),
    checkpoint,
    convert,
    dtype=dtype,
    keep_f32=KEEP_F32,
    mesh=mesh,
    rules=rules,
    allow_unused=allow_unused,
    progress=progress,
  )
