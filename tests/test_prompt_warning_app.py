"""The generating apps warn in one line on stderr when md's default shapes model gets a prompt outside its
grammar (md_data.prompt_warning), and still write their output; a grammar prompt gets no warning."""

import os
import pathlib
import subprocess
import sys

import pytest

from md_core import testing

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _run(app: str, *flags: str) -> subprocess.CompletedProcess:
  env = dict(
    os.environ,
    XLA_FLAGS=testing.FAST_COMPILE_XLA_FLAGS,
    JAX_PLATFORMS="cpu",
    HF_HUB_OFFLINE="1",
    MD_PROGRESS="0",
  )
  return subprocess.run(
    [
      sys.executable,
      app,
      "--config.compilation_cache=False",
      "--config.num_inference_steps=2",
      *flags,
    ],
    cwd=ROOT,
    env=env,
    capture_output=True,
    text=True,
    timeout=600,
  )


@pytest.mark.parametrize(
  "app, prompt, warned",
  [
    ("apps/wan_generate", "a cat surfing", "unknown word 'cat'"),
    ("apps/sd_generate", "a red circle in the top left on a white background", None),
  ],
)
def test_default_model_warns_once_for_a_prompt_outside_its_grammar(tmp_path, app, prompt, warned):
  out = _run(app, f"--config.prompt={prompt}", f"--workdir={tmp_path}")
  assert out.returncode == 0, out.stderr[-3000:]
  lines = [line for line in out.stderr.splitlines() if line.startswith("warning: prompt")]
  if warned is None:
    assert lines == []
  else:
    assert len(lines) == 1 and warned in lines[0] and "backgrounds black, white, gray" in lines[0]
  assert "settings.json" in os.listdir(tmp_path)


def test_web_page_placeholder_is_a_prompt_the_default_models_draw():
  import re

  import md_data

  page = (ROOT / "packages" / "md-serve" / "src" / "md_serve" / "_page.py").read_text()
  placeholder = re.search(r'<textarea id="prompt" placeholder="([^"]+)"', page)[1]
  assert md_data.prompt_warning(placeholder, kind="image") is None, placeholder
