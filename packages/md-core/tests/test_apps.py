"""`add_runtime_config`: the mesh / distributed / cache settings every app config shares."""

import dataclasses

import ml_collections

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
