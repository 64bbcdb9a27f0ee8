"""Single-process `initialize` and `host_local_to_global` (two processes: test_multihost.py)."""

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import md_sharding as mds

_CLUSTER_VARS = (
  "SLURM_JOB_ID",
  "OMPI_MCA_orte_hnp_uri",
  "KUBERNETES_SERVICE_HOST",
  "TPU_WORKER_HOSTNAMES",
)


@pytest.fixture
def plain_env(monkeypatch):
  """An environment with no jax.distributed settings and no cluster."""
  for name in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID", *_CLUSTER_VARS):
    monkeypatch.delenv(name, raising=False)
  return monkeypatch


def test_initialize_is_a_no_op_for_one_process(plain_env):
  assert mds.initialize() is False
  assert mds.initialize(num_processes=1) is False
  plain_env.setenv("JAX_NUM_PROCESSES", "1")
  assert mds.initialize() is False
  assert not jax.distributed.is_initialized()


def test_initialize_rejects_partial_settings(plain_env):
  with pytest.raises(
    ValueError, match=r"num_processes=2 needs a coordinator address.*JAX_COORDINATOR"
  ):
    mds.initialize(num_processes=2, process_id=0)
  with pytest.raises(
    ValueError, match=r"is set but num_processes \(or JAX_NUM_PROCESSES\) and process_id"
  ):
    mds.initialize("127.0.0.1:1234")
  plain_env.setenv("JAX_NUM_PROCESSES", "2")
  with pytest.raises(ValueError, match=r"but process_id \(or JAX_PROCESS_ID\) is not"):
    mds.initialize("127.0.0.1:1234")
  plain_env.setenv("JAX_NUM_PROCESSES", "two")
  with pytest.raises(ValueError, match=r"JAX_NUM_PROCESSES must be an int, got 'two'"):
    mds.initialize()
  assert not jax.distributed.is_initialized()


def test_host_local_to_global_one_process():
  mesh = mds.make_mesh(
    dict(ici_data_parallelism=2, ici_fsdp_parallelism=2, ici_tensor_parallelism=2)
  )
  images = np.arange(8 * 4 * 3, dtype=np.float32).reshape(8, 4, 3)
  labels = np.arange(8, dtype=np.int32)
  noise = -images
  out = mds.host_local_to_global({"images": images, "noise": noise}, mesh, ("batch", None, None))
  assert isinstance(out["images"], jax.Array)
  assert out["images"].shape == (8, 4, 3)
  assert out["images"].sharding.spec == P(("data", "fsdp"), None, None)
  np.testing.assert_array_equal(np.asarray(out["images"]), images)
  np.testing.assert_array_equal(np.asarray(out["noise"]), noise)
  for shard in out["images"].addressable_shards:
    assert shard.data.shape == (2, 4, 3)
    np.testing.assert_array_equal(np.asarray(shard.data), images[shard.index])

  # A PartitionSpec is used as given, for every leaf.
  out = mds.host_local_to_global([labels, labels * 2], mesh, P("tensor"))
  assert [leaf.sharding.spec for leaf in out] == [P("tensor")] * 2
  np.testing.assert_array_equal(np.asarray(out[1]), labels * 2)


def test_host_local_to_global_errors():
  mesh = mds.make_mesh()
  with pytest.raises(ValueError, match=r"shape \(8,\) does not match the 2 logical names"):
    mds.host_local_to_global(np.zeros(8), mesh, ("batch", None))
  with pytest.raises(ValueError, match=r"unknown logical axis name 'btach'"):
    mds.host_local_to_global(np.zeros(8), mesh, ("btach",))
