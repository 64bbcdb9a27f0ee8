"""The sd_generate app end to end on the bundled tiny pipeline: flags → config → PNGs + settings.json."""

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
      "apps/sd_generate",
      f"--config=apps/configs/sd.py:{variant}",
      "--config.compilation_cache=False",
      *flags,
    ],
    cwd=ROOT,
    env=env,
    capture_output=True,
    text=True,
    timeout=600,
  )


def test_sd_generate_writes_images_and_settings(tmp_path):
  from md_core import media

  out = run_app(
    f"--workdir={tmp_path}",
    "--config.prompt=a photo of a cat",
    "--config.num_images_per_prompt=2",
    "--config.num_inference_steps=2",
    "--config.seed=5",
    "--config.scheduler=EulerDiscreteScheduler",
  )
  assert out.returncode == 0, out.stderr[-3000:]
  assert f"wrote 2 image(s) and settings.json to {tmp_path}" in out.stdout
  images = [media.load_image(tmp_path / f"image_{i:04d}.png") for i in range(2)]
  assert all(im.shape == (32, 32, 3) for im in images)
  assert np.abs(images[0] - images[1]).max() > 0.01  # two different noises
  settings = json.loads((tmp_path / "settings.json").read_text())
  assert settings["prompt"] == "a photo of a cat"
  assert settings["seed"] == 5 and settings["num_inference_steps"] == 2
  assert settings["scheduler"] == "EulerDiscreteScheduler"
  assert settings["model"] == "tests/fixtures/sd_pipeline/sd"
  assert settings["images"] == ["image_0000.png", "image_0001.png"]


@pytest.mark.slow
def test_sd_generate_tiny_controlnet(tmp_path):
  out = run_app(
    f"--workdir={tmp_path}", "--config.num_inference_steps=2", variant="tiny-controlnet"
  )
  assert out.returncode == 0, out.stderr[-3000:]
  assert (tmp_path / "image_0000.png").is_file()


def test_sd_generate_reports_bad_settings_clearly(tmp_path):
  out = run_app(f"--workdir={tmp_path}", "--config.height=30")
  assert out.returncode != 0
  assert "height=30 → 24 or 32" in out.stderr and "Traceback" not in out.stderr
  out = run_app(f"--workdir={tmp_path}", "--config.sheduler=DDIMScheduler")
  assert out.returncode != 0 and "did you mean --config.scheduler?" in out.stderr
  out = run_app(f"--workdir={tmp_path}", variant="sd1.5")
  assert out.returncode != 0 and "Traceback" not in out.stderr
  assert (
    "stable-diffusion-v1-5/stable-diffusion-v1-5" in out.stderr and "HF_HUB_OFFLINE=1" in out.stderr
  )


@pytest.mark.slow
@pytest.mark.parametrize(
  "variant",
  ["tiny-img2img", "tiny-controlnet-img2img", "tiny-multi-controlnet", "tiny-refiner"],
)
def test_sd_generate_tiny_feature_variants(tmp_path, variant):
  out = run_app(f"--workdir={tmp_path}", variant=variant)
  assert out.returncode == 0, out.stderr[-3000:]
  settings = json.loads((tmp_path / "settings.json").read_text())
  assert settings["variant"] == variant and settings["images"] == ["image_0000.png"]


@pytest.mark.slow
def test_sd_generate_base_then_refiner(tmp_path):
  from md_core import media

  out = run_app(
    f"--workdir={tmp_path}", "--config.num_images_per_prompt=2", variant="tiny-sdxl-refiner"
  )
  assert out.returncode == 0, out.stderr[-3000:]
  settings = json.loads((tmp_path / "settings.json").read_text())
  assert settings["refiner"] == "tests/fixtures/sd_features/refiner"
  assert settings["refiner_start"] == 0.6
  images = [media.load_image(tmp_path / f"image_{i:04d}.png") for i in range(2)]
  assert all(im.shape == (32, 32, 3) for im in images)


def test_sd_generate_reports_bad_feature_settings(tmp_path):
  out = run_app(
    f"--workdir={tmp_path}",
    "--config.control_image=tests/fixtures/sd_pipeline/control.png",
    variant="tiny-multi-controlnet",
  )
  assert out.returncode != 0 and "Traceback" not in out.stderr
  assert "2 ControlNet(s) need as many control images (comma-separated), got 1" in out.stderr
  out = run_app(
    f"--workdir={tmp_path}",
    "--config.image=tests/fixtures/sd_pipeline/control.png",
    variant="tiny-sdxl-refiner",
  )
  assert out.returncode != 0 and "ensemble is text-to-image" in out.stderr
