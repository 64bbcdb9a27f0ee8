import json

import chex
import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import md_data as mdd
import md_sharding as mds


def _mesh(**ici):
  return mds.make_mesh(mds.MeshConfig(**ici))


def test_synthetic_shapes_images_and_video():
  it = mdd.SyntheticIterator(
    mdd.SyntheticConfig(
      batch_size=3, height=32, width=48, text_length=7, text_dim=5, timesteps=True
    )
  )
  b = next(it)
  chex.assert_shape(b["latents"], (3, 4, 6, 4))
  chex.assert_shape(b["encoder_hidden_states"], (3, 7, 5))
  assert (
    b["timesteps"].dtype == np.int64 and ((0 <= b["timesteps"]) & (b["timesteps"] < 1000)).all()
  )
  wan = mdd.SyntheticConfig.for_family("wan", batch_size=1, height=64, width=32, frames=9)
  assert wan.latent_shape == (1, 3, 8, 4, 16)
  b = next(mdd.SyntheticIterator(wan))
  chex.assert_shape(b["latents"], (1, 3, 8, 4, 16))
  chex.assert_shape(b["encoder_hidden_states"], (1, 512, 4096))
  other = mdd.SyntheticConfig(height=32, width=32, frames=5, vae_spatial=16, vae_temporal=2)
  assert other.latent_shape == (1, 3, 2, 2, 4)


def test_synthetic_is_seeded_and_resumes():
  config = mdd.SyntheticConfig(batch_size=2, height=16, width=16, text_length=3, text_dim=4)
  run = [next(mdd.SyntheticIterator(config, seed=1)) for _ in range(1)]
  a = mdd.SyntheticIterator(config, seed=1)
  want = [next(a) for _ in range(4)]
  chex.assert_trees_all_equal(run[0], want[0])
  b = mdd.SyntheticIterator(config, seed=1)
  next(b)
  c = mdd.SyntheticIterator(config, seed=1)
  c.restore(json.loads(json.dumps(b.state())))
  chex.assert_trees_all_equal(next(c), want[1])
  assert not np.array_equal(
    next(mdd.SyntheticIterator(config, seed=2))["latents"], want[0]["latents"]
  )


@pytest.mark.parametrize(
  "bad, match",
  [
    (dict(height=30), "height=30 must be a multiple of vae_spatial=8"),
    (dict(frames=8), "frames=8 must be 1 \\+ a multiple of vae_temporal=4"),
    (dict(batch_size=0), "batch_size must be a positive int"),
  ],
)
def test_synthetic_rejects_bad_shapes(bad, match):
  with pytest.raises(ValueError, match=match):
    mdd.SyntheticConfig(**bad)


def test_batch_sizes_fractional_and_errors():
  mesh = _mesh(ici_data_parallelism=4, ici_tensor_parallelism=2)
  assert mdd.batch_sizes(mesh, per_device_batch_size=0.5) == (4, 4, 4)
  assert mdd.batch_sizes(mesh, global_batch_size=8) == (8, 8, 4)
  with pytest.raises(
    ValueError, match=r"global_batch_size=6 is not a multiple of the data-parallel size 4"
  ):
    mdd.batch_sizes(mesh, global_batch_size=6)
  with pytest.raises(
    ValueError, match=r"per_device_batch_size=0.25 x 8 devices = 2 is not a multiple"
  ):
    mdd.batch_sizes(mesh, per_device_batch_size=0.25)
  with pytest.raises(ValueError, match="not a whole positive number"):
    mdd.batch_sizes(mesh, per_device_batch_size=0.3)
  with pytest.raises(ValueError, match="give one of"):
    mdd.batch_sizes(mesh)
  with pytest.raises(ValueError, match="does not split evenly over 3 processes"):
    mdd.batch_sizes(mesh, global_batch_size=4, process_count=3)


def test_global_batches_are_sharded_and_equal():
  mesh = _mesh(ici_data_parallelism=2, ici_fsdp_parallelism=2, ici_tensor_parallelism=2)
  config = mdd.SyntheticConfig(batch_size=4, height=16, width=16, text_length=3, text_dim=4)
  it = mdd.GlobalBatches(mdd.SyntheticIterator(config), mesh, per_device_batch_size=0.5)
  want = next(mdd.SyntheticIterator(config))
  got = next(it)
  for key in want:
    assert isinstance(got[key], jax.Array)
    assert got[key].sharding.spec == P(("data", "fsdp"))
    np.testing.assert_array_equal(np.asarray(got[key]), want[key])
  assert it.state() == {"index": 1}
  it.restore({"index": 0})
  np.testing.assert_array_equal(np.asarray(next(it)["latents"]), want["latents"])


def test_global_batches_keep_namedtuples_and_report_resumability():
  mesh = _mesh(ici_data_parallelism=2, ici_fsdp_parallelism=4)
  shapes = mdd.ShapesIterator(mdd.ShapesConfig(size=24), seed=0, batch_size=8)
  batch = next(mdd.GlobalBatches(shapes, mesh, global_batch_size=8))
  assert isinstance(batch, mdd.ShapesBatch) and len(batch.captions) == 8
  assert batch.pixels.sharding.spec == P(("data", "fsdp"))
  plain = mdd.GlobalBatches(iter([{"x": np.zeros((8, 2))}]), mesh, global_batch_size=8)
  assert not hasattr(plain, "state")  # md_train.fit then runs it as not resumable
  wrong = mdd.GlobalBatches(iter([{"x": np.zeros((4, 2))}]), mesh, global_batch_size=8)
  with pytest.raises(ValueError, match=r"'x' has shape \(4, 2\), expected a leading batch of 8"):
    next(wrong)
