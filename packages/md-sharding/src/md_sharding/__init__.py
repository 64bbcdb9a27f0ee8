"""md-sharding: device meshes, logical axis rules, batch sizing and multihost start-up for md."""

from md_sharding._batch import global_batch_size, per_process_batch_size
from md_sharding._mesh import AXES, MeshConfig, fill_parallelism, make_mesh
from md_sharding._multihost import host_local_to_global, initialize
from md_sharding._rules import (
  DEFAULT_RULES,
  MeshAxes,
  Rules,
  logical_to_sharding,
  logical_to_spec,
  logical_tree_to_sharding,
  replace_rules,
  with_logical_constraint,
)

__all__ = [
  "AXES",
  "DEFAULT_RULES",
  "MeshAxes",
  "MeshConfig",
  "Rules",
  "fill_parallelism",
  "global_batch_size",
  "host_local_to_global",
  "initialize",
  "logical_to_sharding",
  "logical_to_spec",
  "logical_tree_to_sharding",
  "make_mesh",
  "per_process_batch_size",
  "replace_rules",
  "with_logical_constraint",
]
