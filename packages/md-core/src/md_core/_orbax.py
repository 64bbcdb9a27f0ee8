"""Saving converted weights with Orbax and restoring them straight onto a mesh (fast reloads)."""

from __future__ import annotations

import os
import pathlib
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from flax import nnx

from md_core import _keymap, _loading


def save_converted(
  module: nnx.Module, directory: str | os.PathLike, *, force: bool = False
) -> pathlib.Path:
  """Saves a model's variables (as loaded and cast) to an Orbax checkpoint folder.

  Raises:
    FileExistsError: `directory` exists and `force` is False.
  """
  import orbax.checkpoint as ocp

  directory = pathlib.Path(directory).absolute()
  if directory.exists() and not force:
    raise FileExistsError(f"{directory} exists; pass force=True to overwrite it")
  flat = {
    _keymap.path_str(p): _loading.variable_value(v)
    for p, v in _loading.flat_variables(module).items()
  }
  with ocp.StandardCheckpointer() as ckptr:
    ckptr.save(directory, flat, force=force)
  return directory


def restore_converted(
  factory: Callable[[], nnx.Module] | nnx.Module,
  directory: str | os.PathLike,
  *,
  mesh: jax.sharding.Mesh | None = None,
  rules: Any = None,
) -> nnx.Module:
  """Restores a model saved by `save_converted`, each array placed with its sharding on `mesh`.

  Raises:
    FileNotFoundError: no checkpoint at `directory`.
    ValueError: the saved arrays do not match the model's (names, shapes or dtypes), listed.
  """
  import orbax.checkpoint as ocp

  directory = pathlib.Path(directory).absolute()
  if not directory.is_dir():
    raise FileNotFoundError(f"{directory}: no converted checkpoint here")
  model = _loading.abstract_model(factory)
  graphdef, state = nnx.split(model)
  variables = _loading.flat_variables(state)
  device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  target = {}
  for path, var in variables.items():
    abstract = _loading.variable_value(var)
    sharding = _loading.placement(var, tuple(abstract.shape), mesh, rules) or device
    target[_keymap.path_str(path)] = jax.ShapeDtypeStruct(
      abstract.shape, abstract.dtype, sharding=sharding
    )
  with ocp.StandardCheckpointer() as ckptr:
    saved = ckptr.metadata(directory)
    saved = getattr(saved, "item_metadata", saved)
    saved = getattr(saved, "tree", saved)
    saved_keys = set(saved.keys()) if hasattr(saved, "keys") else set(target)
    problems = [
      f"parameter {k!r} is not in the saved checkpoint" for k in sorted(set(target) - saved_keys)
    ]
    problems += [
      f"saved array {k!r} is not a parameter of the model" for k in sorted(saved_keys - set(target))
    ]
    for k in sorted(saved_keys & set(target)):
      shape = getattr(saved[k], "shape", None)
      if shape is not None and tuple(shape) != tuple(target[k].shape):
        problems.append(
          f"saved array {k!r} has shape {tuple(shape)}, the model expects {target[k].shape}"
        )
      dtype = getattr(saved[k], "dtype", None)
      if dtype is not None and np.dtype(dtype) != np.dtype(target[k].dtype):
        # Restore casts; a dtype difference is allowed (e.g. restoring bf16 weights into an f32 model).
        target[k] = jax.ShapeDtypeStruct(target[k].shape, dtype, sharding=target[k].sharding)
    if problems:
      raise ValueError(
        f"{directory} does not fit {type(model).__name__}:\n  " + "\n  ".join(problems)
      )
    restored = ckptr.restore(directory, target)
  for path, var in variables.items():
    _loading.set_variable_value(var, restored[_keymap.path_str(path)])
  return nnx.merge(graphdef, state)
