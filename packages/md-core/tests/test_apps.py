"""`add_runtime_config`: the mesh / distributed / cache settings every app config shares."""

import dataclasses
import re
from typing import Any

import ml_collections
import pytest

import md_sharding as mds
from md_core import apps


def test_runtime_config_covers_mesh_config_and_builds_a_mesh():
  c = apps.add_runtime_config(ml_collections.ConfigDict())
  fields = {f.name for f in dataclasses.fields(mds.MeshConfig)}
  assert set(c.mesh.keys()) <= fields
  assert {k for k in fields if k.endswith("_parallelism")} <= set(c.mesh.keys())
  assert c.mesh.ici_fsdp_parallelism == -1 and c.distributed.num_processes == -1
  assert c.compilation_cache is True
  c.mesh.ici_tensor_parallelism = 2
  # What `apps.start` builds (not called here: it changes process-wide JAX settings).
  mesh = mds.make_mesh(mds.MeshConfig.from_dict(c.mesh.to_dict()))
  assert dict(mesh.shape) == {"data": 1, "fsdp": 4, "context": 1, "tensor": 2}


def test_config_types_are_checked_against_the_dataclass():
  import md_core

  @dataclasses.dataclass
  class Sizes:
    in_channels: int = 4
    scale: float = 1.0
    flip: bool = False
    name: str | None = None
    blocks: tuple[int, ...] = (1, 2)
    pair: tuple[int, int] = (1, 2)
    free: Any = None

  ok = dict(in_channels=3, scale=2, flip=True, name=None, blocks=[1, 2, 3], pair=(3, 4), free="x")
  md_core.check_config_types(Sizes, ok, "c.json")
  for key, value, expected in [
    ("in_channels", "4", "in_channels must be an int, got '4'"),
    ("in_channels", True, "in_channels must be an int, got True"),
    ("scale", "1.0", "scale must be a number, got '1.0'"),
    ("flip", 1, "flip must be true or false, got 1"),
    ("name", 3, "name must be a string or null, got 3"),
    ("blocks", [1, "2"], "blocks must be a list of ints, got [1, '2']"),
    ("pair", [1, 2, 3], "pair must be a list of ints, got [1, 2, 3]"),
  ]:
    with pytest.raises(md_core.ConfigError, match=re.escape(f"c.json: {expected}")):
      md_core.check_config_types(Sizes, dict(ok, **{key: value}), "c.json")
