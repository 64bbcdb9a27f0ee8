"""apps/dreambooth_train end to end, each run a real subprocess: the default variant (sd15-lora-tiny, the
tiny SD pipeline) generates its class images, trains, exports a PEFT LoRA, and resumes in a second run;
a missing instance folder and a recipe that is not Dreambooth are refused in one line with exit code 2."""

import json
import subprocess
import sys

import pytest

import md_core
from md_core.testing import app_env, repo_root

ROOT = repo_root()


def _run(args, cache, timeout=600):
  return subprocess.run(
    [sys.executable, "apps/dreambooth_train", *args],
    cwd=ROOT, env=app_env(MD_COMPILATION_CACHE=str(cache)), capture_output=True, text=True,
    timeout=timeout,
  )  # fmt: skip


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
  return tmp_path_factory.mktemp("jax_cache")


def test_default_variant_generates_trains_exports_and_resumes(tmp_path, cache):
  work = tmp_path / "run"
  klass = work / "class_images"  # the variant's class_dir is empty: inside --workdir
  args = [f"--workdir={work}", "--config.steps=2"]
  done = _run(args, cache)
  assert done.returncode == 0, done.stderr[-3000:]
  out = done.stdout
  assert "dreambooth: 3 instance image(s) of 'a photo of sks disc'" in out
  assert f"dreambooth: 4 class image(s) of 'a photo of a disc' in {klass} (4 generated now)" in out
  assert "trained to step 2" in out
  assert len(list(klass.glob("*.png"))) == 4
  lora = work / "export" / "unet" / "pytorch_lora_weights.safetensors"
  keys = list(md_core.SafetensorsFile(lora))
  assert keys and all(k.startswith("unet.") and ".lora_" in k for k in keys)
  settings = json.loads((work / "settings.json").read_text())
  assert settings["final_step"] == 2 and settings["variant"] == "sd15-lora-tiny"
  assert settings["recipe"] == "md_train.recipes:dreambooth_sd"
  # Again with more steps: the class images are reused, training continues from step 2.
  again = _run([*args[:-1], "--config.steps=3"], cache)
  assert again.returncode == 0, again.stderr[-3000:]
  assert "(0 generated now)" in again.stdout and "trained to step 3" in again.stdout
  steps = [json.loads(line)["step"] for line in (work / "metrics.jsonl").read_text().splitlines()]
  assert [s for s in steps if s is not None][-1] == 3


def test_missing_instance_folder_is_one_line(tmp_path, cache):
  done = _run(
    [f"--workdir={tmp_path / 'run'}", f"--config.recipe_options.instance_dir={tmp_path / 'none'}"],
    cache,
  )
  assert done.returncode == 2, done.stderr[-2000:]
  assert f"instance_dir='{tmp_path / 'none'}'" in done.stderr
  assert "Traceback" not in done.stderr


def test_a_recipe_that_is_not_dreambooth_is_refused(tmp_path, cache):
  done = _run(["--config=apps/configs/train.py:sd15-tiny", f"--workdir={tmp_path / 'run'}"], cache)
  assert done.returncode == 2, done.stderr[-2000:]
  assert "is not a Dreambooth recipe" in done.stderr and "apps/train runs the others" in done.stderr
