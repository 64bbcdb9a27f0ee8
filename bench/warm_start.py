"""Cold and warm starts of the apps: each tiny app variant run twice as a fresh process on one empty
persistent compilation cache, and once more with the cache off.

uv run --no-sync python bench/warm_start.py               # every app below, ~5 min on 2 cores
uv run --no-sync python bench/warm_start.py --only=wan    # the rows whose app or variant contains "wan"

Per row: `cold` (the first run: the cache folder empty, every program compiled and written), `warm` (the
second run: the same command, the programs read back), `no cache` (`--config.compilation_cache=False`:
compiles everything, writes nothing), the time the warm start saves (cold − warm) and the cache's files
and size after the first run. Wall times of the whole process (Python start-up, imports, loading the
tiny fixture, compiling, running, writing), best of `--repeats` for each kind. md's apps cache programs
that took at least `jax_persistent_cache_min_compile_time_secs` (md_core.apps.configure_jax) to compile.
The `serve` rows time the server from its start until it prints that it is ready (every model's batch
buckets warmed up), then stop it. Rows with `executables=True` also keep ahead-of-time executables
(md_core.ExecutableStore) in the row's cache folder. Prints a Markdown table. Not part of the tests.
"""

from __future__ import annotations

import argparse
import datetime
import os
import pathlib
import platform
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]

# (app, config:variant, extra flags)
ROWS = (
  ("wan_generate", "wan.py:tiny", ()),
  ("wan_generate", "wan.py:default", ()),
  ("sd_generate", "sd.py:tiny", ()),
  ("sd_generate", "sd.py:default", ()),
  ("flux_generate", "flux.py:tiny", ()),
  ("flux_generate", "flux.py:tiny-klein", ()),
  ("ltx_generate", "ltx.py:tiny", ()),
  ("ltx2_generate", "ltx2.py:tiny", ()),
  ("train", "train.py:wan21-tiny", ("--config.steps=2",)),
  ("prepare_data", "prepare_data.py:tiny", ()),
  # Ahead-of-time executables (md_core.ExecutableStore) on top of the compilation cache: the cold run
  # writes them into the row's cache folder, the warm run reads them back without tracing its programs.
  ("wan_generate", "wan.py:default", ("--config.executables=True",)),
  ("sd_generate", "sd.py:default", ("--config.executables=True",)),
  # The server until it is ready (warm-up of every batch bucket done), then stopped.
  ("serve", "serve.py:tiny", ("--config.warmup=True",)),
  ("serve", "serve.py:tiny", ("--config.warmup=True", "--config.executables=True")),
)


def _run(app: str, config: str, extra, cache: pathlib.Path | None, work: pathlib.Path) -> float:
  env = dict(os.environ, JAX_PLATFORMS="cpu", HF_HUB_OFFLINE="1", MD_PROGRESS="0")
  args = [sys.executable, f"apps/{app}", f"--config=apps/configs/{config}", *extra]
  if cache is None:  # nothing kept: no compilation cache, no executables
    args = [a for a in args if not a.startswith("--config.executables")]
    args.append("--config.compilation_cache=False")
  else:
    env["MD_COMPILATION_CACHE"] = str(cache)
    env["MD_EXECUTABLES"] = str(cache / "executables")
  shutil.rmtree(work, ignore_errors=True)
  start = time.perf_counter()
  if app == "serve":  # until it says it is ready; then stopped
    args.append(f"--config.port={_free_port()}")
    proc = subprocess.Popen(
      args, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    lines = []
    for line in proc.stdout:
      lines.append(line)
      if line.startswith("md-serve: ready"):
        break
    seconds = time.perf_counter() - start
    proc.terminate()
    proc.wait(60)
    if not lines or not lines[-1].startswith("md-serve: ready"):
      raise RuntimeError(f"serve {config} did not get ready:\n{''.join(lines)[-2000:]}")
    return seconds
  args.append(f"--workdir={work}")
  done = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
  seconds = time.perf_counter() - start
  if done.returncode != 0:
    raise RuntimeError(f"{app} {config} failed ({done.returncode}):\n{done.stderr[-2000:]}")
  return seconds


def _free_port() -> int:
  import socket

  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def main() -> None:
  parser = argparse.ArgumentParser()
  parser.add_argument("--only", default="")
  parser.add_argument("--repeats", type=int, default=1)
  args = parser.parse_args()
  rows = [r for r in ROWS if args.only in r[0] or args.only in r[1]]
  print(
    f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC, {platform.machine()}, "
    f"{os.cpu_count()} CPUs, python {platform.python_version()}"
  )
  print(
    "| app | variant | cold s | warm s | saved s (cold − warm) | no cache s | cache files (MB) |"
  )
  print("|---|---|---|---|---|---|---|")
  with tempfile.TemporaryDirectory() as tmp:
    tmp = pathlib.Path(tmp)
    for i, (app, config, extra) in enumerate(rows):
      cold = warm = off = float("inf")
      for r in range(args.repeats):
        cache = tmp / f"cache-{i}-{r}"
        cold = min(cold, _run(app, config, extra, cache, tmp / "work"))
        files = [p for p in cache.rglob("*") if p.is_file()]
        size = sum(p.stat().st_size for p in files) / 1e6
        warm = min(warm, _run(app, config, extra, cache, tmp / "work"))
        off = min(off, _run(app, config, extra, None, tmp / "work"))
      label = config.replace(".py:", ":") + "".join(
        f" {a.removeprefix('--config.')}" for a in extra if not a.startswith("--config.steps")
      )
      print(
        f"| {app} | {label} | {cold:.1f} | {warm:.1f} | {cold - warm:.1f} | "
        f"{off:.1f} | {len(files)} ({size:.1f}) |",
        flush=True,
      )


if __name__ == "__main__":
  main()
