"""Ctrl-C during a long tiny run: the app stops within 2 s of the signal with one line and exit code 130,
writing nothing. Passes once the denoising loop runs as host-driven chunks of steps (md_schedulers.sample):
on CPU a single compiled fori_loop holds the interpreter until it ends."""

import os
import pathlib
import re
import signal
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _default_sigint():
  signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_sigint_during_denoising_stops_within_two_seconds(tmp_path):
  env = dict(os.environ, JAX_PLATFORMS="cpu", HF_HUB_OFFLINE="1", MD_PROGRESS="1", XLA_FLAGS="")
  log = tmp_path / "stderr.txt"
  work = tmp_path / "out"
  with log.open("w") as err:
    proc = subprocess.Popen(
      [
        sys.executable, "apps/wan_generate", "--config=apps/configs/wan.py:tiny",
        "--config.compilation_cache=False", f"--workdir={work}", "--config.num_frames=33",
        "--config.num_inference_steps=1000", "--config.height=96", "--config.width=96",
      ],
      cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=err, text=True,
      # A test run started in the background (`cmd &` in a script) inherits SIGINT ignored, and Python then
      # installs no KeyboardInterrupt handler: give the app the default disposition, as a terminal does.
      preexec_fn=_default_sigint,
    )  # fmt: skip
    deadline = time.monotonic() + 300
    # Steps take a few ms each here, so wait for the bar to count steps (past compilation), then a little.
    started = re.compile(r"denoising:\s+\d+%.*\| [1-9]\d*/1000")
    while not started.search(log.read_text()) and proc.poll() is None:
      assert time.monotonic() < deadline, "the run never started denoising"
      time.sleep(0.1)
    time.sleep(0.5)  # well inside the 1000 steps
    assert proc.poll() is None, log.read_text()[-2000:]
    sent = time.monotonic()
    proc.send_signal(signal.SIGINT)
    proc.wait(timeout=120)
    waited = time.monotonic() - sent
  lines = [line for line in log.read_text().splitlines() if "interrupted" in line]
  assert proc.returncode == 130, log.read_text()[-2000:]
  assert waited < 2.0, f"exited {waited:.1f}s after SIGINT"
  assert lines and lines[-1].startswith("wan_generate: interrupted (SIGINT) at step "), lines
  assert lines[-1].endswith("nothing written") and "Traceback" not in log.read_text()
  assert not work.exists() or not any(work.iterdir())


def test_sigint_during_decoding_stops_with_one_line(tmp_path):
  """Ctrl-C while the VAE decodes (a compiled program holding the main thread): one line naming the
  decoding phase, exit code 130, nothing written. The signal goes as soon as the app announces
  "decoding…"; at 512 x 512 the tiny VAE's decode (compile and run) lasts well past that."""
  env = dict(os.environ, JAX_PLATFORMS="cpu", HF_HUB_OFFLINE="1", MD_PROGRESS="1", XLA_FLAGS="")
  log = tmp_path / "stderr.txt"
  work = tmp_path / "out"
  with log.open("w") as err:
    proc = subprocess.Popen(
      [
        sys.executable, "apps/sd_generate", "--config=apps/configs/sd.py:tiny",
        "--config.compilation_cache=False", f"--workdir={work}", "--config.height=512",
        "--config.width=512", "--config.num_inference_steps=1",
      ],
      cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=err, text=True,
      preexec_fn=_default_sigint,
    )  # fmt: skip
    deadline = time.monotonic() + 300
    while "decoding…" not in log.read_text() and proc.poll() is None:
      assert time.monotonic() < deadline, "the run never started decoding"
      time.sleep(0.02)
    assert proc.poll() is None, log.read_text()[-2000:]
    sent = time.monotonic()
    proc.send_signal(signal.SIGINT)
    proc.wait(timeout=120)
    waited = time.monotonic() - sent
  text = log.read_text()
  assert proc.returncode == 130, text[-2000:]
  assert waited < 2.0, f"exited {waited:.1f}s after SIGINT"
  lines = [line for line in text.splitlines() if "interrupted" in line]
  assert lines == ["sd_generate: interrupted (SIGINT) while decoding; nothing written"], lines
  assert "Traceback" not in text
  assert not work.exists() or not any(work.iterdir())
