"""The body of the training apps (`apps/train`, `apps/dreambooth_train`): check the config, build the
recipe, `fit` it in the workdir (resuming from its checkpoints), export, write settings.json."""

from __future__ import annotations

import json
import os
import pathlib
import tempfile
import time
from collections.abc import Callable
from typing import Any

# Test hook: "N:path" makes the run write `path` and wait there while step N runs (a test then kills
# the process in the middle of that step).
HOLD_ENV = "MD_TRAIN_HOLD_AT_STEP"


def check(config: Any, workdir: str) -> tuple[Callable, Any]:
  """`(recipe function, mesh)`, or one `md_core.apps.UsageError` listing every bad setting."""
  from md_core import apps
  from md_train import recipes

  problems = apps.Problems(config)
  for key in ("steps", "checkpoint_every", "eval_every", "log_every"):
    problems.at_least(key, 0)
  for key in ("profile_start", "profile_steps"):  # optional keys (configs without them: no trace)
    if key in config:
      problems.at_least(key, 0)
  problems.positive("keep")
  problems.at_least("seed", 0)
  problems.positive("peak_flops", optional=True)
  path = pathlib.Path(workdir).expanduser()
  existing = next((p for p in (path, *path.parents) if p.exists()), None)
  if existing is not None and not existing.is_dir():
    problems.add(f"--workdir={workdir!r} is (inside) a file; give a folder")
  elif (why := _unwritable(path)) is not None:
    problems.add(f"--workdir={workdir!r} cannot be written ({why}); give a folder you may write")
  fn = problems.call(recipes.import_recipe, config.recipe, prefix="--config.")
  mesh = problems.call(apps.start, config, prefix="--config.mesh: ")
  problems.raise_if_any()
  return fn, mesh


def _unwritable(path: pathlib.Path) -> str | None:
  """Why the run could not write in `path` (None when it can): the folder is made and a file written
  and removed there, then the folders this made are removed again, before anything loads. (As root,
  permission bits do not stop writes, so `os.access` alone would miss read-only mounts and /proc.)"""
  made = []
  try:
    for folder in (*reversed(path.parents), path):
      if not folder.exists():
        folder.mkdir()
        made.append(folder)
    if not os.access(path, os.W_OK | os.X_OK):
      return "permission denied"
    with tempfile.TemporaryFile(dir=path):
      pass
  except OSError as e:
    return e.strerror or type(e).__name__
  finally:
    for folder in reversed(made):
      try:
        folder.rmdir()
      except OSError:
        pass
  return None


def _hold(spec: str):
  step, _, marker = spec.partition(":")

  def on_step(n):
    if n == int(step):
      pathlib.Path(marker).write_text(f"holding at step {n}\n")
      while True:
        time.sleep(1)

  return on_step


def fill_class_dir(config: Any, workdir: str) -> None:
  """An empty `recipe_options.class_dir` (the Dreambooth variants' default) becomes
  `<workdir>/class_images`, so a run's generated class images stay inside its --workdir."""
  options = config.get("recipe_options")
  if options is not None and "class_dir" in options and not options.class_dir:
    options.class_dir = str(pathlib.Path(workdir).expanduser() / "class_images")


def train(
  config: Any, workdir: str, *, describe: Callable[[Any], list[str]] | None = None
) -> dict[str, Any]:
  """Runs the app: the checks, the recipe, `fit`, the export and settings.json; prints a summary.

  Args:
    config: the app config (`apps/configs/train.py` keys).
    workdir: the run's folder.
    describe: lines printed about the built recipe before training (e.g. Dreambooth's image counts).

  Returns:
    The settings written to `<workdir>/settings.json`.
  """
  import md_train
  from md_core import apps
  from md_core import progress as md_progress

  path = pathlib.Path(workdir).expanduser()
  fill_class_dir(config, workdir)
  with md_progress.phase("checking"):
    make_recipe, mesh = check(config, workdir)
  print(apps.describe_mesh(mesh))
  start = time.perf_counter()
  with md_progress.phase("building the recipe", announce=True):
    try:
      recipe = make_recipe(config)
    except (ValueError, TypeError, FileNotFoundError) as e:
      raise apps.UsageError(f"--config.recipe={config.recipe}: {e}") from None
    if not isinstance(recipe, md_train.Recipe):
      raise apps.UsageError(
        f"--config.recipe={config.recipe} returned {type(recipe).__name__}, not an md_train.Recipe"
      )
  built = time.perf_counter() - start
  for line in describe(recipe) if describe else ():
    print(line)
  hold = os.environ.get(HOLD_ENV)
  start = time.perf_counter()
  with md_progress.phase("training"):
    try:
      state = md_train.fit(
        recipe,
        steps=config.steps,
        workdir=path,
        checkpoint_every=config.checkpoint_every,
        keep=config.keep,
        eval_every=config.eval_every,
        log_every=config.log_every,
        peak_flops=config.peak_flops,
        on_step=_hold(hold) if hold else None,
        profile_start=config.get("profile_start", 0),
        profile_steps=config.get("profile_steps", 0),
      )
    except ValueError as e:
      raise apps.UsageError(str(e).splitlines()) from None
  seconds = time.perf_counter() - start
  exported = None
  if config.export and recipe.export is not None:
    with md_progress.phase("exporting"):
      exported = path / "export"
      recipe.export(state, exported)
  settings = apps.settings_of(
    config,
    final_step=int(state.step),
    fingerprint=dict(recipe.fingerprint),
    build_seconds=round(built, 2),
    train_seconds=round(seconds, 2),
    export=None if exported is None else str(exported.name),
  )
  tmp = path / ".settings.json.tmp"
  tmp.write_text(json.dumps(settings, indent=2, default=str) + "\n")
  tmp.replace(path / "settings.json")
  print(
    f"trained to step {int(state.step)} in {seconds:.1f}s (recipe built in {built:.1f}s); "
    f"checkpoints, metrics.jsonl and tb/ in {path}"
    + (f"; the model in {exported}" if exported else "")
  )
  return settings
