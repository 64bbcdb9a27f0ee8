"""The ltx_generate app end to end on the bundled tiny pipelines: flags → config → MP4 + settings.json."""

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
      "apps/ltx_generate",
      f"--config=apps/configs/ltx.py:{variant}",
      "--config.compilation_cache=False",
      *flags,
    ],
    cwd=ROOT,
    env=env,
    capture_output=True,
    text=True,
    timeout=900,
  )


def _picture(path: pathlib.Path, seed: int) -> pathlib.Path:
  from md_core import media

  rng = np.random.default_rng(seed)
  small = rng.uniform(0, 1, (4, 4, 3))
  media.save_image(path, np.kron(small, np.ones((8, 8, 1))))
  return path


def test_ltx_generate_writes_video_and_settings(tmp_path):
  from md_core import media

  out = run_app(
    f"--workdir={tmp_path}",
    "--config.prompt=a cat surfing a wave",
    "--config.num_inference_steps=2",
    "--config.seed=5",
    "--config.frame_rate=8",
    "--config.stg_scale=1.0",
    "--config.stg_blocks=1",
    "--config.cfg_star=True",
  )
  assert out.returncode == 0, out.stderr[-3000:]
  assert f"wrote 1 video(s) and settings.json to {tmp_path}" in out.stdout
  info = media.video_info(tmp_path / "video_0000.mp4")
  assert info["num_frames"] == 9 and info["fps"] == 8.0
  assert (info["width"], info["height"]) == (32, 32)
  settings = json.loads((tmp_path / "settings.json").read_text())
  assert settings["prompt"] == "a cat surfing a wave" and settings["mode"] == "t2v"
  assert settings["seed"] == 5 and settings["num_inference_steps"] == 2
  assert settings["stg_scale"] == 1.0 and settings["stg_blocks"] == "1" and settings["cfg_star"]
  assert settings["model"] == "tests/fixtures/ltx_pipeline/t2v"
  assert settings["videos"] == ["video_0000.mp4"] and settings["num_frames_generated"] == 9


@pytest.mark.slow
def test_ltx_generate_keyframes_and_multiscale(tmp_path):
  from md_core import media

  first, last = _picture(tmp_path / "first.png", 0), _picture(tmp_path / "last.png", 1)
  out = run_app(
    f"--workdir={tmp_path / 'kf'}", f"--config.image={first}", f"--config.keyframes={last}@8",
    variant="tiny-keyframes",
  )  # fmt: skip
  assert out.returncode == 0, out.stderr[-3000:]
  assert json.loads((tmp_path / "kf" / "settings.json").read_text())["mode"] == "condition"
  out = run_app(
    f"--workdir={tmp_path / 'ms'}", f"--config.image={first}", variant="tiny-multiscale"
  )
  assert out.returncode == 0, out.stderr[-3000:]
  info = media.video_info(tmp_path / "ms" / "video_0000.mp4")
  assert (info["width"], info["height"], info["num_frames"]) == (64, 64, 9)
  settings = json.loads((tmp_path / "ms" / "settings.json").read_text())
  assert settings["passes"] == [dict(height=40, width=40), dict(height=80, width=80)]


@pytest.mark.slow
def test_ltx_generate_reports_bad_sizes_clearly(tmp_path):
  out = run_app(f"--workdir={tmp_path}", "--config.height=36", "--config.num_frames=12")
  assert out.returncode != 0 and "Traceback" not in out.stderr
  assert "height=36 → 32 or 40" in out.stderr and "num_frames=12 → 9 or 13" in out.stderr


def test_ltx_generate_reports_bad_settings_clearly(tmp_path):
  """Errors found before any model is loaded."""
  out = run_app(f"--workdir={tmp_path}", variant="tiny-i2v")
  assert out.returncode != 0 and "--config.image=" in out.stderr and "Traceback" not in out.stderr
  bad = tmp_path / "notes.png"
  bad.write_text("not an image")
  out = run_app(f"--workdir={tmp_path}", f"--config.image={bad}", variant="tiny-i2v")
  assert out.returncode != 0 and "cannot read the conditioning image" in out.stderr
  assert "Traceback" not in out.stderr
  first = _picture(tmp_path / "first.png", 0)
  out = run_app(
    f"--workdir={tmp_path}", f"--config.image={first}", f"--config.keyframes={first}@9",
    variant="tiny-keyframes",
  )  # fmt: skip
  assert out.returncode != 0 and "at frame 9 is outside the video (frames 0 … 8)" in out.stderr
  out = run_app(f"--workdir={tmp_path}", variant="13b-0.9.8-distilled")
  assert out.returncode != 0 and "--config.transformer=" in out.stderr
