"""md_info: prints the mesh md builds here and loads a checkpoint onto it.

uv run apps/md_info --config=apps/configs/info.py
"""

from absl import app
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file(
  "config", None, "ml-collections config file (apps/configs/info.py)."
)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(
      f"unexpected arguments {argv[1:]}; settings go through --config.<key>=<value>"
    )
  from md_core import apps

  config = _CONFIG.value
  if config is None:
    raise app.UsageError("--config is required, e.g. --config=apps/configs/info.py")
  try:
    mesh = apps.start(config)
  except ValueError as e:  # a mesh that does not fit the devices: say so without a traceback
    raise app.UsageError(str(e)) from None
  print(apps.describe_mesh(mesh))
  report = apps.load_checkpoint_onto_mesh(config.checkpoint, mesh, dtype=config.dtype)
  print(report)


if __name__ == "__main__":
  from md_core import apps as md_apps

  md_apps.run(main, doc=__doc__)  # quiet start-up (no TPU INFO line), one-line errors
