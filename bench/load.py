"""Loading full-size checkpoints: md's streaming loader against diffusers' `from_pretrained`, same folders.

uv run --no-sync python bench/load.py --make               # once: random-init folders under --root (~9 GB)
uv run --no-sync python bench/load.py                      # SD 1.5 UNet and Wan 2.1 1.3B, side by side
uv run --no-sync python bench/load.py --models=wan --devices=8   # md on 8 virtual CPU devices (fsdp mesh)
uv run --no-sync python bench/load.py --device_path     # one CPU device through the accelerators' path

`--make` runs tools/bench/make_load_folders.py in the PyTorch reference's virtualenv (tools/.venv): diffusers
builds the real-size models from the configs in tools/configs/ with random weights and saves them (float32,
sharded safetensors with an index). Nothing is downloaded; the folders are never committed.

Each load runs in its own fresh process (md: this interpreter; diffusers: tools/.venv), one at a time, after the
folder's files have been read once so both find them in the page cache. Measured around the load call only
(imports excluded): wall time, and peak anonymous resident memory: a thread samples `RssAnon` from
/proc/self/status every 5 ms (file-backed pages of the memory-mapped checkpoint are not counted, so the page
cache does not inflate the number); `VmHWM` (peak of all resident pages, file-backed included) is reported too.
md loads onto the CPU devices, so its placed weights are part of its own RSS; the excess over the weights'
bytes is what the loader itself holds (plus the jax runtime's own memory, measured before the load).
Not part of the test suite.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import platform
import subprocess
import sys
import threading
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
TORCH_PYTHON = ROOT / "tools" / ".venv" / "bin" / "python"
MODELS = {"sd": ("sd1.5", "unet"), "wan": ("wan2.1-1.3b", "transformer")}
GB = 1e9


def _status(field: str) -> int:
  """A /proc/self/status field in bytes."""
  with open("/proc/self/status") as f:
    for line in f:
      if line.startswith(field + ":"):
        return int(line.split()[1]) * 1024
  raise RuntimeError(f"/proc/self/status has no {field}")


class PeakAnon:
  """Samples RssAnon in a thread; `.peak` is the largest value seen while running."""

  def __init__(self, every: float = 0.005):
    self.every, self.peak, self._stop = every, _status("RssAnon"), threading.Event()
    self._thread = threading.Thread(target=self._run, daemon=True)

  def _run(self):
    while not self._stop.is_set():
      self.peak = max(self.peak, _status("RssAnon"))
      time.sleep(self.every)

  def __enter__(self):
    self._thread.start()
    return self

  def __exit__(self, *exc):
    self._stop.set()
    self._thread.join()
    self.peak = max(self.peak, _status("RssAnon"))


def _measure(load) -> dict:
  import resource

  before = _status("RssAnon")
  usage = resource.getrusage(resource.RUSAGE_SELF)
  start = time.perf_counter()
  with PeakAnon() as peak:
    weights = load()
  seconds = time.perf_counter() - start
  after = resource.getrusage(resource.RUSAGE_SELF)
  cpu = after.ru_utime + after.ru_stime - usage.ru_utime - usage.ru_stime
  return {
    "seconds": seconds,
    "cpu_seconds": cpu,
    "anon_before": before,
    "peak_anon": peak.peak,
    "vm_hwm": _status("VmHWM"),
    "weights": weights,
  }


def _md_worker(model: str, folder: str, devices: int, dtype: str, device_path: bool) -> dict:
  import jax

  if device_path:  # what a single CPU device did before its host path: md's device programs
    from md_core import _stream

    _stream._on_host_device = lambda sharding: False

  if model == "sd":
    import md_sd

    loader = md_sd.load_unet
  else:
    import md_wan

    loader = md_wan.load_transformer
  mesh = None
  if devices > 1:
    import md_sharding as mds

    mesh = mds.make_mesh(mds.MeshConfig(ici_fsdp_parallelism=devices))
  jax.numpy.zeros(()).block_until_ready()  # start the runtime before measuring

  def load():
    from flax import nnx

    m = loader(folder, subfolder=None, mesh=mesh, dtype=jax.numpy.dtype(dtype), progress=False)
    leaves = jax.block_until_ready(jax.tree.leaves(nnx.state(m)))
    return sum(x.nbytes for x in leaves)

  return _measure(load)


def _diffusers_worker(model: str, folder: str, dtype: str) -> dict:
  import diffusers
  import torch

  torch.set_num_threads(2)
  cls = diffusers.UNet2DConditionModel if model == "sd" else diffusers.WanTransformer3DModel

  def load():
    m = cls.from_pretrained(folder, torch_dtype=getattr(torch, dtype))
    return sum(p.numel() * p.element_size() for p in m.parameters())

  return _measure(load)


def _read_once(folder: pathlib.Path) -> None:
  for f in sorted(folder.glob("*.safetensors")):
    with open(f, "rb") as fh:
      while fh.read(64 << 20):
        pass


def _run_worker(python: str, args: list[str], env: dict | None = None) -> dict:
  out = subprocess.run(
    [python, __file__, "--worker", *args], capture_output=True, text=True, env=env, check=False
  )
  if out.returncode:
    raise RuntimeError(f"worker {args} failed:\n{out.stderr[-3000:]}")
  return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--root", default="/tmp/md_load_bench", help="where --make puts the folders")
  parser.add_argument("--make", action="store_true", help="make the random-init folders and exit")
  parser.add_argument("--models", default="sd,wan")
  parser.add_argument("--devices", type=int, default=1, help="md on this many CPU devices (fsdp)")
  parser.add_argument(
    "--dtype",
    default="float32",
    choices=("float32", "bfloat16"),
    help="load dtype on both sides (bfloat16 makes diffusers cast, so it touches every weight)",
  )
  parser.add_argument(
    "--device_path",
    action="store_true",
    help="md through its device programs even on one CPU device (the accelerator path)",
  )
  parser.add_argument(
    "--worker", nargs=3, metavar=("WHO", "MODEL", "FOLDER"), help=argparse.SUPPRESS
  )
  args = parser.parse_args()

  if args.worker:
    who, model, folder = args.worker
    if who == "md":
      result = _md_worker(model, folder, args.devices, args.dtype, args.device_path)
    else:
      result = _diffusers_worker(model, folder, args.dtype)
    print(json.dumps(result))
    return
  if args.make:
    subprocess.run(
      [str(TORCH_PYTHON), str(ROOT / "tools/bench/make_load_folders.py"), "--out", args.root],
      check=True,
    )
    return

  env = dict(os.environ, JAX_PLATFORMS="cpu")
  if args.devices > 1:
    env["XLA_FLAGS"] = (
      env.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={args.devices}"
    )
  print(
    f"# {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC, {platform.machine()},"
    f" {os.cpu_count()} CPUs, md on {args.devices} CPU device(s), {args.dtype}"
    + (", md through its device programs" if args.device_path else "")
  )
  print(
    "| model | weights GB | md s (CPU s) | diffusers s (CPU s) | md / diffusers | "
    "md peak anon GB (excess over weights) | diffusers peak anon GB | md VmHWM GB |"
  )
  print("|---|---|---|---|---|---|---|---|")
  for model in args.models.split(","):
    name, sub = MODELS[model]
    folder = pathlib.Path(args.root) / name / sub
    if not (folder / "config.json").is_file():
      sys.exit(f"{folder}: not there; run `python bench/load.py --make --root={args.root}` first")
    _read_once(folder)
    dtype = f"--dtype={args.dtype}"
    md = _run_worker(
      sys.executable,
      ["md", model, str(folder), f"--devices={args.devices}", dtype]
      + ["--device_path"] * args.device_path,
      env,
    )
    ref = _run_worker(str(TORCH_PYTHON), ["diffusers", model, str(folder), dtype])
    excess = md["peak_anon"] - md["weights"]
    print(
      f"| {name} {sub} | {md['weights'] / GB:.2f} | {md['seconds']:.1f} ({md['cpu_seconds']:.1f}) "
      f"| {ref['seconds']:.1f} ({ref['cpu_seconds']:.1f}) "
      f"| {md['seconds'] / ref['seconds']:.2f} | {md['peak_anon'] / GB:.2f} ({excess / GB:+.2f}; "
      f"runtime before load {md['anon_before'] / GB:.2f}) | {ref['peak_anon'] / GB:.2f} "
      f"| {md['vm_hwm'] / GB:.2f} |",
      flush=True,
    )


if __name__ == "__main__":
  main()
