"""Two processes on localhost: jax.distributed start-up, per-process data → global arrays."""

import json
import os
import pathlib
import socket
import subprocess
import sys
import time

import numpy as np

WORKER = pathlib.Path(__file__).with_name("multihost_worker.py")
NUM_PROCESSES = 2
TIMEOUT_S = 90


def _free_port() -> int:
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _child_env(mode: str, port: int, process_id: int) -> dict[str, str]:
  env = {
    k: v
    for k, v in os.environ.items()
    if not k.startswith(("JAX_", "SLURM_", "OMPI_")) and "proxy" not in k.lower()
  }
  env["JAX_PLATFORMS"] = "cpu"
  # 4 virtual CPU devices per process, 8 in all (replacing the 8 the test session itself has).
  env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
  if mode == "slurm":
    # What `srun -n 2` on one node would set, with the coordinator port pinned to a free one.
    env.update(
      SLURM_JOB_ID="4242",
      SLURM_STEP_NODELIST="127.0.0.1",
      SLURM_NTASKS=str(NUM_PROCESSES),
      SLURM_PROCID=str(process_id),
      SLURM_LOCALID=str(process_id),
      JAX_COORDINATOR_PORT=str(port),
    )
  return env


def _run_workers(mode: str) -> list[dict]:
  port = _free_port()
  procs = [
    subprocess.Popen(
      [sys.executable, str(WORKER), mode, str(port), str(i)],
      env=_child_env(mode, port, i),
      stdout=subprocess.PIPE,
      stderr=subprocess.PIPE,
      text=True,
    )
    for i in range(NUM_PROCESSES)
  ]
  outputs = [None] * NUM_PROCESSES
  deadline = time.monotonic() + TIMEOUT_S
  try:
    for i, proc in enumerate(procs):
      remaining = max(1.0, deadline - time.monotonic())
      outputs[i] = proc.communicate(timeout=remaining)
  except subprocess.TimeoutExpired:
    pass
  finally:
    for i, proc in enumerate(procs):
      if outputs[i] is None:
        if proc.poll() is None:
          proc.kill()
        outputs[i] = proc.communicate()
  report = "\n".join(
    f"--- process {i} (exit {p.returncode}) stdout:\n{o[0]}\n--- stderr:\n{o[1][-4000:]}"
    for i, (p, o) in enumerate(zip(procs, outputs))
  )
  results = []
  for proc, (stdout, _) in zip(procs, outputs):
    lines = [line for line in stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, (
      f"a worker failed or timed out after {TIMEOUT_S}s\n{report}"
    )
    results.append(json.loads(lines[-1][len("RESULT ") :]))
  return results


def test_two_processes_build_global_batch_and_run_sharded_step():
  results = _run_workers("explicit")

  rows, features, out = 4, 6, 4
  x = np.concatenate(
    [np.random.default_rng(p).normal(size=(rows, features)).astype(np.float32) for p in range(2)]
  ).astype(np.float64)
  w = np.random.default_rng(1234).normal(size=(features, out)).astype(np.float32).astype(np.float64)
  y = x @ w

  for result in results:
    assert result["started"] is True and result["again"] is True
    assert (result["process_count"], result["device_count"], result["local_device_count"]) == (
      2,
      8,
      4,
    )
    assert result["rows"] == rows

    fsdp = result["meshes"]["fsdp"]
    assert fsdp["shape"] == [1, 8, 1, 1]
    assert fsdp["x_shape"] == [8, features]
    assert fsdp["x_spec"] == ["fsdp", None]
    # mlp -> tensor is dropped: the tensor axis has size 1.
    assert fsdp["y_spec"] == ["fsdp", None]

    hybrid = result["meshes"]["hybrid"]
    assert hybrid["shape"] == [2, 4, 1, 1]
    # dcn_data=2 over two processes: data row 0 holds process 0's devices, row 1 process 1's.
    assert hybrid["processes"] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert hybrid["x_shape"] == [8, features]
    assert hybrid["x_spec"] == [["data", "fsdp"], None]
    assert hybrid["y_spec"] == [["data", "fsdp"], None]

    tensor = result["meshes"]["hybrid_tensor"]
    assert tensor["shape"] == [2, 2, 1, 2]
    assert tensor["processes"] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert tensor["x_spec"] == [["data", "fsdp"], None]
    assert tensor["y_spec"] == [["data", "fsdp"], "tensor"]

    split = result["meshes"]["split"]
    assert split["shape"] == [4, 2, 1, 1]
    assert split["processes"] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert split["x_spec"] == [["data", "fsdp"], None]

    for mesh in (fsdp, hybrid, split, tensor):
      np.testing.assert_allclose(mesh["sum"], x.sum(), rtol=1e-5, atol=1e-5)
      np.testing.assert_allclose(mesh["weighted_sum"], (np.arange(8)[:, None] * x).sum(), rtol=1e-5)
      np.testing.assert_allclose(mesh["mean"], y.mean(axis=0), rtol=1e-5, atol=1e-5)


def test_two_processes_started_from_detected_slurm_variables():
  results = _run_workers("slurm")

  x = np.concatenate(
    [np.random.default_rng(p).normal(size=(4, 6)).astype(np.float32) for p in range(2)]
  ).astype(np.float64)
  assert sorted(r["process_index"] for r in results) == [0, 1]
  for result in results:
    assert result["started"] is True and result["again"] is True
    assert (result["process_count"], result["device_count"]) == (2, 8)
    fsdp = result["meshes"]["fsdp"]
    assert fsdp["shape"] == [1, 8, 1, 1]
    np.testing.assert_allclose(fsdp["weighted_sum"], (np.arange(8)[:, None] * x).sum(), rtol=1e-5)
