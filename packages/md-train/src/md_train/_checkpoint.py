"""Training checkpoints over Orbax's CheckpointManager: the train state, the data position and the run's
fingerprint, saved asynchronously and restored bit for bit.

A checkpoint of step `n` is the folder `<directory>/<n>/` with two items: `state` (every array of the
`TrainState`, flattened in pytree order and named `leaf_00000…`; PRNG keys as their raw key data) and
`meta` (JSON: the leaves' pytree paths, the data iterator's position, the fingerprint). Orbax writes each
step into a temporary folder and renames it when complete, so a save that fails (disk full, a killed
process) never hides the previous checkpoint.

`meta` also holds a SHA-256 digest of every array (its dtype, shape and bytes) taken at save;
`restore` checks each restored array against it, so a flipped bit or a damaged file is found, and without
an explicit step falls back to the newest checkpoint that reads and verifies (one line on stderr says so).
"""

from __future__ import annotations

import hashlib
import os
import pathlib
import sys
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from md_train._step import TrainState

_VERSION = 1


class CheckpointError(RuntimeError):
  """A checkpoint could not be written (the previous one stays restorable)."""


class CheckpointCorrupt(RuntimeError):
  """A checkpoint does not read back as written (an array's digest differs, a file is damaged)."""


class _Refused(ValueError):
  """A checkpoint that reads fine but belongs to another run (no older one is tried)."""


def digest(value: Any) -> str | None:
  """SHA-256 of an array's dtype, shape and bytes (None when this process does not hold all of it)."""
  if isinstance(value, jax.Array) and not value.is_fully_addressable:
    return None
  a = np.ascontiguousarray(np.asarray(jax.device_get(value)))
  h = hashlib.sha256(f"{a.dtype.str}{a.shape}".encode())
  h.update(a.view(np.uint8).reshape(-1) if a.size else b"")
  return h.hexdigest()


class Restored(Mapping):
  """What `Checkpointer.restore` gives back besides the state (a read-only mapping)."""

  def __init__(self, step: int, data: Any, fingerprint: dict):
    self._items = {"step": step, "data": data, "fingerprint": fingerprint}

  def __getitem__(self, key):
    return self._items[key]

  def __iter__(self):
    return iter(self._items)

  def __len__(self):
    return len(self._items)


def _is_key(leaf: Any) -> bool:
  return hasattr(leaf, "dtype") and jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key)


def _flatten(state: TrainState) -> tuple[list[str], list[Any]]:
  pairs, _ = jax.tree_util.tree_flatten_with_path(state)
  return [jax.tree_util.keystr(p) for p, _ in pairs], [leaf for _, leaf in pairs]


def flat_differences(saved: Mapping[str, Any], wanted: Mapping[str, Any]) -> list[str]:
  """The dotted keys whose values differ between two (nested) JSON-able dicts, sorted."""

  def flat(d, prefix=""):
    out = {}
    for k, v in d.items():
      if isinstance(v, Mapping) and v:
        out.update(flat(v, f"{prefix}{k}."))
      else:
        out[f"{prefix}{k}"] = list(v) if isinstance(v, tuple) else v
    return out

  a, b = flat(dict(saved)), flat(dict(wanted))
  missing = object()
  return sorted(k for k in set(a) | set(b) if a.get(k, missing) != b.get(k, missing))


class Checkpointer:
  """Saves and restores training checkpoints in `directory` (one Orbax CheckpointManager).

  Args:
    directory: the checkpoints' folder (created when missing).
    keep: how many of the latest checkpoints to keep (None: all).
    every: save every this many steps (`save` skips other steps unless forced); 0: only forced saves.
    async_save: write in a background thread (the arrays are copied off the device before `save`
      returns); `wait()` (or `close()`) blocks until the writes are done.

  >>> ckpt = Checkpointer("/tmp/run/checkpoints", keep=3, every=100)  # doctest: +SKIP
  >>> ckpt.save(state, data=batches.state(), fingerprint=recipe.fingerprint)  # doctest: +SKIP
  >>> state, info = ckpt.restore(fresh_state)  # doctest: +SKIP
  """

  def __init__(
    self,
    directory: str | os.PathLike,
    *,
    keep: int | None = 3,
    every: int = 0,
    async_save: bool = True,
  ):
    if keep is not None and (not isinstance(keep, int) or keep < 1):
      raise ValueError(f"keep={keep!r} must be a positive int (or None: keep every checkpoint)")
    if not isinstance(every, int) or every < 0:
      raise ValueError(f"every={every!r} must be an int >= 0 (0: only forced saves)")
    self.directory = pathlib.Path(directory).expanduser().absolute()
    self.keep, self.every, self.async_save = keep, every, async_save
    self._manager = self._open()
    self._pending: int | None = None  # the step of the save that may still be writing

  def _open(self):
    import orbax.checkpoint as ocp

    options = ocp.CheckpointManagerOptions(
      max_to_keep=self.keep,
      create=True,
      cleanup_tmp_directories=True,
      enable_async_checkpointing=self.async_save,
    )
    return ocp.CheckpointManager(self.directory, options=options, item_names=("state", "meta"))

  # --- facts -----------------------------------------------------------------------------------------
  def steps(self) -> list[int]:
    """The steps with a complete checkpoint, oldest first."""
    return sorted(self._manager.all_steps())

  def latest_step(self) -> int | None:
    """The newest complete checkpoint's step, or None when there is none."""
    steps = self.steps()
    return steps[-1] if steps else None

  def should_save(self, step: int) -> bool:
    """Whether `save` at `step` writes (without `force`)."""
    return self.every > 0 and step % self.every == 0

  # --- save --------------------------------------------------------------------------------------------
  def save(
    self,
    state: TrainState,
    *,
    data: Any = None,
    fingerprint: Mapping[str, Any] | None = None,
    force: bool = False,
  ) -> bool:
    """Saves `state` at its step when `should_save(step)` or `force`; returns whether it did.

    Args:
      state: the train state (its `step` names the checkpoint).
      data: the data iterator's position (JSON-able, e.g. `ShapesIterator.state()`), or None.
      fingerprint: the run's description (JSON-able); `restore` checks it.
      force: save whatever the step.

    Raises:
      CheckpointError: the write failed (this one or an earlier asynchronous one); the newest complete
        checkpoint is named and stays restorable.
    """
    import orbax.checkpoint as ocp

    step = int(jax.device_get(state.step))
    if not (force or self.should_save(step)) or step in self.steps():
      return False
    names, leaves = _flatten(state)
    arrays, keys = {}, {}
    for i, (name, leaf) in enumerate(zip(names, leaves)):
      if _is_key(leaf):
        keys[name] = str(jax.random.key_impl(leaf))
        leaf = jax.random.key_data(leaf)
      arrays[f"leaf_{i:05d}"] = leaf
    digests = {k: d for k, v in arrays.items() if (d := digest(v)) is not None}
    meta = {
      "version": _VERSION,
      "step": step,
      "leaves": names,
      "keys": keys,
      "digests": digests,
      "data": data,
      "fingerprint": dict(fingerprint or {}),
    }
    try:
      self._manager.check_for_errors()  # an earlier asynchronous save that failed
    except Exception as e:  # noqa: BLE001
      self._failed(self._pending, e)
    try:
      self._pending = step
      self._manager.save(
        step,
        args=ocp.args.Composite(state=ocp.args.StandardSave(arrays), meta=ocp.args.JsonSave(meta)),
        force=True,
      )
      if not self.async_save:
        self._manager.wait_until_finished()
    except Exception as e:  # noqa: BLE001 - Orbax and the file system raise many kinds
      self._failed(step, e)
    return True

  def _failed(self, step: int | None, error: Exception):
    what = f"the checkpoint of step {step}" if step is not None else "a checkpoint"
    complete = set(self.steps())
    for finish in (self._manager.wait_until_finished, self._manager.close):
      try:  # let the other writes of the failed save end before its folder is removed
        finish()
      except Exception:  # noqa: BLE001 - the manager is being replaced
        pass
    self._drop_incomplete(complete)
    self._manager = self._open()
    latest = self.latest_step()
    kept = (
      f"the checkpoint of step {latest} is intact and restorable"
      if latest is not None
      else "no earlier checkpoint exists"
    )
    raise CheckpointError(
      f"{self.directory}: saving {what} failed ({type(error).__name__}: {error}); {kept}"
    ) from error

  def _drop_incomplete(self, complete: set[int]) -> None:
    """Removes what a failed save left: step folders that are not complete checkpoints. A writer of
    the failed save may still be running (Orbax stops waiting at the first error); it fails once its
    folder is gone, so removal is repeated until the folder stays away."""
    import shutil
    import time

    keep = {str(s) for s in complete}
    quiet = 0
    for _ in range(50):
      left = [
        e
        for e in self.directory.iterdir()
        if e.is_dir() and e.name.split(".", 1)[0].isdigit() and e.name not in keep
      ]
      for entry in left:
        shutil.rmtree(entry, ignore_errors=True)
      quiet = 0 if left else quiet + 1
      if quiet >= 2:
        return
      time.sleep(0.1)

  def wait(self) -> None:
    """Blocks until every asynchronous save is written.

    Raises:
      CheckpointError: a background write failed.
    """
    try:
      self._manager.wait_until_finished()
    except Exception as e:  # noqa: BLE001
      self._failed(self._pending, e)
    self._pending = None

  def close(self) -> None:
    """Waits for pending saves, then releases the manager."""
    try:
      self.wait()
    finally:
      self._manager.close()

  # --- restore --------------------------------------------------------------------------------------
  def read(self, step: int | None = None) -> tuple[dict[str, np.ndarray], dict]:
    """The raw arrays (`{pytree path: host array}`; PRNG keys as key data) and the JSON metadata of
    a checkpoint, without a target state (for inspection and tests). Any checkpoint reads, whatever
    mesh or process count wrote it: each array is restored whole onto this process's first device."""
    import orbax.checkpoint as ocp

    step = self._step_or_latest(step)
    meta = self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())).meta
    # The saved shapes and dtypes, placed on one local device (the saved shardings name the writer's
    # devices, which this process may not have).
    saved = ocp.StandardCheckpointHandler().metadata(self.directory / str(step) / "state")
    saved = getattr(saved, "item_metadata", saved)
    one = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    abstract = {
      name: jax.ShapeDtypeStruct(tuple(m.shape), m.dtype, sharding=one) for name, m in saved.items()
    }
    restored = self._manager.restore(
      step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract))
    ).state
    arrays = {name: np.asarray(restored[f"leaf_{i:05d}"]) for i, name in enumerate(meta["leaves"])}
    return arrays, meta

  def _step_or_latest(self, step: int | None) -> int:
    steps = self.steps()
    if step is None:
      if not steps:
        raise FileNotFoundError(f"{self.directory}: no checkpoint here")
      return steps[-1]
    if step not in steps:
      raise FileNotFoundError(f"{self.directory}: no checkpoint of step {step} (have {steps})")
    return step

  def restore(
    self,
    target: TrainState,
    step: int | None = None,
    *,
    fingerprint: Mapping[str, Any] | None = None,
  ) -> tuple[TrainState, Restored]:
    """The checkpoint of `step` (default: the newest), each array placed like `target`'s.

    Args:
      target: a state of the same structure (e.g. the fresh one the run starts from); its arrays'
        shapes, dtypes and shardings say how to restore.
      step: which checkpoint.
      fingerprint: when given, the saved fingerprint must equal it.

    Returns:
      (the restored state, `Restored` with `step`, `data` (the saved data position) and `fingerprint`).

    Without `step`, a checkpoint that does not read or verify (`CheckpointCorrupt`: an array whose
    digest differs, a damaged or truncated file) is skipped for the newest one that does, with one line
    on stderr naming what was skipped and why.

    Raises:
      FileNotFoundError: no (such) checkpoint.
      CheckpointCorrupt: the checkpoint of `step` (or, without `step`, every checkpoint) does not read
        back as written.
      ValueError: the fingerprint differs (the differing keys named), or the saved state does not fit
        `target` (paths or shapes listed).
    """
    if step is not None:
      step = self._step_or_latest(step)
      try:
        return self._restore_step(target, step, fingerprint)
      except (_Refused, CheckpointCorrupt):
        raise
      except Exception as e:  # noqa: BLE001 - a damaged file: one clear line, not the reader's
        first = str(e).splitlines()[0][:300] if str(e) else ""
        raise CheckpointCorrupt(
          f"{self.directory / str(step)}: does not read back ({type(e).__name__}: {first})"
        ) from e
    steps = self.steps()
    if not steps:
      raise FileNotFoundError(f"{self.directory}: no checkpoint here")
    problems = []
    for s in reversed(steps):
      try:
        out = self._restore_step(target, s, fingerprint)
      except _Refused:
        raise
      except Exception as e:  # noqa: BLE001 - Orbax and tensorstore raise many kinds on damaged files
        problems.append(f"step {s}: {type(e).__name__}: {str(e).splitlines()[0][:300]}")
        continue
      if problems:
        print(
          f"{self.directory}: restored step {s}, the newest checkpoint that verifies (skipped "
          f"{'; '.join(problems)})",
          file=sys.stderr,
          flush=True,
        )
      return out
    raise CheckpointCorrupt(
      f"{self.directory}: no checkpoint verifies ({'; '.join(problems)}); start a new workdir or "
      "restore one from a backup"
    )

  def _restore_step(
    self, target: TrainState, step: int, fingerprint: Mapping[str, Any] | None
  ) -> tuple[TrainState, Restored]:
    import orbax.checkpoint as ocp

    meta = self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())).meta
    where = f"{self.directory / str(step)}"
    if fingerprint is not None:
      diff = flat_differences(meta.get("fingerprint", {}), fingerprint)
      if diff:
        saved, want = meta.get("fingerprint", {}), dict(fingerprint)
        lines = [f"{k}: saved {_get(saved, k)!r}, this run {_get(want, k)!r}" for k in diff[:8]]
        raise _Refused(
          f"{where}: the checkpoint was written by another run (fingerprint differs in "
          f"{', '.join(diff)}):\n  " + "\n  ".join(lines) + "\nuse a new workdir, or the run's "
          "settings"
        )
    names, leaves = _flatten(target)
    if meta["leaves"] != names:
      extra = sorted(set(meta["leaves"]) - set(names))[:5]
      missing = sorted(set(names) - set(meta["leaves"]))[:5]
      raise _Refused(
        f"{where}: the saved state does not fit this run's state ({len(meta['leaves'])} saved "
        f"arrays, {len(names)} expected; saved only: {extra}; expected only: {missing})"
      )
    abstract = {}
    for i, leaf in enumerate(leaves):
      value = jax.random.key_data(leaf) if _is_key(leaf) else leaf
      sharding = getattr(value, "sharding", None)
      abstract[f"leaf_{i:05d}"] = jax.ShapeDtypeStruct(
        np.shape(value), np.asarray(value).dtype if sharding is None else value.dtype,
        sharding=sharding,
      )  # fmt: skip
    try:
      restored = self._manager.restore(
        step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract))
      ).state
    except ValueError as e:
      raise ValueError(f"{where}: the saved arrays do not fit this run's state: {e}") from None
    out = []
    digests = meta.get("digests", {})
    for i, (name, leaf) in enumerate(zip(names, leaves)):
      value = restored[f"leaf_{i:05d}"]
      want = abstract[f"leaf_{i:05d}"]
      saved = digests.get(f"leaf_{i:05d}")
      if saved is not None and (got := digest(value)) is not None and got != saved:
        raise CheckpointCorrupt(
          f"{where}: array {name} does not match the digest written at save (damaged on disk)"
        )
      if tuple(value.shape) != tuple(want.shape):
        raise ValueError(
          f"{where}: array {name} has shape {tuple(value.shape)}, this run's state {want.shape}"
        )
      if _is_key(leaf):
        value = jax.random.wrap_key_data(value, impl=jax.random.key_impl(leaf))
      out.append(value)
    state = jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(target), out)
    return state, Restored(step, meta.get("data"), meta.get("fingerprint", {}))


def _get(d: Mapping[str, Any], dotted: str) -> Any:
  for part in dotted.split("."):
    if not isinstance(d, Mapping) or part not in d:
      return None
    d = d[part]
  return d
