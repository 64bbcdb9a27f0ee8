"""LoRA file formats: reading a file's tensors into per-module factors in the reference's (torch) layout.

Four formats, told apart by their key names (`format=` forces one):
  peft:    `<prefix><module>.lora_A.weight` `[r, in, *k]`, `<prefix><module>.lora_B.weight` `[out, r, *1]`
           (diffusers' `save_lora_weights` with prefixes `unet.` / `transformer.` / `text_encoder.`, PEFT's
           `save_pretrained` with `base_model.model.`, AI-Toolkit's Flux files with `.alpha` tensors);
           `lora_B.bias` (PEFT's `lora_bias`) is a bias delta scaled like the weight's. Alpha from
           `adapter_config.json` beside the file, diffusers' `lora_adapter_metadata` in the header, or
           `<module>.alpha` tensors; without any, alpha = r (scale 1), as diffusers loads such files.
  kohya:   `lora_unet_<module with _ for .>.lora_down.weight` / `.lora_up.weight` / `.alpha` (kohya-ss
           sd-scripts, A1111, musubi-tuner): UNet names in diffusers' tree or SGM's (`input_blocks_4_1_…`,
           kohya's SDXL files), text encoders `lora_te_` / `lora_te1_` / `lora_te2_`, Flux in BFL names,
           Wan in its original names; LyCORIS' own wrapper writes the same names under `lycoris_`
           (its "full" algorithm: whole deltas `.diff` / `.diff_b`, as ComfyUI's, not scaled; its norm
           modules' `.w_norm` / `.b_norm` the same on a norm layer's weight and bias). A
           module without `.alpha` in a file whose other modules have one is an error (`default_alpha=`
           assumes one); a file without any alpha gets alpha = r, as sd-scripts.
  comfyui: `diffusion_model.<module>.lora_A|lora_down.weight` / `lora_B|lora_up.weight` / `.alpha`, names as
           the model's original code has them (BFL Flux, Wan: also lightx2v's distillation LoRAs, LTX-2),
           plus full deltas `<module>.diff` (weight) and `<module>.diff_b` (bias), not scaled; alpha = r where
           a module has none.
  xlabs:   XLabs' Flux files: `double_blocks.N.processor.qkv_lora1|qkv_lora2|proj_lora1|proj_lora2.down|up.
           weight`, `single_blocks.N.processor.qkv_lora|proj_lora.…`; no alpha (scale 1, as XLabs applies
           them).
LyCORIS LoHa (`.hada_w1_a` …) and LoKr (`.lokr_w1`, `.lokr_w2_a` …) modules, in kohya or ComfyUI names, are
read as exact LoRAs of rank r1·r2, on linear layers and convolutions (Tucker cores `hada_t1` / `hada_t2` /
`lokr_t2` too); LoCon's Tucker core `lora_mid` is folded into `lora_down` (an exact LoRA of the same rank).
DoRA norms (peft's `lora_magnitude_vector`, LyCORIS' `dora_scale`) come with their module as its magnitude
(`LoRAWeight.magnitude`). LyCORIS' OFT (`.oft_blocks` [num, b, b]) and BOFT (`.oft_blocks` [stages, num, b, b]),
with `.alpha` (the constraint) and an optional `.rescale`, are read as rotations (`RawOFT`, then
`OFTWeight`); so are PEFT's OFT files (PEFT >= 0.14: `<prefix><module>.oft_R.weight` `[r or 1, b(b-1)/2]`,
the upper triangles of skew blocks, with `adapter_config.json`) and BOFT files (`<module>.boft_R`
`[stages, num, b, b]`, `<module>.boft_s` the output scales), as rotations of the weight's input axis.
Other OFT tensors (PEFT < 0.14's `oft_r` / `oft_s`…) are named and refused.
diffusers' own layouts from before PEFT (`<attn>.processor.to_q_lora.down.weight`, `<module>.lora.down.weight`,
`<module>.lora_linear_layer.down.weight`, no alpha) are renamed to the PEFT names of the same modules
(`diffusers_old_keys`) and read as peft files, as diffusers converts them.
Module names then go through a layout translator (md_lora._layouts) to the family's diffusers names.
"""

from __future__ import annotations

import json
import math
import numbers
import pathlib
import re
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np

FORMATS = ("peft", "kohya", "comfyui", "xlabs")

# The component prefixes a file may carry; with `prefix=None` the one most keys start with is used.
PEFT_PREFIXES = ("unet.", "transformer.", "base_model.model.", "diffusion_model.", "")
# `lycoris_`: LyCORIS' own network wrapper (`create_lycoris` / `LycorisNetwork.save_weights`) names the wrapped
# model's modules as kohya does, under its own prefix.
KOHYA_PREFIXES = ("lora_unet_", "lora_transformer_", "lycoris_")
COMFY_PREFIXES = ("diffusion_model.", "model.diffusion_model.", "transformer.", "")
# Components of a pipeline a file may hold beside the one read: their keys are skipped, not errors.
COMPONENTS = (
  "unet.",
  "transformer.",
  "text_encoder.",
  "text_encoder_2.",
  "text_encoder_3.",
  "lora_unet_",
  "lora_transformer_",
  "lora_te_",
  "lora_te1_",
  "lora_te2_",
  "lora_te3_",
  "diffusion_model.",
  "text_encoders.",
)
_PREFIXES = {
  "peft": PEFT_PREFIXES,
  "kohya": KOHYA_PREFIXES + ("lora_te_", "lora_te1_", "lora_te2_"),
  "comfyui": COMFY_PREFIXES,
  "xlabs": ("diffusion_model.", ""),
}

_FACTORS = {
  "peft": re.compile(
    r"(?P<module>.+)\.lora_(?P<ab>A|B)(?:\.(?P<adapter>[A-Za-z_]\w*))?\.(?P<kind>weight|bias)"
  ),
  "kohya": re.compile(r"(?P<module>[^.]+)\.lora_(?P<ab>down|up|mid)\.(?P<kind>weight)"),
  "comfyui": re.compile(r"(?P<module>.+)\.lora_(?P<ab>A|B|down|up|mid)\.(?P<kind>weight)"),
  "xlabs": re.compile(r"(?P<module>.+\.processor\.\w+)\.(?P<ab>down|up)\.(?P<kind>weight)"),
}
_PEFT_FACTOR = _FACTORS["peft"]
_KOHYA_FACTOR = _FACTORS["kohya"]
_ALPHA = re.compile(r"(?P<module>.+)\.alpha")
# peft / diffusers DoRA: the per-output norms of the adapted weight (`[out]`, conv `[1, out, 1, 1]`).
_MAGNITUDE = re.compile(r"(?P<module>.+)\.lora_magnitude_vector(?:\.[A-Za-z_]\w*)?")
# LyCORIS DoRA (`weight_decompose`): the norms `[out, 1, …]` (per output) or `[1, in, 1, …]` (per input).
_DORA_SCALE = re.compile(r"(?P<module>.+)\.dora_scale")
_DIFF = re.compile(r"(?P<module>.+)\.(?P<kind>diff|diff_b)")
# LyCORIS' NormModule (`train_norm`): whole deltas on a norm layer's weight and bias, read as `diff` / `diff_b`.
_NORM = re.compile(r"(?P<module>.+)\.(?P<kind>w_norm|b_norm)")
_NORM_KIND = {"w_norm": "diff", "b_norm": "diff_b"}
# LyCORIS LoHa: delta = (w1_a @ w1_b) * (w2_a @ w2_b) * alpha / r (Hadamard product of two low-rank factors);
# on a convolution with Tucker cores each part is einsum("abkl,bq,ap->pqkl", hada_t, hada_w_b, hada_w_a).
_LOHA = re.compile(r"(?P<module>.+)\.(?P<slot>hada_(?:w[12]_[ab]|t[12]))")
_LOHA_SLOTS = ("hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b")
# LyCORIS LoKr: delta = kron(w1, w2) * scale, each of w1 / w2 stored whole or as `_a @ _b`; scale =
# alpha / (the rank of a factored part, w2's first), or 1 when both are whole or the file has no alpha.
_LOKR = re.compile(r"(?P<module>.+)\.(?P<slot>lokr_(?:w[12](?:_[ab])?|t[12]))")
_LOKR_SLOTS = (
  "lokr_w1",
  "lokr_w1_a",
  "lokr_w1_b",
  "lokr_w2",
  "lokr_w2_a",
  "lokr_w2_b",
  "lokr_t1",
  "lokr_t2",
)
# LyCORIS OFT / BOFT: blocks of a rotation of the weight's output axis (`oft_blocks`: diagonal OFT [num, b, b],
# BOFT [stages, num, b, b]), a per-output `rescale` [out, 1, ...]; the module's `.alpha` is the constraint.
_OFT = re.compile(r"(?P<module>.+)\.(?P<slot>oft_blocks|rescale)")
_OFT_SLOTS = ("oft_blocks", "rescale")
# LyCORIS GLoRA: `ΔW = (W a1 a2 + b1 b2) · alpha / r` (`a2` `[r, in, 1…]`, `a1` `[in, r, 1…]` mix the input
# channels; `b2` `[r, in, *k]`, `b1` `[out, r, 1…]` a LoRA).
_GLORA = re.compile(r"(?P<module>.+)\.(?P<slot>[ab][12])\.weight")
_GLORA_SLOTS = ("a1", "a2", "b1", "b2")
# LyCORIS IA³: `<module>.weight` (a vector: `[out]` / `[in]`, a convolution's `[1, n, 1…]`) scaling the weight's
# output channels, or its input channels when `<module>.on_input` is 1; kohya names only (`.weight` alone
# names nothing else there).
_IA3 = re.compile(r"(?P<module>[^.]+)\.(?P<slot>weight|on_input)")
# PEFT's OFT (>= 0.14): per module the strict upper triangles (row-major) of `r` skew-symmetric b x b blocks
# `[r, b(b-1)/2]` (`[1, …]` when `block_share`), rotating the weight's input axis.
_PEFT_OFT = re.compile(r"(?P<module>.+)\.oft_R(?:\.(?P<adapter>[A-Za-z_]\w*))?\.weight")
# PEFT's BOFT: `boft_R` [stages, num, b, b] (each block's skew part Q = (B - Bᵀ)/2, rotation (I - Q)(I + Q)⁻¹)
# rotating the weight's input axis through PEFT's butterfly permutations; `boft_s` ([out, 1], conv [1, out])
# scales the outputs.
_PEFT_BOFT = re.compile(r"(?P<module>.+)\.(?P<slot>boft_R|boft_s)(?:\.(?P<adapter>[A-Za-z_]\w*))?")
_XLABS = re.compile(
  r"(?:diffusion_model\.)?(double|single)_blocks\.\d+\.processor\.\w+\.(down|up)\.weight"
)

_FACTOR_SLOT = {"A": "a", "B": "b", "down": "a", "up": "b", "mid": "mid"}
# XLabs' processor LoRAs → the BFL modules they adapt.
_XLABS_MODULES = {
  "double": {
    "qkv_lora1": "img_attn.qkv",
    "qkv_lora2": "txt_attn.qkv",
    "proj_lora1": "img_attn.proj",
    "proj_lora2": "txt_attn.proj",
  },
  "single": {"qkv_lora": "linear1", "proj_lora": "linear2"},
}

# Module-name words that hold an underscore in the module trees kohya names (it writes every `.` as `_`):
# diffusers' UNet / transformers, SGM's UNet, transformers' CLIP, BFL's Flux, Wan's original modules.
_COMPOUND = tuple(
  sorted(
    {
      "down_blocks",
      "up_blocks",
      "mid_block",
      "transformer_blocks",
      "single_transformer_blocks",
      "to_q",
      "to_k",
      "to_v",
      "to_out",
      "to_add_out",
      "add_q_proj",
      "add_k_proj",
      "add_v_proj",
      "proj_in",
      "proj_out",
      "proj_mlp",
      "time_emb_proj",
      "conv_shortcut",
      "conv_in",
      "conv_out",
      "conv_norm_out",
      "time_embedding",
      "add_embedding",
      "linear_1",
      "linear_2",
      "ff_context",
      "norm1_context",
      "norm_out",
      "x_embedder",
      "context_embedder",
      "time_text_embed",
      "timestep_embedder",
      "guidance_embedder",
      "text_embedder",
      "norm_q",
      "norm_k",
      "norm_added_q",
      "norm_added_k",
      # SGM UNet
      "input_blocks",
      "output_blocks",
      "middle_block",
      "in_layers",
      "out_layers",
      "emb_layers",
      "skip_connection",
      "time_embed",
      "label_emb",
      # transformers CLIP
      "text_model",
      "self_attn",
      "q_proj",
      "k_proj",
      "v_proj",
      "out_proj",
      "layer_norm1",
      "layer_norm2",
      "final_layer_norm",
      "text_projection",
      # BFL Flux.1
      "double_blocks",
      "single_blocks",
      "img_attn",
      "txt_attn",
      "img_mlp",
      "txt_mlp",
      "img_mod",
      "txt_mod",
      "img_in",
      "txt_in",
      "time_in",
      "vector_in",
      "guidance_in",
      "in_layer",
      "out_layer",
      "final_layer",
      "adaLN_modulation",
      "query_norm",
      "key_norm",
      # Flux.2 (BFL and diffusers names)
      "double_stream_modulation_img",
      "double_stream_modulation_txt",
      "single_stream_modulation",
      "time_guidance_embed",
      "to_qkv_mlp_proj",
      "linear_in",
      "linear_out",
      # Wan original
      "cross_attn",
      "k_img",
      "v_img",
      "norm_k_img",
      "text_embedding",
      "time_projection",
      "img_emb",
      "patch_embedding",
    },
    key=lambda w: -w.count("_"),
  )
)


class LoRAFileError(ValueError):
  """A LoRA file md cannot read or apply: every problem listed with the file and key."""


class RawLoRA(NamedTuple):
  """One module's factors as stored (torch layout), before mapping to md."""

  module: str  # reference module name without the component prefix: "down_blocks.0.resnets.0.conv1"
  a: np.ndarray  # [r, in, *k]  (lora_A / lora_down)
  b: np.ndarray  # [out, r, *1] (lora_B / lora_up)
  alpha: float | None  # None: the format gives none (scale 1)
  keys: tuple[str, ...]  # the file keys it came from
  bias: np.ndarray | None = None  # [out] PEFT `lora_B.bias`: a bias delta scaled as the weight's
  # DoRA norms in the weight's torch layout, one axis not 1 (0: per output, 1: per input); trailing axes
  # may be missing. `dora_rule`: "peft" (`lora_magnitude_vector`) or "lycoris" (`dora_scale`).
  magnitude: np.ndarray | None = None
  dora_rule: str = "peft"


class RawOFT(NamedTuple):
  """One OFT / BOFT module as read, checked (see `md_lora.OFTWeight` for the math)."""

  module: str
  blocks: np.ndarray  # [stages, num, b, b] (diagonal OFT: stages = 1)
  alpha: float  # LyCORIS' constraint per output: the norm bound is alpha · num · b (<= 0: none)
  rescale: np.ndarray | None  # [out] or None
  butterfly: bool
  keys: tuple[str, ...]
  # "lycoris": blocks as stored, rotating the outputs; "peft": PEFT's OFT, `blocks` [1, r, b, b] the
  # rotations themselves (made here), rotating the inputs (see `md_lora.OFTWeight`)
  rule: str = "lycoris"


class RawGLoRA(NamedTuple):
  """One LyCORIS GLoRA module as stored, checked (torch layout; see `md_lora.GLoRAWeight`)."""

  module: str
  a1: np.ndarray  # [in, r]
  a2: np.ndarray  # [r, in]
  b1: np.ndarray  # [out, r, 1…]
  b2: np.ndarray  # [r, in, *k]
  scale: float  # alpha / r
  keys: tuple[str, ...]


class RawIA3(NamedTuple):
  """One LyCORIS IA³ module as stored, checked (see `md_lora.IA3Weight`)."""

  module: str
  vector: np.ndarray  # [n]
  on_input: bool
  keys: tuple[str, ...]


class RawDelta(NamedTuple):
  """A full (not low-rank) delta on one tensor, as lightx2v's `diff` / `diff_b` keys hold them."""

  module: str
  kind: str  # "weight" or "bias"
  delta: np.ndarray  # the tensor's shape, torch layout
  key: str


def kohya_module_name(name: str) -> str:
  """`down_blocks_0_attentions_0_transformer_blocks_0_attn1_to_out_0` →
  `down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_out.0` (diffusers' module tree).

  >>> kohya_module_name("mid_block_resnets_1_time_emb_proj")
  'mid_block.resnets.1.time_emb_proj'
  """
  words = name.split("_")
  out, i = [], 0
  while i < len(words):
    for compound in _COMPOUND:
      parts = compound.split("_")
      if words[i : i + len(parts)] == parts:
        out.append(compound)
        i += len(parts)
        break
    else:
      out.append(words[i])
      i += 1
  return ".".join(out)


# diffusers' own layouts before PEFT (its SD / SDXL training scripts, diffusers <= 0.24): attention
# processors `<attn>.processor.to_q_lora.down.weight` (`to_k_lora`, `to_v_lora`, `to_out_lora`), LoRA layers
# `<module>.lora.down.weight`, text-encoder layers `<module>.lora_linear_layer.down.weight`; no alpha.
_DIFFUSERS_OLD = re.compile(
  r"(?P<module>.+?)(?P<proc>\.processor)?\.(?P<what>to_q_lora|to_k_lora|to_v_lora|to_out_lora|lora|"
  r"lora_linear_layer)\.(?P<ab>down|up)\.weight"
)
# The attention processors' names → the projections they adapt, in a UNet and in a CLIP text encoder
# (diffusers' UNET_TO_DIFFUSERS and DIFFUSERS_OLD_TO_PEFT).
_PROCESSOR_TARGETS = {
  "unet": {
    "to_q_lora": "to_q",
    "to_k_lora": "to_k",
    "to_v_lora": "to_v",
    "to_out_lora": "to_out.0",
  },
  "text": {
    "to_q_lora": "q_proj",
    "to_k_lora": "k_proj",
    "to_v_lora": "v_proj",
    "to_out_lora": "out_proj",
  },
}


def diffusers_old_keys(keys: Sequence[str]) -> dict[str, str] | None:
  """For a file in diffusers' pre-PEFT layout, `{PEFT key: file key}` naming each factor as diffusers'
  PEFT files name the same module (`lora_A` / `lora_B`); None for a file in any other layout.

  >>> diffusers_old_keys(["unet.mid_block.attentions.0.transformer_blocks.0.attn2.processor.to_out_lora.up.weight"])
  {'unet.mid_block.attentions.0.transformer_blocks.0.attn2.to_out.0.lora_B.weight': 'unet.mid_block.attentions.0.transformer_blocks.0.attn2.processor.to_out_lora.up.weight'}
  """
  matches = [(k, _DIFFUSERS_OLD.fullmatch(k)) for k in keys]
  if not any(m for _, m in matches) or any(
    _PEFT_FACTOR.fullmatch(k) or _XLABS.fullmatch(k) for k in keys
  ):
    return None
  out = {}
  for key, m in matches:
    if m is None:
      out[key] = key
      continue
    module, what = m["module"], m["what"]
    if what not in ("lora", "lora_linear_layer"):
      text = module.startswith("text_encoder") or ".self_attn" in module or "text_model." in module
      module = f"{module}.{_PROCESSOR_TARGETS['text' if text else 'unet'][what]}"
    out[f"{module}.lora_{'A' if m['ab'] == 'down' else 'B'}.weight"] = key
  return out


class RenamedTensors(Mapping):
  """A file's tensors under other names (`{new name: file key}`), read lazily from the file."""

  def __init__(self, tensors: Mapping[str, Any], names: Mapping[str, str]):
    self._tensors, self._names = tensors, dict(names)

  def __getitem__(self, key: str) -> Any:
    return self._tensors[self._names[key]]

  def __iter__(self):
    return iter(self._names)

  def __len__(self) -> int:
    return len(self._names)


def detect_format(keys: Sequence[str], where: str) -> str:
  """The format of a LoRA file from its key names; LoRAFileError (with examples) when none fits.

  >>> detect_format(["diffusion_model.blocks.0.self_attn.q.lora_down.weight"], "f")
  'comfyui'
  """
  if any(_XLABS.fullmatch(k) for k in keys):
    return "xlabs"
  comfy = (_FACTORS["comfyui"], _DIFF, _LOHA, _LOKR, _OFT, _GLORA)
  factors = [k for k in keys if any(p.fullmatch(k) for p in comfy)]
  if factors and sum(k.startswith(COMFY_PREFIXES[:2]) for k in factors) * 2 > len(factors):
    return "comfyui"
  if any(
    _PEFT_FACTOR.fullmatch(k) or _PEFT_OFT.fullmatch(k) or _PEFT_BOFT.fullmatch(k) for k in keys
  ):
    return "peft"
  if any(
    any(p.fullmatch(k) for p in (_KOHYA_FACTOR, _LOHA, _LOKR, _OFT, _DIFF, _GLORA, _IA3))
    and k.startswith(("lora_", "lycoris_"))
    for k in keys
  ):
    return "kohya"
  shown = ", ".join(repr(k) for k in list(keys)[:5])
  raise LoRAFileError(
    f"{where}: unknown LoRA format: no `lora_A`/`lora_B` (diffusers / PEFT), `lora_down`/`lora_up` "
    f"(kohya), `diffusion_model.` (ComfyUI), `processor.*_lora` (XLabs) or `.lora.down` / "
    f"`processor.to_q_lora.down` / `lora_linear_layer.down` (diffusers before PEFT) keys among {len(keys)} "
    f"tensors (first: {shown}); md reads {FORMATS} and LyCORIS LoHa / LoKr / OFT / BOFT"
  )


def _choose_prefix(modules: Sequence[str], candidates: Sequence[str]) -> str:
  """The known prefix most modules carry (the empty one only when none does); a denoiser's prefix
  before a text encoder's (kohya's `lora_unet_` beside more `lora_te1_` modules)."""
  counts = {p: sum(m.startswith(p) for m in modules) for p in candidates if p}
  best = max(
    counts,
    key=lambda p: (counts[p] > 0 and not p.startswith("lora_te"), counts[p], len(p)),
    default="",
  )
  return best if counts.get(best) else ""


def _check_scalar(value: Any, what: str) -> float:
  if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
    raise LoRAFileError(f"{what} is {value!r}, not a finite number")
  return float(value)


def _peft_config(
  path: pathlib.Path, metadata: Mapping[str, str], prefix: str, config: Any
) -> dict | None:
  """The PEFT LoraConfig fields that set scales: explicit, `adapter_config.json`, or the header's."""
  if config is not None:
    if isinstance(config, str | pathlib.Path):
      return json.loads(pathlib.Path(config).read_text())
    return dict(config)
  beside = path.parent / "adapter_config.json"
  if path.is_file() and beside.is_file():
    return json.loads(beside.read_text())
  raw = metadata.get("lora_adapter_metadata")
  if raw is None:
    return None
  try:
    packed = json.loads(raw)
  except json.JSONDecodeError as e:
    raise LoRAFileError(f"{path}: unreadable lora_adapter_metadata in the header ({e})") from None
  component = prefix.rstrip(".")
  if component and any(k.startswith(component + ".") for k in packed):
    return {k[len(component) + 1 :]: v for k, v in packed.items() if k.startswith(component + ".")}
  return packed if "lora_alpha" in packed or "r" in packed else None


def _pattern_value(patterns: Mapping[str, Any], module: str) -> Any:
  """PEFT's rule: a pattern applies to a module whose name ends with it (after a `.`)."""
  if module in patterns:
    return patterns[module]
  for pattern, value in patterns.items():
    if re.match(rf"(.*\.)?({pattern})$", module):
      return value
  return None


def _split_key(key: str, fmt: str) -> tuple[str, str] | None:
  """`(module, slot)` of a file key: slot a / b / bias / alpha / diff / diff_b; None for other keys."""
  m = _FACTORS[fmt].fullmatch(key)
  if m:
    slot = _FACTOR_SLOT[m["ab"]]
    if m["kind"] == "bias":
      if slot != "b":
        return None
      slot = "bias"
    module = m["module"]
    if fmt == "xlabs":
      module = _xlabs_module(module)
      if module is None:
        return None
    return module, slot
  m = _ALPHA.fullmatch(key)
  if m:
    return m["module"], "alpha"
  for lycoris in (_LOHA, _LOKR, _OFT, _GLORA):
    m = lycoris.fullmatch(key)
    if m and fmt in ("kohya", "comfyui") and (fmt == "comfyui" or "." not in m["module"]):
      return m["module"], m["slot"]
  if fmt == "peft":
    m = _MAGNITUDE.fullmatch(key)
    if m:
      return m["module"], "magnitude"
    m = _PEFT_OFT.fullmatch(key)
    if m:
      return m["module"], "oft_R"
    m = _PEFT_BOFT.fullmatch(key)
    if m:
      return m["module"], m["slot"]
  m = _DORA_SCALE.fullmatch(key)
  if m and fmt in ("kohya", "comfyui") and (fmt == "comfyui" or "." not in m["module"]):
    return m["module"], "dora_scale"
  m = _DIFF.fullmatch(key)
  if m and (fmt in ("comfyui", "peft") or (fmt == "kohya" and "." not in m["module"])):
    return m["module"], m["kind"]  # kohya names: LyCORIS' full fine-tuning diffs ("full")
  m = _NORM.fullmatch(key)
  if m and (fmt == "comfyui" or (fmt == "kohya" and "." not in m["module"])):
    return m["module"], _NORM_KIND[m["kind"]]
  m = _IA3.fullmatch(key)
  if m and fmt == "kohya":
    return m["module"], "ia3_" + m["slot"]
  return None


def _xlabs_module(module: str) -> str | None:
  m = re.fullmatch(r"(.*)(double|single)_blocks\.(\d+)\.processor\.(\w+)", module)
  if m is None:
    return None
  head, stack, i, proc = m.groups()
  target = _XLABS_MODULES[stack].get(proc)
  return None if target is None else f"{head}{stack}_blocks.{i}.{target}"


def _alpha_of(value: Any, what: str) -> float:
  value = np.asarray(value)
  if value.size != 1:
    raise LoRAFileError(f"{what} has shape {value.shape}; an alpha is one number")
  if not np.issubdtype(value.dtype, np.number) or np.issubdtype(value.dtype, np.bool_):
    raise LoRAFileError(f"{what} has dtype {value.dtype}; an alpha is a number")
  return _check_scalar(float(value.reshape(())), what)


def read_modules(
  tensors: Mapping[str, np.ndarray],
  metadata: Mapping[str, str],
  path: pathlib.Path,
  fmt: str,
  prefix: str | None,
  config: Any = None,
  default_alpha: float | None = None,
) -> tuple[list[RawLoRA], list[RawDelta], list[RawOFT], list[tuple[str, str]], list[str], bool]:
  """Groups a file's keys into modules of the chosen component.

  Returns:
    (modules, deltas, rotations, leftovers, others, rslora): `deltas` are full `diff` / `diff_b` deltas;
    `rotations` LyCORIS OFT / BOFT modules;
    `leftovers` are `(key, why)` for keys that are no factor of this component; `others` keys of the
    pipeline's other components (`COMPONENTS`); `rslora`: scales are alpha / sqrt(r).
    A problem with a module (rank mismatch, a bad or missing alpha) raises LoRAFileError.
  """
  if fmt not in FORMATS:
    raise LoRAFileError(f"{path}: format={fmt!r}; md reads {FORMATS}")
  parts: dict[str, dict[str, str]] = {}
  leftovers: list[tuple[str, str]] = []
  for key in tensors:
    found = _split_key(key, fmt)
    if found is None:
      lycoris = re.search(r"\.(dora_scale|lora_magnitude_vector|(?:oft|boft)_\w+)", key)
      why = f"is no tensor of a {fmt} LoRA"
      if lycoris:
        why = f"is a LyCORIS / DoRA / OFT tensor ({lycoris[1]}), which md does not read yet"
      # PEFT < 0.14's OFT, older LyCORIS, other formats' OFT…
      if lycoris and "oft_" in lycoris[1]:
        why += (
          f" in a {fmt} file (md reads LyCORIS' OFT / BOFT: `.oft_blocks` / `.alpha` / `.rescale`, "
          "kohya or ComfyUI names, and PEFT's OFT / BOFT: `.oft_R.weight`, `.boft_R` / `.boft_s`)"
        )
        if lycoris[1] in ("oft_r", "oft_s"):
          why += "; `oft_r` / `oft_s` are PEFT < 0.14's OFT, which PEFT itself no longer loads"
      leftovers.append((key, why))
      continue
    module, slot = found
    if slot in parts.get(module, {}):
      raise LoRAFileError(
        f"{path}: {key!r} and {parts[module][slot]!r} are both the {slot} of module {module!r}"
      )
    parts.setdefault(module, {})[slot] = key

  if prefix is None:
    prefix = _choose_prefix(list(parts), _PREFIXES[fmt])
  cfg = _peft_config(path, metadata, prefix, config) if fmt == "peft" else None
  rslora = bool(cfg.get("use_rslora", False)) if cfg else False
  some_alpha = any("alpha" in found for found in parts.values())
  modules: list[RawLoRA] = []
  deltas: list[RawDelta] = []
  rotations: list[RawOFT] = []
  others: list[str] = []
  names = {"a": "lora_A", "b": "lora_B"} if fmt in ("peft", "comfyui") else {}
  if fmt == "kohya":
    names = {"a": "lora_down", "b": "lora_up"}
  elif fmt == "xlabs":
    names = {"a": "down", "b": "up"}
  for module, found in parts.items():
    keys = tuple(found.values())
    if not module.startswith(prefix):
      if prefix and module.startswith(COMPONENTS):
        others += keys  # another component of the pipeline (the UNet's file holding text encoders)
      else:
        why = f"is outside the component read (prefix {prefix!r})"
        leftovers += [(k, why) for k in keys]
      continue
    name = module[len(prefix) :]
    if fmt == "kohya":
      name = kohya_module_name(name)
    for slot, kind in (("diff", "weight"), ("diff_b", "bias")):
      if slot in found:
        deltas.append(RawDelta(name, kind, np.asarray(tensors[found[slot]]), found[slot]))
    if set(_OFT_SLOTS) & set(found):
      rotations.append(_oft(path, module, name, found, tensors))
      continue
    if set(_GLORA_SLOTS) & set(found):
      rotations.append(_glora(path, module, name, found, tensors))
      continue
    if {"ia3_weight", "ia3_on_input"} & set(found):
      rotations.append(_ia3(path, module, name, found, tensors))
      continue
    if "oft_R" in found:
      rotations.append(_peft_oft(path, module, name, found, tensors, cfg))
      continue
    if {"boft_R", "boft_s"} & set(found):
      rotations.append(_peft_boft(path, module, name, found, tensors, cfg))
      continue
    if (set(_LOHA_SLOTS) | {"hada_t1", "hada_t2"}) & set(found):
      raw = _loha(path, module, name, found, tensors, default_alpha, some_alpha)
      modules.append(_with_dora_scale(path, module, found, tensors, raw))
      continue
    if set(_LOKR_SLOTS) & set(found):
      modules.append(
        _with_dora_scale(path, module, found, tensors, _lokr(path, module, name, found, tensors))
      )
      continue
    if not ({"a", "b", "mid", "alpha", "bias", "magnitude", "dora_scale"} & set(found)):
      continue
    if "a" not in found or "b" not in found:
      lacking = [names[x] for x in ("a", "b") if x not in found]
      raise LoRAFileError(f"{path}: module {module!r} has no {' / '.join(lacking)} ({keys})")
    a, b = tensors[found["a"]], tensors[found["b"]]
    if "mid" in found:
      a = _fold_mid(path, module, found, a, tensors[found["mid"]])
    if a.ndim < 2 or b.ndim < 2 or a.shape[0] != b.shape[1] or any(d != 1 for d in b.shape[2:]):
      raise LoRAFileError(
        f"{path}: rank mismatch for {module!r}: {found['a']!r} has shape {a.shape} (rank first), "
        f"{found['b']!r} has shape {b.shape} (rank second, then 1s)"
      )
    rank = a.shape[0]
    alpha = None
    if "alpha" in found:
      alpha = _alpha_of(tensors[found["alpha"]], f"{path}: {found['alpha']!r}")
    elif fmt == "kohya" and default_alpha is not None:
      alpha = _check_scalar(default_alpha, "default_alpha")
    elif fmt == "kohya" and some_alpha:
      raise LoRAFileError(
        f"{path}: module {module!r} has no {module + '.alpha'!r} while the file's other modules "
        "have one (a damaged file?); pass default_alpha= to assume one, e.g. the rank for scale 1"
      )
    elif cfg is not None:
      alpha = _pattern_value(cfg.get("alpha_pattern") or {}, name)
      if alpha is None:
        alpha = cfg.get("lora_alpha", rank)
      alpha = _check_scalar(alpha, f"{path}: lora_alpha for {name!r} (adapter config)")
    bias = None
    if "bias" in found:
      bias = np.asarray(tensors[found["bias"]])
      if bias.shape != (b.shape[0],):
        raise LoRAFileError(
          f"{path}: {found['bias']!r} has shape {bias.shape}, expected ({b.shape[0]},) as "
          f"{found['b']!r} {b.shape} has rows"
        )
    magnitude = None
    if "magnitude" in found:
      magnitude = np.asarray(tensors[found["magnitude"]])
      if magnitude.size != b.shape[0] or sum(d != 1 for d in magnitude.shape) > 1:
        raise LoRAFileError(
          f"{path}: {found['magnitude']!r} has shape {magnitude.shape}; a DoRA magnitude holds one norm "
          f"per output ({b.shape[0]}, as {found['b']!r} {b.shape} has rows)"
        )
      magnitude = magnitude.reshape(
        -1, *(1,) * (b.ndim - 1)
      )  # peft's conv norms are [1, out, 1, 1]
    raw = RawLoRA(name, np.asarray(a), np.asarray(b), alpha, keys, bias, magnitude)
    modules.append(_with_dora_scale(path, module, found, tensors, raw))
  return modules, deltas, rotations, leftovers, others, rslora


def _with_dora_scale(
  path: pathlib.Path,
  module: str,
  found: Mapping[str, str],
  tensors: Mapping[str, np.ndarray],
  raw: RawLoRA,
) -> RawLoRA:
  """`raw` with its module's LyCORIS `dora_scale` (if any) as a DoRA magnitude under LyCORIS' rule."""
  if "dora_scale" not in found:
    return raw
  key = found["dora_scale"]
  scale = np.asarray(tensors[key])
  axes = [i for i, d in enumerate(scale.shape) if d != 1]
  if (
    scale.ndim < 2
    or len(axes) > 1
    or (axes and axes[0] > 1)
    or (axes == [0] and scale.shape[0] != raw.b.shape[0])
  ):
    raise LoRAFileError(
      f"{path}: {key!r} has shape {scale.shape}; LyCORIS' dora_scale holds one norm per output "
      f"[{raw.b.shape[0]}, 1, …] or per input [1, in, 1, …] of module {module!r}"
    )
  return raw._replace(magnitude=scale, dora_rule="lycoris")


def _fold_mid(
  path: pathlib.Path, module: str, found: Mapping[str, str], down: Any, mid: Any
) -> np.ndarray:
  """LoCon's Tucker form, `lora_up · lora_mid · lora_down` (1x1, kxk, 1x1 convolutions), as one LoRA of the
  same rank: the core folded into the down factor, `a[r, i, h, w] = sum_s mid[r, s, h, w] · down[s, i]`."""
  down, mid = np.asarray(down), np.asarray(mid)
  flat = (
    down.reshape(down.shape[:2])
    if down.ndim >= 2 and down.size == np.prod(down.shape[:2])
    else None
  )
  if flat is None or mid.ndim < 3 or mid.shape[:2] != (flat.shape[0], flat.shape[0]):
    raise LoRAFileError(
      f"{path}: LoCon module {module!r}: {found['mid']!r} has shape {mid.shape} and {found['a']!r} "
      f"{down.shape}; a Tucker core is [r, r, *k] beside a 1x1 down [r, in, 1, ...]"
    )
  return np.einsum("rs...,si->ri...", mid, flat)


def _alpha_or_default(
  path: pathlib.Path,
  module: str,
  kind: str,
  found: Mapping[str, str],
  tensors: Mapping[str, np.ndarray],
  default_alpha: float | None,
  some_alpha: bool,
  rank: int,
) -> float:
  if "alpha" in found:
    return _alpha_of(tensors[found["alpha"]], f"{path}: {found['alpha']!r}")
  if default_alpha is not None:
    return _check_scalar(default_alpha, "default_alpha")
  if some_alpha:
    raise LoRAFileError(
      f"{path}: {kind} module {module!r} has no {module + '.alpha'!r} while the file's other modules "
      "have one; pass default_alpha="
    )
  return float(rank)  # LyCORIS' default: alpha = dim, scale 1


def _tucker(
  path: pathlib.Path, kind: str, module: str, keys: Sequence[str], t: Any, wa: Any, wb: Any
) -> tuple[np.ndarray, np.ndarray]:
  """`(u [out, r], v [r, in·k…])` of LyCORIS' Tucker part `einsum("abkl,bq,ap->pqkl", t, wb, wa)` (core `t`
  [r, r, *k], `wa` [r, out], `wb` [r, in]): `u = wa.T`, `v[a, (q, k…)] = sum_b t[a, b, k…] · wb[b, q]`."""
  t, wa, wb = np.asarray(t), np.asarray(wa), np.asarray(wb)
  if t.ndim < 3 or wa.ndim != 2 or wb.ndim != 2 or t.shape[:2] != (wa.shape[0], wb.shape[0]):
    shapes = ", ".join(f"{k!r} {x.shape}" for k, x in zip(keys, (t, wa, wb)))
    raise LoRAFileError(
      f"{path}: rank or shape mismatch for {kind} module {module!r}: {shapes} (a Tucker core is "
      "[r_a, r_b, *k] beside factors [r_a, out] and [r_b, in])"
    )
  v = np.einsum("ab...,bq->aq...", t, wb)
  return wa.T, v.reshape(v.shape[0], -1)


def _loha_part(
  path: pathlib.Path,
  module: str,
  found: Mapping[str, str],
  tensors: Mapping[str, np.ndarray],
  i: int,
) -> tuple[np.ndarray, np.ndarray]:
  """`(u [out, r], v [r, in·k…])` with part i = `u @ v` (a convolution's input and kernel axes flattened)."""
  wa, wb = (np.asarray(tensors[found[f"hada_w{i}_{x}"]]) for x in "ab")
  core = f"hada_t{i}"
  if core in found:
    keys = (found[core], found[f"hada_w{i}_a"], found[f"hada_w{i}_b"])
    return _tucker(path, "LoHa", module, keys, tensors[found[core]], wa, wb)
  if wa.ndim != 2 or wb.ndim < 2 or wa.shape[1] != wb.shape[0]:
    raise LoRAFileError(
      f"{path}: rank or shape mismatch for LoHa module {module!r}: {found[f'hada_w{i}_a']!r} "
      f"{wa.shape}, {found[f'hada_w{i}_b']!r} {wb.shape}"
    )
  return wa, wb.reshape(wb.shape[0], -1)


def _loha(
  path: pathlib.Path,
  module: str,
  name: str,
  found: Mapping[str, str],
  tensors: Mapping[str, np.ndarray],
  default_alpha: float | None,
  some_alpha: bool,
) -> RawLoRA:
  """A LoHa module as an exact low-rank LoRA of rank r1·r2 (the Khatri-Rao products of its factors):
  `(u1 @ v1) * (u2 @ v2) = B @ A` with `B[:, (i, j)] = u1[:, i] * u2[:, j]` and
  `A[(i, j), :] = v1[i, :] * v2[j, :]`; its alpha is rescaled so that scale = alpha / r1 stays. On a
  convolution `A` keeps the input and kernel axes flattened (the loader shapes it as the kernel)."""
  lacking = [s for s in _LOHA_SLOTS if s not in found]
  if lacking:
    raise LoRAFileError(f"{path}: LoHa module {module!r} has no {' / '.join(lacking)}")
  (u1, v1), (u2, v2) = (_loha_part(path, module, found, tensors, i) for i in (1, 2))
  if u1.shape[0] != u2.shape[0] or v1.shape[1] != v2.shape[1]:
    raise LoRAFileError(
      f"{path}: rank or shape mismatch for LoHa module {module!r}: its two parts are "
      f"[{u1.shape[0]}, {v1.shape[1]}] and [{u2.shape[0]}, {v2.shape[1]}] (out, in·k…)"
    )
  rank = v1.shape[0]
  alpha = _alpha_or_default(path, module, "LoHa", found, tensors, default_alpha, some_alpha, rank)
  r1, r2 = v1.shape[0], v2.shape[0]
  a = (v1[:, None, :] * v2[None, :, :]).reshape(r1 * r2, v1.shape[1])
  b = (u1[:, :, None] * u2[:, None, :]).reshape(u1.shape[0], r1 * r2)
  keys = tuple(found.values())
  return RawLoRA(name, a, b, alpha / rank * (r1 * r2), keys)


def _lokr_part(
  path: pathlib.Path,
  module: str,
  found: Mapping[str, str],
  tensors: Mapping[str, np.ndarray],
  i: int,
) -> tuple[np.ndarray, np.ndarray, int | None]:
  """`(u [out, r], v [r, in·k…], rank)` with `w_i = u @ v` (a convolution's input and kernel axes
  flattened): a factored part as stored (its rank), a Tucker part (`lokr_t{i}`, its rank), a whole one
  split by an identity on its shorter side (rank None)."""
  whole, a, b, core = f"lokr_w{i}", f"lokr_w{i}_a", f"lokr_w{i}_b", f"lokr_t{i}"
  if whole in found and (a in found or b in found or core in found):
    raise LoRAFileError(f"{path}: LoKr module {module!r} has both {whole} and {a} / {b}")
  if whole in found:
    w = np.asarray(tensors[found[whole]])
    if w.ndim < 2:
      raise LoRAFileError(
        f"{path}: LoKr module {module!r}: {found[whole]!r} has shape {w.shape}; a part is a matrix "
        "or a convolution kernel"
      )
    w = w.reshape(w.shape[0], -1)
    if w.shape[1] <= w.shape[0]:
      return w, np.eye(w.shape[1], dtype=w.dtype), None
    return np.eye(w.shape[0], dtype=w.dtype), w, None
  if a not in found or b not in found:
    lacking = [s for s in (a, b) if s not in found]
    raise LoRAFileError(
      f"{path}: LoKr module {module!r} has neither {whole} nor {' / '.join(lacking)}"
    )
  if core in found:
    keys = (found[core], found[a], found[b])
    u, v = _tucker(
      path, "LoKr", module, keys, tensors[found[core]], tensors[found[a]], tensors[found[b]]
    )
    return u, v, v.shape[0]
  u, v = np.asarray(tensors[found[a]]), np.asarray(tensors[found[b]])
  if u.ndim != 2 or v.ndim < 2 or u.shape[1] != v.shape[0]:
    raise LoRAFileError(
      f"{path}: rank or shape mismatch for LoKr module {module!r}: {found[a]!r} {u.shape}, "
      f"{found[b]!r} {v.shape}"
    )
  return u, v.reshape(v.shape[0], -1), v.shape[0]


def _lokr(
  path: pathlib.Path,
  module: str,
  name: str,
  found: Mapping[str, str],
  tensors: Mapping[str, np.ndarray],
) -> RawLoRA:
  """A LoKr module as an exact LoRA of rank r1·r2: with `w1 = u1 @ v1`, `w2 = u2 @ v2`,
  `kron(w1, w2) = kron(u1, u2) @ kron(v1, v2)`; its alpha is rescaled so that the scale stays LyCORIS'
  (alpha / the rank of w2's factors, else of w1's; 1 when both are whole or there is no alpha). On a
  convolution (w1 a matrix, w2 a kernel [o2, i2, *k]: LyCORIS' `kron(w1[..., None, None], w2)`) the
  columns of `kron(v1, v2)` are the flattened (input, kernel) axes of the delta, in order."""
  if "lokr_t1" in found:
    raise LoRAFileError(
      f"{path}: LoKr module {module!r} has a Tucker core on its first part ({found['lokr_t1']!r}); "
      "LyCORIS keeps w1 a matrix"
    )
  u1, v1, rank1 = _lokr_part(path, module, found, tensors, 1)
  u2, v2, rank2 = _lokr_part(path, module, found, tensors, 2)
  rank = rank2 if rank2 is not None else rank1
  scale = 1.0
  if "alpha" in found and rank is not None:
    scale = _alpha_of(tensors[found["alpha"]], f"{path}: {found['alpha']!r}") / rank
  b = np.kron(u1, u2)  # [o1·o2, r1·r2]
  a = np.kron(v1, v2)  # [r1·r2, i1·i2·k…]
  return RawLoRA(name, a, b, scale * a.shape[0], tuple(found.values()))


def _oft(
  path: pathlib.Path,
  module: str,
  name: str,
  found: Mapping[str, str],
  tensors: Mapping[str, np.ndarray],
) -> RawOFT:
  """A LyCORIS OFT / BOFT module, its shapes checked: diagonal OFT `oft_blocks` [num, b, b], BOFT
  [stages, num, b, b] (b even, each stage's butterfly span `2^i · b` tiling the output: num divisible by
  `2^(stages-1)`), `alpha` one number, `rescale` one factor per output [num·b, 1, ...]."""
  extra = sorted(set(found) - {*_OFT_SLOTS, "alpha"})
  if extra:
    keys = ", ".join(repr(found[k]) for k in extra)
    raise LoRAFileError(
      f"{path}: OFT module {module!r} also has {keys}; an OFT module holds only oft_blocks, alpha "
      "and rescale"
    )
  if "oft_blocks" not in found:
    raise LoRAFileError(f"{path}: OFT module {module!r} has {found['rescale']!r} but no oft_blocks")
  key = found["oft_blocks"]
  blocks = np.asarray(tensors[key])
  shape = blocks.shape
  what = f"{path}: OFT module {module!r}: {key!r} has shape {shape}"
  if blocks.ndim not in (3, 4) or shape[-1] != shape[-2] or 0 in shape:
    raise LoRAFileError(
      f"{what}; LyCORIS' oft_blocks are [num, b, b] (diagonal OFT) or [stages, num, b, b] (BOFT)"
    )
  butterfly = blocks.ndim == 4
  if butterfly:
    stages, num, b = shape[0], shape[1], shape[2]
    if b % 2 or num % 2 ** (stages - 1):
      raise LoRAFileError(
        f"{what}; BOFT blocks are [stages, num, b, b] with b even and num divisible by "
        f"2^(stages - 1) = {2 ** (stages - 1)} (stage i mixes outputs 2^i·b/2 apart)"
      )
  else:
    blocks = blocks[None]
  if "alpha" not in found:
    raise LoRAFileError(
      f"{path}: OFT module {module!r} has no {module + '.alpha'!r} (LyCORIS writes its constraint "
      "there, 0 for none)"
    )
  alpha = _alpha_of(tensors[found["alpha"]], f"{path}: {found['alpha']!r}")
  out = blocks.shape[1] * blocks.shape[2]
  rescale = None
  if "rescale" in found:
    rescale = np.asarray(tensors[found["rescale"]])
    if rescale.size != out or any(d != 1 for d in rescale.shape[1:]):
      raise LoRAFileError(
        f"{path}: OFT module {module!r}: {found['rescale']!r} has shape {rescale.shape}; a rescale "
        f"holds one factor per output [{out}, 1, ...] ({key!r} {shape} tiles {out} outputs)"
      )
    rescale = rescale.reshape(out)
  keys = (key, *(k for k in found.values() if k != key))  # the blocks' key names the module
  return RawOFT(name, blocks, alpha, rescale, butterfly, keys)


def _peft_oft(
  path: pathlib.Path,
  module: str,
  name: str,
  found: Mapping[str, str],
  tensors: Mapping[str, np.ndarray],
  cfg: Mapping[str, Any] | None,
) -> RawOFT:
  """A PEFT OFT module (PEFT >= 0.14) → its rotations `[1, r, b, b]`, made as PEFT's `OFTRotationModule.
  get_weight` makes them: each stored row the strict upper triangle (row-major) of a skew block Q; with
  `coft`, a block whose Frobenius norm passes `eps / sqrt(r)` is scaled onto it; then the Cayley–Neumann
  series `I + 2Q + 2Q² + … + Q^m` of `num_cayley_neumann_terms` terms (PEFT >= 0.18's series), or with
  `use_cayley_neumann=False` the exact Cayley transform `(I - Q)(I + Q)⁻¹`. Computed in float64."""
  key = found["oft_R"]
  extra = sorted(set(found) - {"oft_R"})
  if extra:
    keys = ", ".join(repr(found[k]) for k in extra)
    raise LoRAFileError(
      f"{path}: PEFT OFT module {module!r} ({key!r}) also has {keys}; a PEFT OFT module holds only "
      "oft_R.weight"
    )
  if cfg is None:
    raise LoRAFileError(
      f"{path}: {key!r} is a PEFT OFT module, whose rotation depends on the adapter's OFTConfig "
      "(use_cayley_neumann, num_cayley_neumann_terms, coft, eps, block_share): put the "
      "adapter_config.json PEFT saved beside the file, or pass config="
    )
  kind = cfg.get("peft_type", "OFT")
  if kind != "OFT":
    raise LoRAFileError(
      f"{path}: the adapter config says peft_type {kind!r}, but {key!r} is a PEFT OFT tensor"
    )
  if "oft_block_size" not in cfg:
    raise LoRAFileError(
      f"{path}: the adapter config has no oft_block_size: an OFT adapter of PEFT < 0.14, whose "
      "format PEFT itself no longer loads (retrain it with a newer PEFT)"
    )
  vec = np.asarray(tensors[key])
  b = int(round((1 + math.sqrt(1 + 8 * vec.shape[-1])) / 2)) if vec.ndim == 2 else 0
  if vec.ndim != 2 or 0 in vec.shape or b * (b - 1) // 2 != vec.shape[1]:
    raise LoRAFileError(
      f"{path}: PEFT OFT module {module!r}: {key!r} has shape {vec.shape}; PEFT stores [r, b(b-1)/2] "
      "(each row the upper triangle of a b x b skew block)"
    )
  share = cfg.get("block_share", False)
  if share and vec.shape[0] != 1:
    raise LoRAFileError(
      f"{path}: PEFT OFT module {module!r}: {key!r} has shape {vec.shape}, but the config's "
      "block_share stores one shared block [1, b(b-1)/2]"
    )
  r = vec.shape[0]
  q = np.zeros((r, b, b), np.float64)
  rows, cols = np.triu_indices(b, 1)
  q[:, rows, cols] = vec.astype(np.float64)
  q = q - np.swapaxes(q, 1, 2)
  if cfg.get("coft", False):
    eps = _check_scalar(cfg.get("eps", 6e-5), f"{path}: the adapter config's eps") / math.sqrt(r)
    norm = np.sqrt(np.sum(q * q, axis=(1, 2), keepdims=True))
    q = np.where(norm <= eps, q, q * (eps / np.maximum(norm, np.finfo(np.float64).tiny)))
  eye = np.broadcast_to(np.eye(b), q.shape)
  if cfg.get("use_cayley_neumann", True):
    terms = cfg.get("num_cayley_neumann_terms", 5)
    if isinstance(terms, bool) or not isinstance(terms, numbers.Integral):
      raise LoRAFileError(f"{path}: the adapter config's num_cayley_neumann_terms is {terms!r}")
    rot = eye.copy()
    if terms > 1:
      rot += 2 * q
    if terms > 2:  # PEFT's loop: 2Q² … 2Q^(n-2), then Q^(max(3, n-1)) once
      power = q @ q
      rot += 2 * power
      for _ in range(3, terms - 1):
        power = power @ q
        rot += 2 * power
      rot += power @ q
  else:
    rot = np.linalg.solve(eye + q, eye - q)  # (I + Q) and (I - Q) commute
  rot = rot.astype(np.float32)[None]
  return RawOFT(name, rot, 0.0, None, False, (key,), "peft")


def _peft_boft(
  path: pathlib.Path,
  module: str,
  name: str,
  found: Mapping[str, str],
  tensors: Mapping[str, np.ndarray],
  cfg: Mapping[str, Any] | None,
) -> RawOFT:
  """A PEFT BOFT module → its rotations `[stages, num, b, b]` as PEFT's `BOFTLayer.cayley_batch` makes them
  (`Q = (B - Bᵀ)/2`, `(I - Q)(I + Q)⁻¹`, in float64) and its output scales `boft_s` (`[out, 1]`, a
  convolution's `[1, out]`). Stages past the first need b and num even, num divisible by 2^(stages-1)."""
  extra = sorted(set(found) - {"boft_R", "boft_s"})
  if extra or "boft_R" not in found or "boft_s" not in found:
    keys = ", ".join(repr(k) for k in found.values())
    raise LoRAFileError(
      f"{path}: PEFT BOFT module {module!r} has {keys}; a PEFT BOFT module holds boft_R and boft_s"
    )
  kind = (cfg or {}).get("peft_type", "BOFT")
  if kind != "BOFT":
    raise LoRAFileError(
      f"{path}: the adapter config says peft_type {kind!r}, but {found['boft_R']!r} is a PEFT BOFT "
      "tensor"
    )
  key = found["boft_R"]
  blocks = np.asarray(tensors[key])
  shape = blocks.shape
  what = f"{path}: PEFT BOFT module {module!r}: {key!r} has shape {shape}"
  if blocks.ndim != 4 or shape[-1] != shape[-2] or 0 in shape:
    raise LoRAFileError(f"{what}; PEFT stores boft_R as [stages, num, b, b]")
  stages, num, b = shape[:3]
  if stages > 1 and (b % 2 or num % 2 ** (stages - 1)):
    raise LoRAFileError(
      f"{what}; with {stages} butterfly stages PEFT needs b even and num divisible by "
      f"2^(stages - 1) = {2 ** (stages - 1)}"
    )
  scales = np.asarray(tensors[found["boft_s"]])
  if scales.ndim != 2 or 1 not in scales.shape:
    raise LoRAFileError(
      f"{path}: PEFT BOFT module {module!r}: {found['boft_s']!r} has shape {scales.shape}; PEFT "
      "stores one scale per output, [out, 1] (a convolution's [1, out])"
    )
  q = blocks.astype(np.float64)
  q = 0.5 * (q - np.swapaxes(q, -1, -2))
  eye = np.broadcast_to(np.eye(b), q.shape)
  rot = np.linalg.solve(eye + q, eye - q).astype(np.float32)  # (I + Q) and (I - Q) commute
  keys = (key, found["boft_s"])
  return RawOFT(name, rot, 0.0, scales.reshape(-1), True, keys, "peft")


def _glora(
  path: pathlib.Path,
  module: str,
  name: str,
  found: Mapping[str, str],
  tensors: Mapping[str, np.ndarray],
) -> RawGLoRA:
  """A LyCORIS GLoRA module: `a1` `[in, r, 1…]`, `a2` `[r, in, 1…]` (linear: `[in, r]`, `[r, in]`), `b1`
  `[out, r, 1…]`, `b2` `[r, in, *k]`, `alpha` (0 or none: r); scale alpha / r, as LyCORIS' `GLoRAModule`."""
  extra = sorted(set(found) - {*_GLORA_SLOTS, "alpha"})
  missing = [s for s in _GLORA_SLOTS if s not in found]
  if extra or missing:
    what = ", ".join(repr(found[k]) for k in extra) if extra else f"no {' / '.join(missing)}"
    raise LoRAFileError(
      f"{path}: GLoRA module {module!r} has {what}; a GLoRA module holds a1, a2, b1, b2 (and alpha; "
      "md does not read its Tucker form, `bm`)"
    )
  a1, a2, b1, b2 = (np.asarray(tensors[found[s]]) for s in _GLORA_SLOTS)
  r = a2.shape[0] if a2.ndim else 0
  fan_in = a1.shape[0] if a1.ndim else 0
  ok = (
    a1.ndim >= 2 and a2.ndim >= 2 and b1.ndim >= 2 and b2.ndim >= 2
    and all(d == 1 for d in (*a1.shape[2:], *a2.shape[2:], *b1.shape[2:]))
    and a1.shape[1] == r and a2.shape[1] == fan_in and b1.shape[1] == r and b2.shape[:2] == (r, fan_in)
  )  # fmt: skip
  if not ok:
    shapes = ", ".join(f"{s} {tuple(np.shape(t))}" for s, t in zip(_GLORA_SLOTS, (a1, a2, b1, b2)))
    raise LoRAFileError(
      f"{path}: GLoRA module {module!r}: {shapes}; LyCORIS stores a1 [in, r, 1…], a2 [r, in, 1…], "
      "b1 [out, r, 1…], b2 [r, in, *k]"
    )
  alpha = float(r)
  if "alpha" in found:
    alpha = _alpha_of(tensors[found["alpha"]], f"{path}: {found['alpha']!r}") or float(r)
  keys = (found["a1"], *(k for s, k in found.items() if s != "a1"))
  return RawGLoRA(name, a1.reshape(fan_in, r), a2.reshape(r, fan_in), b1, b2, alpha / r, keys)


def _ia3(
  path: pathlib.Path,
  module: str,
  name: str,
  found: Mapping[str, str],
  tensors: Mapping[str, np.ndarray],
) -> RawIA3:
  """A LyCORIS IA³ module: `weight` (one factor per output, or per input with `on_input` 1) and
  `on_input`."""
  extra = sorted(set(found) - {"ia3_weight", "ia3_on_input"})
  if extra or len(found) != 2:
    keys = ", ".join(repr(k) for k in found.values())
    raise LoRAFileError(
      f"{path}: IA3 module {module!r} has {keys}; a LyCORIS IA3 module holds weight and on_input"
    )
  vector = np.asarray(tensors[found["ia3_weight"]])
  flag = np.asarray(tensors[found["ia3_on_input"]])
  if vector.size == 0 or sum(d != 1 for d in vector.shape) > 1 or flag.size != 1:
    raise LoRAFileError(
      f"{path}: IA3 module {module!r}: {found['ia3_weight']!r} has shape {vector.shape} and "
      f"{found['ia3_on_input']!r} {flag.shape}; LyCORIS stores one factor per channel and one flag"
    )
  keys = (found["ia3_weight"], found["ia3_on_input"])
  return RawIA3(name, vector.reshape(-1), bool(flag.reshape(())), keys)
