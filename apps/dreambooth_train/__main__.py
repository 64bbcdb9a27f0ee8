"""dreambooth_train: Dreambooth fine-tuning (a subject's few images + an identifier prompt, with prior
preservation from class images md generates itself); checkpoints, metrics and the exported model or LoRA
go to --workdir.

uv run apps/dreambooth_train --workdir=/tmp/db
uv run apps/dreambooth_train --config=apps/configs/dreambooth.py:flux1-lora-tiny --workdir=/tmp/db-flux
uv run apps/dreambooth_train --help --config=apps/configs/dreambooth.py:sd15-lora-tiny   # keys and values

The same loop and workdir as apps/train (checkpoints/, metrics.jsonl, tb/, export/, settings.json;
running again resumes). Before training it says how many instance and class images the run uses and how
many class images it generated.
"""

import os
import sys

# Before jax loads: its C++ start-up INFO lines stay hidden unless --verbosity asks (md_core.apps.quiet).
if not any(a.startswith(("--verbosity", "-v")) for a in sys.argv[1:]):
  os.environ["TF_CPP_MIN_LOG_LEVEL"] = os.environ.get("TF_CPP_MIN_LOG_LEVEL") or "2"

from absl import flags  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from md_core import apps  # noqa: E402

# Without --config: the `sd15-lora-tiny` variant.
_DEFAULT_CONFIG = os.path.join(os.path.dirname(__file__), "..", "configs", "dreambooth.py")
_CONFIG = config_flags.DEFINE_config_file(
  "config",
  None,
  "ml-collections config file (apps/configs/dreambooth.py:<variant>; without it: sd15-lora-tiny).",
)
_FIXED = ("variant",)
_WORKDIR = flags.DEFINE_string(
  "workdir", "runs/dreambooth", "Folder of the run: checkpoints, metrics, TensorBoard, export."
)


def _class_count(config) -> int:
  """Images already in the class folder (before the recipe generates the missing ones)."""
  import pathlib

  from md_train import IMAGE_SUFFIXES

  folder = (config.recipe_options.to_dict() or {}).get("class_dir")
  path = pathlib.Path(folder).expanduser() if folder else None
  if path is None or not path.is_dir():
    return 0
  return sum(p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES for p in path.iterdir())


def _describe(config):
  before = _class_count(config)

  def describe(recipe):
    import md_train

    batches = recipe.batches
    if not isinstance(batches, md_train.DreamboothBatches):
      raise apps.UsageError(
        f"--config.recipe={config.recipe} is not a Dreambooth recipe (its batches are "
        f"{type(batches).__name__}); dreambooth_train runs md_train.recipes.dreambooth_sd / "
        "dreambooth_flux, apps/train runs the others"
      )
    opts = config.recipe_options
    lines = [
      f"dreambooth: {len(batches.instance)} instance image(s) of {opts.instance_prompt!r} from "
      f"{opts.instance_dir}"
    ]
    if batches.klass is None:
      lines.append("dreambooth: no prior preservation")
    else:
      made = max(len(batches.klass) - before, 0)
      lines.append(
        f"dreambooth: {len(batches.klass)} class image(s) of {opts.class_prompt!r} in "
        f"{opts.class_dir} ({made} generated now), prior_loss_weight {opts.prior_loss_weight}"
      )
    return lines

  return describe


def main(argv):
  from md_train import _app

  _app.fill_class_dir(_CONFIG.value, _WORKDIR.value)  # class images inside --workdir by default
  _app.train(_CONFIG.value, _WORKDIR.value, describe=_describe(_CONFIG.value))


if __name__ == "__main__":
  if not any(a == "--config" or a.startswith("--config=") for a in sys.argv[1:]):
    sys.argv.insert(1, f"--config={_DEFAULT_CONFIG}:sd15-lora-tiny")
  apps.run(main, doc=__doc__, fixed=_FIXED)
