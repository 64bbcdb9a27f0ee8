"""Wan transformer weights: diffusers tensor names → md parameter paths, and the loader."""

from __future__ import annotations

import os
import re
from typing import Any

import jax
from flax import nnx

import md_core
from md_wan._config import WanConfig
from md_wan._transformer import WanTransformer

# Per-block modules: diffusers name → (md path, kind).
_BLOCK_MODULES = {
  "attn1.to_q": ("attn1/to_q", "linear"),
  "attn1.to_k": ("attn1/to_k", "linear"),
  "attn1.to_v": ("attn1/to_v", "linear"),
  "attn1.to_out.0": ("attn1/to_out", "linear"),
  "attn1.norm_q": ("attn1/norm_q", "norm"),
  "attn1.norm_k": ("attn1/norm_k", "norm"),
  "attn2.to_q": ("attn2/to_q", "linear"),
  "attn2.to_k": ("attn2/to_k", "linear"),
  "attn2.to_v": ("attn2/to_v", "linear"),
  "attn2.to_out.0": ("attn2/to_out", "linear"),
  "attn2.norm_q": ("attn2/norm_q", "norm"),
  "attn2.norm_k": ("attn2/norm_k", "norm"),
  "attn2.add_k_proj": ("attn2/add_k_proj", "linear"),
  "attn2.add_v_proj": ("attn2/add_v_proj", "linear"),
  "attn2.norm_added_k": ("attn2/norm_added_k", "norm"),
  "norm2": ("norm2", "norm"),
  "ffn.net.0.proj": ("ffn/proj_in", "linear"),
  "ffn.net.2": ("ffn/proj_out", "linear"),
}

_TOP_MODULES = {
  "patch_embedding": ("patch_embedding", "conv3d"),
  "condition_embedder.time_embedder.linear_1": ("time_embedder/linear_1", "linear"),
  "condition_embedder.time_embedder.linear_2": ("time_embedder/linear_2", "linear"),
  "condition_embedder.time_proj": ("time_proj", "linear"),
  "condition_embedder.text_embedder.linear_1": ("text_embedder/linear_1", "linear"),
  "condition_embedder.text_embedder.linear_2": ("text_embedder/linear_2", "linear"),
  "condition_embedder.image_embedder.norm1": ("image_embedder/norm1", "norm"),
  "condition_embedder.image_embedder.ff.net.0.proj": ("image_embedder/ff/proj_in", "linear"),
  "condition_embedder.image_embedder.ff.net.2": ("image_embedder/ff/proj_out", "linear"),
  "condition_embedder.image_embedder.norm2": ("image_embedder/norm2", "norm"),
  "proj_out": ("proj_out", "linear"),
}

_BLOCK = re.compile(r"blocks\.(\d+)\.(.+)\.(weight|bias)")
_MODULE = re.compile(r"(.+)\.(weight|bias)")

# Tensors that real files carry and the reference model ignores (`_keys_to_ignore_on_load_unexpected`).
ALLOW_UNUSED = (r"blocks\.\d+\.attn2\.norm_added_q\.weight",)
# Parameters the reference keeps in float32: diffusers matches `_keep_in_fp32_modules` ("time_embedder",
# "scale_shift_table", "norm1", "norm2", "norm3") as substrings of the names, which also catches the image
# embedder's norms.
KEEP_F32 = (
  r"scale_shift_table$",
  r"^time_embedder/",
  r"^blocks/norm2/",
  r"^image_embedder/norm[12]/",
)


def _leaf(kind: str, suffix: str) -> tuple[str, str]:
  if kind in ("linear", "conv3d"):
    return ("kernel", kind) if suffix == "weight" else ("bias", "identity")
  return ("scale" if suffix == "weight" else "bias"), "identity"


def _path(text: str) -> tuple[str, ...]:
  return tuple(text.split("/"))


def convert_key(name: str) -> md_core.Target | None:
  """Maps one diffusers `WanTransformer3DModel` tensor name to md's `WanTransformer` parameter.

  Block tensors `blocks.<i>.…` go to layer `i` of the stacked (scanned) parameter. Returns None for names
  that are not parameters of the model.

  >>> convert_key("blocks.3.attn1.to_q.weight")
  Target(path=('blocks', 'attn1', 'to_q', 'kernel'), layout='linear', split=None, layer=3)
  """
  if name == "scale_shift_table":
    return md_core.Target(("scale_shift_table",))
  if name == "condition_embedder.image_embedder.pos_embed":
    return md_core.Target(("image_embedder", "pos_embed"))
  m = re.fullmatch(r"blocks\.(\d+)\.scale_shift_table", name)
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


def load_transformer(
  source: str | os.PathLike,
  *,
  subfolder: str | None = "transformer",
  mesh: jax.sharding.Mesh | None = None,
  dtype: Any = None,
  rules: Any = None,
  progress: bool = False,
  **overrides,
) -> WanTransformer:
  """Loads a Wan transformer from a diffusers checkpoint (folder or hub id) onto `mesh`.

  Args:
    source: a diffusers pipeline folder or hub id (`"Wan-AI/Wan2.1-T2V-14B-Diffusers"`), or a transformer
      folder with `subfolder=None`.
    subfolder: the component: "transformer", or "transformer_2" for Wan 2.2's low-noise expert.
    mesh: place parameters on this mesh (md-sharding rules over their logical axes).
    dtype: floating dtype of the parameters (default float32: a bfloat16 file is upcast); the
      reference's float32 tables stay float32.
    rules: md-sharding logical axis rules.
    progress: show a progress bar over tensors.
    **overrides: `WanConfig` run-time settings, e.g. `attention="ulysses"`, `remat="full"`.

  Returns:
    The `WanTransformer` with the checkpoint's weights.
  """
  folder = md_core.resolve_source(source, subfolder=subfolder)
  cfg = WanConfig.from_json(folder / "config.json", **overrides)
  return md_core.load_weights(
    lambda: WanTransformer(cfg, rngs=nnx.Rngs(0)),
    md_core.open_checkpoint(folder),
    convert_key,
    dtype=dtype,
    keep_f32=KEEP_F32,
    mesh=mesh,
    rules=rules,
    allow_unused=ALLOW_UNUSED,
    progress=progress,
  )
