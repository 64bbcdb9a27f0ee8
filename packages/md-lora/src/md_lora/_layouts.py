"""Module-name layouts of LoRA files: the reference models' original names → diffusers module names.

Files made outside diffusers name modules as the model's original code does: BFL's Flux.1 (`double_blocks.N.
img_attn.qkv`, fused q/k/v and single blocks' fused `linear1` = q, k, v and the MLP input) and Flux.2
(the same block names, shared `*_stream_modulation` layers; `linear1` stays fused in diffusers), Wan's
(`blocks.N.self_attn.q`, `ffn.0`, `head.head`), the SGM UNet of SD / SDXL (`input_blocks.4.1.…`) and
LTX-2's (`patchify_proj`, `adaln_single`, `q_norm`). Each translator here maps such a module name to the
diffusers module(s) it is, with the rows of the output axis each one takes: a LoRA on a fused projection is
one LoRA per part, sharing `lora_A` and taking its part of `lora_B`'s rows (exact: `B[rows] @ A` is the
part of the fused delta). The families' diffusers key maps take it from there.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Collection, Sequence

import numpy as np

# A piece of a module: (diffusers module name, rows of the output axis it takes, or None for all).
Piece = tuple[str, np.ndarray | None]
Translator = Callable[[str, int, int], list[Piece] | None]  # (name, out rows, in features) → pieces


def _thirds(out: int) -> list[np.ndarray]:
  size = out // 3
  return [np.arange(j * size, (j + 1) * size) for j in range(3)]


# BFL Flux.1 → diffusers FluxTransformer2DModel.
_FLUX_TOP = {
  "img_in": "x_embedder",
  "txt_in": "context_embedder",
  "time_in.in_layer": "time_text_embed.timestep_embedder.linear_1",
  "time_in.out_layer": "time_text_embed.timestep_embedder.linear_2",
  "guidance_in.in_layer": "time_text_embed.guidance_embedder.linear_1",
  "guidance_in.out_layer": "time_text_embed.guidance_embedder.linear_2",
  "vector_in.in_layer": "time_text_embed.text_embedder.linear_1",
  "vector_in.out_layer": "time_text_embed.text_embedder.linear_2",
  "final_layer.linear": "proj_out",
}
_FLUX_DOUBLE = {
  "img_mod.lin": "norm1.linear",
  "txt_mod.lin": "norm1_context.linear",
  "img_attn.proj": "attn.to_out.0",
  "txt_attn.proj": "attn.to_add_out",
  "img_mlp.0": "ff.net.0.proj",
  "img_mlp.2": "ff.net.2",
  "txt_mlp.0": "ff_context.net.0.proj",
  "txt_mlp.2": "ff_context.net.2",
  "img_attn.norm.query_norm": "attn.norm_q",
  "img_attn.norm.key_norm": "attn.norm_k",
  "txt_attn.norm.query_norm": "attn.norm_added_q",
  "txt_attn.norm.key_norm": "attn.norm_added_k",
}
_FLUX_QKV = {
  "img_attn.qkv": ("attn.to_q", "attn.to_k", "attn.to_v"),
  "txt_attn.qkv": ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj"),
}
_FLUX_SINGLE = {
  "modulation.lin": "norm.linear",
  "linear2": "proj_out",
  "norm.query_norm": "attn.norm_q",
  "norm.key_norm": "attn.norm_k",
}
_FLUX_BLOCK = re.compile(r"(double_blocks|single_blocks)\.(\d+)\.(.+)")


def _bfl_top(name: str, out: int, top: dict[str, str]) -> list[Piece] | None:
  """A BFL top-level module (Flux.1 and Flux.2): renamed, the final modulation's BFL `[shift; scale]`
  rows put in diffusers' `[scale; shift]` order."""
  if name in top:
    return [(top[name], None)]
  if name == "final_layer.adaLN_modulation.1":
    half = out // 2
    return [("norm_out.linear", np.r_[half:out, 0:half])]
  return None


def _bfl_double(i: str, rest: str, out: int, double: dict[str, str]) -> list[Piece] | None:
  """A module of BFL double block `i` (Flux.1 and Flux.2): renamed, or a fused qkv split in thirds."""
  head = f"transformer_blocks.{i}."
  if rest in double:
    return [(head + double[rest], None)]
  if rest in _FLUX_QKV:
    return [(head + n, rows) for n, rows in zip(_FLUX_QKV[rest], _thirds(out))]
  return None


def flux_bfl(name: str, out: int, features: int) -> list[Piece] | None:
  """BFL Flux.1 module → diffusers module(s).

  >>> [(n, r[[0, -1]].tolist()) for n, r in flux_bfl("single_blocks.0.linear1", 56, 8)]
  [('single_transformer_blocks.0.attn.to_q', [0, 7]), ('single_transformer_blocks.0.attn.to_k', [8, 15]), \
('single_transformer_blocks.0.attn.to_v', [16, 23]), ('single_transformer_blocks.0.proj_mlp', [24, 55])]
  """
  pieces = _bfl_top(name, out, _FLUX_TOP)
  m = _FLUX_BLOCK.fullmatch(name)
  if pieces is not None or m is None:
    return pieces
  stack, i, rest = m.groups()
  if stack == "double_blocks":
    return _bfl_double(i, rest, out, _FLUX_DOUBLE)
  head = f"single_transformer_blocks.{i}."
  if rest in _FLUX_SINGLE:
    return [(head + _FLUX_SINGLE[rest], None)]
  if rest == "linear1":  # rows [q; k; v; mlp]; q, k, v are as wide as the block's input
    qkv = [np.arange(j * features, (j + 1) * features) for j in range(3)]
    names = ("attn.to_q", "attn.to_k", "attn.to_v")
    return [(head + n, r) for n, r in zip(names, qkv)] + [
      (head + "proj_mlp", np.arange(3 * features, out))
    ]
  return None


# BFL Flux.2 (ai-toolkit / ComfyUI / kohya files for Klein) → diffusers Flux2Transformer2DModel.
_FLUX2_TOP = {
  "img_in": "x_embedder",
  "txt_in": "context_embedder",
  "time_in.in_layer": "time_guidance_embed.timestep_embedder.linear_1",
  "time_in.out_layer": "time_guidance_embed.timestep_embedder.linear_2",
  "guidance_in.in_layer": "time_guidance_embed.guidance_embedder.linear_1",
  "guidance_in.out_layer": "time_guidance_embed.guidance_embedder.linear_2",
  "final_layer.linear": "proj_out",
  "double_stream_modulation_img.lin": "double_stream_modulation_img.linear",
  "double_stream_modulation_txt.lin": "double_stream_modulation_txt.linear",
  "single_stream_modulation.lin": "single_stream_modulation.linear",
}
_FLUX2_DOUBLE = {
  "img_attn.proj": "attn.to_out.0",
  "txt_attn.proj": "attn.to_add_out",
  "img_mlp.0": "ff.linear_in",
  "img_mlp.2": "ff.linear_out",
  "txt_mlp.0": "ff_context.linear_in",
  "txt_mlp.2": "ff_context.linear_out",
  "img_attn.norm.query_norm": "attn.norm_q",
  "img_attn.norm.key_norm": "attn.norm_k",
  "txt_attn.norm.query_norm": "attn.norm_added_q",
  "txt_attn.norm.key_norm": "attn.norm_added_k",
}
_FLUX2_SINGLE = {
  "linear1": "attn.to_qkv_mlp_proj",  # q, k, v and the MLP input, fused in diffusers too
  "linear2": "attn.to_out",
  "norm.query_norm": "attn.norm_q",
  "norm.key_norm": "attn.norm_k",
}
# Block names some Flux.2 exporters already write in diffusers' form (one of them as `sformer_blocks.`).
_FLUX2_EXPANDED = {
  "transformer_blocks.": "transformer_blocks.",
  "single_transformer_blocks.": "single_transformer_blocks.",
  "sformer_blocks.": "transformer_blocks.",
}


def flux2_bfl(name: str, out: int, features: int) -> list[Piece] | None:
  """BFL Flux.2 module → diffusers module(s): a double block's fused qkv splits in thirds, everything else
  is renamed; `final_layer.adaLN_modulation.1`'s `[shift; scale]` rows become diffusers' `[scale; shift]`
  (as diffusers' own checkpoint conversion swaps them).

  >>> flux2_bfl("single_blocks.1.linear1", 120, 8)
  [('single_transformer_blocks.1.attn.to_qkv_mlp_proj', None)]
  """
  pieces = _bfl_top(name, out, _FLUX2_TOP)
  if pieces is not None:
    return pieces
  for old, new in _FLUX2_EXPANDED.items():
    if name.startswith(old):
      return [(new + name[len(old) :], None)]
  m = _FLUX_BLOCK.fullmatch(name)
  if m is None:
    return None
  stack, i, rest = m.groups()
  if stack == "double_blocks":
    return _bfl_double(i, rest, out, _FLUX2_DOUBLE)
  rest = _FLUX2_SINGLE.get(rest)
  return None if rest is None else [(f"single_transformer_blocks.{i}.{rest}", None)]


def _is_flux2(paths: Collection[tuple]) -> bool:
  """Whether md parameter paths are a Flux.2 transformer's (its shared modulation layers)."""
  return any(p[:1] == ("single_stream_modulation",) for p in paths)


# Wan's original modules → diffusers WanTransformer3DModel.
_WAN_BLOCK = {
  "self_attn.q": "attn1.to_q",
  "self_attn.k": "attn1.to_k",
  "self_attn.v": "attn1.to_v",
  "self_attn.o": "attn1.to_out.0",
  "self_attn.norm_q": "attn1.norm_q",
  "self_attn.norm_k": "attn1.norm_k",
  "cross_attn.q": "attn2.to_q",
  "cross_attn.k": "attn2.to_k",
  "cross_attn.v": "attn2.to_v",
  "cross_attn.o": "attn2.to_out.0",
  "cross_attn.k_img": "attn2.add_k_proj",
  "cross_attn.v_img": "attn2.add_v_proj",
  "cross_attn.norm_q": "attn2.norm_q",
  "cross_attn.norm_k": "attn2.norm_k",
  "cross_attn.norm_k_img": "attn2.norm_added_k",
  "norm3": "norm2",  # Wan's cross-attention norm (the affine one) is diffusers' norm2
  "ffn.0": "ffn.net.0.proj",
  "ffn.2": "ffn.net.2",
}
_WAN_TOP = {
  "patch_embedding": "patch_embedding",
  "text_embedding.0": "condition_embedder.text_embedder.linear_1",
  "text_embedding.2": "condition_embedder.text_embedder.linear_2",
  "time_embedding.0": "condition_embedder.time_embedder.linear_1",
  "time_embedding.2": "condition_embedder.time_embedder.linear_2",
  "time_projection.1": "condition_embedder.time_proj",
  "head.head": "proj_out",
  "img_emb.proj.0": "condition_embedder.image_embedder.norm1",
  "img_emb.proj.1": "condition_embedder.image_embedder.ff.net.0.proj",
  "img_emb.proj.3": "condition_embedder.image_embedder.ff.net.2",
  "img_emb.proj.4": "condition_embedder.image_embedder.norm2",
}
_WAN_BLOCK_RE = re.compile(r"blocks\.(\d+)\.(.+)")


def wan_original(name: str, out: int, features: int) -> list[Piece] | None:
  """Wan 2.1 / 2.2 original module → diffusers module.

  >>> wan_original("blocks.7.cross_attn.k_img", 16, 16)
  [('blocks.7.attn2.add_k_proj', None)]
  """
  if name in _WAN_TOP:
    return [(_WAN_TOP[name], None)]
  m = _WAN_BLOCK_RE.fullmatch(name)
  if m and m.group(2) in _WAN_BLOCK:
    return [(f"blocks.{m.group(1)}.{_WAN_BLOCK[m.group(2)]}", None)]
  return None


# LTX-2's original names → diffusers LTX2VideoTransformer3DModel (md_ltx's single-file renames).
_LTX2_RENAMES = (
  ("audio_patchify_proj", "audio_proj_in"),
  ("patchify_proj", "proj_in"),
  ("av_ca_video_scale_shift_adaln_single", "av_cross_attn_video_scale_shift"),
  ("av_ca_a2v_gate_adaln_single", "av_cross_attn_video_a2v_gate"),
  ("av_ca_audio_scale_shift_adaln_single", "av_cross_attn_audio_scale_shift"),
  ("av_ca_v2a_gate_adaln_single", "av_cross_attn_audio_v2a_gate"),
  ("audio_prompt_adaln_single", "audio_prompt_adaln"),
  ("prompt_adaln_single", "prompt_adaln"),
  ("q_norm", "norm_q"),
  ("k_norm", "norm_k"),
)


def ltx2_original(name: str, out: int, features: int) -> list[Piece] | None:
  """LTX-2 original module → diffusers module (most names are the same in both).

  >>> ltx2_original("audio_adaln_single.linear", 8, 8)
  [('audio_time_embed.linear', None)]
  """
  for old, new in _LTX2_RENAMES:
    name = name.replace(old, new)
  for old, new in (("adaln_single.", "time_embed."), ("audio_adaln_single.", "audio_time_embed.")):
    if name.startswith(old):
      name = new + name[len(old) :]
  return [(name, None)]


def sgm_unet(paths: Collection[tuple]) -> Translator:
  """The SGM (original SD / SDXL) UNet's module names → diffusers', for the model whose paths are given.

  SGM numbers the UNet's layers in one list per side (`input_blocks.N.M`, `output_blocks.N.M`); which
  diffusers block, resnet or attention each is follows from layers per block and which blocks attend,
  read here off md's parameter paths (`down_blocks/1/attentions/0/…`).
  """
  per_block = 1 + max(
    (p[3] for p in paths if p[:1] == ("down_blocks",) and p[2] == "resnets"), default=1
  )
  attends_down = {p[1] for p in paths if p[:1] == ("down_blocks",) and p[2] == "attentions"}
  attends_up = {p[1] for p in paths if p[:1] == ("up_blocks",) and p[2] == "attentions"}
  n_down = 1 + max((p[1] for p in paths if p[:1] == ("down_blocks",)), default=0)
  inputs: dict[int, tuple[str, dict[str, str]]] = {0: ("", {"0": "conv_in"})}
  n = 1
  for i in range(n_down):
    for j in range(per_block):
      parts = {"0": f"down_blocks.{i}.resnets.{j}"}
      if i in attends_down:
        parts["1"] = f"down_blocks.{i}.attentions.{j}"
      inputs[n] = ("", parts)
      n += 1
    if i < n_down - 1:
      inputs[n] = ("", {"0.op": f"down_blocks.{i}.downsamplers.0.conv"})
      n += 1
  outputs: dict[int, dict[str, str]] = {}
  n = 0
  for i in range(n_down):
    for j in range(per_block + 1):
      parts = {"0": f"up_blocks.{i}.resnets.{j}"}
      if i in attends_up:
        parts["1"] = f"up_blocks.{i}.attentions.{j}"
      if j == per_block and i < n_down - 1:
        parts["2" if i in attends_up else "1"] = f"up_blocks.{i}.upsamplers.0"
      outputs[n] = parts
      n += 1
  middle = {"0": "mid_block.resnets.0", "1": "mid_block.attentions.0", "2": "mid_block.resnets.1"}
  resnet = {
    "in_layers.0": "norm1",
    "in_layers.2": "conv1",
    "emb_layers.1": "time_emb_proj",
    "out_layers.0": "norm2",
    "out_layers.3": "conv2",
    "skip_connection": "conv_shortcut",
  }
  top = {
    "time_embed.0": "time_embedding.linear_1",
    "time_embed.2": "time_embedding.linear_2",
    "label_emb.0.0": "add_embedding.linear_1",
    "label_emb.0.2": "add_embedding.linear_2",
    "out.0": "conv_norm_out",
    "out.2": "conv_out",
    "input_blocks.0.0": "conv_in",
  }

  def inner(base: str, rest: str) -> str:
    if ".resnets." in base:
      return f"{base}.{resnet.get(rest, rest)}"
    if base.endswith(".upsamplers.0") and rest == "conv":
      return f"{base}.conv"
    return f"{base}.{rest}" if rest else base

  def translate(name: str, out: int, features: int) -> list[Piece] | None:
    if name in top:
      return [(top[name], None)]
    m = re.fullmatch(r"(input_blocks|output_blocks)\.(\d+)\.(\d+)(?:\.(.+))?", name)
    if m:
      side, n, part, rest = m.group(1), int(m.group(2)), m.group(3), m.group(4) or ""
      if side == "input_blocks" and n in inputs:
        parts = inputs[n][1]
        if f"{part}.{rest}" in parts:  # downsampler "0.op"
          return [(parts[f"{part}.{rest}"], None)]
        if part in parts:
          return [(inner(parts[part], rest), None)]
      if side == "output_blocks" and n in outputs and part in outputs[n]:
        return [(inner(outputs[n][part], rest), None)]
      return None
    m = re.fullmatch(r"middle_block\.(\d)(?:\.(.+))?", name)
    if m and m.group(1) in middle:
      return [(inner(middle[m.group(1)], m.group(2) or ""), None)]
    return None

  return translate


def detect_layout(names: Sequence[str]) -> str | None:
  """The module-name layout of a file's modules: "flux-bfl", "wan", "sgm-unet", "ltx2" or None
  (diffusers names, or names the family's key map reads as they are)."""
  bfl = ("double_blocks.", "single_blocks.", "final_layer.", "img_in", "txt_in", "time_in.")
  bfl += ("guidance_in.", "vector_in.", "double_stream_modulation_", "single_stream_modulation.")
  if any(n.startswith(bfl) for n in names):
    return "flux-bfl"
  if any(re.match(r"blocks\.\d+\.(self_attn\.|cross_attn\.|ffn\.\d$)", n) for n in names):
    return "wan"
  if any(n.startswith(("input_blocks.", "output_blocks.", "middle_block.")) for n in names):
    return "sgm-unet"
  if any(w in n for n in names for w in ("patchify_proj", "adaln_single", ".q_norm", ".k_norm")):
    return "ltx2"
  return None


def translator(layout: str | None, paths: Collection[tuple]) -> Translator | None:
  if layout is None:
    return None
  if layout == "sgm-unet":
    return sgm_unet(paths)
  if layout == "flux-bfl" and _is_flux2(paths):
    return flux2_bfl
  return {"flux-bfl": flux_bfl, "wan": wan_original, "ltx2": ltx2_original}[layout]


# What a file's module names say about the model it was made for (for "this LoRA is for another model").
FAMILY_HINTS = (
  ("flux-bfl", "Flux.1 (BFL names)"),
  ("wan", "Wan (original names)"),
  ("sgm-unet", "an SD / SDXL UNet (SGM names)"),
  ("ltx2", "LTX-2 (original names)"),
)


# SD 1.x / 2.x and SDXL UNets, told apart by their cross-attention width (the text states' width that
# `attn2.to_k` / `attn2.to_v` read) or, without those modules, by blocks only one of them has: SDXL has
# several transformer blocks per attention, none in its first down / last up block (SGM `input_blocks.1-2`,
# `output_blocks.9-11`), attention in its first up block (SGM `output_blocks.0-2`).
_UNET_WIDTHS = {768: "an SD 1.x UNet", 1024: "an SD 2.x UNet", 2048: "an SDXL UNet"}
_SDXL_BLOCKS = re.compile(
  r"(^|\.)(transformer_blocks\.[1-9]|up_blocks\.0\.attentions|output_blocks\.[0-2]\.1)\.|label_emb\."
)
_SD1_BLOCKS = re.compile(
  r"(^|\.)(down_blocks\.0\.attentions|up_blocks\.3\.attentions|input_blocks\.[12]\.1|"
  r"output_blocks\.(9|10|11)\.1)\."
)


def _unet_model(names: Sequence[str], context_widths: Collection[int]) -> str:
  """Which SD UNet a file's modules come from: by cross-attention width, else by block names."""
  known = {_UNET_WIDTHS[w] for w in context_widths if w in _UNET_WIDTHS}
  if len(known) == 1:
    return known.pop()
  sdxl = any(_SDXL_BLOCKS.search(n) for n in names)
  sd1 = any(_SD1_BLOCKS.search(n) for n in names)
  if sdxl != sd1:
    return "an SDXL UNet" if sdxl else "an SD 1.x / 2.x UNet"
  return "an SD / SDXL UNet"


def guess_model(names: Sequence[str], context_widths: Collection[int] = ()) -> str | None:
  """A short guess at the model a LoRA's module names belong to (None when they do not say).

  Args:
    names: the file's module names.
    context_widths: the input widths of its cross-attention key / value modules (`attn2.to_k`), which
      tell SD 1.x (768), SD 2.x (1024) and SDXL (2048) UNets apart.
  """
  flux2 = ("double_stream_modulation", "single_stream_modulation", "to_qkv_mlp_proj", "linear_in")
  if any(w in n for n in names for w in flux2):
    return "Flux.2 (BFL or diffusers names)"
  layout = detect_layout(names)
  if layout == "sgm-unet":
    return f"{_unet_model(names, context_widths)} (SGM names)"
  if layout is not None:
    return dict(FAMILY_HINTS)[layout]
  checks = (
    ("single_transformer_blocks.", "Flux.1 (diffusers names)"),
    ("down_blocks.", "UNET (diffusers names)"),
    ("text_model.encoder.layers.", "a CLIP text encoder"),
    ("audio_to_video_attn", "LTX-2 (diffusers names)"),
  )
  for needle, what in checks:
    if any(needle in n for n in names):
      return what.replace("UNET", _unet_model(names, context_widths))
  if any(re.match(r"blocks\.\d+\.attn1\.", n) for n in names):
    return "Wan (diffusers names)"
  return None
