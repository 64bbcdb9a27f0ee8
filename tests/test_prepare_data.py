"""apps/prepare_data end to end, as real subprocesses: a folder of four shapes images encoded with the shipped
shapes-sd model; the records read back equal md's own encoding of those images (the VAE posterior mean
times `scaling_factor`, as diffusers' train_text_to_image.py; the CLIP states of the captions); bad
settings fail with one line and exit code 2. (Skipping complete shards on a rerun is tested on
md_data.write_latent_shards, in packages/md-data/tests/test_prepare.py.)
"""

import json
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from PIL import Image

import md_data as mdd
import md_sd

ROOT = pathlib.Path(__file__).resolve().parents[1]
MODEL = ROOT / "models" / "shapes-sd"


def _run(args, cache):
  env = dict(
    os.environ,
    JAX_PLATFORMS="cpu",
    HF_HUB_OFFLINE="1",
    MD_PROGRESS="0",
    XLA_FLAGS="--xla_force_host_platform_device_count=1",
    MD_COMPILATION_CACHE=str(cache),
  )
  return subprocess.run(
    [sys.executable, "apps/prepare_data", *args],
    cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
  )  # fmt: skip


@pytest.fixture(scope="module")
def images(tmp_path_factory):
  folder = tmp_path_factory.mktemp("images")
  pixels, captions = [], []
  for i in range(4):
    sample = mdd.shapes_sample(mdd.ShapesConfig(size=32), 7, i)
    Image.fromarray(np.round(sample.pixels * 255).astype(np.uint8)).save(folder / f"s{i}.png")
    (folder / f"s{i}.txt").write_text(sample.caption)
    pixels.append(np.round(sample.pixels * 255) / 255)
    captions.append(sample.caption)
  return folder, np.stack(pixels).astype(np.float32), captions


@pytest.fixture(scope="module")
def prepared(tmp_path_factory, images):
  folder = images[0]
  work = tmp_path_factory.mktemp("prepared")
  cache = tmp_path_factory.mktemp("jax_cache")
  args = [
    "--config=apps/configs/prepare_data.py:sd",
    f"--config.source={folder}",
    "--config.height=32",
    "--config.width=32",
    "--config.batch_size=2",
    "--config.records_per_shard=2",
    "--config.eval_count=1",
    f"--workdir={work}",
  ]
  done = _run(args, cache)
  assert done.returncode == 0, done.stderr[-3000:]
  return work, cache


def _records(path):
  """A shard's records, decoded without TensorFlow (tf.data reads the same files in md-data's tests)."""
  out = []
  for record in mdd.iter_tfrecord(path):
    features = mdd.decode_example(record)
    out.append({k: mdd.parse_tensor(features[k][0]) for k in mdd.LATENT_FEATURES})
    if mdd.TIMESTEPS_FEATURE in features:
      out[-1][mdd.TIMESTEPS_FEATURE] = features[mdd.TIMESTEPS_FEATURE]
  return out


def test_records_equal_mds_encoding(images, prepared):
  _, pixels, captions = images
  work = prepared[0]
  assert sorted(p.name for p in (work / "train").iterdir()) == [
    "train-00000-of-00002.tfrecord",
    "train-00001-of-00002.tfrecord",
  ]
  shards = sorted((work / "train").iterdir()) + sorted((work / "eval").iterdir())
  records = [r for shard in shards for r in _records(shard)]  # file order = example order
  pipe = md_sd.load_pipeline(MODEL)
  factor = float(pipe.vae.config.scaling_factor)
  graphdef, state = nnx.split(pipe.vae)  # jitted: one compile instead of many eager ops
  encode = jax.jit(lambda s, x: nnx.merge(graphdef, s).encode(x * 2 - 1).mean * factor)
  want = np.asarray(encode(state, jnp.asarray(pixels)))
  states = np.asarray(pipe.encode_prompt(captions)[0])
  assert len(records) == 4
  for i, r in enumerate(records):
    assert r["latents"].shape == want.shape[1:]
    np.testing.assert_allclose(r["latents"], want[i], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(r["encoder_hidden_states"], states[i], rtol=1e-5, atol=1e-5)
  assert "timesteps" not in records[0] and records[3]["timesteps"].tolist() == [0]
  settings = json.loads((work / "settings.json").read_text())
  assert settings["splits"]["train"] == dict(records=3, written=2, skipped=0)


def test_bad_settings_fail_in_one_line(tmp_path, prepared):
  empty = tmp_path / "empty"
  empty.mkdir()
  args = [
    "--config=apps/configs/prepare_data.py:sd",
    f"--config.source={empty}",
    f"--workdir={tmp_path}/w",
  ]
  done = _run(args, prepared[1])
  assert done.returncode == 2
  assert f"{empty} holds no images or videos" in done.stderr


def test_prepared_records_through_grain_resume_in_fit(prepared, tmp_path):
  """md_train.fit checkpoints a GrainIterator's position with its state; a run stopped at step 3 and
  resumed in a fresh iterator ends with the parameters of a straight run, bit for bit."""
  import grain

  import md_train as mdt

  shards = sorted((prepared[0] / "train").iterdir())
  records = [r for shard in shards for r in _records(shard)]  # a list is a random-access source

  def loss_fn(params, batch, key):
    del key
    return jnp.mean((batch["latents"] - params["w"]) ** 2), {}

  optimizer = mdt.make_optimizer(learning_rate=0.1)

  def recipe():
    params = {"w": jnp.zeros((1, *records[0]["latents"].shape), jnp.float32)}  # [1, h, w, c]
    batches = mdd.GrainIterator(records, batch_size=1, seed=3, shard=grain.sharding.NoSharding())
    return mdt.Recipe(
      state=mdt.init_state(params, optimizer),
      step=mdt.make_train_step(loss_fn, optimizer),
      batches=batches,
      fingerprint={"test": "prepare_data"},
    )

  # Seed 3 draws records 2, 1, 0 | 1, 0, 2: steps 4-5 of the straight run see other records than a
  # resumed run that restarted its data would, so the equality below needs the saved position.
  straight = mdt.fit(recipe(), steps=5, progress=False)
  work = tmp_path / "run"
  mdt.fit(recipe(), steps=3, workdir=work, checkpoint_every=3, progress=False)
  resumed = mdt.fit(recipe(), steps=5, workdir=work, checkpoint_every=3, progress=False)
  assert int(resumed.step) == 5
  np.testing.assert_array_equal(np.asarray(resumed.params["w"]), np.asarray(straight.params["w"]))
