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

# Not apps.define_output_flags: a training workdir is reused on purpose (that is how a run resumes).
_WORKDIR = flags.DEFINE_string(
  "workdir", "runs/train", "Folder of the run: checkpoints, metrics, TensorBoard, export."
)


def main(argv):
  from md_train import _app

  _app.train(_CONFIG.value, _WORKDIR.value)


if __name__ == "__main__":
  apps.run(main, doc=__doc__, fixed=_FIXED)
