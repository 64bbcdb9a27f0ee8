"""Two real processes on localhost (`jax.distributed.initialize`, 2 CPU devices each) train a tiny NNX
flow-matching model through `md_train.make_train_step` (AdamW + EMA, noise and sigmas drawn from the
state's rng) for 2 steps on one mesh over all 4 devices (dcn data 2 across the processes × fsdp 2 inside
each; kernels sharded over fsdp), the global batch assembled by `md_data.GlobalBatches` from each
process's own rows, and write one checkpoint with `md_train.Checkpointer`; the final parameters equal a single-process run of
the same 2 steps on the same global batch within 1e-5, and so do the checkpoint's (restored into the
one-device state, and read without a target by `Checkpointer.read`). (The Wan transformer
of tests/test_sharding.py would work too, but its sharded step compiles for minutes on a loaded 2-core
machine.)

The CPU backend runs cross-process collectives through gloo (`jax_cpu_collectives_implementation`). Each
worker is this file run as a script (`python tests/test_multihost.py --worker <id> <port> <folder>`); a
hung worker fails the test at the timeout instead of blocking it.
"""

from __future__ import annotations

import os
import pathlib
import socket
import subprocess
import sys

import numpy as np

STEPS, TOL, PROCESSES, LOCAL_DEVICES, TIMEOUT_S = 2, 1e-5, 2, 2, 240


def _batch():
  rng = np.random.default_rng(1)
  return {
    "latents": rng.standard_normal((8, 16), np.float32),  # [B, D]
    "cond": rng.standard_normal((8, 8), np.float32),  # [B, E]
  }


def _model():
  import jax.numpy as jnp
  from flax import nnx

  class Denoiser(nnx.Module):
    """A two-layer velocity model on the noisy latents and the condition."""

    def __init__(self, *, rngs):
      self.hidden = nnx.Linear(16 + 8, 32, rngs=rngs)
      self.out = nnx.Linear(32, 16, rngs=rngs)

    def __call__(self, noisy, sigmas, cond):  # [B, D], [B], [B, E] -> [B, D]
      h = jnp.concatenate([noisy * (1 - sigmas[:, None]), cond], axis=-1)
      return self.out(nnx.gelu(self.hidden(h)))

  return Denoiser(rngs=nnx.Rngs(0))


def _flow_loss(frozen):
  """Rectified-flow MSE with noise and sigmas drawn from the step's key (as `families.wan_loss`)."""
  import jax

  import md_train as mdt

  def loss_fn(params, batch, key):
    k_noise, k_t = jax.random.split(key)
    latents = batch["latents"]
    noise = jax.random.normal(k_noise, latents.shape)
    sigmas = mdt.flow_sigmas(k_t, latents.shape[0], sampler="shifted", shift=3.0)
    noisy, target = mdt.diffusion_inputs("flow", latents, noise, sigmas)
    return mdt.diffusion_loss(frozen.merge(params)(noisy, sigmas, batch["cond"]), target), {}

  return loss_fn


def _train(mesh, process_rows=None):
  """`STEPS` steps of the tiny model; `(state, losses)`. With a mesh, the kernels are sharded over fsdp
  and the batch over data x fsdp, built from this process's rows of the global batch
  (`process_rows(sharding, global_shape) -> slice`)."""
  import jax
  from jax.sharding import NamedSharding, PartitionSpec

  import md_data as mdd
  import md_train as mdt

  frozen, params = mdt.split_trainable(_model())
  batch, batch_sharding, shardings = _batch(), None, None
  if mesh is not None:
    # Host copies placed on the mesh (the same values in every process).
    params = jax.tree.map(
      lambda p: jax.device_put(
        np.asarray(p),
        NamedSharding(mesh, PartitionSpec("fsdp") if p.ndim == 2 else PartitionSpec()),
      ),
      params,
    )
    batch_sharding = NamedSharding(mesh, PartitionSpec(("data", "fsdp")))
    # This process's data source yields only its own rows; md_data.GlobalBatches makes them global.
    rows = process_rows(batch_sharding, batch["latents"].shape)
    local = iter([{name: value[rows] for name, value in batch.items()}])
    batches = mdd.GlobalBatches(local, mesh, global_batch_size=batch["latents"].shape[0])
    assert batches.sizes.per_process_batch_size == rows.stop - rows.start
    batch = next(batches)
    assert all(v.sharding.is_equivalent_to(batch_sharding, 2) for v in batch.values())
  opt = mdt.make_optimizer(learning_rate=1e-2, warmup_steps=1, ema_decay=0.9)
  state = mdt.init_state(params, opt, rng=0)
  if mesh is not None:
    shardings = mdt.state_shardings(state)
  step = mdt.make_train_step(
    _flow_loss(frozen), opt, state_sharding=shardings, batch_sharding=batch_sharding
  )
  losses = []
  for _ in range(STEPS):
    state, metrics = step(state, batch)
    losses.append(float(metrics["loss"]))
  return state, losses


def _process_rows(sharding, shape) -> slice:
  """The contiguous rows of the global batch that this process's devices hold."""
  rows = [idx[0] for idx in sharding.addressable_devices_indices_map(shape).values()]
  start = min(r.start or 0 for r in rows)
  stop = max(shape[0] if r.stop is None else r.stop for r in rows)
  return slice(start, stop)


def _worker(process_id: int, port: int, folder: pathlib.Path) -> None:
  import jax

  jax.config.update("jax_platforms", "cpu")
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.config.update("jax_default_matmul_precision", "highest")
  jax.config.update("jax_threefry_partitionable", True)
  jax.distributed.initialize(
    coordinator_address=f"127.0.0.1:{port}",
    num_processes=PROCESSES,
    process_id=process_id,
    initialization_timeout=60,
  )
  from jax.experimental import multihost_utils

  import md_sharding as mds
  import md_train as mdt

  assert jax.process_count() == PROCESSES and jax.local_device_count() == LOCAL_DEVICES
  mesh = mds.make_mesh(mds.MeshConfig(dcn_data_parallelism=PROCESSES, ici_fsdp_parallelism=-1))
  state, losses = _train(mesh, _process_rows)
  ckpt = mdt.Checkpointer(folder / "checkpoints", async_save=False)
  ckpt.save(state, force=True)
  ckpt.close()
  params = multihost_utils.process_allgather(state.params, tiled=True)
  if process_id == 0:
    leaves = {f"leaf_{i:04d}": np.asarray(v) for i, v in enumerate(jax.tree.leaves(params))}
    np.savez(folder / "params.npz", losses=np.asarray(losses), **leaves)
  multihost_utils.sync_global_devices("md-multihost-done")
  jax.distributed.shutdown()


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def test_two_processes_train_and_checkpoint_like_one(tmp_path):
  import jax

  import md_train as mdt

  env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "XLA_"))}
  env.update(
    XLA_FLAGS=f"--xla_force_host_platform_device_count={LOCAL_DEVICES}", JAX_PLATFORMS="cpu"
  )
  port, script = _free_port(), pathlib.Path(__file__).resolve()
  procs = [
    subprocess.Popen(
      [sys.executable, str(script), "--worker", str(i), str(port), str(tmp_path)],
      env=env,
      stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT,
      text=True,
    )
    for i in range(PROCESSES)
  ]
  outputs = []
  try:
    for p in procs:
      outputs.append(p.communicate(timeout=TIMEOUT_S)[0])
  except subprocess.TimeoutExpired:
    for p in procs:
      p.kill()
    raise AssertionError(f"a worker hung for more than {TIMEOUT_S} s") from None
  for i, (p, out) in enumerate(zip(procs, outputs)):
    assert p.returncode == 0, f"worker {i} exited {p.returncode}:\n{out[-4000:]}"

  assert [d.name for d in (tmp_path / "checkpoints").iterdir() if d.is_dir()] == [str(STEPS)]
  assert (tmp_path / "checkpoints" / str(STEPS) / "state").is_dir()
  got = np.load(tmp_path / "params.npz")
  state, losses = _train(None)
  np.testing.assert_allclose(got["losses"], losses, atol=TOL, rtol=0)
  want = [np.asarray(v) for v in jax.tree.leaves(state.params)]
  assert len(want) == len(got.files) - 1
  err = max(float(np.abs(got[f"leaf_{i:04d}"] - w).max()) for i, w in enumerate(want))
  print(f"2 processes vs 1: max parameter error {err:.1e}")
  for i, w in enumerate(want):
    np.testing.assert_allclose(got[f"leaf_{i:04d}"], w, atol=TOL, rtol=0, err_msg=f"leaf {i}")
  # The 4-device checkpoint restores into the one-device state (placed like the target's arrays).
  restored, info = mdt.Checkpointer(tmp_path / "checkpoints").restore(state)
  assert info["step"] == STEPS
  for r, w in zip(jax.tree.leaves(restored.params), want):
    np.testing.assert_allclose(np.asarray(r), w, atol=TOL, rtol=0)
  # ... and reads without a target (whole host arrays, whatever topology wrote it).
  arrays, meta = mdt.Checkpointer(tmp_path / "checkpoints").read()
  assert meta["step"] == STEPS and len(arrays) == len(jax.tree.leaves(restored))
  for name, r in zip(meta["leaves"], jax.tree.leaves(restored)):
    r = jax.random.key_data(r) if jax.dtypes.issubdtype(r.dtype, jax.dtypes.prng_key) else r
    np.testing.assert_array_equal(arrays[name], np.asarray(r), err_msg=name)


if __name__ == "__main__" and sys.argv[1:2] == ["--worker"]:
  _worker(int(sys.argv[2]), int(sys.argv[3]), pathlib.Path(sys.argv[4]))
