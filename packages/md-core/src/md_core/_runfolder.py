"""An app's output folder: checked before any work, written atomically, described by settings.json.

A run writes its files into a hidden staging folder inside `workdir`, then moves each into place with an
atomic rename and writes `settings.json` last (temp file + rename). `settings.json` lists the files the run
wrote under `"files"`, so it always describes exactly the outputs beside it. A folder that already holds
anything is refused unless the caller passes `overwrite=True`; then the earlier run's files (the ones its
settings.json lists) that the new run does not write again are removed, and nothing else is touched.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import tempfile
from collections.abc import Mapping
from typing import Any

SETTINGS = "settings.json"
_STAGING_PREFIX = ".md-partial-"


def _write_probe(folder: pathlib.Path) -> str | None:
  """None when a file can be created (and removed) in `folder`, else the reason."""
  try:
    fd, name = tempfile.mkstemp(prefix=".md-probe-", dir=folder)
  except OSError as e:
    return e.strerror or str(e)
  os.close(fd)
  os.unlink(name)
  return None


class RunFolder:
  """The folder one app run writes to.

  Args:
    workdir: the output folder (created when missing, with its parents).
    overwrite: allow a folder that already holds files; the earlier run's outputs are replaced.
    flag: the setting's name for messages (`--workdir`).
  """

  def __init__(
    self, workdir: str | os.PathLike, *, overwrite: bool = False, flag: str = "--workdir"
  ):
    self.path = pathlib.Path(workdir).expanduser()
    self.overwrite = overwrite
    self.flag = flag
    self._created: list[pathlib.Path] = []
    self._staging: pathlib.Path | None = None

  def problems(self) -> list[str]:
    """Checks the folder without writing any output; creates it (and its parents) when missing.

    Returns:
      One line per problem (empty when the folder can take the run).
    """
    where = f"{self.flag}={str(self.path)!r}"
    existing = next((p for p in (self.path, *self.path.parents) if p.exists()), None)
    if existing is not None and not existing.is_dir():
      what = (
        "is a file" if existing == self.path else f"is inside {str(existing)!r}, which is a file"
      )
      return [f"{where} {what}; give a folder"]
    if not self.path.exists():
      missing = [p for p in (self.path, *self.path.parents) if not p.exists()]
      try:
        self.path.mkdir(parents=True)
      except OSError as e:
        return [f"{where} cannot be created: {e.strerror or e}"]
      self._created = missing  # removed again if the run ends without writing anything
    reason = _write_probe(self.path)
    if reason is not None:
      return [f"{where} is not writable: {reason}"]
    held = sorted(p.name for p in self.path.iterdir() if not p.name.startswith(_STAGING_PREFIX))
    if held and not self.overwrite:
      shown = ", ".join(held[:4]) + (f" and {len(held) - 4} more" if len(held) > 4 else "")
      return [
        f"{where} is not empty (holds {shown}); give a new folder, or --overwrite to replace the "
        "earlier run's outputs"
      ]
    return []

  def staging(self) -> pathlib.Path:
    """A hidden folder inside the workdir where the run writes its files under their final names."""
    if self._staging is None:
      self._staging = pathlib.Path(tempfile.mkdtemp(prefix=_STAGING_PREFIX, dir=self.path))
    return self._staging

  def commit(self, settings: Mapping[str, Any]) -> list[pathlib.Path]:
    """Moves the staged files into the workdir and writes settings.json describing them.

    Args:
      settings: what the run used; `"files"` (the names written, sorted) is added.

    Returns:
      The paths of the files now in the workdir, settings.json last.
    """
    staged = sorted(p for p in self.staging().iterdir() if p.is_file())
    names = [p.name for p in staged]
    earlier = self._earlier_files()
    final = []
    for p in staged:
      target = self.path / p.name
      os.replace(p, target)
      final.append(target)
    for name in earlier:
      stale = self.path / name
      if name not in names and name != SETTINGS and stale.is_file():
        stale.unlink()
    text = json.dumps(dict(settings, files=names), indent=2, default=str) + "\n"
    tmp = self.staging() / SETTINGS
    tmp.write_text(text)
    os.replace(tmp, self.path / SETTINGS)
    self.discard()
    self._created = []
    return [*final, self.path / SETTINGS]

  def _earlier_files(self) -> list[str]:
    path = self.path / SETTINGS
    if not path.is_file():
      return []
    try:
      earlier = json.loads(path.read_text())
    except (OSError, ValueError):
      return []
    listed = earlier.get("files", []) if isinstance(earlier, dict) else []
    return [n for n in listed if isinstance(n, str) and "/" not in n and n not in ("", ".", "..")]

  def discard(self) -> None:
    """Removes the staging folder, and the workdir itself when this run created it and it is empty."""
    if self._staging is not None:
      shutil.rmtree(self._staging, ignore_errors=True)
      self._staging = None
    for folder in self._created:
      try:
        folder.rmdir()
      except OSError:
        break
    self._created = []
