"""The ltx2_generate app end to end on the bundled tiny LTX-2 pipeline: flags → config → MP4 with sound +
settings.json."""

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
      "apps/ltx2_generate",
      f"--config=apps/configs/ltx2.py:{variant}",
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


def _ltx2_outputs(folder: pathlib.Path) -> tuple[dict, dict]:
  from md_core import media

  return media.video_info(folder / "video_0000.mp4"), json.loads(
    (folder / "settings.json").read_text()
  )


def test_ltx2_generate_writes_video_with_audio_and_settings(tmp_path):
  """tiny-ltx2 (text-to-video with sound): one MP4 with an H.264 video stream of the decoded frames and an
  AAC stream of the generated waveform, and settings.json with the sample rate and the audio duration."""

  out = run_app(
    f"--workdir={tmp_path}", "--config.prompt=a cat playing a piano", "--config.num_inference_steps=2",
    "--config.seed=3", variant="tiny",
  )  # fmt: skip
  assert out.returncode == 0, out.stderr[-3000:]
  assert f"wrote 1 video(s) with audio and settings.json to {tmp_path}" in out.stdout
  info, settings = _ltx2_outputs(tmp_path)
  # The tiny VAE's decoder gives fewer / smaller frames than its encoder takes, as the reference's
  # frames recorded in the fixture (diffusers' LTX2Pipeline on the same folder).
  want = testing.load_arrays(testing.fixture_path("ltx2_pipeline") / "io.npz")["t2v_frames"].shape
  assert (info["num_frames"], info["height"], info["width"]) == want[1:4]
  # ... and the app says so in one line, and its own default prompts fit the tiny tokenizer (no warning).
  assert (
    f"note: the video has {want[1]} frames of {want[2]} x {want[3]}; asked 9 of 32 x 64"
    in out.stderr
  )
  assert "UserWarning" not in out.stderr
  assert info["fps"] == 24.0 and info["has_audio"] and info["audio_sample_rate"] == 24000
  assert settings["variant"] == "tiny" and settings["mode"] == "t2v"
  assert settings["prompt"] == "a cat playing a piano" and settings["seed"] == 3
  assert settings["num_frames_generated"] == want[1]
  assert settings["frame_size"] == dict(height=want[2], width=want[3])
  assert settings["sample_rate"] == 24000 and settings["audio_channels"] == 2
  assert settings["videos"] == ["video_0000.mp4"]
  # The waveform in the file is the generated one (AAC keeps its length), and its length follows the
  # requested 9 frames at 24 fps to within one or two audio latent frames (40 ms each).
  assert abs(info["audio_duration"] - settings["audio_seconds"]) < 0.01
  assert abs(settings["audio_seconds"] - 9 / 24) < 0.1


@pytest.mark.slow
def test_ltx2_generate_image_to_video(tmp_path):

  first = _picture(tmp_path / "first.png", 0)
  out = run_app(
    f"--workdir={tmp_path / 'i2v'}", f"--config.image={first}", "--config.num_inference_steps=2",
    variant="tiny-i2v",
  )  # fmt: skip
  assert out.returncode == 0, out.stderr[-3000:]
  info, settings = _ltx2_outputs(tmp_path / "i2v")
  want = testing.load_arrays(testing.fixture_path("ltx2_pipeline") / "io.npz")["i2v_frames"].shape
  assert (info["num_frames"], info["height"], info["width"]) == want[1:4] and info["has_audio"]
  assert (
    settings["mode"] == "i2v" and settings["image"] == str(first) and settings["image_crf"] == 33
  )
  assert abs(info["audio_duration"] - settings["audio_seconds"]) < 0.01


def test_ltx2_generate_reports_bad_settings_clearly(tmp_path):
  """Errors found before any model is loaded: image-to-video without an image, sizes the tiny VAE cannot
  take (with the nearest valid ones), a distilled run without its transformer file."""
  out = run_app(f"--workdir={tmp_path}", variant="tiny-i2v")
  assert out.returncode != 0 and "Traceback" not in out.stderr
  assert "is image-to-video: set --config.image=" in out.stderr
  out = run_app(
    f"--workdir={tmp_path}", "--config.height=40", "--config.width=64", "--config.num_frames=12",
    variant="tiny",
  )  # fmt: skip
  assert out.returncode != 0 and "Traceback" not in out.stderr
  assert "height=40 → 32 or 64" in out.stderr and "num_frames=12 → 9 or 17" in out.stderr
  assert "width=64 →" not in out.stderr
  out = run_app(f"--workdir={tmp_path}", "--config.timesteps=1000,900", variant="tiny")
  assert out.returncode != 0 and "--config.timesteps is not a setting" in out.stderr
  out = run_app(f"--workdir={tmp_path}", "--config.sigmas=1.0,x", variant="tiny")
  assert out.returncode != 0 and "--config.sigmas='1.0,x' must be 'distilled'" in out.stderr
  out = run_app(f"--workdir={tmp_path}", variant="ltx2-distilled")
  assert out.returncode != 0 and "--config.transformer=" in out.stderr
  assert "ltx-2-19b-distilled.safetensors" in out.stderr
  assert not list(tmp_path.iterdir())
