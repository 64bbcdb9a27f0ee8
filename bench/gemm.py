"""Matmul speed of XLA's CPU backend (what md runs) against PyTorch's (what diffusers runs), same shapes,
one process each: the GEMMs of the bench rows' steps, float32, best of --repeats.

uv run python bench/gemm.py                 # Wan 2.1 1.3B block shapes at 192 tokens, Flux / LTX shapes
uv run python bench/gemm.py --shapes=192x1536x8960,2048x2048x2048

Prints GFLOP/s per shape for both and the ratio. The torch side runs in the reference's virtualenv
(`tools/.venv/bin/python`) as a subprocess. Not part of the test suite.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
TORCH_PYTHON = ROOT / "tools" / ".venv" / "bin" / "python"
SHAPES = (
  # Wan 2.1 1.3B blocks, 192 video + 512 text tokens: FFN in / out, attention projections, text K/V.
  "192x1536x8960,192x8960x1536,192x1536x1536,512x1536x1536,512x4096x1536,"
  # LTX-Video 2B blocks at 768 tokens; Flux bench (dim 512) at 1664 tokens; a square reference.
  "768x2048x8192,768x8192x2048,1664x512x4608,1664x2048x512,2048x2048x2048"
)

_TORCH = r"""
import json, sys, time, torch
shapes, repeats = json.loads(sys.argv[1]), int(sys.argv[2])
out = {}
with torch.no_grad():
  for m, k, n in shapes:
    a, w = torch.randn(m, k), torch.randn(n, k)  # nn.Linear's (out, in) weight
    torch.nn.functional.linear(a, w)
    best = float("inf")
    for _ in range(repeats):
      start = time.perf_counter()
      torch.nn.functional.linear(a, w)
      best = min(best, time.perf_counter() - start)
    out[f"{m}x{k}x{n}"] = best
print(json.dumps({"seconds": out, "threads": torch.get_num_threads(), "torch": torch.__version__}))
"""


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--shapes", default=SHAPES, help="comma-separated MxKxN")
  parser.add_argument("--repeats", type=int, default=10)
  args = parser.parse_args()
  shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]
  if not TORCH_PYTHON.is_file():
    raise SystemExit(f"{TORCH_PYTHON} not found: create it with `bash tools/make_fixtures.sh core`")
  run = subprocess.run(
    [str(TORCH_PYTHON), "-c", _TORCH, json.dumps(shapes), str(args.repeats)],
    capture_output=True,
    text=True,
    check=True,
    env=dict(os.environ, HF_HUB_OFFLINE="1"),
  )
  ref = json.loads(run.stdout.strip().splitlines()[-1])

  import jax  # noqa: PLC0415
  import jax.numpy as jnp  # noqa: PLC0415

  mm = jax.jit(lambda a, b: a @ b)
  print(
    f"# GEMM float32: jax {jax.__version__} ({jax.devices()[0].platform}, {os.cpu_count()} cores) vs "
    f"torch {ref['torch']} ({ref['threads']} threads)"
  )
  print("| M x K x N | XLA GFLOP/s | torch GFLOP/s | XLA / torch |")
  print("|---|---|---|---|")
  for m, k, n in shapes:
    a = jax.random.normal(jax.random.key(0), (m, k), jnp.float32)
    b = jax.random.normal(jax.random.key(1), (k, n), jnp.float32)
    jax.block_until_ready(mm(a, b))
    best = float("inf")
    for _ in range(args.repeats):
      start = time.perf_counter()
      jax.block_until_ready(mm(a, b))
      best = min(best, time.perf_counter() - start)
    flops = 2 * m * k * n
    theirs = ref["seconds"][f"{m}x{k}x{n}"]
    print(
      f"| {m} x {k} x {n} | {flops / best / 1e9:.0f} | {flops / theirs / 1e9:.0f} | {theirs / best:.2f} |"
    )


if __name__ == "__main__":
  main()
