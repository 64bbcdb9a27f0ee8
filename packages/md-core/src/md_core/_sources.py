"""Where a checkpoint lives: a local folder (diffusers layout or a single component) or a hub id."""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import re
import types
import typing
from collections.abc import Mapping
from typing import Any

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.\-]*/[\w.\-]+$")

# A `model_index.json` key md reads (diffusers ignores keys that start with "_"): components this pipeline
# folder shares with another one, `{"vae": "../t2v/vae"}`, each a folder path relative to the pipeline's.
SHARED_COMPONENTS = "_md_components"


def hub_offline() -> bool:
  """Whether the Hugging Face hub may not be contacted (`HF_HUB_OFFLINE`, read at call time)."""
  return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def hub_cache_dir(cache_dir: str | os.PathLike | None = None) -> pathlib.Path:
  """The hub cache folder huggingface_hub uses (`HF_HUB_CACHE`, else `HF_HOME/hub`, else ~/.cache)."""
  if cache_dir is not None:
    return pathlib.Path(cache_dir)
  if os.environ.get("HF_HUB_CACHE"):
    return pathlib.Path(os.environ["HF_HUB_CACHE"])
  home = os.environ.get("HF_HOME") or os.path.join(
    os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "huggingface"
  )
  return pathlib.Path(home) / "hub"


def resolve_source(
  source: str | os.PathLike,
  *,
  subfolder: str | None = None,
  revision: str | None = None,
  cache_dir: str | os.PathLike | None = None,
  allow_patterns: list[str] | None = None,
) -> pathlib.Path:
  """Turns a checkpoint source into a local folder.

  Args:
    source: a local folder (a diffusers pipeline with `model_index.json`, or one component's folder), or a hub
      id such as `"Wan-AI/Wan2.1-T2V-1.3B-Diffusers"`, resolved through the huggingface_hub cache. With
      `HF_HUB_OFFLINE=1` only the cache is read; otherwise missing files are downloaded.
    subfolder: a component of the checkpoint (`"transformer"`, `"vae"`, `"scheduler"`); it must exist.
    revision: a hub branch, tag or commit (default: main).
    cache_dir: the hub cache to use instead of the default one.
    allow_patterns: with a hub id, download only files matching these patterns (default: the subfolder and
      `model_index.json` when `subfolder` is given, everything otherwise).

  Returns:
    The local folder (the component's folder when `subfolder` is given).

  Raises:
    FileNotFoundError: the folder, component or cached hub snapshot is not there; the message says which and
      where it looked.
  """
  text = os.fspath(source)
  path = pathlib.Path(text).expanduser()
  if path.exists():
    if not path.is_dir():
      raise FileNotFoundError(f"{path}: a checkpoint source must be a folder, not a file")
    root = path
  elif _HUB_ID.match(text) and not text.startswith((".", "/")):
    root = _from_hub(text, subfolder, revision, cache_dir, allow_patterns)
  else:
    raise FileNotFoundError(
      f"{text!r} is neither an existing folder nor a hub id of the form 'org/name'"
    )
  if subfolder is None:
    return root
  component = root / subfolder
  if not component.is_dir() and (root / "model_index.json").is_file():
    shared = shared_component(root, subfolder, read_json(root / "model_index.json"))
    if shared is not None:
      return shared
  if not component.is_dir():
    have = sorted(p.name for p in root.iterdir() if p.is_dir())
    raise FileNotFoundError(
      f"{root}: checkpoint has no component {subfolder!r} (components here: {have})"
    )
  return component


def shared_component(root: str | os.PathLike, name: str, index: dict) -> pathlib.Path | None:
  """The folder of component `name` that pipeline folder `root` shares with another pipeline, or None.

  A pipeline's `model_index.json` (`index`) may say, under `"_md_components"`, that a component lives in
  another folder instead of in its own subfolder: `{"vae": "../t2v/vae"}`, relative to `root`. md's
  test fixtures store identical components once this way.

  Raises:
    FileNotFoundError: the entry names a folder that is not there (the message names both).
    ValueError: `_md_components` is not a mapping of component names to relative paths.
  """
  table = index.get(SHARED_COMPONENTS)
  if table is None:
    return None
  where = pathlib.Path(root) / "model_index.json"
  if not isinstance(table, dict) or not all(
    isinstance(v, str) and v and not os.path.isabs(v) for v in table.values()
  ):
    raise ValueError(
      f"{where}: {SHARED_COMPONENTS} must map component names to relative folder paths, got {table!r}"
    )
  if name not in table:
    return None
  folder = pathlib.Path(os.path.normpath(pathlib.Path(root) / table[name]))
  if not folder.is_dir():
    raise FileNotFoundError(
      f"{where}: component {name!r} is shared from {table[name]!r}, but {folder} is not a folder"
    )
  return folder


def _from_hub(repo_id, subfolder, revision, cache_dir, allow_patterns) -> pathlib.Path:
  import huggingface_hub
  from huggingface_hub import errors

  cache = hub_cache_dir(cache_dir)
  offline = hub_offline()
  if allow_patterns is None and subfolder is not None:
    allow_patterns = [f"{subfolder}/*", "model_index.json"]
  try:
    folder = huggingface_hub.snapshot_download(
      repo_id,
      revision=revision,
      cache_dir=str(cache),
      local_files_only=offline,
      allow_patterns=allow_patterns,
    )
  except (
    errors.LocalEntryNotFoundError,
    errors.RepositoryNotFoundError,
    errors.RevisionNotFoundError,
  ) as e:
    how = (
      "HF_HUB_OFFLINE=1 is set, so only the local cache is read; download it on a machine with access "
      "(e.g. `hf download " + repo_id + "`) or pass a local folder"
      if offline
      else "the hub could not provide it"
    )
    raise FileNotFoundError(
      f"hub id {repo_id!r} is not available in the cache at {cache}: {how} ({e})"
    ) from None
  return pathlib.Path(folder)


class ConfigError(ValueError):
  """A config file md cannot use (not JSON, or a value of the wrong type); the message names the file
  and the key."""


def read_json(path: str | os.PathLike) -> dict:
  """Reads a JSON config, with an error that names the file (`ConfigError` when it is not JSON)."""
  path = pathlib.Path(path)
  if not path.is_file():
    raise FileNotFoundError(f"{path}: no such config file")
  try:
    return json.loads(path.read_text())
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    raise ConfigError(f"{path}: not valid JSON ({e})") from None


_SCALARS = {int: "an int", float: "a number", bool: "true or false", str: "a string"}


def _type_ok(value: Any, kind: Any) -> bool | None:
  """Whether `value` fits the annotation `kind`; None when `kind` is not one md checks."""
  if kind is Any:
    return None
  if kind in _SCALARS:
    if kind is float:
      return isinstance(value, int | float) and not isinstance(value, bool)
    if kind is int:
      return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, kind)
  origin, args = typing.get_origin(kind), typing.get_args(kind)
  if origin in (typing.Union, types.UnionType):
    verdicts = [_type_ok(value, a) for a in args]
    return None if None in verdicts else any(verdicts)
  if kind is type(None):
    return value is None
  if origin in (tuple, list) and args:
    if not isinstance(value, list | tuple):
      return False
    inner = args[:1] if origin is list or (len(args) == 2 and args[1] is Ellipsis) else args
    if len(inner) > 1 and len(inner) != len(value):
      return False
    verdicts = [_type_ok(v, inner[min(i, len(inner) - 1)]) for i, v in enumerate(value)]
    return None if None in verdicts else all(verdicts)
  return None


def _type_name(kind: Any) -> str:
  if kind in _SCALARS:
    return _SCALARS[kind]
  if kind is type(None):
    return "null"
  origin, args = typing.get_origin(kind), typing.get_args(kind)
  if origin in (typing.Union, types.UnionType):
    return " or ".join(_type_name(a) for a in args)
  if origin in (tuple, list):
    plural = {int: "ints", float: "numbers", bool: "booleans", str: "strings"}
    return f"a list of {plural.get(args[0], _type_name(args[0]))}" if args else "a list"
  return getattr(kind, "__name__", str(kind))


def check_config_types(cls: type, values: Mapping[str, Any], where: str) -> None:
  """Checks the values of a config dataclass's fields against their annotations (ints, numbers, bools,
  strings, lists of them, optional ones) before the dataclass is built.

  Args:
    cls: the config dataclass.
    values: field name -> value read from the file (other keys are ignored).
    where: the file (or what the values came from), named in the error.

  Raises:
    ConfigError: `<where>: <key> must be <type>, got <value>`.
  """
  hints = typing.get_type_hints(cls)
  for f in dataclasses.fields(cls):
    if f.name in values and f.name in hints and _type_ok(values[f.name], hints[f.name]) is False:
      raise ConfigError(
        f"{where}: {f.name} must be {_type_name(hints[f.name])}, got {values[f.name]!r}"
      )


def load_config(
  source: str | os.PathLike, *, subfolder: str | None = None, name: str = "config.json"
) -> dict:
  """Reads `<component>/config.json` (or `name`) of a checkpoint source."""
  return read_json(resolve_source(source, subfolder=subfolder) / name)
