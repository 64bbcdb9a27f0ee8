"""Filling an abstract NNX model from a reference checkpoint, tensor by tensor, placed with its sharding."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import math
import os
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from md_core import _keymap, _stream
from md_core._abstract import shapes_only
from md_core._keymap import KeyMap, Path, Target

_MAX_LISTED = 25


class WeightLoadError(ValueError):
  """A checkpoint that does not fit the model: unknown, missing or mis-shaped tensors, all listed at once."""


@dataclasses.dataclass(frozen=True)
class LoadReport:
  """What a load did. `unused` are checkpoint tensors skipped by the allow-list; `missing` model parameters
  left at their fill value by the allow-list."""

  loaded: int
  unused: tuple[str, ...]
  missing: tuple[str, ...]


def variable_value(var: Any) -> Any:
  """The value of an NNX variable across flax versions."""
  return var.get_value() if hasattr(var, "get_value") else var.value


def set_variable_value(var: Any, value: Any) -> None:
  if hasattr(var, "set_value"):
    var.set_value(value)
  else:
    var.value = value


def logical_axes(var: Any) -> tuple[str | None, ...] | None:
  """The logical axis names a parameter was declared with (`nnx.Param(..., logical_axes=(...))`)."""
  meta = var.get_metadata() if hasattr(var, "get_metadata") else {}
  axes = meta.get("logical_axes") if isinstance(meta, Mapping) else None
  if axes is None:
    axes = getattr(var, "logical_axes", None)
  return tuple(axes) if axes is not None else None


def flat_variables(module_or_state: Any) -> dict[Path, Any]:
  """`{path: Variable}` of a module or state (the variables themselves, so values can be set in place)."""
  state = module_or_state
  if isinstance(module_or_state, nnx.Module):
    state = nnx.state(module_or_state)
  return {tuple(path): var for path, var in nnx.to_flat_state(state)}


def abstract_model(factory: Callable[[], nnx.Module] | nnx.Module) -> nnx.Module:
  """`factory()` built with shapes only (`nnx.eval_shape`): no memory, no random init."""
  if isinstance(factory, nnx.Module):
    return factory
  with shapes_only():
    return nnx.eval_shape(factory)


def placement(
  var: Any, shape: tuple[int, ...], mesh: jax.sharding.Mesh | None, rules: Any = None
) -> jax.sharding.Sharding | None:
  """The sharding of a parameter on `mesh` from its logical axis names (replicated when it has none)."""
  if mesh is None:
    return None
  import md_sharding as mds

  axes = logical_axes(var)
  if axes is None or len(axes) != len(shape):
    axes = (None,) * len(shape)
  return mds.logical_to_sharding(axes, mesh, rules=rules, shape=shape)


def target_dtype(
  path: Path, current: Any, dtype: Any, keep_f32: Sequence[str], stored: Any = None
) -> np.dtype:
  """A floating parameter's dtype: float32 if its path matches a `keep_f32` pattern; else `dtype` if given;
  with `dtype="stored"` the checkpoint's `stored` floating dtype; else (None, or nothing stored) the model's
  `current` one. Other parameters keep theirs."""
  current = np.dtype(current)
  if not jnp.issubdtype(current, jnp.floating):
    return current
  text = _keymap.path_str(path)
  if any(re.search(p, text) for p in keep_f32):
    return np.dtype(np.float32)
  if _is_stored(dtype):
    if stored is not None and jnp.issubdtype(np.dtype(stored), jnp.floating):
      return np.dtype(stored)
    return current
  return current if dtype is None else np.dtype(dtype)


def _is_stored(dtype: Any) -> bool:
  return isinstance(dtype, str) and dtype == "stored"


def load_weights(
  factory: Callable[[], nnx.Module] | nnx.Module,
  checkpoint: Mapping[str, np.ndarray],
  convert_key: KeyMap,
  *,
  dtype: Any = None,
  keep_f32: Sequence[str] = (),
  mesh: jax.sharding.Mesh | None = None,
  rules: Any = None,
  allow_unused: Sequence[str] = (),
  allow_missing: Sequence[str] = (),
  fill_missing: Callable[[Path, tuple[int, ...], np.dtype], np.ndarray] | None = None,
  progress: bool = True,
  return_report: bool = False,
):
  """Builds a model from a reference checkpoint without materialising a random init.

  The model is built abstractly, every checkpoint tensor is mapped with `convert_key` and checked against the
  parameter it fills (shape, presence) before anything is read; then each tensor is read from its memory-mapped
  file, converted (split, layout), cast once and placed with its target sharding.

  Args:
    factory: a function building the model (called under `nnx.eval_shape`) or an abstract model.
    checkpoint: tensor name → array mapping, e.g. from `open_checkpoint` (`file_of(key)` is used in errors).
    convert_key: the family's key map: tensor name → `Target`, several targets, or None for unknown names.
    dtype: dtype for floating parameters. None: the model's own (float32 for md's modules: a bfloat16
      file is upcast, as diffusers loads without `torch_dtype`). `"stored"`: each tensor's own floating
      dtype (per tensor, so a file mixing bfloat16 and float32 keeps both; stacked layers take their common
      type; parameters filled without a tensor take the model's own).
    keep_f32: regexes over parameter paths (`"blocks/0/norm/scale"`) that stay float32 whatever `dtype` is.
    mesh: place parameters on this mesh with shardings from their logical axis names (md-sharding rules).
    rules: md-sharding logical axis rules (default rules when None).
    allow_unused: regexes over tensor names that may be in the checkpoint and are skipped.
    allow_missing: regexes over parameter paths that may be absent from the checkpoint.
    fill_missing: value for an allowed-missing parameter (default: zeros).
    progress: show a progress bar over tensors.
    return_report: also return a `LoadReport`.

  Returns:
    The model with its parameters (and `LoadReport` when `return_report`).

  Raises:
    WeightLoadError: listing every unknown, missing or mis-shaped tensor with its file, name and both shapes.
  """
  model = abstract_model(factory)
  graphdef, state = nnx.split(model)
  variables = flat_variables(state)
  plan, unused, missing = _plan(
    model, variables, checkpoint, convert_key, allow_unused, allow_missing
  )

  items = list(variables.items())
  if progress:
    from md_core import progress as _progress

    items = _progress.track(items, desc=f"loading {type(model).__name__}")

  def value_of(path, var):
    abstract = variable_value(var)
    shape = tuple(abstract.shape)
    pieces = plan.get(path)
    sharding = placement(var, shape, mesh, rules)
    if not pieces:
      out_dtype = target_dtype(path, abstract.dtype, dtype, keep_f32)
      value = fill_missing(path, shape, out_dtype) if fill_missing else np.zeros(shape, out_dtype)
      value = np.asarray(value).astype(out_dtype, copy=False)
      return jax.device_put(value, sharding) if sharding is not None else jnp.asarray(value)
    ordered = sorted(pieces, key=lambda p: p[1].layer or 0)
    # Memory-mapped views: each device reads only its slice of each tensor (see _stream).
    arrays = [(np.asarray(checkpoint[k]), t) for k, t in ordered]
    stored = np.result_type(*(a.dtype for a, _ in arrays))
    out_dtype = target_dtype(path, abstract.dtype, dtype, keep_f32, stored)
    if pieces[0][1].layer is not None:
      return _stream.place_stacked(shape, arrays, out_dtype, sharding)
    return _stream.place_tensor(*arrays[0], out_dtype, sharding)

  def small(path, var) -> bool:
    """A single tensor the host converts whole (no device program, no host copy beyond the placed
    buffer), so several can be converted at once without holding more memory."""
    pieces = plan.get(path)
    if not pieces or len(pieces) != 1 or pieces[0][1].layer is not None:
      return False
    return math.prod(variable_value(var).shape) * 4 <= _stream.HOST_BYTES

  # NumPy's copies release the GIL: the many small tensors convert on a thread per core, the large ones
  # (threaded inside `_stream`) and the stacked ones one at a time.
  workers = min(os.cpu_count() or 1, 8)
  pending = []
  with concurrent.futures.ThreadPoolExecutor(workers) as pool:
    for path, var in items:
      if workers > 1 and small(path, var):
        pending.append((var, pool.submit(value_of, path, var)))
      else:
        set_variable_value(var, value_of(path, var))
    for var, future in pending:
      set_variable_value(var, future.result())
  loaded = nnx.merge(graphdef, state)
  if return_report:
    return loaded, LoadReport(loaded=len(plan), unused=tuple(unused), missing=tuple(missing))
  return loaded


def coverage(
  manifest: Mapping[str, Sequence[int]],
  factory: Callable[[], nnx.Module] | nnx.Module,
  convert_key: KeyMap,
  *,
  allow_unused: Sequence[str] = (),
  allow_missing: Sequence[str] = (),
) -> list[str]:
  """Checks a key map against a checkpoint's names and shapes only (a key manifest): the problems found.

  The same checks as `load_weights`, without any tensor data: an empty list means the map covers every
  tensor of the checkpoint with the right shapes and fills every parameter of the model.
  """

  model = abstract_model(factory)
  _, state = nnx.split(model)
  shapes = _Manifest(manifest)
  try:
    _plan(model, flat_variables(state), shapes, convert_key, allow_unused, allow_missing)
  except WeightLoadError as e:
    return str(e).split("\n  ")[1:]
  return []


class _Manifest(dict):
  """Tensor names and shapes without data, shaped like a Checkpoint for `_plan`."""

  name = "key manifest"

  def __init__(self, shapes: Mapping[str, Sequence[int]]):
    super().__init__({k: tuple(v) for k, v in shapes.items()})

  def shape(self, key: str) -> tuple[int, ...]:
    return self[key]


def _plan(model, variables, checkpoint, convert_key, allow_unused, allow_missing):
  """Maps and checks every tensor (names and shapes only); raises WeightLoadError listing all problems."""
  name = getattr(checkpoint, "name", "checkpoint")

  def where(key: str) -> str:
    file_of = getattr(checkpoint, "file_of", None)
    return str(file_of(key)) if file_of else name

  def shape_of(key: str) -> tuple[int, ...]:
    shape = getattr(checkpoint, "shape", None)
    return tuple(shape(key)) if callable(shape) else tuple(np.shape(checkpoint[key]))

  problems: list[str] = []
  unused: list[str] = []
  plan: dict[Path, list[tuple[str, Target]]] = {}
  claimed: set[Path] = set()
  for key in checkpoint:
    targets = convert_key(key)
    if targets is None:
      if any(re.fullmatch(p, key) for p in allow_unused):
        unused.append(key)
      else:
        problems.append(
          f"{where(key)}: tensor {key!r} {shape_of(key)} maps to no parameter of the model"
        )
      continue
    if isinstance(targets, Target):
      targets = (targets,)
    for target in targets:
      var = variables.get(tuple(target.path))
      if var is None:
        problems.append(
          f"{where(key)}: tensor {key!r} maps to {_keymap.path_str(target.path)!r}, which the model does not have"
        )
        continue
      claimed.add(
        tuple(target.path)
      )  # mis-shaped or not: the parameter is not reported missing too
      want = tuple(variable_value(var).shape)
      if target.layer is not None:
        if not want or not 0 <= target.layer < want[0]:
          problems.append(
            f"{where(key)}: tensor {key!r} goes to layer {target.layer} of {_keymap.path_str(target.path)!r} "
            f"with shape {want}"
          )
          continue
        want = want[1:]
      try:
        got = _keymap.target_shape(shape_of(key), target)
      except ValueError as e:
        got = f"unconvertible ({e})"
      if got != want:
        problems.append(
          f"{where(key)}: tensor {key!r} has shape {shape_of(key)} (→ {got} as {target.layout}), "
          f"expected {want} for {_keymap.path_str(target.path)!r}"
        )
        continue
      plan.setdefault(tuple(target.path), []).append((key, target))

  missing: list[str] = []
  for path, var in variables.items():
    text = _keymap.path_str(path)
    pieces = plan.get(path, [])
    shape = tuple(variable_value(var).shape)
    layered = any(t.layer is not None for _, t in pieces)
    if layered:
      have = sorted({t.layer for _, t in pieces})
      if have != list(range(shape[0])) or len(pieces) != shape[0]:
        absent = sorted(set(range(shape[0])) - set(have))
        problems.append(
          f"{name}: parameter {text!r} {shape} is stacked over {shape[0]} layers; checkpoint gives layers "
          f"{have} ({len(pieces)} tensors); missing layers {absent}"
        )
    elif len(pieces) > 1:
      keys = [k for k, _ in pieces]
      problems.append(f"{name}: parameter {text!r} is filled by several tensors {keys}")
    elif not pieces and path not in claimed:
      if any(re.fullmatch(p, text) for p in allow_missing):
        missing.append(text)
      else:
        problems.append(f"{name}: parameter {text!r} {shape} has no tensor in the checkpoint")

  if problems:
    listed = "\n  ".join(problems[:_MAX_LISTED])
    more = f"\n  … and {len(problems) - _MAX_LISTED} more" if len(problems) > _MAX_LISTED else ""
    raise WeightLoadError(
      f"{name} does not fit {type(model).__name__}: {len(problems)} problem(s)\n  {listed}{more}"
    )

  return plan, unused, missing
