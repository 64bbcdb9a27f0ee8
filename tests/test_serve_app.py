"""apps/serve as a user meets it: every bad setting is one line naming it (exit 2) before any weights load;
a typo in a key gets the nearest key; with a warm-up and an executables folder it serves its bucket
without compiling, and a restart reads every program back."""

import pathlib
import re
import signal
import socket
import subprocess
import sys
import time

import httpx

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
    "--config.video_max_sequence_length=-1", "--config.port=70000", "--config.host=0.0.0.0",
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
    "--config.video_max_sequence_length=-1 must be ≥ 0",
    "--config.port=70000 is out of range: expected 1..65535",
    "--config.host=0.0.0.0 is not loopback: set a token",
  ):
    assert words in text, (words, text)


def test_unknown_key_gets_the_nearest():
  out = _run("--config.prot=8080")
  assert out.returncode == 2 and "port" in out.stderr and "Traceback" not in out.stderr, out.stderr


def _start(tmp, port: int, *flags: str) -> tuple[subprocess.Popen, list[str]]:
  """apps/serve (the video model only, batch bucket 1) until it says it is ready: the process and its
  lines so far."""
  cmd = [
    sys.executable, str(ROOT / "apps" / "serve"), "--config=apps/configs/serve.py:tiny-video",
    f"--config.port={port}", "--config.batch_buckets=1", "--config.max_batch=1",
    *flags,
  ]  # fmt: skip
  env = dict(ENV, MD_COMPILATION_CACHE=str(tmp / "cache"))  # not the user's cache
  proc = subprocess.Popen(
    cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
  )
  lines = []
  for line in proc.stdout:
    lines.append(line.rstrip())
    if line.startswith("md-serve: ready"):
      return proc, lines
  proc.wait(30)
  raise AssertionError("apps/serve stopped before it was ready:\n" + "\n".join(lines[-30:]))


def test_warm_up_with_executables_serves_without_compiling(tmp_path):
  """`--config.warmup=True --config.executables=<folder>`: the server runs its bucket once before it
  listens; a request of that shape then compiles nothing (the server's own /metrics say so). Started
  again on the same folder, the warm-up reads every program back and compiles none."""
  flags = ("--config.warmup=True", f"--config.executables={tmp_path / 'exe'}")
  port = _free_port()
  proc, lines = _start(tmp_path, port, *flags)
  try:
    assert len([line for line in lines if line.startswith("warm-up: video n=1:")]) == 1, lines
    # the text encoder, the denoising loop and the VAE decode
    assert f"executables in {tmp_path / 'exe'}: 0 read back, 3 compiled and written" in lines, lines
    assert list((tmp_path / "exe").glob("*.jaxexe")), "no executables written"
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=120) as client:
      for _ in range(100):  # uvicorn binds just after the ready line
        try:
          client.get("/healthz")
          break
        except httpx.ConnectError:
          time.sleep(0.1)
      compiles = _compiles(client)
      r = client.post("/v1/videos/generations", json={"prompt": "a red circle moving right"})
      assert r.status_code == 200, r.text
      assert r.json()["data"][0]["mime_type"] == "video/mp4"
      assert _compiles(client) == compiles
  finally:
    proc.terminate()
    proc.wait(60)

  written = sorted(p.name for p in tmp_path.rglob("*") if p.is_file())
  proc, lines = _start(tmp_path, _free_port(), *flags)
  proc.terminate()
  proc.wait(60)
  assert f"executables in {tmp_path / 'exe'}: 3 read back, 0 compiled and written" in lines, lines
  assert sorted(p.name for p in tmp_path.rglob("*") if p.is_file()) == written  # nothing new


def test_sigterm_in_finish_mode_records_every_accepted_job(tmp_path):
  """SIGTERM with more queued work than `finish_timeout_s`: the running job's loop stops at a step
  boundary, every accepted job ends succeeded or cancelled with a stderr line, and the process exits 0
  (it used to abort with 134 while the worker was still in a program)."""
  port = _free_port()
  proc, lines = _start(
    tmp_path, port, "--config.finish_timeout_s=2", "--config.max_steps=400",
    "--config.preview_every=0",
  )  # fmt: skip
  try:
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60) as client:
      for _ in range(100):
        try:
          client.get("/healthz")
          break
        except httpx.ConnectError:
          time.sleep(0.1)
      body = {"prompt": "a red circle", "steps": 400, "wait": False}
      ids = [client.post("/v1/videos/generations", json=body).json()["id"] for _ in range(4)]
      while client.get(f"/v1/jobs/{ids[0]}").json()["status"] == "queued":
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
  finally:
    if proc.poll() is None:
      proc.kill()
  assert proc.returncode == 0, out[-3000:]
  assert "Traceback" not in out, out[-3000:]
  cancelled = [i for i in ids if f"md-serve: {i} cancelled: server shut down (2 s to finish" in out]
  assert len(cancelled) >= 3, out[-3000:]  # 400 steps each: at most the first finished


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _compiles(client) -> float:
  text = client.get("/metrics").text
  return float(re.search(r"^md_serve_compiles_total ([0-9.e+-]+)$", text, re.M).group(1))


def test_default_variant_serves_the_trained_shapes_models(tmp_path):
  """Without a model flag the server runs md's own trained models (models/shapes-sd, models/shapes-wan):
  what it returns over HTTP shows the prompt's colour and background to md_data's analyser."""
  import base64
  import io

  import numpy as np
  from PIL import Image, ImageSequence

  import md_data

  port = _free_port()
  cmd = [
    sys.executable, str(ROOT / "apps" / "serve"), "--config=apps/configs/serve.py:default",
    f"--config.port={port}", "--config.batch_buckets=2", "--config.max_batch=2",
  ]  # fmt: skip
  env = dict(ENV, MD_COMPILATION_CACHE=str(tmp_path / "cache"))
  proc = subprocess.Popen(
    cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
  )
  try:
    lines = [next(proc.stdout)]
    assert lines[0].startswith("md-serve on") and "'image', 'video'" in lines[0], lines
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=300) as client:
      for _ in range(600):
        try:
          models = client.get("/v1/models").json()["data"]
          break
        except httpx.ConnectError:
          time.sleep(0.1)
      sizes = {m["id"]: m["default_size"] for m in models}
      assert sizes == {"image": "64x64", "video": "64x64"}
      body = {"n": 2, "guidance": 3.0, "seed": 0}
      r = client.post(
        "/v1/images/generations",
        json={**body, "prompt": "a blue square in the top left on a white background"},
      )
      assert r.status_code == 200, r.text
      for item in r.json()["data"]:
        image = np.asarray(Image.open(io.BytesIO(base64.b64decode(item["b64_json"]))))
        seen = md_data.analyse(image[..., :3])
        assert (seen.colour, seen.background) == ("blue", "white"), seen
      r = client.post(
        "/v1/videos/generations",
        json={
          **body, "prompt": "a red circle moving right on a black background", "video_format": "gif",
        },
      )  # fmt: skip
      assert r.status_code == 200, r.text
      for item in r.json()["data"]:
        gif = Image.open(io.BytesIO(base64.b64decode(item["b64_json"])))
        frames = np.stack([np.asarray(f.convert("RGB")) for f in ImageSequence.Iterator(gif)])
        # 9 frames; the GIF keeps each run of equal frames once (the shapes VAE decodes a latent frame
        # into 4 equal ones: 1 + 4 + 4)
        assert frames.shape == (3, 64, 64, 3) and gif.info["duration"] > 0
        seen = md_data.analyse(frames)
        assert (seen.colour, seen.background) == ("red", "black"), seen
  finally:
    proc.terminate()
    proc.wait(60)
