"""apps/train end to end, each run a real subprocess: the tiny Wan 2.1 recipe killed with SIGKILL in the
middle of step 4 resumes in a fresh process from step 3's checkpoint and ends bit for bit where a straight
run ends (parameters, optimizer state, rng, data position, logged losses); TensorBoard holds `loss` once
per step; the export reads back with md's loader; bad settings fail with one clear line and exit code 2.
"""

import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
from tensorboard.backend.event_processing import event_accumulator

import md_train as mdt
import md_wan

ROOT = pathlib.Path(__file__).resolve().parents[1]
ARGS = [
  "--config=apps/configs/train.py:wan21-tiny",
  "--config.steps=6",
  "--config.checkpoint_every=3",
]


def _env(cache, devices=1, **extra):
  flags = f"--xla_force_host_platform_device_count={devices}"
  return dict(
    os.environ,
    JAX_PLATFORMS="cpu",
    HF_HUB_OFFLINE="1",
    MD_PROGRESS="0",
    XLA_FLAGS=flags,
    MD_COMPILATION_CACHE=str(cache),
    **extra,
  )


def _run(args, env, timeout=600):
  return subprocess.run(
    [sys.executable, "apps/train", *args],
    cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout,
  )  # fmt: skip


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
  """One persistent compilation cache for every run of this module (later runs load the programs)."""
  return tmp_path_factory.mktemp("jax_cache")


@pytest.fixture(scope="module")
def straight(tmp_path_factory, cache):
  work = tmp_path_factory.mktemp("straight")
  done = _run([*ARGS, f"--workdir={work}"], _env(cache))
  assert done.returncode == 0, done.stderr[-3000:]
  return work


@pytest.fixture(scope="module")
def resumed(tmp_path_factory, cache):
  """Killed (SIGKILL) while step 4 runs, after step 3's checkpoint is complete; resumed to 6."""
  work = tmp_path_factory.mktemp("killed")
  marker = work.parent / f"{work.name}.holding"
  log = work.parent / f"{work.name}.stderr"
  env = _env(cache, MD_TRAIN_HOLD_AT_STEP=f"4:{marker}")
  with log.open("w") as err:
    proc = subprocess.Popen(
      [sys.executable, "apps/train", *ARGS, f"--workdir={work}"],
      cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=err, text=True,
    )  # fmt: skip
    deadline = time.monotonic() + 600
    while not (marker.exists() and (work / "checkpoints" / "3").is_dir()):
      assert proc.poll() is None, log.read_text()[-3000:]
      assert time.monotonic() < deadline, "the run never reached step 4"
      time.sleep(0.1)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
  assert proc.returncode == -signal.SIGKILL
  assert mdt.Checkpointer(work / "checkpoints").steps() == [3]
  rows = mdt.read_metrics(work)
  assert [r["step"] for r in rows] == [1, 2, 3]  # step 4 never finished
  done = _run([*ARGS, f"--workdir={work}"], _env(cache))
  assert done.returncode == 0, done.stderr[-3000:]
  assert "at step 3" in done.stdout, done.stdout
  return work


def test_sigkill_in_step_4_then_resume_equals_the_straight_run(straight, resumed):
  want, want_meta = mdt.Checkpointer(straight / "checkpoints").read(6)
  got, got_meta = mdt.Checkpointer(resumed / "checkpoints").read(6)
  assert list(got) == list(want)
  assert any(k.startswith(".params") for k in got) and any(k.startswith(".opt_state") for k in got)
  for name in want:
    assert got[name].dtype == want[name].dtype, name
    np.testing.assert_array_equal(got[name], want[name], err_msg=name)
  assert got_meta["data"] == want_meta["data"] and got_meta["data"]["index"] == 12  # next batch
  assert got_meta["fingerprint"] == want_meta["fingerprint"]
  losses = [(r["step"], r["loss"]) for r in mdt.read_metrics(resumed)]
  assert losses == [(r["step"], r["loss"]) for r in mdt.read_metrics(straight)]
  assert [s for s, _ in losses] == [1, 2, 3, 4, 5, 6]


def test_tensorboard_and_metrics(straight, resumed):
  """`loss` at every logged step once (the killed run's steps after 3 purged), with the JSON lines'
  values; lr, grad_norm, step time, TFLOP/s and MFU logged too."""
  for work in (straight, resumed):
    acc = event_accumulator.EventAccumulator(str(work / "tb"))
    acc.Reload()
    rows = mdt.read_metrics(work)
    loss = acc.Scalars("loss")
    assert [e.step for e in loss] == [1, 2, 3, 4, 5, 6]
    np.testing.assert_allclose([e.value for e in loss], [r["loss"] for r in rows], rtol=1e-7)
    assert {"lr", "grad_norm", "step_time", "tflops_per_device", "mfu"} <= set(
      acc.Tags()["scalars"]
    )
    assert all(r["tflops_per_device"] > 0 for r in rows)
  settings = json.loads((straight / "settings.json").read_text())
  assert settings["final_step"] == 6 and settings["recipe"] == "md_train.recipes:wan21_tiny"


def test_export_reads_back_with_md_wan(straight):
  """export/transformer (diffusers layout) loads with md_wan.load_transformer into the parameters of
  the final checkpoint, bit for bit."""
  folder = straight / "export" / "transformer"
  assert (folder / "config.json").is_file()
  model = md_wan.load_transformer(folder, subfolder=None)
  _, params = mdt.split_trainable(model)
  arrays, _ = mdt.Checkpointer(straight / "checkpoints").read(6)
  trained = [v for k, v in arrays.items() if k.startswith(".params")]
  loaded = jax.tree.leaves(params)
  assert len(trained) == len(loaded)
  for a, b in zip(trained, loaded):
    np.testing.assert_array_equal(a, np.asarray(b))
  source = md_wan.load_transformer(ROOT / "tests/fixtures/wan_pipeline/t2v")
  original = jax.tree.leaves(mdt.split_trainable(source)[1])
  assert any(not np.array_equal(a, np.asarray(b)) for a, b in zip(trained, original))


def test_resume_with_other_settings_names_them(straight, cache):
  done = _run(
    [*ARGS, f"--workdir={straight}", "--config.recipe_options.learning_rate=0.002"], _env(cache)
  )
  assert done.returncode == 2, done.stderr[-2000:]
  assert "fingerprint differs in options.learning_rate" in done.stderr
  assert "saved 0.001, this run 0.002" in done.stderr and "Traceback" not in done.stderr


def test_unknown_recipe(tmp_path, cache):
  """One line and exit code 2 before anything is built (the other spellings: test_recipes.py)."""
  done = _run(
    [*ARGS, f"--workdir={tmp_path}", "--config.recipe=md_train.recipes:wan99_tiny"], _env(cache)
  )
  assert done.returncode == 2, done.stderr[-2000:]
  assert "md_train.recipes has no function 'wan99_tiny'" in done.stderr
  assert (
    "did you mean md_train.recipes:wan21_tiny?" in done.stderr and "Traceback" not in done.stderr
  )


EMPTY = """
import jax.numpy as jnp
import md_train as mdt

def build(config):
  opt = mdt.make_optimizer(learning_rate=1e-3)
  state = mdt.init_state({"w": jnp.zeros((2,))}, opt, rng=config.seed)
  loss = lambda p, b, k: (jnp.sum(p["w"] * b["x"]), {})
  return mdt.Recipe(state=state, step=mdt.make_train_step(loss, opt), batches=iter([]))
"""


def test_empty_data_source_from_another_recipe_module(tmp_path, cache):
  """A recipe from any importable module runs through the app; one whose data yields nothing fails with
  one line."""
  (tmp_path / "empty_recipe.py").write_text(EMPTY)
  env = _env(cache, PYTHONPATH=os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
  done = _run([*ARGS, f"--workdir={tmp_path / 'run'}", "--config.recipe=empty_recipe:build"], env)
  assert done.returncode == 2, done.stderr[-2000:]
  assert "the data source ran out before step 1" in done.stderr and "Traceback" not in done.stderr


def test_shapes_variants_start_from_the_shipped_default_models():
  """`sd15-shapes` / `wan21-shapes` run the default models' own stage recipes from models/ (the recipes
  themselves are trained a step in tests/test_default_image_model.py and tests/test_default_models.py)."""
  import importlib.util

  from md_train import recipes

  spec = importlib.util.spec_from_file_location("_train_cfg", ROOT / "apps/configs/train.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  for name, folder in (("sd15-shapes", "models/shapes-sd"), ("wan21-shapes", "models/shapes-wan")):
    recipe, options = module.VARIANTS[name]
    assert callable(recipes.import_recipe(recipe))
    assert options["base"] == folder and (ROOT / folder / "model_index.json").is_file()
    assert options["warmup_steps"] < module.get_config(name).steps


@pytest.mark.parametrize("app", ["train", "dreambooth_train"])
def test_unwritable_workdir_is_one_line_before_loading(tmp_path, cache, app):
  """A --workdir the run cannot write (/proc refuses new folders even to root; a read-only folder for
  other users): one line naming it, exit code 2, before any weights load, and nothing made."""
  bad = ["/proc/md-train-run/inside"]
  if os.geteuid() != 0:  # root writes through permission bits
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o555)
    bad.append(str(locked / "run"))
  config = ARGS[:1] if app == "train" else ["--config=apps/configs/dreambooth.py:sd15-lora-tiny"]
  for workdir in bad:
    done = subprocess.run(
      [sys.executable, f"apps/{app}", *config, f"--workdir={workdir}"],
      cwd=ROOT, env=_env(cache), capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"{app}: --workdir={workdir!r} cannot be written ("), lines
    assert "give a folder you may write" in lines[0] and "loading" not in done.stdout
    assert not pathlib.Path(workdir).exists()
