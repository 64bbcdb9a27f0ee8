"""The SD pipeline on an 8-device mesh (data=2, fsdp=2, tensor=2) equals the single-device run."""

import jax
import numpy as np
import pytest

import md_sd
import md_sharding as mds
from md_core import testing


# ~2 minutes of compiling (the whole SD pipeline twice): under `-m slow`. The default suite keeps the UNet
# on the same mesh (below) and the Flux, LTX and Wan pipelines on 8 devices (their *_pipeline_sharded files).
@pytest.mark.slow
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
  kw = dict(
    height=32,
    width=32,
    num_inference_steps=2,
    guidance_scale=5.0,
    seed=1,
    num_images_per_prompt=2,
    progress=False,
  )
  prompts = ["a photo of a cat", "an astronaut riding a horse"]
  want = np.asarray(single(prompts, **kw))
  # 4 images: the batch splits over data × fsdp (2 × 2), the parameters over fsdp × tensor.
  assert sharded.place(jax.numpy.zeros((4, 1))).sharding.spec[0] == ("data", "fsdp")
  got = sharded(prompts, **kw)
  assert got.shape[0] == 4 and len(got.sharding.device_set) == 8
  np.testing.assert_allclose(np.asarray(got), want, atol=1e-5, rtol=0)


def test_unet_batch_over_data_and_fsdp_matches_single_device():
  """The UNet with its batch split over data × fsdp (params over fsdp × tensor) equals one device.

  A 4×4 latent leaves 4 tokens in the mid block: the size at which XLA's partitioner (jaxlib 0.10, CPU)
  miscompiled the attention output's residual add before the UNet pinned its token stream's sharding.
  """
  from flax import nnx

  root = testing.fixture_path("sd_pipeline") / "sd"
  mesh = mds.make_mesh(
    mds.MeshConfig(ici_data_parallelism=2, ici_fsdp_parallelism=2, ici_tensor_parallelism=2)
  )
  single = md_sd.load_unet(root, progress=False)
  sharded = md_sd.load_unet(root, mesh=mesh, progress=False)
  rng = np.random.default_rng(0)
  x = rng.standard_normal((4, 4, 4, single.cfg.in_channels)).astype(np.float32)
  ctx = rng.standard_normal((4, 7, 16)).astype(np.float32)

  def run(model, x, ctx):
    graph, state = nnx.split(model)
    return jax.jit(lambda s, x, c: nnx.merge(graph, s)(x, 500.0, c))(state, x, ctx)

  want = np.asarray(run(single, x, ctx))
  batch = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(("data", "fsdp")))
  with jax.set_mesh(mesh):
    got = run(sharded, jax.device_put(x, batch), jax.device_put(ctx, batch))
  assert got.sharding.spec[0] == ("data", "fsdp")
  np.testing.assert_allclose(np.asarray(got), want, atol=1e-5, rtol=0)
