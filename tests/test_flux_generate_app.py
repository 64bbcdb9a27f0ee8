"""The flux_generate app end to end on the bundled tiny pipeline: flags → config → PNGs + settings.json."""

import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from md_core import testing

ROOT = pathlib.Path(__file__).resolve().parents[1]


def run_app(*flags: str, variant: str = "tiny") -> subprocess.CompletedProcess:
  env = dict(
    os.environ,
    XLA_FLAGS="--xla_force_host_platform_device_count=8 " + testing.FAST_COMPILE_XLA_FLAGS,
    JAX_PLATFORMS="cpu",
    HF_HUB_OFFLINE="1",
    MD_PROGRESS="0",
  )
  return subprocess.run(
    [
      sys.executable,
      "apps/flux_generate",
      f"--config=apps/configs/flux.py:{variant}",
      "--config.compilation_cache=False",
      *flags,
    ],
    cwd=ROOT,
    env=env,
    capture_output=True,
    text=True,
    timeout=600,
  )


def test_flux_generate_writes_images_and_settings(tmp_path):
  from md_core import media

  out = run_app(
    f"--workdir={tmp_path}",
    "--config.prompt=a photo of a cat",
    "--config.num_images_per_prompt=2",
    "--config.num_inference_steps=2",
    "--config.seed=5",
  )
  assert out.returncode == 0, out.stderr[-3000:]
  assert f"wrote 2 image(s) and settings.json to {tmp_path}" in out.stdout
  images = [media.load_image(tmp_path / f"image_{i:04d}.png") for i in range(2)]
  assert all(im.shape == (32, 48, 3) for im in images)
  assert np.abs(images[0] - images[1]).max() > 0.01  # two different noises
  settings = json.loads((tmp_path / "settings.json").read_text())
  assert settings["prompt"] == "a photo of a cat"
  assert settings["seed"] == 5 and settings["num_inference_steps"] == 2
  assert settings["model"] == "tests/fixtures/flux_pipeline/dev"
  assert settings["scheduler_config"]["use_dynamic_shifting"] is True
  assert settings["images_written"] == ["image_0000.png", "image_0001.png"]


def test_flux_generate_reports_bad_settings_clearly(tmp_path):
  out = run_app(f"--workdir={tmp_path}", "--config.height=40")
  assert out.returncode != 0
  assert "height=40 → 32 or 48" in out.stderr and "Traceback" not in out.stderr
  out = run_app(f"--workdir={tmp_path}", "--config.gudance_scale=2")
  assert out.returncode != 0 and "did you mean --config.guidance_scale?" in out.stderr
  out = run_app(f"--workdir={tmp_path}", variant="flux1-schnell")
  assert out.returncode != 0 and "Traceback" not in out.stderr
  assert "black-forest-labs/FLUX.1-schnell" in out.stderr and "HF_HUB_OFFLINE=1" in out.stderr


KLEIN = "tests/fixtures/flux2_pipeline"


def _klein_outputs(tmp_path, out, count, shape):
  from md_core import media

  assert out.returncode == 0, out.stderr[-3000:]
  assert f"wrote {count} image(s) and settings.json to {tmp_path}" in out.stdout
  images = [media.load_image(tmp_path / f"image_{i:04d}.png") for i in range(count)]
  assert all(im.shape == (*shape, 3) for im in images)
  assert all(0.05 < float(im.std()) for im in images)  # decoded pictures, not a flat fill
  return json.loads((tmp_path / "settings.json").read_text())


def test_flux_generate_klein_edit_from_reference_pngs(tmp_path):
  """Two reference PNGs; the output size comes from the first one (100x72 cropped to 96x64)."""
  out = run_app(
    f"--workdir={tmp_path}",
    "--config.prompt=a cat",
    "--config.num_images_per_prompt=2",
    variant="tiny-klein-edit",
  )
  settings = _klein_outputs(tmp_path, out, 2, (64, 96))
  assert settings["model"] == f"{KLEIN}/klein" and settings["edit"] is True
  assert settings["images"] == f"{KLEIN}/ref_0.png,{KLEIN}/ref_1.png"
  assert settings["image_size"] == [64, 96] and settings["kv_cache_used"] is False


@pytest.mark.slow
def test_flux_generate_klein_text_to_image(tmp_path):
  out = run_app(f"--workdir={tmp_path}", "--config.prompt=a cat", variant="tiny-klein")
  settings = _klein_outputs(tmp_path, out, 1, (32, 48))
  assert settings["edit"] is False and settings["kv_cache_used"] is False


@pytest.mark.slow
def test_flux_generate_klein_kv_edit(tmp_path):
  out = run_app(
    f"--workdir={tmp_path}",
    "--config.prompt=a cat",
    "--config.seed=2",
    variant="tiny-klein-kv-edit",
  )
  settings = _klein_outputs(tmp_path, out, 1, (64, 96))
  assert settings["kv_cache_used"] is True


def test_flux_generate_klein_reports_bad_references(tmp_path):
  """A file that is not an image fails before the model loads, naming it (more than 4 references:
  md-flux's own tests)."""
  broken = tmp_path / "broken.png"
  broken.write_text("not an image")
  out = run_app(
    f"--workdir={tmp_path}",
    f"--config.images={KLEIN}/ref_0.png,{broken}",
    variant="tiny-klein-edit",
  )
  assert out.returncode != 0 and "Traceback" not in out.stderr
  assert (
    "--config.images: image" in out.stderr
    and "broken.png' cannot be read as an image" in out.stderr
  )
