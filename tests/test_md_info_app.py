"""The md_info app end to end: flags → config → mesh → checkpoint on the mesh."""

import json
import os
import pathlib
import re
import subprocess
import sys

from md_core import testing

ROOT = pathlib.Path(__file__).resolve().parents[1]


def run_app(*flags: str) -> subprocess.CompletedProcess:
  env = dict(
    os.environ,
    XLA_FLAGS="--xla_force_host_platform_device_count=8 " + testing.FAST_COMPILE_XLA_FLAGS,
    JAX_PLATFORMS="cpu",
  )
  return subprocess.run(
    [
      sys.executable,
      "apps/md_info",
      "--config=apps/configs/info.py",
      "--config.compilation_cache=False",
      *flags,
    ],
    cwd=ROOT,
    env=env,
    capture_output=True,
    text=True,
    timeout=120,
  )


def test_md_info_builds_mesh_and_loads_checkpoint():
  out = run_app("--config.mesh.ici_data_parallelism=2", "--config.mesh.ici_tensor_parallelism=2")
  assert out.returncode == 0, out.stderr[-2000:]
  assert "mesh: data=2, fsdp=2, context=1, tensor=2 (8 devices: cpu; 1 process(es)" in out.stdout
  assert "loaded 14 tensors (1,838 values, 0.01 MiB as float32)" in out.stdout
  # Logs stay quiet: no absl / XLA INFO line (e.g. jax's "Unable to initialize backend 'tpu'").
  assert not [line for line in out.stderr.splitlines() if re.match(r"I\d{4} ", line)], out.stderr
  # Independent count: tensors with an axis that fsdp=2 divides, from the checkpoint's manifest.
  manifest = json.loads((ROOT / "tests/fixtures/core/stack_manifest.json").read_text())["tensors"]
  split = sum(any(d % 2 == 0 for d in t["shape"]) for t in manifest.values())
  assert f"{split} split over fsdp=2, {len(manifest) - split} replicated" in out.stdout


def test_md_info_reports_bad_settings_clearly():
  out = run_app("--config.mesh.ici_tensor_parallelism=3")
  assert out.returncode != 0
  assert "does not divide the 8 devices" in out.stderr and "Traceback" not in out.stderr
  out = run_app("--config.mesh.ici_tensr_parallelism=2")
  assert out.returncode != 0
  assert "did you mean --config.mesh.ici_tensor_parallelism?" in out.stderr
