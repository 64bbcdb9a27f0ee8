"""md_train.fit, Checkpointer, MetricsWriter and eval_loss on a small NNX model and md_data shapes batches:
a resumed run equals an uninterrupted one bit for bit (parameters, optimizer state, rng, next batch), a
failed save keeps the previous checkpoint, TensorBoard holds the logged losses once, errors name what is
wrong."""

import errno
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from tensorboard.backend.event_processing import event_accumulator

import md_data
import md_sharding as mds
import md_train as mdt


class Tiny(nnx.Module):
  def __init__(self, rngs):
    self.a = nnx.Linear(48, 32, rngs=rngs)
    self.b = nnx.Linear(32, 48, rngs=rngs)

  def __call__(self, x):
    return self.b(jax.nn.gelu(self.a(x)))


class Batches:
  """Shapes images reduced to 48 features, resumable through the shapes iterator."""

  def __init__(self, seed=0):
    self.shapes = md_data.ShapesIterator(md_data.ShapesConfig(size=24), seed=seed, batch_size=2)

  def __iter__(self):
    return self

  def __next__(self):
    pixels = next(self.shapes).pixels[:, ::6, ::6, :]  # [2, 4, 4, 3]
    return {"latents": jnp.asarray(pixels.reshape(2, 48) * 2 - 1)}

  def state(self):
    return self.shapes.state()

  def restore(self, state):
    self.shapes.restore(state)


def _loss_fn(frozen):
  def loss_fn(params, batch, key):
    k1, k2 = jax.random.split(key)
    x = batch["latents"]
    noise = jax.random.normal(k1, x.shape)
    sigmas = batch["sigmas"] if "sigmas" in batch else jax.random.uniform(k2, (x.shape[0],))
    noisy, target = mdt.diffusion_inputs("flow", x, noise, sigmas)
    return mdt.diffusion_loss(frozen.merge(params)(noisy), target), {}

  return loss_fn


_FROZEN, _ = mdt.split_trainable(Tiny(nnx.Rngs(0)))
LOSS_FN = _loss_fn(_FROZEN)
# EMA and accumulation make the optimizer state more than Adam's moments.
OPT = mdt.make_optimizer(
  learning_rate=1e-2, warmup_steps=2, ema_decay=0.9, gradient_accumulation_steps=2
)
STEP = mdt.make_train_step(LOSS_FN, OPT)  # one jitted step: fits share its compiled program


def _evaluate(state):
  return {"eval/loss": mdt.eval_loss(LOSS_FN, state.params, [next(Batches())], [0.5])[0.5]}


def _recipe(fingerprint=None):
  """A fresh recipe (new parameters from the same seed, a new iterator), as a restarted process has."""
  _, params = mdt.split_trainable(Tiny(nnx.Rngs(0)))
  return mdt.Recipe(
    state=mdt.init_state(params, OPT, rng=0),
    step=STEP,
    batches=Batches(),
    eval=_evaluate,
    fingerprint=fingerprint if fingerprint is not None else {"lr": 1e-2, "model": {"width": 32}},
  ), LOSS_FN


def _leaves(state):
  return [np.asarray(jax.random.key_data(x) if mdt._checkpoint._is_key(x) else x) for x in state]


def _assert_bitwise(a, b):
  la, lb = jax.tree.leaves(_leaves_tree(a)), jax.tree.leaves(_leaves_tree(b))
  assert len(la) == len(lb)
  for x, y in zip(la, lb):
    assert x.dtype == y.dtype and x.shape == y.shape
    assert np.array_equal(x, y), np.abs(x.astype(np.float64) - y).max()


def _leaves_tree(state):
  return jax.tree.map(
    lambda x: np.asarray(jax.random.key_data(x) if mdt._checkpoint._is_key(x) else x), state
  )


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
  """An uninterrupted 6-step run, checkpoints every 3 steps."""
  workdir = tmp_path_factory.mktemp("straight")
  recipe, _ = _recipe()
  state = mdt.fit(recipe, steps=6, workdir=workdir, checkpoint_every=3, eval_every=3)
  return workdir, state, recipe.batches


def test_resume_after_3_steps_is_bit_exact(straight, tmp_path):
  """3 steps, a fresh process-like restart (new recipe), on to 6: parameters, optimizer state (Adam
  moments, EMA, accumulation counters), rng and the next batch equal the straight run's bit for bit."""
  workdir, want, want_batches = straight
  first, _ = _recipe()
  mdt.fit(first, steps=3, workdir=tmp_path, checkpoint_every=3, eval_every=3)
  again, _ = _recipe()
  got = mdt.fit(again, steps=6, workdir=tmp_path, checkpoint_every=3, eval_every=3)
  assert int(got.step) == 6
  _assert_bitwise(got, want)
  assert again.batches.state() == want_batches.state()
  np.testing.assert_array_equal(next(again.batches)["latents"], next(want_batches)["latents"])
  losses = [(m["step"], m["loss"]) for m in mdt.read_metrics(tmp_path) if "loss" in m]
  assert losses == [(m["step"], m["loss"]) for m in mdt.read_metrics(workdir) if "loss" in m]
  assert [s for s, _ in losses] == [1, 2, 3, 4, 5, 6]


def test_crash_in_step_4_resumes_from_3(straight, tmp_path):
  """A run that dies in step 4 (after step 3's checkpoint) resumes from 3 and ends equal; the JSON lines
  and TensorBoard hold each step once."""
  _, want, _ = straight

  def crash(n):
    if n == 4:
      raise RuntimeError("killed")

  recipe, _ = _recipe()
  with pytest.raises(RuntimeError, match="killed"):
    mdt.fit(recipe, steps=6, workdir=tmp_path, checkpoint_every=3, on_step=crash)
  assert mdt.Checkpointer(tmp_path / "checkpoints").steps() == [3]
  recipe, _ = _recipe()
  got = mdt.fit(recipe, steps=6, workdir=tmp_path, checkpoint_every=3)
  _assert_bitwise(got, want)
  steps = [m["step"] for m in mdt.read_metrics(tmp_path)]
  assert steps == [1, 2, 3, 4, 5, 6]
  acc = event_accumulator.EventAccumulator(str(tmp_path / "tb"))
  acc.Reload()
  assert [e.step for e in acc.Scalars("loss")] == [1, 2, 3, 4, 5, 6]


def test_metrics_jsonl_and_tensorboard(straight):
  """Every logged step has loss, lr, grad_norm, step time, TFLOP/s and MFU; TensorBoard's `loss` holds
  the same values at the same steps; eval every 3 steps."""
  workdir, _, _ = straight
  rows = mdt.read_metrics(workdir)
  train = [r for r in rows if "loss" in r]
  for r in train:
    assert {"loss", "lr", "grad_norm", "step_time", "tflops_per_device", "mfu"} <= set(r)
    assert r["step_time"] > 0 and r["tflops_per_device"] > 0 and 0 < r["mfu"] < 10
  # Warm-up over 2 optimizer updates of 2 micro-batches each: lr 0, 0, 1/2, 1/2, 1, 1 (x 1e-2).
  np.testing.assert_allclose([r["lr"] for r in train], np.asarray([0, 0, 0.5, 0.5, 1, 1]) * 1e-2)
  evals = [r for r in rows if "eval/loss" in r]
  assert [r["step"] for r in evals] == [3, 6]
  acc = event_accumulator.EventAccumulator(str(workdir / "tb"))
  acc.Reload()
  scalars = acc.Scalars("loss")
  assert [e.step for e in scalars] == [r["step"] for r in train]
  np.testing.assert_allclose([e.value for e in scalars], [r["loss"] for r in train], rtol=1e-7)
  assert [e.step for e in acc.Scalars("eval/loss")] == [3, 6]


def test_log_every(tmp_path):
  recipe, _ = _recipe()
  mdt.fit(recipe, steps=5, workdir=tmp_path, log_every=2)
  assert [m["step"] for m in mdt.read_metrics(tmp_path)] == [2, 4, 5]


def test_profile_window_writes_a_trace(tmp_path):
  """Steps 3-4 of 5 traced into <workdir>/profile (an .xplane.pb TensorBoard's profile plugin reads);
  the run's results are those of an untraced run."""
  recipe, _ = _recipe()
  traced = mdt.fit(recipe, steps=5, workdir=tmp_path / "a", profile_start=2, profile_steps=2)
  traces = list((tmp_path / "a" / mdt.PROFILE_DIR).rglob("*.xplane.pb"))
  assert len(traces) == 1 and traces[0].stat().st_size > 0
  plain = mdt.fit(_recipe()[0], steps=5, workdir=tmp_path / "b")
  assert not (tmp_path / "b" / mdt.PROFILE_DIR).exists()
  for a, b in zip(jax.tree.leaves(traced.params), jax.tree.leaves(plain.params), strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  with pytest.raises(ValueError, match="profile_steps needs a profile_dir"):
    mdt.fit(_recipe()[0], steps=2, profile_steps=1)
  with pytest.raises(ValueError, match="profile_start=-1 must be an int >= 0"):
    mdt.fit(_recipe()[0], steps=2, workdir=tmp_path / "c", profile_start=-1)


def test_resume_with_another_fingerprint_fails(straight, tmp_path):
  """The error names the differing keys (nested ones dotted) and both values."""
  workdir, _, _ = straight
  recipe, _ = _recipe(fingerprint={"lr": 2e-2, "model": {"width": 64}})
  with pytest.raises(ValueError, match=r"fingerprint differs in lr, model\.width") as e:
    mdt.fit(recipe, steps=7, workdir=workdir)
  assert "saved 32, this run 64" in str(e.value)


def test_empty_data_source(tmp_path):
  recipe, _ = _recipe()
  with pytest.raises(ValueError, match="data source ran out before step 1"):
    mdt.fit(recipe._replace(batches=iter([])), steps=2, workdir=tmp_path)
  with pytest.raises(ValueError, match="ran out before step 3"):
    mdt.fit(recipe._replace(batches=iter([next(Batches())] * 2)), steps=4)
  first = next(Batches())
  odd = {"latents": first["latents"][:1]}
  with pytest.raises(ValueError, match=r"shapes \{'latents': \(1, 48\)\} does not fit the step"):
    mdt.fit(_recipe()[0]._replace(batches=iter([first, odd])), steps=2)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # the failed writer
def test_failed_save_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
  """A save that fails (disk full while writing) raises a CheckpointError naming the step and the intact
  checkpoint; the previous one restores bit for bit, and later saves work again."""
  from orbax.checkpoint._src.handlers import json_checkpoint_handler as jch

  recipe, _ = _recipe()
  state = recipe.state
  ckpt = mdt.Checkpointer(tmp_path, every=1)
  for _ in range(2):
    state, _ = recipe.step(state, next(recipe.batches))
    ckpt.save(state, data=recipe.batches.state())
  ckpt.wait()
  saved = _leaves_tree(state)
  state, _ = recipe.step(state, next(recipe.batches))

  async def disk_full(self, x, directory):
    raise OSError(errno.ENOSPC, "No space left on device")

  monkeypatch.setattr(jch.JsonCheckpointHandler, "_save_fn", disk_full)
  with pytest.raises(mdt.CheckpointError, match="step 3 failed.*No space left.*step 2 is intact"):
    ckpt.save(state)
    ckpt.wait()
  monkeypatch.undo()
  assert ckpt.steps() == [1, 2]
  fresh, _ = _recipe()
  restored, info = mdt.Checkpointer(tmp_path).restore(fresh.state)
  assert info["step"] == 2 and info["data"]["index"] == 4
  _assert_bitwise(restored, saved)
  assert ckpt.save(state, force=True)
  ckpt.close()
  assert mdt.Checkpointer(tmp_path).steps() == [1, 2, 3]


def test_checkpointer_keep_and_structure_errors(tmp_path):
  recipe, _ = _recipe()
  state = recipe.state
  ckpt = mdt.Checkpointer(tmp_path, keep=2, every=2)
  for _ in range(6):
    state, _ = recipe.step(state, next(recipe.batches))
    ckpt.save(state)
  ckpt.close()
  assert ckpt.steps() == [4, 6]
  arrays, meta = ckpt.read()
  assert meta["step"] == 6 and len(arrays) == len(jax.tree.leaves(state))
  other = mdt.init_state({"w": jnp.zeros((3,))}, mdt.make_optimizer(learning_rate=1.0))
  with pytest.raises(ValueError, match="does not fit this run's state"):
    mdt.Checkpointer(tmp_path).restore(other)
  with pytest.raises(FileNotFoundError, match="no checkpoint of step 5"):
    mdt.Checkpointer(tmp_path).restore(state, step=5)
  with pytest.raises(ValueError, match="keep=0"):
    mdt.Checkpointer(tmp_path, keep=0)


def test_batch_sharding_needs_a_multiple_of_the_data_parallel_devices():
  mesh = mds.make_mesh(mds.MeshConfig.from_dict({"ici_data_parallelism": 2}))  # data 2 x fsdp 4
  assert mdt.batch_sharding(mesh, 16).spec == jax.sharding.PartitionSpec(("data", "fsdp"))
  with pytest.raises(ValueError, match=r"batch_size=3 .* device count 8 \(mesh data=2 x fsdp=4\)"):
    mdt.batch_sharding(mesh, 3)


def test_eval_loss_at_fixed_timesteps():
  """Each bucket's batch carries the level (scaled), the noise is the same for every level: a loss that
  is linear in the level gives it back exactly, and the real loss repeats bit for bit."""

  def linear(params, batch, key):
    return jnp.mean(batch["sigmas"]) * params["w"] + 0 * jax.random.normal(key), {}

  batches = [{"latents": jnp.zeros((2, 3))}, {"latents": jnp.zeros((4, 3))}]
  got = mdt.eval_loss(
    linear, {"w": jnp.float32(2.0)}, batches, [100, 500], key="sigmas", scale=1e-3
  )
  assert got == {100: pytest.approx(0.2, rel=1e-6), 500: pytest.approx(1.0, rel=1e-6)}

  recipe, loss_fn = _recipe()
  data = [next(Batches()) for _ in range(2)]
  a = mdt.eval_loss(loss_fn, recipe.state.params, data, [0.1, 0.9], key="sigmas")
  b = mdt.eval_loss(loss_fn, recipe.state.params, data, [0.1, 0.9], key="sigmas")
  assert a == b and a[0.1] != a[0.9]
  with pytest.raises(ValueError, match="gave no batches"):
    mdt.eval_loss(loss_fn, recipe.state.params, [], [0.5])


def test_metrics_writer_drops_steps_after_resume(tmp_path):
  with mdt.MetricsWriter(tmp_path, tensorboard=False) as w:
    for step in (1, 2, 3):
      w.write(step, {"loss": step / 10})
  with open(tmp_path / "metrics.jsonl", "a") as f:
    f.write('{"step": 4, "loss"')  # a half-written line of a killed run
  with mdt.MetricsWriter(tmp_path, resume_step=2, tensorboard=False) as w:
    w.write(3, {"loss": 0.5, "nan": float("nan")})
  rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  assert rows == [
    {"step": 1, "loss": 0.1},
    {"step": 2, "loss": 0.2},
    {"step": 3, "loss": 0.5, "nan": None},
  ]
