"""Reading a LoRA file for one md model: every key mapped through the family's key map, or named."""

from __future__ import annotations

import difflib
import math
import os
import pathlib
import re
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from flax import nnx

import md_core
from md_core import KeyMap, Target, path_str
from md_lora._adapter import Adapter, LoRAWeight, Site
from md_lora._formats import LoRAFileError, RawLoRA, detect_format, read_modules

_MAX_LISTED = 20
_PERMUTATIONS = {
  "linear": (1, 0),
  "conv1d": (2, 1, 0),
  "conv2d": (2, 3, 1, 0),
  "conv3d": (2, 3, 4, 1, 0),
}


def param_shapes(params_or_model: Any) -> dict[tuple, tuple[int, ...]]:
  """`{path: shape}` of an NNX module, an `nnx.State`, or a mapping from paths to arrays / shapes."""
  if isinstance(params_or_model, nnx.Module):
    params_or_model = nnx.state(params_or_model)
  if isinstance(params_or_model, nnx.State):
    out = {}
    for path, var in nnx.to_flat_state(params_or_model):
      value = var.get_value() if hasattr(var, "get_value") else var.value
      out[tuple(path)] = tuple(np.shape(value))
    return out
  return {
    tuple(p): tuple(v) if isinstance(v, tuple) else tuple(np.shape(v))
    for p, v in params_or_model.items()
  }


def lora_factors(a: np.ndarray, b: np.ndarray, target: Target) -> tuple[np.ndarray, np.ndarray]:
  """torch-layout factors (`a` `[r, in, *k]`, `b` `[out, r, *1]`) → md-layout `(down, up)` for `target`.

  The delta `b @ a` is a tensor in the reference layout of the base weight, so it converts as the weight
  does: a split of the weight's output axis splits `b`, of its input axis splits `a`; the layout's
  permutation moves the output axis last, where `up` puts it.
  """
  if target.split is not None:
    index, parts, axis = target.split
    if axis not in (0, 1):
      raise ValueError(f"a LoRA cannot follow a split along axis {axis} of the weight")
    x = b if axis == 0 else a
    if x.shape[axis] % parts:
      raise ValueError(f"cannot take part {index} of {parts} along axis {axis} of shape {x.shape}")
    size = x.shape[axis] // parts
    x = np.take(x, np.arange(index * size, (index + 1) * size), axis=axis)
    a, b = (a, x) if axis == 0 else (x, b)
  b2 = b.reshape(b.shape[:2])
  if target.layout == "identity":
    return b2, a
  perm = _PERMUTATIONS[target.layout]
  if a.ndim != len(perm):
    raise ValueError(
      f"layout {target.layout!r} takes a {len(perm)}-d weight, the LoRA is {a.ndim}-d"
    )
  return np.transpose(a, perm), b2.T


def _nearest(module: str, paths: Sequence[str]) -> str:
  guess = module.replace(".", "/") + "/kernel"
  close = difflib.get_close_matches(guess, paths, n=1, cutoff=0.5)
  return f"; nearest md parameter {close[0]!r}" if close else ""


def load_lora(
  file: str | os.PathLike,
  convert_key: KeyMap,
  params_or_model: Any,
  *,
  prefix: str | None = None,
  format: str | None = None,
  config: Any = None,
  default_alpha: float | None = None,
  allow_unmatched: Sequence[str] = (),
) -> Adapter:
  """Reads a LoRA file for one md model, checking every key before anything is computed.

  Each module's base weight name (`<module>.weight`) goes through the family's `convert_key`; its
  Target (path, layout, split, layer) says where the delta lands and how it converts. Names only the
  model's shapes are used (an abstract model from `nnx.eval_shape` serves).

  Args:
    file: a `.safetensors` LoRA file.
    convert_key: the family's key map for this component (`md_sd.unet_key_map(cfg)`,
      `md_flux.convert_key`, `md_wan.convert_key`…).
    params_or_model: the md module (or its `nnx.State`, or `{path: array or shape}`) the LoRA adapts.
    prefix: the component's prefix in the file's names (`"unet."`, `"transformer."`, `"lora_unet_"`);
      default: the known prefix most keys carry.
    format: force "peft" or "kohya" (default: detected from the keys).
    config: PEFT `LoraConfig` fields (a dict, or an `adapter_config.json` path); default: the
      `adapter_config.json` beside the file, else the file's `lora_adapter_metadata`, else alpha = r.
    default_alpha: for kohya files without `.alpha` tensors, the alpha to assume.
    allow_unmatched: regexes over file keys that may map to nothing (e.g. `r"text_encoder\\..*"`); they
      are listed in `Adapter.skipped`.

  Returns:
    The Adapter, keyed by md parameter site.

  Raises:
    SafetensorsError: the file is not a readable safetensors file (e.g. truncated).
    LoRAFileError: an unknown format, a rank mismatch, a missing or non-numeric alpha, keys that map to
      nothing or to parameters of other shapes (all listed, with file and key), or a LoRA made for
      another model (said first).
  """
  path = pathlib.Path(file)
  tensors = md_core.SafetensorsFile(path)
  keys = list(tensors)
  fmt = format or detect_format(keys, str(path))
  modules, leftovers, rslora = read_modules(
    tensors, tensors.metadata, path, fmt, prefix, config, default_alpha
  )
  shapes = param_shapes(params_or_model)
  known = [path_str(p) for p in shapes]

  weights: dict[Site, LoRAWeight] = {}
  names: dict[Site, str] = {}
  unmatched: list[tuple[RawLoRA, str]] = []
  misshaped: list[str] = []
  for mod in modules:
    targets = convert_key(mod.module + ".weight")
    if targets is None:
      unmatched.append((mod, "maps to no parameter of the model" + _nearest(mod.module, known)))
      continue
    for target in (targets,) if isinstance(targets, Target) else targets:
      site = Site(tuple(target.path), target.layer)
      shape = shapes.get(site.path)
      if shape is None:
        unmatched.append((mod, f"maps to {str(site)!r}, which the model does not have"))
        continue
      want = shape[1:] if target.layer is not None else shape
      try:
        down, up = lora_factors(mod.a, mod.b, target)
        got = tuple(down.shape[:-1]) + tuple(up.shape[1:])
      except ValueError as e:
        got = f"unconvertible ({e})"
      if got != want:
        misshaped.append(
          f"{path}: {mod.keys[0]!r}: the delta of {mod.module!r} (lora_A {mod.a.shape}, lora_B "
          f"{mod.b.shape}) is {got} in md's layout, the model's {str(site)!r} is {want}"
        )
        continue
      if site in weights:
        raise LoRAFileError(f"{path}: {mod.module!r} and {names[site]!r} both adapt {str(site)!r}")
      rank = mod.a.shape[0]
      alpha = float(rank) if mod.alpha is None else mod.alpha
      scale = alpha / (math.sqrt(rank) if rslora else rank)
      weights[site], names[site] = LoRAWeight(down, up, scale), mod.module

  def allowed(keys: Sequence[str]) -> bool:
    return all(any(re.fullmatch(p, k) for p in allow_unmatched) for k in keys)

  problems, skipped = [], []
  for k, why in leftovers:
    (skipped.append(k) if allowed([k]) else problems.append(f"{path}: {k!r} {why}"))
  for mod, why in unmatched:
    if allowed(mod.keys):
      skipped += mod.keys
    else:
      problems.append(f"{path}: {mod.keys[0]!r} ({mod.module!r}) {why}")
  problems += misshaped
  if problems:
    bad = len(unmatched) + len(misshaped)
    head = f"{path}: {len(problems)} problem(s) applying this {fmt} LoRA to {_model_name(params_or_model)}"
    if modules and bad * 2 > len(modules):
      head = (
        f"{path}: this LoRA is for another model: {bad} of its {len(modules)} modules "
        f"{'do not fit the shapes of' if len(misshaped) * 2 > len(modules) else 'match nothing in'} "
        f"{_model_name(params_or_model)} (another family, or another size of it)"
      )
    elif not modules:
      head = f"{path}: no module of the component read (prefix {prefix!r}); pass prefix="
    listed = "\n  ".join(problems[:_MAX_LISTED])
    more = f"\n  … and {len(problems) - _MAX_LISTED} more" if len(problems) > _MAX_LISTED else ""
    hint = "\n  (allow_unmatched= takes regexes over keys that may stay unmatched)"
    raise LoRAFileError(f"{head}\n  {listed}{more}{hint if not misshaped else ''}")
  return Adapter(weights, names, str(path), fmt, tuple(skipped))


def _model_name(params_or_model: Any) -> str:
  if isinstance(params_or_model, nnx.Module):
    return type(params_or_model).__name__
  return "the model" if not isinstance(params_or_model, Mapping) else "the given parameters"
