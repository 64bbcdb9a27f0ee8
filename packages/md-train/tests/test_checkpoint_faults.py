"""Damaged checkpoints and diverging runs, each with its clear outcome: a flipped bit, NaN bytes or a
truncated file in the newest checkpoint is found by the per-array digests and the previous checkpoint is
restored bit for bit (one line says so); with an explicit step the damage is an error naming the array;
a non-finite loss stops `fit` naming the step, with no checkpoint written after it."""

import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import md_train as mdt


class Tiny(nnx.Module):
  def __init__(self, rngs):
    self.a = nnx.Linear(64, 64, rngs=rngs)

  def __call__(self, x):
    return self.a(x)


def _loss_fn(frozen):
  def loss_fn(params, batch, key):
    x = batch["x"]
    return jnp.mean((frozen.merge(params)(x) - x) ** 2), {}

  return loss_fn


_FROZEN, _ = mdt.split_trainable(Tiny(nnx.Rngs(0)))
STEP = mdt.make_train_step(_loss_fn(_FROZEN), mdt.make_optimizer(learning_rate=1e-3))


class Batches:
  """Random rows; from `nan_at` on (a 1-based step) the rows are NaN."""

  def __init__(self, nan_at=None):
    self.index, self.nan_at = 0, nan_at

  def __iter__(self):
    return self

  def __next__(self):
    self.index += 1
    x = np.random.default_rng(self.index).normal(size=(2, 64)).astype(np.float32)
    if self.nan_at is not None and self.index >= self.nan_at:
      x[:] = np.nan
    return {"x": jnp.asarray(x)}

  def state(self):
    return {"index": self.index}

  def restore(self, state):
    self.index = state["index"]


def _fresh_state():
  _, params = mdt.split_trainable(Tiny(nnx.Rngs(0)))
  return mdt.init_state(params, mdt.make_optimizer(learning_rate=1e-3), rng=0)


def _saved(tmp_path) -> tuple[mdt.Checkpointer, dict]:
  """Checkpoints of steps 1 and 2; the arrays of step 1."""
  state, batches = _fresh_state(), Batches()
  ckpt = mdt.Checkpointer(tmp_path / "ckpt", every=1, async_save=False)
  arrays = None
  for _ in range(2):
    state, _ = STEP(state, next(batches))
    ckpt.save(state, data=batches.state())
    if arrays is None:
      arrays = jax.tree.map(lambda x: np.asarray(jax.device_get(x)), _plain(state))
  ckpt.close()
  return ckpt, arrays


def _plain(state):
  return jax.tree.map(
    lambda x: (
      jax.random.key_data(x)
      if jax.dtypes.issubdtype(getattr(x, "dtype", np.float32), jax.dtypes.prng_key)
      else x
    ),
    state,
  )


def _data_files(folder: pathlib.Path) -> list[pathlib.Path]:
  """The array data files of a checkpoint's state item, largest first."""
  files = [p for p in (folder / "state").rglob("*") if p.is_file() and p.stat().st_size > 1024]
  return sorted(files, key=lambda p: -p.stat().st_size)


def _damage(ckpt, how: str) -> None:
  target = _data_files(ckpt.directory / "2")[0]
  data = bytearray(target.read_bytes())
  if how == "bit flip":
    data[len(data) // 2] ^= 0x10
  elif how == "nan":
    at = len(data) // 2 // 4 * 4
    data[at : at + 4096] = np.full(1024, np.nan, np.float32).tobytes()[: len(data) - at]
  elif how == "truncation":
    data = data[: len(data) // 3]
  target.write_bytes(bytes(data))


@pytest.mark.parametrize("how", ["bit flip", "nan", "truncation"])
def test_a_damaged_newest_checkpoint_falls_back_to_the_previous(tmp_path, capfd, how):
  ckpt, step1 = _saved(tmp_path)
  _damage(ckpt, how)
  restored, info = mdt.Checkpointer(ckpt.directory).restore(_fresh_state())
  assert info["step"] == 1 and info["data"] == {"index": 1}
  for a, b in zip(jax.tree.leaves(_plain(restored)), jax.tree.leaves(step1), strict=True):
    np.testing.assert_array_equal(np.asarray(a), b)
  err = capfd.readouterr().err.strip().splitlines()
  assert len(err) == 1 and "restored step 1, the newest checkpoint that verifies" in err[0], err
  assert "step 2:" in err[0]
  # Named explicitly, the damaged step is one clear error (the digest, or the reader's own check of
  # the compressed bytes, whichever sees it first).
  with pytest.raises(
    mdt.CheckpointCorrupt, match=r"/2: (array .* does not match the digest|does no)"
  ):
    mdt.Checkpointer(ckpt.directory).restore(_fresh_state(), step=2)


def test_an_array_that_differs_from_its_digest_is_found(tmp_path, capfd):
  """Damage the storage layer cannot see (the data reads, but is not what was saved): only the digest
  finds it. Here the saved digest of one array is changed instead of its bytes, to the same effect."""
  ckpt, step1 = _saved(tmp_path)
  meta_file = ckpt.directory / "2" / "meta" / "metadata"
  meta = json.loads(meta_file.read_text())
  meta["digests"]["leaf_00001"] = "0" * 64
  meta_file.write_text(json.dumps(meta))
  with pytest.raises(mdt.CheckpointCorrupt, match=r"/2: array .* does not match the digest"):
    mdt.Checkpointer(ckpt.directory).restore(_fresh_state(), step=2)
  _, info = mdt.Checkpointer(ckpt.directory).restore(_fresh_state())
  assert info["step"] == 1
  assert "restored step 1, the newest checkpoint that verifies" in capfd.readouterr().err


def test_no_checkpoint_that_verifies_is_one_clear_error(tmp_path):
  ckpt, _ = _saved(tmp_path)
  for step in ("1", "2"):
    target = _data_files(ckpt.directory / step)[0]
    data = bytearray(target.read_bytes())
    data[len(data) // 2] ^= 0x01
    target.write_bytes(bytes(data))
  with pytest.raises(mdt.CheckpointCorrupt, match="no checkpoint verifies .*step 2: .*step 1: "):
    mdt.Checkpointer(ckpt.directory).restore(_fresh_state())


def test_a_non_finite_loss_stops_fit_naming_the_step(tmp_path):
  recipe = mdt.Recipe(state=_fresh_state(), step=STEP, batches=Batches(nan_at=5))
  with pytest.raises(
    FloatingPointError, match="loss is nan at step 5; the newest checkpoint is step 3"
  ):
    mdt.fit(recipe, steps=8, workdir=tmp_path, checkpoint_every=3, progress=False)
  assert mdt.Checkpointer(tmp_path / "checkpoints").steps() == [3]
