"""apps/train on the cached-latent records apps/prepare_data writes (`recipe_options.records`).

End to end as real subprocesses: prepare_data `tiny` (shapes-sd, 6 train + 2 eval records) then apps/train
`sd15-records` on that workdir for 2 steps: a checkpoint, finite losses, and the eval loss of the eval/
records at their fixed timesteps (0 and 999). In process, the Wan recipe on a few records written here
(channels first, as MaxDiffusion writes them): batches come back channels last and shuffled, 3 straight
steps equal 2 steps + a resume in a fresh records iterator bit for bit (and the next batch too), and the
eval loss at each record's timestep equals that record's batch-1 loss; records without settings.json
(MaxDiffusion's own) train once the model is named; bad workdirs and records that do not fit the model
fail naming the problem.
"""

import importlib.util
import json
import math
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

import md_data as mdd
import md_train as mdt
import md_train.families as mtf
import md_wan
from md_train import recipes

ROOT = pathlib.Path(__file__).resolve().parents[1]
SHAPES_SD = ROOT / "models" / "shapes-sd"
WAN = (
  ROOT / "tests" / "fixtures" / "wan_pipeline" / "t2v"
)  # in_channels 4, text_dim 16, patch 1x2x2


def _run(app, args, cache):
  env = dict(
    os.environ,
    JAX_PLATFORMS="cpu",
    HF_HUB_OFFLINE="1",
    MD_PROGRESS="0",
    # One device; the tests' fast-compile flags (md_core.pytest_plugin): compiling is most of these runs.
    XLA_FLAGS="--xla_force_host_platform_device_count=1 --xla_backend_optimization_level=0 "
    "--xla_llvm_disable_expensive_passes=true",
    MD_COMPILATION_CACHE=str(cache),
  )
  return subprocess.run(
    [sys.executable, f"apps/{app}", *args],
    cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
  )  # fmt: skip


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
  return tmp_path_factory.mktemp("jax_cache")


@pytest.fixture(scope="module")
def prepared(tmp_path_factory, cache):
  work = tmp_path_factory.mktemp("prepared")
  done = _run(
    "prepare_data", ["--config=apps/configs/prepare_data.py:tiny", f"--workdir={work}"], cache
  )
  assert done.returncode == 0, done.stderr[-3000:]
  return work


def _config(variant, **options):
  spec = importlib.util.spec_from_file_location("_train_config", ROOT / "apps/configs/train.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  _, opts = module.VARIANTS[variant]
  return ml_collections.ConfigDict(dict(seed=0, recipe_options=dict(opts, **options)))


def test_train_app_on_prepare_data_records(prepared, cache, tmp_path):
  work = tmp_path / "run"
  args = [
    "--config=apps/configs/train.py:sd15-records",
    f"--config.recipe_options.records={prepared}",
    "--config.steps=2",
    "--config.checkpoint_every=2",
    "--config.eval_every=2",
    "--config.peak_flops=1e12",  # not measured: MFU is not under test
    f"--workdir={work}",
  ]
  done = _run("train", args, cache)
  assert done.returncode == 0, done.stderr[-3000:]
  assert (work / "checkpoints" / "2").is_dir()
  rows = [json.loads(line) for line in (work / "metrics.jsonl").read_text().splitlines()]
  losses = [r["loss"] for r in rows if "loss" in r]
  assert len(losses) == 2 and all(math.isfinite(x) for x in losses)
  (ev,) = [r for r in rows if "eval/loss" in r]
  # prepare_data tiny: 2 eval records at timesteps spread over [0, 1000): 0 and 999.
  assert ev["step"] == 2 and set(ev) == {"step", "eval/loss", "eval/loss_t0", "eval/loss_t999"}
  assert math.isfinite(ev["eval/loss"])
  assert ev["eval/loss"] == pytest.approx((ev["eval/loss_t0"] + ev["eval/loss_t999"]) / 2)
  # Epsilon targets: at t=0 the noise is nearly invisible (loss ~1), at t=999 nearly all there.
  assert ev["eval/loss_t999"] < 0.1 < ev["eval/loss_t0"]
  settings = json.loads((work / "settings.json").read_text())
  assert settings["fingerprint"]["records"]["splits"]["train"]["records"] == 6
  assert (work / "export" / "unet" / "diffusion_pytorch_model.safetensors").is_file()


def _write_records(
  folder, *, latents, states, family="sd", model=SHAPES_SD, eval_timesteps=None, **settings
):
  """A prepare_data-like workdir: train/ records of `latents` / `states` (stored as given), optional
  eval/ records (one per timestep) and settings.json."""
  folder = pathlib.Path(folder)
  n = len(latents)
  mdd.write_tfrecord(
    folder / "train" / "train-00000-of-00001.tfrecord",
    [mdd.latent_example(latents[i], states[i]) for i in range(n)],
  )
  splits = {"train": {"records": n, "written": 1, "skipped": 0}}
  if eval_timesteps:
    mdd.write_tfrecord(
      folder / "eval" / "eval-00000-of-00001.tfrecord",
      [
        mdd.latent_example(latents[i], states[i], timesteps=t) for i, t in enumerate(eval_timesteps)
      ],
    )
    splits["eval"] = {"records": len(eval_timesteps), "written": 1, "skipped": 0}
  info = dict(family=family, model=str(model), num_train_timesteps=1000, splits=splits, **settings)
  (folder / "settings.json").write_text(json.dumps(info))
  return folder


def _copy(tree):
  return jax.tree.map(lambda x: x.copy(), tree)


@pytest.fixture(scope="module")
def wan(tmp_path_factory):
  """4 Wan records stored channels first (MaxDiffusion's layout) and 2 eval records at timesteps 100
  and 900, the tiny Wan recipe on them, and a copy of its starting state (the step donates it)."""
  rng = np.random.default_rng(0)
  latents = rng.normal(size=(4, 2, 4, 4, 4)).astype(np.float32)  # [n, f, h, w, c]
  states = rng.normal(size=(4, 8, 16)).astype(np.float32)  # [n, S, text_dim]
  work = _write_records(
    tmp_path_factory.mktemp("wan"), latents=np.moveaxis(latents, -1, 1), states=states,
    family="wan", model=WAN, eval_timesteps=[100, 900], channels_first=True,
  )  # fmt: skip
  recipe = recipes.wan21_tiny(_config("wan21-records", records=str(work)))
  data = recipes.prepared_data(work, family="wan")
  return data, latents, states, recipe, _copy(recipe.state)


def test_wan_records_channels_last_and_shuffled(wan):
  data, latents, _, _, _ = wan
  assert data.latents == (2, 4, 4, 4) and data.encoder_hidden_states == (8, 16) and data.eval
  batch = next(recipes.record_batches(data, batch_size=4, seed=0))
  got = np.asarray(batch["latents"])
  assert got.shape == (4, 2, 4, 4, 4)
  order = [int(np.argmin(np.abs(latents - x).sum(axis=(1, 2, 3, 4)))) for x in got]
  assert sorted(order) == [0, 1, 2, 3] and order != [0, 1, 2, 3]  # every record, shuffled
  np.testing.assert_array_equal(got, latents[order])


def test_resume_from_records_is_exact(wan, tmp_path):
  """3 steps straight vs 2 steps, then a resume in a fresh records iterator: the same parameters and
  optimizer state, bit for bit, and the same next batch (the 4th: the second pass over the 4 records,
  reshuffled)."""
  data, _, _, recipe, init = wan

  def fresh():
    batches = recipes.record_batches(data, batch_size=2, seed=0)
    return recipe._replace(state=_copy(init), batches=batches)

  run = fresh()
  straight = mdt.fit(run, steps=3, progress=False)
  after = next(run.batches)
  work = tmp_path / "run"
  mdt.fit(fresh(), steps=2, workdir=work, checkpoint_every=2, progress=False)
  second = fresh()
  resumed = mdt.fit(second, steps=3, workdir=work, progress=False)
  assert int(resumed.step) == 3
  for a, b in zip(_arrays(straight), _arrays(resumed), strict=True):
    np.testing.assert_array_equal(a, b)
  resumed_next = next(second.batches)
  for key in ("latents", "encoder_hidden_states"):
    np.testing.assert_array_equal(np.asarray(resumed_next[key]), np.asarray(after[key]))
  # The saved position matters: a fresh iterator's 4th batch is another one than its 1st.
  first = next(recipes.record_batches(data, batch_size=2, seed=0))
  assert not np.array_equal(np.asarray(first["latents"]), np.asarray(after["latents"]))


def _arrays(state):
  """Every array of a train state (PRNG keys as their key data)."""
  key = lambda x: jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)  # noqa: E731
  return [np.asarray(jax.random.key_data(x) if key(x) else x) for x in jax.tree.leaves(state)]


def test_wan_eval_per_record_timestep(wan):
  """2 steps, then the eval loss at each eval record's timestep (sigma = t / 1000) equals the loss of
  that record alone (a batch of 1, the evaluator's noise key); `eval/loss` is their mean."""
  _, latents, states, recipe, init = wan
  state = mdt.fit(recipe._replace(state=_copy(init)), steps=2, progress=False)
  metrics = recipe.eval(state)
  assert set(metrics) == {"eval/loss", "eval/loss_t100", "eval/loss_t900"}
  frozen, _ = mdt.split_trainable(md_wan.load_transformer(WAN))
  loss_fn = mtf.wan_loss(frozen, shift=5.0)
  for i, t in enumerate([100, 900]):
    single = {
      "latents": jnp.asarray(latents[i : i + 1]),
      "encoder_hidden_states": jnp.asarray(states[i : i + 1]),
      "sigmas": jnp.full((1,), t / 1000, jnp.float32),
    }
    want, _ = loss_fn(state.params, single, jax.random.fold_in(jax.random.key(0), i))
    np.testing.assert_allclose(metrics[f"eval/loss_t{t}"], float(want), rtol=1e-5)
  assert metrics["eval/loss"] == pytest.approx(
    (metrics["eval/loss_t100"] + metrics["eval/loss_t900"]) / 2
  )


def test_records_without_settings_json(wan, tmp_path):
  """MaxDiffusion's own cached-latent records: the files at the folder's top, latents channels first,
  no settings.json. With `model` named they train like prepare_data's (channels last, the same
  shapes); without it the error says how."""
  _, latents, states, _, _ = wan
  folder = tmp_path / "maxdiffusion"
  mdd.write_tfrecord(
    folder / "file_00-4.tfrec",
    [mdd.latent_example(np.moveaxis(latents[i], -1, 0), states[i]) for i in range(4)],
  )
  with pytest.raises(
    FileNotFoundError, match=r"has no settings.json.*recipe_options.model=<folder>"
  ):
    recipes.wan21_tiny(_config("wan21-records", records=str(folder)))
  recipe = recipes.wan21_tiny(_config("wan21-records", records=str(folder), model=str(WAN)))
  data = recipes.prepared_data(folder, family="wan", model=str(WAN))
  assert data.train_dir == folder and not data.eval and data.latents == (2, 4, 4, 4)
  assert data.settings["source"] == "records without settings.json"
  got = np.asarray(next(recipe.batches)["latents"])
  order = [int(np.argmin(np.abs(latents - x).sum(axis=(1, 2, 3, 4)))) for x in got]
  np.testing.assert_array_equal(got, latents[order])
  # Stored channels last, said so: the same batches.
  last = tmp_path / "channels_last"
  mdd.write_tfrecord(
    last / "train" / "part-0.tfrec", [mdd.latent_example(latents[i], states[i]) for i in range(4)]
  )
  data = recipes.prepared_data(last, family="wan", model=str(WAN), channels_first=False)
  assert data.train_dir == last / "train" and data.latents == (2, 4, 4, 4)
  got = next(recipes.record_batches(data, batch_size=2, seed=0))["latents"]
  np.testing.assert_array_equal(np.asarray(got), latents[order[:2]])


def test_missing_and_empty_workdirs(tmp_path):
  missing = tmp_path / "nowhere"
  with pytest.raises(FileNotFoundError, match=f"{missing} does not exist"):
    recipes.sd15_tiny(_config("sd15-records", records=str(missing)))
  empty = tmp_path / "empty"
  empty.mkdir()
  with pytest.raises(FileNotFoundError, match=f"{empty} has no settings.json"):
    recipes.sd15_tiny(_config("sd15-records", records=str(empty)))
  with pytest.raises(ValueError, match="records='' is empty"):
    recipes.sd15_tiny(_config("sd15-records"))
  no_records = tmp_path / "no_records"
  (no_records / "train").mkdir(parents=True)
  (no_records / "settings.json").write_text(json.dumps(dict(family="sd", model=str(SHAPES_SD))))
  with pytest.raises(ValueError, match=f"{no_records / 'train'} holds no record files"):
    recipes.sd15_tiny(_config("sd15-records", records=str(no_records)))


def test_sdxl_records_are_refused_naming_the_added_conditioning(tmp_path):
  """An SDXL UNet needs pooled text embeddings and time ids, which cached-latent records do not hold."""
  rng = np.random.default_rng(0)
  folder = tmp_path / "records"
  mdd.write_tfrecord(
    folder / "part-0.tfrec",
    [
      mdd.latent_example(rng.normal(size=(4, 4, 4)).astype(np.float32), rng.normal(size=(8, 32)))
      for _ in range(2)
    ],
  )
  sdxl = ROOT / "tests" / "fixtures" / "sd_pipeline" / "sdxl"
  with pytest.raises(ValueError, match=r"has an SDXL UNet .*the sdxl-tiny variant, no records"):
    recipes.sd15_tiny(_config("sd15-records", records=str(folder), model=str(sdxl)))


def test_records_that_do_not_fit_the_model(tmp_path):
  """shapes-sd's UNet takes 4 latent channels and 32-wide CLIP states; errors before any weights load."""
  rng = np.random.default_rng(0)
  states = rng.normal(size=(2, 16, 32)).astype(np.float32)
  three = _write_records(
    tmp_path / "three", latents=rng.normal(size=(2, 8, 8, 3)).astype(np.float32), states=states
  )
  message = (
    rf"{three}: feature 'latents' has shape \(8, 8, 3\) \(channels last\) per record; the UNet of "
    rf"{SHAPES_SD} takes \(h, w, 4\)"
  )
  with pytest.raises(ValueError, match=message):
    recipes.sd15_tiny(_config("sd15-records", records=str(three)))
  wide = _write_records(
    tmp_path / "wide",
    latents=rng.normal(size=(2, 8, 8, 4)).astype(np.float32),
    states=rng.normal(size=(2, 16, 48)).astype(np.float32),
  )
  message = r"feature 'encoder_hidden_states' has shape \(16, 48\) .* takes \(S, 32\)"
  with pytest.raises(ValueError, match=message):
    recipes.sd15_tiny(_config("sd15-records", records=str(wide)))
  # SD records given to the Wan recipe: named by settings.json's family.
  with pytest.raises(ValueError, match=r"prepared for family='sd' .* use the sd15-records variant"):
    recipes.wan21_tiny(_config("wan21-records", records=str(wide)))
  # Another model than the records' one, with another VAE (the tiny SD fixture's).
  fits = _write_records(
    tmp_path / "fits",
    latents=rng.normal(size=(2, 4, 4, 4)).astype(np.float32),
    states=rng.normal(size=(2, 16, 16)).astype(np.float32),
  )
  fixture = ROOT / "tests" / "fixtures" / "sd_pipeline" / "sd"
  with pytest.raises(ValueError, match=r"has another VAE .* differ in .*scaling_factor"):
    recipes.sd15_tiny(_config("sd15-records", records=str(fits), model=str(fixture)))
  few = _write_records(
    tmp_path / "few", latents=rng.normal(size=(2, 8, 8, 4)).astype(np.float32), states=states
  )
  with pytest.raises(ValueError, match=rf"{few}: train/ holds 2 records, fewer than batch_size=4"):
    recipes.sd15_tiny(_config("sd15-records", records=str(few), batch_size=4))
