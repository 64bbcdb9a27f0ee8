"""The SD pipeline on an 8-device mesh (data=2, fsdp=2, tensor=2) equals the single-device run."""

import jax
import numpy as np

import md_sd
import md_sharding as mds
from md_core import testing


def test_sharded_pipeline_matches_single_device():
  root = testing.fixture_path("sd_pipeline")
  mesh = mds.make_mesh(
    mds.MeshConfig(ici_data_parallelism=2, ici_fsdp_parallelism=2, ici_tensor_parallelism=2)
  )
  assert dict(mesh.shape) == {"data": 2, "fsdp": 2, "context": 1, "tensor": 2}
  single = md_sd.load_pipeline(root / "sd")
  sharded = md_sd.load_pipeline(root / "sd", mesh=mesh)
  specs = [
    x.sharding.spec
    for x in jax.tree.leaves(sharded._unet.state)
    if isinstance(x, jax.Array) and isinstance(x.sharding, jax.sharding.NamedSharding)
  ]
  assert any("tensor" in str(s) for s in specs) and any("fsdp" in str(s) for s in specs)
  kw = dict(height=32, width=32, num_inference_steps=2, guidance_scale=5.0, seed=1, progress=False)
  prompts = ["a photo of a cat", "an astronaut riding a horse"]
  want = np.asarray(single(prompts, **kw))
  got = sharded(prompts, **kw)
  assert len(got.sharding.device_set) == 8
  np.testing.assert_allclose(np.asarray(got), want, atol=1e-5, rtol=0)
