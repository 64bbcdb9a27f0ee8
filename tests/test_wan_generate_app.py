"""The wan_generate app end to end on the bundled tiny pipeline: flags → config → MP4 + settings.json."""

import json
import os
import pathlib
import subprocess
import sys

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
      "apps/wan_generate",
      f"--config=apps/configs/wan.py:{variant}",
      "--config.compilation_cache=False",
      *flags,
    ],
    cwd=ROOT,
    env=env,
    capture_output=True,
    text=True,
    timeout=600,
  )


def test_wan_generate_writes_video_and_settings(tmp_path):
  from md_core import media

  out = run_app(
    f"--workdir={tmp_path}",
    "--config.prompt=a cat surfing a wave",
    "--config.num_inference_steps=2",
    "--config.seed=5",
    "--config.frame_rate=8",
    "--config.flow_shift=5.0",
  )
  assert out.returncode == 0, out.stderr[-3000:]
  assert f"wrote 1 video(s) and settings.json to {tmp_path}" in out.stdout
  info = media.video_info(tmp_path / "video_0000.mp4")
  assert info["num_frames"] == 9 and info["fps"] == 8.0
  assert (info["width"], info["height"]) == (32, 32)
  settings = json.loads((tmp_path / "settings.json").read_text())
  assert settings["prompt"] == "a cat surfing a wave"
  assert settings["seed"] == 5 and settings["num_inference_steps"] == 2
  assert settings["scheduler"] == "UniPCMultistepScheduler"
  assert settings["scheduler_config"]["flow_shift"] == 5.0
  assert settings["model"] == "tests/fixtures/wan_pipeline/t2v"
  assert settings["videos"] == ["video_0000.mp4"] and settings["num_frames_generated"] == 9


def test_wan_generate_reports_bad_settings_clearly(tmp_path):
  out = run_app(f"--workdir={tmp_path}", "--config.height=40")
  assert out.returncode != 0 and "Traceback" not in out.stderr
  assert "height=40 must be a positive multiple of 16 → 32 or 48" in out.stderr
  out = run_app(f"--workdir={tmp_path}", "--config.flowshift=5")
  assert out.returncode != 0 and "did you mean --config.flow_shift?" in out.stderr
  out = run_app(f"--workdir={tmp_path}", variant="2.1-i2v-14b-480p")
  assert out.returncode != 0 and "--config.image=" in out.stderr and "Traceback" not in out.stderr
  for variant in ("2.1-flf2v-14b-720p", "tiny-flf2v"):  # FLF2V needs both frames
    out = run_app(f"--workdir={tmp_path}", "--config.image=a.png", variant=variant)
    assert out.returncode != 0 and "--config.last_image=" in out.stderr
    assert "Traceback" not in out.stderr


@pytest.mark.slow
def test_wan_generate_first_last_frame(tmp_path):
  """Wan 2.1 FLF2V on the tiny flf2v/ pipeline: the first and the last frame come from image files."""
  from md_core import media, testing

  ref = testing.load_arrays(ROOT / "tests/fixtures/wan_pipeline/outputs.npz")
  first = media.save_image(tmp_path / "first.png", ref["flf2v/image"])
  last = media.save_image(tmp_path / "last.png", ref["flf2v/last_image"])
  out = run_app(
    f"--workdir={tmp_path / 'out'}",
    f"--config.image={first}",
    f"--config.last_image={last}",
    variant="tiny-flf2v",
  )
  assert out.returncode == 0, out.stderr[-3000:]
  info = media.video_info(tmp_path / "out" / "video_0000.mp4")
  assert info["num_frames"] == 9 and (info["width"], info["height"]) == (32, 32)
  settings = json.loads((tmp_path / "out" / "settings.json").read_text())
  assert settings["model"] == "tests/fixtures/wan_pipeline/flf2v"
  assert (settings["image"], settings["last_image"]) == (str(first), str(last))
