"""md_info: builds the mesh, loads a checkpoint onto it and prints what it did.

uv run apps/md_info --config=apps/configs/info.py
uv run apps/md_info --config=apps/configs/info.py --config.checkpoint=path/to/model.safetensors \
  --config.mesh.ici_tensor_parallelism=2
"""

import ml_collections

from md_core import apps as md_apps


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  if arg not in (None, "", "default"):
    raise ValueError(f"apps/configs/info.py takes no variant, got {arg!r}")
  c = ml_collections.ConfigDict()
  # A safetensors file, a sharded index or a folder; the default is the small sharded checkpoint in the repo.
  c.checkpoint = "tests/fixtures/core/stack_sharded"
  c.dtype = "float32"
  md_apps.add_runtime_config(c)  # mesh, distributed, compilation_cache
  c.lock()
  return c
