"""train: trains a recipe with md_train.fit; checkpoints, metrics and the exported model go to --workdir.

uv run apps/train --config=apps/configs/train.py:wan21-tiny --workdir=/tmp/wan21-tiny
uv run apps/train --help --config=apps/configs/train.py:wan21-tiny   # the variants, keys and values

The workdir holds checkpoints/ (Orbax, the newest `keep`), metrics.jsonl, tb/ (TensorBoard), export/
(when the recipe has an exporter and --config.export) and settings.json. Running again with the same
workdir resumes from the newest checkpoint.
"""

import os
import sys

# Before jax loads: its C++ start-up INFO lines stay hidden unless --verbosity asks (md_core.apps.quiet).
if not any(a.startswith(("--verbosity", "-v")) for a in sys.argv[1:]):
  os.environ["TF_CPP_MIN_LOG_LEVEL"] = os.environ.get("TF_CPP_MIN_LOG_LEVEL") or "2"

from absl import flags  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from md_core import apps  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file(
  "config", None, "ml-collections config file (apps/configs/train.py:<variant>)."
)
_FIXED = ("variant",)
# Test hook: "N:path" makes the run write `path` and wait there while step N runs (a test then kills
# the process in the middle of that step).
HOLD_ENV = "MD_TRAIN_HOLD_AT_STEP"


# Not apps.define_output_flags: a training workdir is reused on purpose (that is how a run resumes).
_WORKDIR = flags.DEFINE_string(
  "workdir", "runs/train", "Folder of the run: checkpoints, metrics, TensorBoard, export."
)


def _check(config, workdir):
  import pathlib

  problems = apps.Problems(config)
  for key in ("steps", "checkpoint_every", "eval_every", "log_every"):
    problems.at_least(key, 0)
  problems.positive("keep")
  problems.at_least("seed", 0)
  problems.positive("peak_flops", optional=True)
  path = pathlib.Path(workdir).expanduser()
  existing = next((p for p in (path, *path.parents) if p.exists()), None)
  if existing is not None and not existing.is_dir():
    problems.add(f"--workdir={workdir!r} is (inside) a file; give a folder")
  from md_train import recipes

  fn = problems.call(recipes.import_recipe, config.recipe, prefix="--config.")
  mesh = problems.call(apps.start, config, prefix="--config.mesh: ")
  problems.raise_if_any()
  return fn, mesh


def _hold(spec: str):
  import pathlib
  import time

  step, _, marker = spec.partition(":")

  def on_step(n):
    if n == int(step):
      pathlib.Path(marker).write_text(f"holding at step {n}\n")
      while True:
        time.sleep(1)

  return on_step


def main(argv):
  import json
  import pathlib
  import time

  from md_core import progress as md_progress

  config = _CONFIG.value
  workdir = pathlib.Path(_WORKDIR.value).expanduser()
  with md_progress.phase("checking"):
    make_recipe, mesh = _check(config, _WORKDIR.value)
  print(apps.describe_mesh(mesh))

  import md_train

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
  hold = os.environ.get(HOLD_ENV)
  start = time.perf_counter()
  with md_progress.phase("training"):
    try:
      state = md_train.fit(
        recipe,
        steps=config.steps,
        workdir=workdir,
        checkpoint_every=config.checkpoint_every,
        keep=config.keep,
        eval_every=config.eval_every,
        log_every=config.log_every,
        peak_flops=config.peak_flops,
        on_step=_hold(hold) if hold else None,
      )
    except ValueError as e:
      raise apps.UsageError(str(e).splitlines()) from None
  seconds = time.perf_counter() - start
  exported = None
  if config.export and recipe.export is not None:
    with md_progress.phase("exporting"):
      exported = workdir / "export"
      recipe.export(state, exported)
  settings = apps.settings_of(
    config,
    final_step=int(state.step),
    fingerprint=dict(recipe.fingerprint),
    build_seconds=round(built, 2),
    train_seconds=round(seconds, 2),
    export=None if exported is None else str(exported.name),
  )
  tmp = workdir / ".settings.json.tmp"
  tmp.write_text(json.dumps(settings, indent=2, default=str) + "\n")
  tmp.replace(workdir / "settings.json")
  print(
    f"trained to step {int(state.step)} in {seconds:.1f}s (recipe built in {built:.1f}s); "
    f"checkpoints, metrics.jsonl and tb/ in {workdir}"
    + (f"; the model in {exported}" if exported else "")
  )


if __name__ == "__main__":
  apps.run(main, doc=__doc__, fixed=_FIXED)
