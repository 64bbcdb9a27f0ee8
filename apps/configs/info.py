"""md_info: builds the mesh, loads a checkpoint onto it and prints what it did.

uv run apps/md_info --config=apps/configs/info.py
uv run apps/md_info --config=apps/configs/info.py --config.checkpoint=path/to/model.safetensors \
  --config.mesh.ici_tensor_parallelism=2
"""

import ml_collections


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  if arg not in (None, "", "default"):
    raise ValueError(f"apps/configs/info.py takes no variant, got {arg!r}")
  c = ml_collections.ConfigDict()
  # A safetensors file, a sharded index or a folder; the default is the small sharded checkpoint in the repo.
  c.checkpoint = "tests/fixtures/core/stack_sharded"
  c.dtype = "float32"
  c.mesh = ml_collections.ConfigDict(
    dict(
      ici_data_parallelism=1,
      ici_fsdp_parallelism=-1,
      ici_context_parallelism=1,
      ici_tensor_parallelism=1,
      dcn_data_parallelism=1,
      dcn_fsdp_parallelism=1,
      dcn_context_parallelism=1,
      dcn_tensor_parallelism=1,
    )
  )
  c.distributed = ml_collections.ConfigDict(
    dict(coordinator_address="", num_processes=-1, process_id=-1)
  )
  c.compilation_cache = True
  c.lock()
  return c
