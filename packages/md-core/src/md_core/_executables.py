"""Ahead-of-time compiled programs kept on disk: a pipeline's jitted programs, compiled once per argument
signature (the shape bucket: shapes, dtypes, shardings) and serialized (`jax.experimental.
serialize_executable`), so a later process calls them without tracing, lowering or compiling.

The persistent compilation cache (`md_core.apps.configure_jax`) already skips XLA's compile in a second
process, but every program is still traced and lowered to find its cache entry; an `ExecutableStore`
skips those too. A program's file is named by a hash of everything that decides the executable: the
program's key in its pipeline (`Pipeline.jit`), the pipeline's module graphs (structure, static settings,
LoRA slots, quantization), the arguments' tree, shapes, dtypes and shardings, md's own source code, the
jax / jaxlib versions and the devices. A key whose text names an object's address (no stable repr) is
never stored: such programs run through `jax.jit` as before.

An executable file is a pickle, and unpickling runs code, so a file is read back only when md wrote it:
the folder must belong to this user and be writable by no one else (md makes it 0700), and the file's
SHA-256 must be the one `manifest.json` (written by the store, same rules) records for it. Anything else
is compiled again, with a warning; an untrusted folder is neither read nor written.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import json
import os
import pathlib
import pickle
import threading
import warnings
from collections.abc import Callable, Hashable
from typing import Any

import jax
import numpy as np

FORMAT = 1  # bumped when the file layout changes
MANIFEST = "manifest.json"  # {"format": 1, "files": {name: sha256 hex}}: what this store wrote


def _untrusted(path: pathlib.Path) -> str | None:
  """Why `path` (a folder or file md reads code from) cannot be trusted, or None: it must belong to this
  user and be writable by no one else."""
  st = path.stat()
  if st.st_uid != os.getuid():
    return f"{path} belongs to uid {st.st_uid}, not this user ({os.getuid()})"
  if st.st_mode & 0o022:
    return f"{path} is writable by other users (mode {st.st_mode & 0o777:o})"
  return None


@functools.cache
def code_fingerprint() -> str:
  """A hash of the source of every installed md_* package, found without importing them (any edit to md
  gives new executables)."""
  import importlib.util
  import pkgutil

  digest = hashlib.sha256()
  for name in sorted(m.name for m in pkgutil.iter_modules() if m.name.startswith("md_")):
    spec = importlib.util.find_spec(name)
    for folder in sorted(spec.submodule_search_locations or []) if spec else []:
      for path in sorted(pathlib.Path(folder).rglob("*.py")):
        digest.update(f"{name}/{path.relative_to(folder)}".encode())
        digest.update(path.read_bytes())
  return digest.hexdigest()


def _platform_fingerprint() -> str:
  import jaxlib

  devices = jax.devices()
  return repr(
    (
      FORMAT,
      jax.__version__,
      jaxlib.__version__,
      jax.default_backend(),
      sorted({d.device_kind for d in devices}),
      len(devices),
      jax.process_count(),
      jax.process_index(),
      os.environ.get("XLA_FLAGS", ""),
      [
        str(getattr(jax.config, name, None))
        for name in (
          "jax_enable_x64",
          "jax_default_matmul_precision",
          "jax_threefry_partitionable",
          "jax_default_prng_impl",
        )
      ],
    )
  )


def _devices_of(compiled: Any) -> list:
  """The devices a compiled program runs on, in its device assignment's order ([] if jax does not say)."""
  runtime = compiled.runtime_executable()
  for name in ("local_devices", "devices"):
    get = getattr(runtime, name, None)
    if callable(get):
      return list(get())
  return []


def _leaf_signature(x: Any) -> tuple:
  if isinstance(x, jax.Array):
    return (tuple(x.shape), str(x.dtype), bool(getattr(x, "weak_type", False)), repr(x.sharding))
  if isinstance(x, np.ndarray | np.generic):
    return (tuple(np.shape(x)), str(x.dtype), "host")
  if isinstance(x, bool | int | float | complex):
    return ("python", type(x).__name__)
  raise TypeError(f"an argument leaf of type {type(x).__name__} has no executable signature")


def signature(args: tuple, kwargs: dict) -> tuple[Any, str]:
  """The arguments' tree and a text naming every leaf's shape, dtype, weak type and sharding."""
  leaves, tree = jax.tree.flatten((args, kwargs))
  return tree, repr((repr(tree), tuple(_leaf_signature(x) for x in leaves)))


def stable_repr(value: Any) -> str | None:
  """`repr(value)`, or None when it names an object's address (it would differ in every process)."""
  text = repr(value)
  return None if " at 0x" in text or "object at" in text else text


class ExecutableStore:
  """A folder of serialized executables, shared by the pipelines that use it (`Pipeline.use_executables`,
  or every pipeline of a process through `set_default_store`; the apps' `--config.executables`).

  `stats` counts programs `compiled` (and written), `loaded` from the folder, and calls that ran
  `unstored` (through `jax.jit`: a key without a stable repr, or an argument without a signature)."""

  def __init__(self, folder: str | os.PathLike):
    self.folder = pathlib.Path(folder).expanduser()  # made when the first executable is written
    self.stats = {"compiled": 0, "loaded": 0, "unstored": 0}
    self._lock = threading.Lock()
    self._warned: set[str] = set()

  def __repr__(self) -> str:
    return f"ExecutableStore({str(self.folder)!r}, {self.stats})"

  def files(self) -> list[pathlib.Path]:
    return sorted(self.folder.glob("*.jaxexe"))

  def path_for(self, owner: str, key_text: str, sig: str) -> pathlib.Path:
    digest = hashlib.sha256()
    for part in (_platform_fingerprint(), code_fingerprint(), owner, key_text, sig):
      digest.update(part.encode())
      digest.update(b"\0")
    return self.folder / f"{digest.hexdigest()[:40]}.jaxexe"

  def _warn_once(self, message: str) -> None:
    if message not in self._warned:
      self._warned.add(message)
      warnings.warn(message, stacklevel=4)

  def _folder_problem(self) -> str | None:
    problem = _untrusted(self.folder)
    manifest = self.folder / MANIFEST
    if problem is None and manifest.exists():
      problem = _untrusted(manifest)
    return problem

  def _manifest(self) -> dict[str, str]:
    path = self.folder / MANIFEST
    if not path.exists():
      return {}
    try:
      data = json.loads(path.read_text())
      files = data["files"] if data.get("format") == FORMAT else {}
    except (ValueError, KeyError, TypeError, AttributeError):
      return {}
    return files if isinstance(files, dict) else {}

  @contextlib.contextmanager
  def _manifest_lock(self):
    with open(self.folder / f"{MANIFEST}.lock", "a") as lock:  # noqa: PTH123
      fcntl.flock(lock, fcntl.LOCK_EX)
      try:
        yield
      finally:
        fcntl.flock(lock, fcntl.LOCK_UN)

  def load(self, path: pathlib.Path) -> Any | None:
    """The executable in `path`, or None when there is none; a file md did not write (its digest is not
    the manifest's), or any file of an untrusted folder, is never unpickled: it is reported and the
    program compiled again."""
    from jax.experimental import serialize_executable

    if not path.exists():
      return None
    problem = self._folder_problem()
    if problem is not None:
      self._warn_once(f"md executables: not reading {self.folder} ({problem}); compiling instead")
      return None
    try:
      data = path.read_bytes()
      if self._manifest().get(path.name) != hashlib.sha256(data).hexdigest():
        raise ValueError(f"its SHA-256 is not the one {MANIFEST} records: not written by md")
      payload, in_tree, out_tree, device_ids = pickle.loads(data)
      by_id = {d.id: d for d in jax.devices()}
      compiled = serialize_executable.deserialize_and_load(
        payload, in_tree, out_tree, execution_devices=[by_id[i] for i in device_ids] or None
      )
    except Exception as e:  # noqa: BLE001 - any unreadable file is recompiled, never fatal
      warnings.warn(
        f"md executables: {path} did not load ({type(e).__name__}: {e}); compiling it again",
        stacklevel=3,
      )
      return None
    with self._lock:
      self.stats["loaded"] += 1
    return compiled

  def save(self, path: pathlib.Path, compiled: Any) -> None:
    from jax.experimental import serialize_executable

    payload, in_tree, out_tree = serialize_executable.serialize(compiled)
    devices = [d.id for d in _devices_of(compiled)]  # where it runs
    data = pickle.dumps((payload, in_tree, out_tree, devices), protocol=pickle.HIGHEST_PROTOCOL)
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    problem = self._folder_problem()
    if problem is not None:
      self._warn_once(f"md executables: not writing to {self.folder} ({problem})")
      return
    tmp = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
      f.write(data)
    with self._manifest_lock():
      files = self._manifest()
      files[path.name] = hashlib.sha256(data).hexdigest()
      manifest = self.folder / MANIFEST
      new = manifest.with_name(f"{MANIFEST}.{os.getpid()}.{threading.get_ident()}.tmp")
      fd = os.open(new, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
      with os.fdopen(fd, "w") as f:
        json.dump({"format": FORMAT, "files": files}, f, indent=0, sort_keys=True)
      os.replace(tmp, path)  # atomic: a concurrent reader sees the whole file or none
      os.replace(new, manifest)
    with self._lock:
      self.stats["compiled"] += 1


_JIT = object()  # a signature the ahead-of-time path could not run: jax.jit's own


class AotProgram:
  """A jitted program whose executables, one per argument signature, come from an `ExecutableStore`."""

  def __init__(self, store: ExecutableStore, owner: str, key: Hashable, jitted: Callable):
    self.store, self.owner, self.jitted = store, owner, jitted
    self.key_text = stable_repr(key)
    self._executables: dict[str, Any] = {}

  def __getattr__(self, name: str) -> Any:  # lower, trace, eval_shape... of the jitted program
    return getattr(self.jitted, name)

  def __call__(self, *args: Any, **kwargs: Any) -> Any:
    if self.key_text is None:
      self.store.stats["unstored"] += 1
      return self.jitted(*args, **kwargs)
    try:
      _, sig = signature(args, kwargs)
    except TypeError:
      self.store.stats["unstored"] += 1
      return self.jitted(*args, **kwargs)
    compiled = self._executables.get(sig)
    if compiled is _JIT:
      self.store.stats["unstored"] += 1
      return self.jitted(*args, **kwargs)
    if compiled is not None:
      return compiled(*args, **kwargs)
    path = self.store.path_for(self.owner, self.key_text, sig)
    compiled = self.store.load(path)
    if compiled is None:
      try:  # e.g. a program with static arguments, which a compiled call does not take
        compiled = self.jitted.lower(*args, **kwargs).compile()
        out = compiled(*args, **kwargs)
      except Exception:  # noqa: BLE001 - the plain path raises the program's own errors, if any
        self._executables[sig] = _JIT
        self.store.stats["unstored"] += 1
        return self.jitted(*args, **kwargs)
      try:
        self.store.save(path, compiled)
      except (
        OSError
      ) as e:  # a full disk or a read-only folder costs the next process a compile, no more
        warnings.warn(f"md executables: could not write {path} ({e})", stacklevel=2)
      self._executables[sig] = compiled
      return out
    self._executables[sig] = compiled
    return compiled(*args, **kwargs)


_DEFAULT: list[ExecutableStore | None] = [None]


def set_default_store(store: ExecutableStore | str | os.PathLike | None) -> ExecutableStore | None:
  """Makes `store` (a folder or an `ExecutableStore`; None: none) the one every pipeline without its own
  uses from now on; returns it."""
  if store is not None and not isinstance(store, ExecutableStore):
    store = ExecutableStore(store)
  _DEFAULT[0] = store
  return store


def default_store() -> ExecutableStore | None:
  return _DEFAULT[0]
