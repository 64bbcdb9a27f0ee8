"""One process of the two-process test in test_multihost.py (a script; pytest does not collect it).

Usage: python multihost_worker.py MODE PORT PROCESS_ID, where MODE is "explicit" (settings passed to
`initialize`) or "slurm" (no arguments: jax detects the SLURM variables the test sets). Prints one
line `RESULT {json}` on success.
"""

import json
import sys

import jax

# Multi-process CPU computations need a cross-process collectives backend; gloo ships with jaxlib
# (and is the default in recent jax, which may one day drop the option).
if "jax_cpu_collectives_implementation" in jax.config.values:
  jax.config.update("jax_cpu_collectives_implementation", "gloo")

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec  # noqa: E402

import md_sharding as mds  # noqa: E402

NUM_PROCESSES = 2
FEATURES, OUT = 6, 4


def process_batch(process_id: int, rows: int) -> np.ndarray:
  """The rows process `process_id` loads: distinct per process, reproducible anywhere."""
  return np.random.default_rng(process_id).normal(size=(rows, FEATURES)).astype(np.float32)


def weights() -> np.ndarray:
  return np.random.default_rng(1234).normal(size=(FEATURES, OUT)).astype(np.float32)


def main(mode: str, port: int, process_id: int) -> None:
  if mode == "explicit":
    started = mds.initialize(
      f"127.0.0.1:{port}", NUM_PROCESSES, process_id, initialization_timeout=30
    )
  else:
    started = mds.initialize(initialization_timeout=30)
  again = mds.initialize()  # idempotent: no second start
  rows = mds.per_process_batch_size(1.0)  # 8 devices * 1 / 2 processes = 4
  local = process_batch(process_id, rows)
  # What the global batch must be: process 0's rows, then process 1's.
  expected_x = np.concatenate([process_batch(p, rows) for p in range(NUM_PROCESSES)])
  w_host = weights()
  expected_y = expected_x.astype(np.float64) @ w_host.astype(np.float64)

  results = {
    "started": started,
    "process_index": jax.process_index(),
    "again": again,
    "process_count": jax.process_count(),
    "device_count": jax.device_count(),
    "local_device_count": jax.local_device_count(),
    "rows": rows,
    "meshes": {},
  }
  configs = {
    "fsdp": {"ici_fsdp_parallelism": -1},
    "hybrid": {"dcn_data_parallelism": 2, "ici_fsdp_parallelism": -1},
    # Four dcn groups over two processes: each process's devices are split in two.
    "split": {"dcn_data_parallelism": 4, "ici_fsdp_parallelism": -1},
    "hybrid_tensor": {
      "dcn_data_parallelism": 2,
      "ici_fsdp_parallelism": 2,
      "ici_tensor_parallelism": 2,
    },
  }
  row_weights = np.arange(expected_x.shape[0], dtype=np.float32)[:, None]
  if mode != "explicit":
    configs = {"fsdp": configs["fsdp"]}
  for label, config in configs.items():
    mesh = mds.make_mesh(config)
    # Each mesh row along `data` of the hybrid mesh must be one process's devices.
    processes = np.vectorize(lambda d: d.process_index)(mesh.devices)
    x = mds.host_local_to_global(local, mesh, ("batch", None))
    w = mds.host_local_to_global(w_host, mesh, PartitionSpec())
    replicated = NamedSharding(mesh, PartitionSpec())
    y_sharding = mds.logical_to_sharding(("batch", "mlp"), mesh, shape=expected_y.shape)

    def step(x, w, mesh=mesh):
      y = mds.with_logical_constraint(x @ w, ("batch", "mlp"), mesh=mesh)
      # The weighted sum depends on the row order: it checks which process's data went where.
      return jnp.sum(x), jnp.sum(row_weights * x), jnp.mean(y, axis=0), y

    step = jax.jit(
      step, static_argnames="mesh", out_shardings=(replicated, replicated, replicated, y_sharding)
    )
    total, weighted, mean, y = step(x, w)
    # The global x, row by row, must hold both processes' data in order.
    for shard in x.addressable_shards:
      np.testing.assert_array_equal(np.asarray(shard.data), expected_x[shard.index])
    for shard in y.addressable_shards:
      np.testing.assert_allclose(
        np.asarray(shard.data), expected_y[shard.index], rtol=1e-5, atol=1e-5
      )
    np.testing.assert_allclose(
      float(total), expected_x.astype(np.float64).sum(), rtol=1e-5, atol=1e-5
    )
    np.testing.assert_allclose(np.asarray(mean), expected_y.mean(axis=0), rtol=1e-5, atol=1e-5)
    results["meshes"][label] = {
      "shape": list(mesh.devices.shape),
      "processes": processes.reshape(-1).tolist(),
      "x_shape": list(x.shape),
      "x_spec": [s if not isinstance(s, tuple) else list(s) for s in x.sharding.spec],
      "y_spec": [s if not isinstance(s, tuple) else list(s) for s in y.sharding.spec],
      "sum": float(total),
      "weighted_sum": float(weighted),
      "mean": np.asarray(mean).tolist(),
    }
  print("RESULT " + json.dumps(results), flush=True)


if __name__ == "__main__":
  main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
