"""The shared sampling loop driven from the host in chunks vs one whole-loop program, same pipeline.

uv run python bench/loop.py                 # the tiny Wan T2V fixture pipeline, 20 steps
uv run python bench/loop.py --steps=50 --repeats=5

`md_schedulers.drive` runs a jitted `run_steps(carry, lo, hi)` chunk by chunk so progress, per-step
callbacks, cancellation and Ctrl-C act between steps. This measures what that costs against running every
step in one call (`chunk=None`, one `fori_loop`, what the pipelines did before): the whole denoising loop's
wall time (best of --repeats, after a warm-up that compiles), for chunk sizes None, 1, 4 and "auto" (the pipelines' default), and the ratio to
`chunk=None`. A small model makes the per-dispatch overhead as visible as it can be. Not part of the tests.
"""

from __future__ import annotations

import argparse
import datetime
import platform
import time

import jax
import numpy as np

import md_wan
from md_core import testing


def _time(pipe, kw, chunk, repeats):
  pipe(**kw, chunk=chunk, output_type="latent").block_until_ready()  # compile + warm up
  best = float("inf")
  for _ in range(repeats):
    start = time.perf_counter()
    pipe(**kw, chunk=chunk, output_type="latent").block_until_ready()
    best = min(best, time.perf_counter() - start)
  return best


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=20)
  parser.add_argument("--repeats", type=int, default=3)
  args = parser.parse_args()
  pipe = md_wan.load_pipeline(testing.fixture_path("wan_pipeline") / "t2v")
  embeds = pipe.encode_prompt(["a cat surfing"])
  negative = pipe.encode_prompt([""])
  kw = dict(
    prompt_embeds=embeds, negative_prompt_embeds=negative, height=32, width=32, num_frames=9,
    num_inference_steps=args.steps, guidance_scale=5.0, seed=0, progress=False,
  )  # fmt: skip
  rows = [(chunk, _time(pipe, kw, chunk, args.repeats)) for chunk in (None, 1, 4, "auto")]
  base = rows[0][1]
  print(
    f"# {datetime.date.today()} {platform.processor() or platform.machine()} jax {jax.__version__}"
  )
  print(f"| chunk | loop time ({args.steps} steps) | per step | vs one program |")
  print("|---|---|---|---|")
  for chunk, t in rows:
    print(f"| {chunk} | {t * 1e3:.1f} ms | {t / args.steps * 1e3:.2f} ms | {t / base:.3f}x |")
  a = pipe(**kw, chunk=None, output_type="latent")
  b = pipe(**kw, chunk=1, output_type="latent")
  print(
    f"max abs difference chunk=1 vs chunk=None: {float(np.abs(np.asarray(a) - np.asarray(b)).max()):.1e}"
  )


if __name__ == "__main__":
  main()
