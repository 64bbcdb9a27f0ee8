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
from md_lora._adapter import Adapter, GLoRAWeight, IA3Weight, LoRAWeight, OFTWeight, Site
from md_lora._formats import (
  FORMATS,
  LoRAFileError,
  RawDelta,
  RawGLoRA,
  RawIA3,
  RawLoRA,
  RawOFT,
  RenamedTensors,
  detect_format,
  diffusers_old_keys,
  read_modules,
)
from md_lora._layouts import detect_layout, guess_model, translator

_MAX_LISTED = 20
_NEAREST = "\x00nearest"  # placeholder, filled in for the listed problems
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


def lora_factors(
  a: np.ndarray, b: np.ndarray, target: Target, shape: tuple[int, ...] | None = None
) -> tuple[np.ndarray, np.ndarray]:
  """torch-layout factors (`a` `[r, in, *k]`, `b` `[out, r, *1]`) → md-layout `(down, up)` for `target`.

  The delta `b @ a` is a tensor in the reference layout of the base weight, so it converts as the weight
  does: a split of the weight's output axis splits `b`, of its input axis splits `a`; the layout's
  permutation moves the output axis last, where `up` puts it. Given the weight's md `shape` (one layer),
  an `a` `[r, in·k…]` (LyCORIS' convolution factors keep the input and kernel axes flattened) takes the
  kernel's axes first.
  """
  a = _kernel_axes(a, target, shape)
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


def _kernel_axes(a: np.ndarray, target: Target, shape: tuple[int, ...] | None) -> np.ndarray:
  """`a` `[r, in·k…]` as `[r, in, *k]` for a convolution weight of md shape `shape`; else `a` unchanged."""
  perm = _PERMUTATIONS.get(target.layout)
  if shape is None or a.ndim != 2 or perm is None or len(perm) != len(shape) or len(perm) < 3:
    return a
  reference = [0] * len(perm)
  for axis, source in enumerate(perm):
    reference[source] = shape[axis]
  if (target.split is not None and target.split[2] == 1) or a.shape[1] != math.prod(reference[1:]):
    return a  # the layout check below names the mismatch
  return a.reshape(a.shape[0], *reference[1:])


def magnitude_of(magnitude: np.ndarray, target: Target, shape: tuple[int, ...]) -> np.ndarray:
  """A DoRA magnitude in the weight's torch layout (one axis not 1: 0 per output, 1 per input; trailing 1s
  may be missing) → md's layout for a weight of md shape `shape` (one layer), as the weight is permuted; a
  split of the weight along the magnitude's axis takes its part. Raises ValueError for a split along the
  other axis (the norms would span the whole fused weight) or a magnitude that does not fit `shape`."""
  magnitude = magnitude.reshape(*magnitude.shape, *(1,) * (len(shape) - magnitude.ndim))
  axis = next((i for i, d in enumerate(magnitude.shape) if d != 1), 0)
  if target.split is not None:
    index, parts, split = target.split
    if magnitude.shape[split] == 1 and magnitude.size > 1:
      raise ValueError(
        f"a DoRA magnitude along axis {axis} cannot follow a split along axis {split} of the weight"
      )
    size = magnitude.shape[split] // parts
    if magnitude.shape[split] % parts:
      raise ValueError(f"cannot take part {index} of {parts} of a magnitude of {magnitude.shape}")
    magnitude = np.take(magnitude, np.arange(index * size, (index + 1) * size), axis=split)
  if target.layout != "identity":
    magnitude = np.transpose(magnitude, _PERMUTATIONS[target.layout])
  if magnitude.ndim != len(shape) or any(m not in (1, s) for m, s in zip(magnitude.shape, shape)):
    raise ValueError(f"the DoRA magnitude is {magnitude.shape} in md's layout, the weight {shape}")
  return magnitude


def delta_factors(delta: np.ndarray, target: Target) -> tuple[np.ndarray, np.ndarray]:
  """A full delta (torch layout of the base tensor) → md-layout `(down, up)` with `tensordot(down, up, 1)`
  equal to it: `down` is the delta itself, `up` the identity (vectors: `down = [1]`, `up = [delta]`)."""
  if target.split is not None:
    index, parts, axis = target.split
    if delta.shape[axis] % parts:
      raise ValueError(
        f"cannot take part {index} of {parts} along axis {axis} of shape {delta.shape}"
      )
    size = delta.shape[axis] // parts
    delta = np.take(delta, np.arange(index * size, (index + 1) * size), axis=axis)
  if target.layout != "identity":
    perm = _PERMUTATIONS[target.layout]
    if delta.ndim != len(perm):
      raise ValueError(
        f"layout {target.layout!r} takes a {len(perm)}-d weight, the delta is {delta.ndim}-d"
      )
    delta = np.transpose(delta, perm)
  if delta.ndim == 1:
    return np.ones((1,), delta.dtype), delta[None]
  return delta, np.eye(delta.shape[-1], dtype=delta.dtype)


def _covers(pieces: Sequence[tuple[str, Any]], rows: int) -> bool:
  """Whether a fused module's pieces take each of its output rows once (unsplit pieces take all)."""
  taken = [r for _, r in pieces if r is not None]
  if not taken:
    return True
  joined = np.sort(np.concatenate(taken))
  return len(joined) == rows and bool(np.all(joined == np.arange(rows)))


def _translate(
  modules: list[RawLoRA],
  deltas: list[RawDelta],
  rotations: list[RawOFT],
  paths: Sequence[tuple],
  layout: str | None,
) -> tuple[list[RawLoRA], list[RawDelta], list[RawOFT], list[tuple[str, str]]]:
  """Module names of `layout` → diffusers names, a fused module split into its parts' rows (an OFT
  rotation, which mixes the rows of its whole module, only renamed)."""
  move = translator(layout, paths)
  if move is None:
    return modules, deltas, rotations, []
  features = {m.module: m.a.shape[1] for m in modules}
  unknown: list[tuple[str, str]] = []
  why = f"is no module md knows in the {layout} layout"
  out_modules = []
  for mod in modules:
    pieces = move(mod.module, mod.b.shape[0], mod.a.shape[1])
    if pieces is None:
      unknown += [(k, why + f" ({mod.module!r})") for k in mod.keys]
      continue
    if not _covers(pieces, mod.b.shape[0]):
      parts = ", ".join(name for name, _ in pieces)
      unknown.append(
        (
          mod.keys[0],
          f"has {mod.b.shape[0]} output rows, which do not split into {parts} (lora_A "
          f"{mod.a.shape}, lora_B {mod.b.shape})",
        )
      )
      continue
    for name, rows in pieces:
      if rows is None:
        out_modules.append(mod._replace(module=name))
      elif len(rows):
        bias = None if mod.bias is None else mod.bias[rows]
        out_modules.append(mod._replace(module=name, b=mod.b[rows], bias=bias))
  features.update({d.module: d.delta.shape[1] for d in deltas if d.delta.ndim > 1})
  out_deltas = []
  for d in deltas:
    width = features.get(d.module, 0)
    pieces = move(d.module, d.delta.shape[0], width)
    if pieces is None:
      unknown.append((d.key, why + f" ({d.module!r})"))
      continue
    if (
      not width and any(rows is not None for _, rows in pieces) or not _covers(pieces, len(d.delta))
    ):
      unknown.append(
        (d.key, f"is a delta on fused {d.module!r}, which md splits only beside its weight's")
      )
      continue
    for name, rows in pieces:
      if rows is None:
        out_deltas.append(d._replace(module=name))
      elif len(rows):
        out_deltas.append(d._replace(module=name, delta=d.delta[rows]))
  out_rotations = []
  for rot in rotations:
    if isinstance(rot, RawGLoRA):
      out = rot.b1.shape[0]
    elif isinstance(rot, RawIA3):
      out = 0 if rot.on_input else len(rot.vector)
    else:
      out = rot.blocks.shape[1] * rot.blocks.shape[2]
    pieces = move(rot.module, out, 0)
    if pieces is None:
      unknown.append((rot.keys[0], why + f" ({rot.module!r})"))
    elif len(pieces) != 1 or pieces[0][1] is not None:
      parts = ", ".join(name for name, _ in pieces)
      unknown.append(
        (
          rot.keys[0],
          f"is an OFT rotation of fused {rot.module!r}, which md does not split ({parts})",
        )
      )
    else:
      out_rotations.append(rot._replace(module=pieces[0][0]))
  return out_modules, out_deltas, out_rotations, unknown


def _nearest(module: str, paths: Sequence[str]) -> str:
  guess = module.replace(".", "/") + "/kernel"
  close = difflib.get_close_matches(guess, paths, n=1, cutoff=0.5)
  return f"; nearest md parameter {close[0]!r}" if close else ""


def load_lora(
  file: str | os.PathLike | Mapping[str, Any],
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

  The file's format (`FORMATS`) and module-name layout (diffusers names, BFL Flux, Wan's original
  names, SGM's UNet, LTX-2's original names) are read off its keys; modules in another layout are renamed
  to the family's diffusers names first, fused ones (BFL `qkv`, `linear1`) split into their parts. Each
  module's base weight name (`<module>.weight`) then goes through the family's `convert_key`; its Target
  (path, layout, split, layer) says where the delta lands and how it converts. Full deltas (`diff`,
  `diff_b`, PEFT `lora_B.bias`) land on `<module>.weight` / `<module>.bias`. Only the model's shapes are
  used (an abstract model from `nnx.eval_shape` serves).

  Args:
    file: a `.safetensors` LoRA file, or a mapping of its tensors (`{key: array}`; a `name` and
      `metadata` attribute are used where present).
    convert_key: the family's diffusers key map for this component (`md_sd.unet_key_map(cfg)`,
      `md_flux.convert_key`, `md_wan.convert_key`, `md_ltx.ltx2_convert_key`,
      `md_text.clip_text_convert_key`…).
    params_or_model: the md module (or its `nnx.State`, or `{path: array or shape}`) the LoRA adapts.
    prefix: the component's prefix in the file's names (`"unet."`, `"text_encoder_2."`, `"lora_te1_"`,
      `"diffusion_model."`); default: the known prefix most keys carry.
    format: force one of `FORMATS` (default: detected from the keys).
    config: PEFT `LoraConfig` / `OFTConfig` fields (a dict, or an `adapter_config.json` path); default: the
      `adapter_config.json` beside the file, else the file's `lora_adapter_metadata`, else alpha = r.
    default_alpha: for kohya files whose modules lack `.alpha` tensors, the alpha to assume.
    allow_unmatched: regexes over file keys that may map to nothing (e.g. `r"lora_te_.*"`); they are
      listed in `Adapter.skipped`, as are the keys of the pipeline's other components the file holds
      (`text_encoder.` beside `unet.`).

  Returns:
    The Adapter, keyed by md parameter site (`lora_report` lists it).

  Raises:
    SafetensorsError: the file is not a readable safetensors file (e.g. truncated).
    LoRAFileError: an unknown format, a rank mismatch, a missing or non-numeric alpha, keys that map to
      nothing or to parameters of other shapes (all listed, with file and key), or a LoRA made for
      another model (said first, with the model its names suggest).
  """
  if isinstance(file, Mapping):  # tensors already read (a state dict), or shapes-only stand-ins
    tensors, path = file, pathlib.Path(str(getattr(file, "name", "<tensors>")))
    metadata = dict(getattr(file, "metadata", None) or {})
  else:
    path = pathlib.Path(file)
    tensors = md_core.SafetensorsFile(path)
    metadata = tensors.metadata
  keys = list(tensors)
  if format is not None and format not in FORMATS:
    raise LoRAFileError(f"{path}: format={format!r}; md reads {FORMATS}")
  if format in (None, "peft") and (renamed := diffusers_old_keys(keys)) is not None:
    tensors, keys = RenamedTensors(tensors, renamed), list(renamed)  # read as the PEFT names
  fmt = format or detect_format(keys, str(path))
  modules, deltas, rotations, leftovers, others, rslora = read_modules(
    tensors, metadata, path, fmt, prefix, config, default_alpha
  )
  shapes = param_shapes(params_or_model)
  known = [path_str(p) for p in shapes]
  source_names = [m.module for m in modules] + [d.module for d in deltas]
  source_names += [r.module for r in rotations]
  source_ids = (
    {m.keys[0] for m in modules} | {d.key for d in deltas} | {r.keys[0] for r in rotations}
  )
  # Cross-attention key / value input widths (the text states' width) say which SD UNet a file is for.
  context_widths = {
    int(m.a.shape[1]) for m in modules if re.search(r"attn2\.to_[kv]$", m.module) and m.a.ndim == 2
  }
  layout = detect_layout(source_names)
  modules, deltas, rotations, untranslated = _translate(
    modules, deltas, rotations, list(shapes), layout
  )
  leftovers += untranslated

  weights: dict[Site, LoRAWeight | OFTWeight] = {}
  names: dict[Site, str] = {}
  unmatched: list[tuple[tuple[str, ...], str, str]] = []  # (keys, module, why)
  misshaped: list[str] = []
  bad_ids = {k for k, _ in untranslated}  # the first key of each source module with a problem

  def place(site: Site, weight: LoRAWeight | OFTWeight, module: str, key: str, what: str) -> None:
    shape = shapes[site.path]
    want = shape[1:] if site.layer is not None else shape
    if isinstance(weight, IA3Weight):
      axis = "inputs" if weight.on_input else "outputs"
      got = len(weight.vector)
      want = (want[-2] if weight.on_input else want[-1]) if len(want) > 1 else None
      problem = f"{what} of {module!r} scales {got} {axis}, the model's {str(site)!r} is {shape}"
    elif isinstance(weight, GLoRAWeight):
      got = tuple(np.shape(weight.down)[:-1]) + tuple(np.shape(weight.up)[1:])
      problem = f"the GLoRA of {module!r} ({what}) is {got} in md's layout, the model's "
      problem += f"{str(site)!r} is {want}"
    elif isinstance(weight, OFTWeight):
      axis = "inputs" if weight.rule == "peft" else "outputs"
      if weight.rule == "peft":  # a convolution's inputs flattened with its kernel axes
        got, want = weight.size, math.prod(want[:-1]) if len(want) > 1 else None
      else:
        got, want = weight.size, want[-1] if want else None
      problem = f"{what} of {module!r} rotate {got} {axis}, the model's {str(site)!r} is {shape} "
      problem += f"({want} {axis})"
      if weight.rule == "peft" and weight.rescale is not None and got == want:  # BOFT's boft_s
        got, want = np.size(weight.rescale), shape[-1]
        problem = f"{module!r} scales {got} outputs (boft_s), the model's {str(site)!r} is {shape} "
        problem += f"({want} outputs)"
    else:
      got = tuple(np.shape(weight.down)[:-1]) + tuple(np.shape(weight.up)[1:])
      problem = f"the delta of {module!r} ({what}) is {got} in md's layout, the model's "
      problem += f"{str(site)!r} is {want}"
    if got != want:
      bad_ids.add(key)
      misshaped.append(f"{path}: {key!r}: {problem}")
    elif site in weights:
      raise LoRAFileError(f"{path}: {module!r} and {names[site]!r} both adapt {str(site)!r}")
    else:
      weights[site], names[site] = weight, module

  def targets_of(name: str, keys: tuple[str, ...], module: str) -> list[Target]:
    targets = convert_key(name)
    if targets is None:
      bad_ids.add(keys[0])
      unmatched.append((keys, module, "maps to no parameter of the model" + _NEAREST))
      return []
    out = []
    for target in (targets,) if isinstance(targets, Target) else targets:
      if tuple(target.path) not in shapes:
        bad_ids.add(keys[0])
        site = Site(tuple(target.path), target.layer)
        unmatched.append((keys, module, f"maps to {str(site)!r}, which the model does not have"))
      else:
        out.append(target)
    return out

  for mod in modules:
    rank = mod.a.shape[0]
    alpha = float(rank) if mod.alpha is None else mod.alpha
    scale = alpha / (math.sqrt(rank) if rslora else rank)
    what = f"lora_A {mod.a.shape}, lora_B {mod.b.shape}"
    for target in targets_of(mod.module + ".weight", mod.keys, mod.module):
      site = Site(tuple(target.path), target.layer)
      try:
        layer = shapes[site.path][1:] if site.layer is not None else shapes[site.path]
        down, up = lora_factors(mod.a, mod.b, target, tuple(layer))
        magnitude = None
        if mod.magnitude is not None:
          magnitude = magnitude_of(mod.magnitude, target, tuple(layer))
      except ValueError as e:
        misshaped.append(
          f"{path}: {mod.keys[0]!r}: {mod.module!r} cannot follow {str(site)!r} ({e})"
        )
        continue
      weight = LoRAWeight(down, up, scale, magnitude, mod.dora_rule)
      place(site, weight, mod.module, mod.keys[0], what)
    if mod.bias is not None:
      bias_key = next(k for k in mod.keys if k.endswith(".bias"))
      for target in targets_of(mod.module + ".bias", (bias_key,), mod.module):
        site = Site(tuple(target.path), target.layer)
        down, up = delta_factors(mod.bias, target)
        place(site, LoRAWeight(down, up, scale), mod.module, bias_key, f"bias {mod.bias.shape}")
  for rot in rotations:
    if isinstance(rot, RawGLoRA):
      _place_glora(rot, path, shapes, targets_of, place, misshaped, bad_ids)
      continue
    if isinstance(rot, RawIA3):
      what = f"IA3 {'inputs' if rot.on_input else 'outputs'} {rot.vector.shape}"
      for target in targets_of(rot.module + ".weight", rot.keys, rot.module):
        site = Site(tuple(target.path), target.layer)
        if target.split is not None or target.layout == "identity":
          bad_ids.add(rot.keys[0])
          misshaped.append(
            f"{path}: {rot.keys[0]!r}: IA3 module {rot.module!r} cannot follow {str(site)!r} (part of "
            "a fused tensor, or kept in torch's layout)"
          )
          continue
        place(site, IA3Weight(rot.vector, rot.on_input), rot.module, rot.keys[0], what)
      continue
    peft = rot.rule == "peft"
    kind = ("PEFT " if peft else "") + ("BOFT" if rot.butterfly else "OFT")
    what = f"{kind} blocks {rot.blocks.shape[1:] if not rot.butterfly else rot.blocks.shape}"
    for target in targets_of(rot.module + ".weight", rot.keys, rot.module):
      site = Site(tuple(target.path), target.layer)
      if target.split is not None or target.layout == "identity":
        bad_ids.add(rot.keys[0])
        how = "part of a fused tensor" if target.split is not None else "kept in torch's layout"
        axis = "input axis" if peft else "last axis"
        misshaped.append(
          f"{path}: {rot.keys[0]!r}: {kind} module {rot.module!r} cannot follow {str(site)!r} ({how}: "
          f"md rotates a whole kernel's {axis} only)"
        )
        continue
      blocks, (_, num, b, _) = rot.blocks, rot.blocks.shape
      shape = shapes[site.path][1:] if site.layer is not None else shapes[site.path]
      inputs = math.prod(shape[:-1]) if len(shape) > 1 else 0
      if peft and not rot.butterfly and num == 1 and inputs % b == 0:  # OFT's block_share
        blocks = np.tile(blocks, (1, inputs // b, 1, 1))
      weight = OFTWeight(blocks, rot.alpha * num * b, rot.rescale, rot.butterfly, rot.rule)
      place(site, weight, rot.module, rot.keys[0], what)
  for d in deltas:
    for target in targets_of(f"{d.module}.{d.kind}", (d.key,), d.module):
      site = Site(tuple(target.path), target.layer)
      try:
        down, up = delta_factors(d.delta, target)
      except ValueError as e:
        bad_ids.add(d.key)
        misshaped.append(f"{path}: {d.key!r}: {d.module!r} cannot follow {str(site)!r} ({e})")
        continue
      place(site, LoRAWeight(down, up, 1.0), f"{d.module}.{d.kind}", d.key, f"diff {d.delta.shape}")

  def allowed(keys: Sequence[str]) -> bool:
    return all(any(re.fullmatch(p, k) for p in allow_unmatched) for k in keys)

  problems, skipped = [], list(others)
  nearest_of: dict[str, str] = {}
  for k, why in leftovers:
    (skipped.append(k) if allowed([k]) else problems.append(f"{path}: {k!r} {why}"))
  for mkeys, module, why in unmatched:
    if allowed(mkeys):
      skipped += [k for k in mkeys if k not in skipped]
    else:
      problems.append(f"{path}: {mkeys[0]!r} ({module!r}) {why}")
      nearest_of[problems[-1]] = module
  problems += misshaped
  # The nearest md path (difflib over every path) only for the problems listed.
  for i, text in enumerate(problems[:_MAX_LISTED]):
    if text.endswith(_NEAREST):
      problems[i] = text[: -len(_NEAREST)] + _nearest(nearest_of[text], known)
  if problems:
    n_modules = len(source_ids)
    bad = len(bad_ids & source_ids)
    model = _model_name(params_or_model)
    head = f"{path}: {len(problems)} problem(s) applying this {fmt} LoRA to {model}"
    if n_modules and bad * 2 > n_modules:
      guess = guess_model(source_names, context_widths)
      made_for = f" (its names are those of {guess})" if guess else ""
      head = (
        f"{path}: this LoRA is for another model{made_for}: {bad} of its {n_modules} modules "
        f"{'do not fit the shapes of' if len(misshaped) * 2 > bad else 'match nothing in'} "
        f"{model} (another family, or another size of it)"
      )
    elif not n_modules:
      head = f"{path}: no module of the component read (prefix {prefix!r}); pass prefix="
    listed = "\n  ".join(problems[:_MAX_LISTED])
    more = f"\n  … and {len(problems) - _MAX_LISTED} more" if len(problems) > _MAX_LISTED else ""
    hint = "\n  (allow_unmatched= takes regexes over keys that may stay unmatched)"
    raise LoRAFileError(f"{head}\n  {listed}{more}{hint if not misshaped else ''}")
  return Adapter(weights, names, str(path), fmt, tuple(skipped))


def _place_glora(rot, path, shapes, targets_of, place, misshaped, bad_ids) -> None:
  """A GLoRA module onto its md kernel: the LoRA part as `lora_factors` converts it, the input mix as
  stored (it acts on the kernel's input axis, which every md layout keeps second to last)."""
  what = f"a1 {rot.a1.shape}, a2 {rot.a2.shape}, b1 {rot.b1.shape}, b2 {rot.b2.shape}"
  for target in targets_of(rot.module + ".weight", rot.keys, rot.module):
    site = Site(tuple(target.path), target.layer)
    layer = shapes[site.path][1:] if site.layer is not None else shapes[site.path]
    problem = None
    if target.split is not None or target.layout == "identity":
      how = "part of a fused tensor" if target.split is not None else "kept in torch's layout"
      problem = f"GLoRA module {rot.module!r} cannot follow {str(site)!r} ({how})"
    elif len(layer) < 2 or layer[-2] != rot.a1.shape[0]:
      problem = f"GLoRA {rot.module!r} mixes {rot.a1.shape[0]} inputs, {str(site)!r} is {layer}"
    else:
      try:
        down, up = lora_factors(rot.b2, rot.b1, target, tuple(layer))
      except ValueError as e:
        problem = f"{rot.module!r} cannot follow {str(site)!r} ({e})"
    if problem is not None:
      bad_ids.add(rot.keys[0])
      misshaped.append(f"{path}: {rot.keys[0]!r}: {problem}")
      continue
    weight = GLoRAWeight(down, up, rot.scale, rot.a1, rot.a2)
    place(site, weight, rot.module, rot.keys[0], what)


def lora_report(adapter: Adapter) -> str:
  """Every adapted md site with the file module it came from, its rank and scale; then the skipped keys.

  One line per site: `blocks/attn1/to_q/kernel[3]  <- blocks.3.attn1.to_q  r=4 scale=2` (a DoRA site adds
  `dora=peft` or `dora=lycoris`; an OFT site reads `oft blocks=4x2` or `boft stages=2 blocks=2x4`, its
  norm bound and `rescale`; PEFT's OFT `peft-oft (inputs) blocks=18x4`).
  """
  lines = [repr(adapter)]
  for site in sorted(adapter.weights, key=str):
    w = adapter.weights[site]
    if isinstance(w, GLoRAWeight):
      lines.append(f"  {str(site)}  <- {adapter.names[site]}  glora r={w.rank} scale={w.scale:g}")
      continue
    if isinstance(w, IA3Weight):
      axis = "inputs" if w.on_input else "outputs"
      lines.append(f"  {str(site)}  <- {adapter.names[site]}  ia3 ({axis}) n={len(w.vector)}")
      continue
    if isinstance(w, OFTWeight):
      stages, num, b = np.shape(w.blocks)[:3]
      kind = f"boft stages={stages}" if w.butterfly else "oft"
      kind = f"peft-{kind} (inputs)" if w.rule == "peft" else kind
      bound = f" constraint={w.constraint:g}" if w.constraint > 0 else ""
      rescale = " rescale" if w.rescale is not None else ""
      lines.append(
        f"  {str(site)}  <- {adapter.names[site]}  {kind} blocks={num}x{b}{bound}{rescale}"
      )
      continue
    dora = "" if w.magnitude is None else f" dora={w.dora_rule}"
    lines.append(f"  {str(site)}  <- {adapter.names[site]}  r={w.rank} scale={w.scale:g}{dora}")
  lines += [f"  skipped: {k}" for k in adapter.skipped]
  return "\n".join(lines)


def _model_name(params_or_model: Any) -> str:
  if isinstance(params_or_model, nnx.Module):
    return type(params_or_model).__name__
  return "the model" if not isinstance(params_or_model, Mapping) else "the given parameters"
