"""LoRA file formats: reading a file's tensors into per-module factors in the reference's (torch) layout.

Two formats so far, told apart by their key names:
  peft:   `<prefix><module>.lora_A.weight` `[r, in, *k]`, `<prefix><module>.lora_B.weight` `[out, r, *1]`
          (diffusers' `save_lora_weights` with prefixes `unet.` / `transformer.` / `text_encoder.`, PEFT's
          `save_pretrained` with `base_model.model.`); alpha from `adapter_config.json` beside the file,
          diffusers' `lora_adapter_metadata` in the safetensors header, or `<module>.alpha` tensors; without
          any, alpha = r (scale 1), as diffusers loads such files.
  kohya:  `lora_unet_<module with _ for .>.lora_down.weight` / `.lora_up.weight` / `.alpha` (kohya-ss
          sd-scripts, A1111, ComfyUI), SD UNet names in diffusers' module tree.
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

FORMATS = ("peft", "kohya")

# The component prefixes a file may carry; with `prefix=None` the one most keys start with is used.
PEFT_PREFIXES = ("unet.", "transformer.", "base_model.model.", "diffusion_model.", "")
KOHYA_PREFIXES = ("lora_unet_", "lora_transformer_")
OTHER_COMPONENTS = ("text_encoder.", "text_encoder_2.", "lora_te_", "lora_te1_", "lora_te2_")

_PEFT_FACTOR = re.compile(
  r"(?P<module>.+)\.lora_(?P<ab>A|B)(?:\.(?P<adapter>[A-Za-z_]\w*))?\.weight"
)
_ALPHA = re.compile(r"(?P<module>.+)\.alpha")
_KOHYA_FACTOR = re.compile(r"(?P<module>[^.]+)\.lora_(?P<ab>down|up)\.weight")

# Module-name words that hold an underscore in diffusers' module trees (kohya writes every `.` as `_`).
_FACTOR_SLOT = {"A": "a", "B": "b", "down": "a", "up": "b"}

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


def detect_format(keys: Sequence[str], where: str) -> str:
  """The format of a LoRA file from its key names; LoRAFileError (with examples) when none fits."""
  if any(_PEFT_FACTOR.fullmatch(k) for k in keys):
    return "peft"
  if any(_KOHYA_FACTOR.fullmatch(k) and k.startswith("lora_") for k in keys):
    return "kohya"
  shown = ", ".join(repr(k) for k in list(keys)[:5])
  raise LoRAFileError(
    f"{where}: unknown LoRA format: no `lora_A`/`lora_B` (diffusers / PEFT) or `lora_down`/`lora_up` "
    f"(kohya) keys among {len(keys)} tensors (first: {shown}); md reads {FORMATS}"
  )


def _choose_prefix(modules: Sequence[str], candidates: Sequence[str]) -> str:
  counts = {p: sum(m.startswith(p) for m in modules) for p in candidates}
  return max(candidates, key=lambda p: (counts[p], len(p)))


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
  if beside.is_file():
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


def read_modules(
  tensors: Mapping[str, np.ndarray],
  metadata: Mapping[str, str],
  path: pathlib.Path,
  fmt: str,
  prefix: str | None,
  config: Any = None,
  default_alpha: float | None = None,
) -> tuple[list[RawLoRA], list[tuple[str, str]], bool]:
  """Groups a file's keys into modules of the chosen component.

  Returns:
    (modules, leftovers, rslora): `leftovers` are `(key, why)` for keys that are no factor of this
    component; `rslora`: scales are alpha / sqrt(r). A problem with a module (rank mismatch, a bad or
    missing alpha) raises LoRAFileError.
  """
  if fmt not in FORMATS:
    raise ValueError(f"format={fmt!r}; md reads {FORMATS}")
  factor_re = _PEFT_FACTOR if fmt == "peft" else _KOHYA_FACTOR
  parts: dict[str, dict[str, str]] = {}
  leftovers: list[tuple[str, str]] = []
  for key in tensors:
    m = factor_re.fullmatch(key)
    if m:
      parts.setdefault(m["module"], {})[_FACTOR_SLOT[m["ab"]]] = key
      continue
    m = _ALPHA.fullmatch(key)
    if m:
      parts.setdefault(m["module"], {})["alpha"] = key
      continue
    leftovers.append(
      (key, "is not a LoRA factor md reads (DoRA, LoRA bias and LyCORIS are not yet)")
    )

  candidates = PEFT_PREFIXES if fmt == "peft" else KOHYA_PREFIXES + ("lora_",)
  if prefix is None:
    prefix = _choose_prefix(list(parts), candidates)
  cfg = _peft_config(path, metadata, prefix, config) if fmt == "peft" else None
  rslora = bool(cfg.get("use_rslora", False)) if cfg else False
  modules: list[RawLoRA] = []
  for module, found in parts.items():
    keys = tuple(found.values())
    if not module.startswith(prefix):
      why = f"is outside the component read (prefix {prefix!r})"
      leftovers += [(k, why) for k in keys]
      continue
    name = module[len(prefix) :]
    if fmt == "kohya":
      name = kohya_module_name(name)
    if "a" not in found or "b" not in found:
      have = {"a": "lora_A", "b": "lora_B"} if fmt == "peft" else {"a": "lora_down", "b": "lora_up"}
      lacking = [have[x] for x in ("a", "b") if x not in found]
      raise LoRAFileError(f"{path}: module {module!r} has no {' / '.join(lacking)} ({keys})")
    a, b = tensors[found["a"]], tensors[found["b"]]
    if a.ndim < 2 or b.ndim < 2 or a.shape[0] != b.shape[1] or any(d != 1 for d in b.shape[2:]):
      raise LoRAFileError(
        f"{path}: rank mismatch for {module!r}: {found['a']!r} has shape {a.shape} (rank first), "
        f"{found['b']!r} has shape {b.shape} (rank second, then 1s)"
      )
    rank = a.shape[0]
    alpha = None
    if "alpha" in found:
      value = np.asarray(tensors[found["alpha"]])
      if value.size != 1:
        raise LoRAFileError(
          f"{path}: {found['alpha']!r} has shape {value.shape}; an alpha is one number"
        )
      alpha = _check_scalar(float(value.reshape(())), f"{path}: {found['alpha']!r}")
    elif fmt == "kohya" and default_alpha is not None:
      alpha = _check_scalar(default_alpha, "default_alpha")
    elif fmt == "kohya":
      raise LoRAFileError(
        f"{path}: module {module!r} has no {module + '.alpha'!r}: kohya files give every module its "
        "alpha (pass default_alpha= to assume one, e.g. the rank for scale 1)"
      )
    elif cfg is not None:
      alpha = _pattern_value(cfg.get("alpha_pattern") or {}, name)
      if alpha is None:
        alpha = cfg.get("lora_alpha", rank)
      alpha = _check_scalar(alpha, f"{path}: lora_alpha for {name!r} (adapter config)")
    modules.append(RawLoRA(name, np.asarray(a), np.asarray(b), alpha, keys))
  return modules, leftovers, rslora
