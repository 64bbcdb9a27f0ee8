"""apps/serve as a user meets it: every bad setting is one line naming it (exit 2) before any weights load;
a typo in a key gets the nearest key."""

import pathlib
import subprocess
import sys

from md_core import testing

ROOT = pathlib.Path(__file__).resolve().parents[1]
ENV = testing.app_env()


def _run(*flags: str) -> subprocess.CompletedProcess:
  cmd = [
    sys.executable,
    str(ROOT / "apps" / "serve"),
    "--config=apps/configs/serve.py:default",
    *flags,
  ]
  return subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)


def test_bad_settings_are_one_line_each():
  out = _run(
    "--config.image_model=/nonexistent/folder", "--config.verifier=bogus",
    "--config.shutdown=later", "--config.batch_buckets=a,b", "--config.image_loras=x=missing.safetensors",
  )  # fmt: skip
  assert out.returncode == 2, out.stderr[-2000:]
  assert "Traceback" not in out.stderr
  lines = out.stderr.strip().splitlines()
  assert all(line.startswith("serve: ") for line in lines), lines
  text = out.stderr
  for words in (
    "image_model=/nonexistent/folder: no model_index.json",
    "--config.verifier: '', 'shapes' or 'clip=<folder>'",
    "--config.shutdown must be finish or cancel",
    "--config.batch_buckets",
    "'x=missing.safetensors' is not name=<existing .safetensors file>",
  ):
    assert words in text, (words, text)


def test_unknown_key_gets_the_nearest():
  out = _run("--config.prot=8080")
  assert out.returncode == 2 and "port" in out.stderr and "Traceback" not in out.stderr, out.stderr
