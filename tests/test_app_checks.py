"""The apps as a user meets them: every usage error is one line naming the setting, before any weights
load; outputs never destroy earlier work; --help lists the variants and keys; tiny variants work from any
directory; a clean run prints no warning or INFO line."""

import json
import pathlib
import subprocess
import sys
import time

import pytest

from md_core import testing

ROOT = pathlib.Path(__file__).resolve().parents[1]
ENV = testing.app_env(TF_CPP_MIN_LOG_LEVEL="")


def run(app: str, config: str, *flags: str, cwd=ROOT, timeout=600) -> subprocess.CompletedProcess:
  start = time.perf_counter()
  out = subprocess.run(
    [sys.executable, str(ROOT / "apps" / app), f"--config={config}", *flags],
    cwd=cwd, env=ENV, capture_output=True, text=True, timeout=timeout,
  )  # fmt: skip
  out.seconds = time.perf_counter() - start
  return out


def one_line_error(out, *needles: str) -> list[str]:
  """Exit code 2, no traceback or help block, every line of stderr a problem naming the app."""
  lines = out.stderr.strip().splitlines()
  assert out.returncode == 2, out.stderr[-2000:]
  assert "Traceback" not in out.stderr and "Flags:" not in out.stderr and "USAGE" not in out.stderr
  assert all(line.split(":")[0].endswith("_generate") for line in lines), lines
  for needle in needles:
    assert any(needle in line for line in lines), (needle, lines)
  return lines


WAN = "apps/configs/wan.py:tiny"


# Each run holds several problems: the app reports every one of them (one line each), so one start-up
# checks many messages. Settings checked when the flags are parsed (unknown or fixed keys) stop there,
# before the values are checked, so they are a run of their own.
@pytest.mark.parametrize(
  "flags",
  [
    {  # flag: the message it gets
      "--config.num_inference_steps=0": "--config.num_inference_steps=0 must be positive",
      "--config.height=40": "--config.height=40 must be a positive multiple of 16 → 32 or 48",
      "--config.num_frames=8": "--config.num_frames=8 must be 4k + 1 → 5 or 9",
      "--config.dtype=fp16x": "--config.dtype='fp16x' is not a parameter dtype; choose one of float32",
      "--config.attention=foo": "--config.attention='foo' is not one of auto, dot_product",
      "--config.image=tests/fixtures/none.png": "'tests/fixtures/none.png' does not exist",
      "--config.mesh.ici_tensor_parallelism=3": "--config.mesh:",
    },
    {  # flag: the message it gets
      "--config.promt=x": "--config.promt is not a setting of apps/configs/wan.py:tiny; did you mean --config.prompt?",
      "--config.steps=3": "did you mean --config.num_inference_steps?",
      "--config.fps=8": "did you mean --config.frame_rate?",
      "--config.variant=2.1-t2v-14b": "--config.variant is set by the variant, not a setting",
    },
    {"--config.num_inference_steps=2000": "num_train_timesteps=1000"},
    {"--config.image=README.md": "cannot be read as an image"},
  ],
  ids=["values", "keys", "steps", "image"],
)  # fmt: skip
def test_wan_usage_errors_are_one_line_before_loading(tmp_path, flags):
  out = run("wan_generate", WAN, f"--workdir={tmp_path / 'out'}", *flags)
  lines = one_line_error(out, *flags.values())
  assert len(lines) == len(flags), lines  # every problem, once
  assert not (tmp_path / "out").exists()  # nothing left behind


def test_ltx_video_size_is_checked_before_loading(tmp_path):
  """The LTX-Video multiple and frame step come from the checkpoint's configs (the tiny VAE: 8, 4)."""
  out = run(
    "ltx_generate", "apps/configs/ltx.py:tiny", f"--workdir={tmp_path / 'out'}",
    "--config.height=36", "--config.num_frames=8",
  )  # fmt: skip
  one_line_error(out, "height=36 → 32 or 40", "num_frames=8 → 5 or 9")


def test_several_problems_are_reported_together(tmp_path):
  out = run(
    "sd_generate", "apps/configs/sd.py:tiny", f"--workdir={tmp_path}", "--config.height=30",
    "--config.num_inference_steps=-1", "--config.image=missing.png", "--config.dtype=f16",
  )  # fmt: skip
  lines = one_line_error(
    out, "height=30 → 24 or 32", "num_inference_steps=-1", "missing.png", "dtype"
  )
  assert len(lines) == 4


@pytest.mark.parametrize("app, config", [
  ("sd_generate", "apps/configs/sd.py:tiny"),
  ("flux_generate", "apps/configs/flux.py:tiny"),
  ("ltx_generate", "apps/configs/ltx.py:tiny"),
  ("ltx2_generate", "apps/configs/ltx2.py:tiny"),
])  # fmt: skip
def test_bad_workdir_fails_first(tmp_path, app, config):
  a_file = tmp_path / "notes.txt"
  a_file.write_text("keep me")
  out = run(app, config, f"--workdir={a_file}")
  one_line_error(out, f"--workdir='{a_file}' is a file; give a folder")
  assert a_file.read_text() == "keep me"
  if app != "sd_generate":
    return  # the apps share md_core.apps.output_folder: the other two cases once, on one app
  out = run(app, config, f"--workdir={a_file}/inside")
  one_line_error(out, "which is a file")
  out = run(app, config, "--workdir=/proc/md-out")
  one_line_error(out, "--workdir='/proc/md-out' cannot be created")
  assert a_file.read_text() == "keep me"


def test_second_run_loses_nothing_and_settings_describe_the_folder(tmp_path):
  work = tmp_path / "out"
  first = run("wan_generate", WAN, f"--workdir={work}", "--config.num_videos_per_prompt=2")
  assert first.returncode == 0, first.stderr[-2000:]
  before = {p.name: p.read_bytes() for p in work.iterdir()}
  videos = ["video_0000.mp4", "video_0000_frames.png", "video_0001.mp4", "video_0001_frames.png"]
  assert sorted(before) == ["settings.json", *videos]
  again = run("wan_generate", WAN, f"--workdir={work}")
  one_line_error(
    again,
    "is not empty (holds settings.json, video_0000.mp4, video_0000_frames.png, video_0001.mp4 "
    "and 1 more)",
    "--overwrite",
  )
  assert {p.name: p.read_bytes() for p in work.iterdir()} == before
  # --overwrite with fewer outputs: the earlier run's extra video goes, settings.json lists what is there.
  third = run("wan_generate", WAN, f"--workdir={work}", "--overwrite", "--config.seed=4")
  assert third.returncode == 0, third.stderr[-2000:]
  names = sorted(p.name for p in work.iterdir())
  assert names == ["settings.json", "video_0000.mp4", "video_0000_frames.png"]
  settings = json.loads((work / "settings.json").read_text())
  assert settings["files"] == ["video_0000.mp4", "video_0000_frames.png"] and settings["seed"] == 4
  # A clean run prints nothing but its summary: no warning, no INFO line, no PyTorch-not-found advice.
  assert third.stderr.strip() == "", third.stderr
  lines = third.stdout.strip().splitlines()
  assert (
    len(lines) == 3
    and lines[0].startswith("mesh: ")
    and lines[1].startswith("wrote 1 video(s)")
    and lines[2] == "contact sheet(s) of the frames: video_0000_frames.png"
  )


def test_help_lists_variants_and_keys():
  out = subprocess.run(
    [sys.executable, "apps/wan_generate", "--help", f"--config={WAN}"],
    cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=120,
  )  # fmt: skip
  assert out.returncode == 0, out.stderr
  assert "Variants of apps/configs/wan.py: 2.1-t2v-1.3b" in out.stdout and "tiny-ti2v" in out.stdout
  assert "  num_inference_steps = 3" in out.stdout and "  guidance_scale_2 = None" in out.stdout
  assert "--workdir" in out.stdout and "--overwrite" in out.stdout


def test_tiny_variant_runs_from_another_directory(tmp_path):
  out = run(
    "sd_generate", str(ROOT / "apps/configs/sd.py") + ":tiny", f"--workdir={tmp_path / 'out'}",
    "--config.num_inference_steps=1", cwd=tmp_path,
  )  # fmt: skip
  assert out.returncode == 0, out.stderr[-2000:]
  assert (tmp_path / "out" / "image_0000.png").is_file()
  # A relative path that is missing names the working directory it was read from.
  out = run(
    "sd_generate", str(ROOT / "apps/configs/sd.py") + ":tiny", f"--workdir={tmp_path / 'o2'}",
    "--config.model=models/nowhere/sd", cwd=tmp_path,
  )  # fmt: skip
  one_line_error(out, f"relative to the working directory {tmp_path}")


def test_leading_steps_past_the_table_are_refused_before_loading(tmp_path):
  """The tiny SD scheduler is DDIM with `leading` spacing and steps_offset=1: 1000 steps would start at
  timestep 1000, so the checks name the key and the valid range (1 to 999) before any weight loads."""
  out = run(
    "sd_generate", "apps/configs/sd.py:tiny", f"--workdir={tmp_path / 'out'}",
    "--config.num_inference_steps=1000",
  )  # fmt: skip
  lines = one_line_error(out, "--config.num_inference_steps=1000", "DDIMScheduler", "use 1 to 999")
  assert len(lines) == 1 and "loading" not in out.stdout + out.stderr, out.stderr
  assert not (tmp_path / "out").exists()


def _broken_sd(tmp_path, how: str) -> tuple[pathlib.Path, pathlib.Path]:
  """A copy of the tiny SD pipeline with one file broken `how`; returns (folder, the broken file)."""
  import shutil

  model = tmp_path / "sd"
  shutil.copytree(testing.fixture_path("sd_pipeline") / "sd", model)
  if how == "truncated weights":
    path = model / "unet" / "diffusion_pytorch_model.safetensors"
    path.write_bytes(path.read_bytes()[:3000])
  elif how == "config not JSON":
    path = model / "vae" / "config.json"
    path.write_text('{"in_channels":')
  elif how == "string in_channels":
    path = model / "unet" / "config.json"
    config = json.loads(path.read_text())
    path.write_text(json.dumps(dict(config, in_channels="4")))
  else:  # missing config
    path = model / "vae" / "config.json"
    path.unlink()
  return model, path


def _file_error(out, *needles: str) -> str:
  """Non-zero exit, no traceback, the last line of stderr one problem naming the file."""
  assert out.returncode != 0 and "Traceback" not in out.stderr, out.stderr[-3000:]
  last = out.stderr.strip().splitlines()[-1]
  assert last.startswith("sd_generate: "), last
  for needle in needles:
    assert needle in last, (needle, last)
  return last


@pytest.mark.parametrize(
  "how, needles",
  [
    ("truncated weights", ["truncated"]),
    ("config not JSON", ["not valid JSON"]),
    ("missing config", ["no config.json"]),
    ("string in_channels", ["in_channels must be an int, got '4'"]),
  ],
)  # fmt: skip
def test_broken_model_files_end_in_one_line_naming_them(tmp_path, how, needles):
  model, path = _broken_sd(tmp_path, how)
  out = run("sd_generate", "apps/configs/sd.py:tiny", f"--workdir={tmp_path / 'out'}",
            f"--config.model={model}")  # fmt: skip
  _file_error(out, str(path.parent if how == "missing config" else path), *needles)
  assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def test_bad_lora_files_end_in_one_line_naming_them(tmp_path):
  """A truncated LoRA file and one whose keys are no LoRA layout: exit code 2, one line naming the file
  (a missing one is refused by the checks before loading)."""
  import numpy as np
  from safetensors.numpy import save_file

  truncated = tmp_path / "truncated.safetensors"
  truncated.write_bytes(b"garbage!")
  wrong = tmp_path / "wrong.safetensors"
  save_file({"foo.bar.weight": np.zeros((2, 2), np.float32)}, str(wrong))
  for path, needle in ((truncated, "not a safetensors file"), (wrong, "unknown LoRA format")):
    out = run("sd_generate", "apps/configs/sd.py:tiny", f"--workdir={tmp_path / 'out'}",
              f"--config.loras={path}")  # fmt: skip
    assert out.returncode == 2
    _file_error(out, f"loras entry {str(path)!r}", needle)
  out = run("sd_generate", "apps/configs/sd.py:tiny", f"--workdir={tmp_path / 'out'}",
            f"--config.loras={tmp_path / 'none.safetensors'}")  # fmt: skip
  one_line_error(out, "none.safetensors': no such file")


def test_flag_values_of_the_wrong_type_name_key_value_and_type(tmp_path):
  out = run("sd_generate", "apps/configs/sd.py:tiny", f"--workdir={tmp_path / 'out'}",
            "--config.guidance_scale=abc")  # fmt: skip
  assert one_line_error(out) == ["sd_generate: flag --config.guidance_scale=abc: must be a number"]
  out = run("sd_generate", "apps/configs/sd.py:tiny", f"--workdir={tmp_path / 'out'}",
            "--config.height=4x")  # fmt: skip
  assert one_line_error(out) == ["sd_generate: flag --config.height=4x: must be an int"]
