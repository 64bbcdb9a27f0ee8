"""`--config.cache` / `--config.cache_options.*` in the generate apps: bad settings are one-line errors
before any weights load; a tiny Flux run with a cache records it in settings.json and prints the steps
computed vs reused."""

import json
import pathlib
import subprocess
import sys
import time

import pytest

from md_core import testing

ROOT = pathlib.Path(__file__).resolve().parents[1]
ENV = testing.app_env(TF_CPP_MIN_LOG_LEVEL="")


def run(app: str, config: str, *flags: str) -> subprocess.CompletedProcess:
  start = time.perf_counter()
  out = subprocess.run(
    [sys.executable, str(ROOT / "apps" / app), f"--config={config}", *flags],
    cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600,
  )  # fmt: skip
  out.seconds = time.perf_counter() - start
  return out


def one_line_error(out, needle: str) -> None:
  """Exit code 2, no traceback, every stderr line a problem naming the app, before loading."""
  lines = out.stderr.strip().splitlines()
  assert out.returncode == 2, out.stderr[-2000:]
  assert "Traceback" not in out.stderr
  assert all(line.split(":")[0].endswith("_generate") for line in lines), lines
  assert any(needle in line for line in lines), (needle, lines)


FLUX, SD = "apps/configs/flux.py:tiny", "apps/configs/sd.py:tiny"


@pytest.mark.parametrize(
  "app, config, flags, needle",
  [
    # Each case is an app start-up (~10 s); the slow ones are more messages of the same checks.
    pytest.param("flux_generate", FLUX, ["--config.cache=tea"], "'tea' is not an md-cache policy; expected one of", marks=pytest.mark.slow),
    pytest.param("flux_generate", FLUX, ["--config.cache=magcach"], "did you mean 'magcache'?", marks=pytest.mark.slow),
    ("sd_generate", SD, ["--config.cache=first_block_cache"], "apply to any denoiser: ['deepcache', 'faster_cache', 'sencache', 'taylorseer']"),
    ("flux_generate", FLUX, ["--config.cache=magcache"], "calibrate=True"),
    (
      "flux_generate", FLUX, ["--config.cache=teacache", "--config.cache_options.interval=2"],
      "teacache takes ['threshold', 'coefficients'], not ['interval']",
    ),
    pytest.param(
      "sd_generate", SD, ["--config.cache=faster_cache", "--config.cache_options.epsilon=0.1"],
      "faster_cache takes ['interval', 'alpha_low', 'alpha_high'], not ['epsilon']",
      marks=pytest.mark.slow,
    ),
    ("flux_generate", FLUX, ["--config.cache=deepcache"], "caches a UNet's deep branch, and flux has a transformer"),
    pytest.param("flux_generate", FLUX, ["--config.cache_options.treshold=0.1"], "did you mean --config.cache_options.threshold?", marks=pytest.mark.slow),
  ],
)  # fmt: skip
def test_cache_errors_are_one_line_before_loading(tmp_path, app, config, flags, needle):
  one_line_error(run(app, config, f"--workdir={tmp_path / 'out'}", *flags), needle)


def test_tiny_flux_run_with_a_cache_reports_steps(tmp_path):
  work = tmp_path / "out"
  out = run(
    "flux_generate", FLUX, f"--workdir={work}", "--config.num_inference_steps=4",
    "--config.cache=teacache", "--config.cache_options.threshold=1e9",
  )  # fmt: skip
  assert out.returncode == 0, out.stderr[-2000:]
  assert out.stdout.strip().splitlines()[-1] == "cache teacache: 2 of 4 steps computed, 2 reused"
  settings = json.loads((work / "settings.json").read_text())
  assert settings["cache"] == "teacache" and settings["cache_options"]["threshold"] == 1e9
  assert settings["cache_report"] == dict(denoiser_calls=4, steps_computed=2, steps_reused=2)
