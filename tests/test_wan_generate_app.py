"""The wan_generate app end to end on the bundled tiny pipeline: flags → config → MP4 + settings.json."""

import json
import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def run_app(*flags: str, variant: str = "tiny") -> subprocess.CompletedProcess:
  env = dict(
    os.environ,
    XLA_FLAGS="--xla_force_host_platform_device_count=8",
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
    "--config.steps=2",
    "--config.seed=5",
    "--config.fps=8",
    "--config.flow_shift=5.0",
  )
  assert out.returncode == 0, out.stderr[-3000:]
  assert f"wrote 1 video(s) and settings.json to {tmp_path}" in out.stdout
  info = media.video_info(tmp_path / "video_0000.mp4")
  assert info["num_frames"] == 9 and info["fps"] == 8.0
  assert (info["width"], info["height"]) == (32, 32)
  settings = json.loads((tmp_path / "settings.json").read_text())
  assert settings["prompt"] == "a cat surfing a wave"
  assert settings["seed"] == 5 and settings["steps"] == 2
  assert settings["scheduler"] == "UniPCMultistepScheduler"
  assert settings["scheduler_config"]["flow_shift"] == 5.0
  assert settings["model"] == "tests/fixtures/wan_pipeline/t2v"
  assert settings["videos"] == ["video_0000.mp4"] and settings["num_frames_generated"] == 9


def test_wan_generate_reports_bad_settings_clearly(tmp_path):
  out = run_app(f"--workdir={tmp_path}", "--config.height=40")
  assert out.returncode != 0 and "Traceback" not in out.stderr
  assert "height=40 → 32 or 48" in out.stderr
  out = run_app(f"--workdir={tmp_path}", "--config.flowshift=5")
  assert out.returncode != 0 and 'Did you mean "flow_shift"' in out.stderr
  out = run_app(f"--workdir={tmp_path}", variant="2.1-i2v-14b-480p")
  assert out.returncode != 0 and "--config.image=" in out.stderr and "Traceback" not in out.stderr
