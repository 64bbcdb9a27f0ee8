"""md-cache policies against the uncached run, per family × policy: denoiser calls saved, wall time, quality.

uv run python bench/cache.py                     # SD (medium UNet) and Wan T2V (tiny fixture), 20 steps
uv run python bench/cache.py --steps=30 --families=sd
uv run python bench/cache.py --families=sd-default,wan-default   # md's default models, with quality
uv run python bench/cache.py --families=flux,ltx    # the tiny Flux.1 dev and LTX-Video fixture pipelines
uv run python bench/cache.py --families=sd-default --policies=taylorseer,deepcache   # only these rows

Models: `sd` is bench/sd.py's "small" pipeline (random SD 1.x-layout UNet, 64-128-256 channels, built
once with the reference's interpreter `tools/.venv/bin/python` into --workdir) at 128 px; `wan` is the
tiny Wan 2.1 T2V fixture pipeline (tests/fixtures/wan_pipeline/t2v) at 64x64, 9 frames, whose
transformer is small enough that per-step overheads weigh more than on a real model; `flux` and `ltx` the
tiny Flux.1 dev (64 px) and LTX-Video T2V (64x64x9) fixture pipelines, the same way. Random weights:
PSNR / SSIM say how far a cached run moves from the uncached one on the same seed, not image quality.
`sd-default` / `wan-default` are md's trained default models (models/shapes-sd at 64 px, models/shapes-wan at
64x64, 9 frames), whose outputs md_data's analyser can score: their rows add the quality score (the mean
of the right-colour and right-shape rates, and for video the right-direction rate, over the model's
evaluation prompts x 2 seeds, in points).

Each cell: the policy's run and the uncached run (output_type="latent": text encoding and the denoising
loop, no decoding) timed alternately in the same process (best of
--repeats each, after a compiling warm-up), the ratio uncached / cached (> 1: faster), the denoiser calls (for the CFG cache the
steps that ran the unconditional rows), PSNR (dB) and SSIM (8x8 windows, per channel, mean) of the
decoded output against the uncached one. Prints a Markdown table. Not part of the tests.
"""

from __future__ import annotations

import argparse
import datetime
import os
import pathlib
import platform
import subprocess
import time

import jax
import numpy as np

import md_cache
from md_core import testing

ROOT = pathlib.Path(__file__).resolve().parents[1]
TORCH_PYTHON = ROOT / "tools" / ".venv" / "bin" / "python"


def policies(steps: int, family: str) -> dict:
  """Each policy at the bench's settings; on the default models (`*-default`) at the policies' own
  defaults (what the issue's 2-point quality rule is about)."""
  if family.endswith("-default"):
    out = {
      "taylorseer": md_cache.taylorseer(),
      "sencache": md_cache.sencache(),
      "faster_cache": md_cache.faster_cache(),
    }
    if family.startswith("sd"):
      out["deepcache"] = md_cache.deepcache()
    else:
      out["first_block_cache"] = md_cache.first_block_cache()
      out["teacache"] = md_cache.teacache()
    return out
  out = {
    "taylorseer": md_cache.taylorseer(3, warmup_steps=3),
    "sencache": md_cache.sencache(0.1),
    "faster_cache": md_cache.faster_cache(),
  }
  if family == "flux":  # Flux.1 dev embeds its guidance: no negative branch for the CFG cache
    del out["faster_cache"]
  if family.startswith("sd"):
    out["deepcache"] = md_cache.deepcache()
  else:  # block-level policies need transformer block stacks
    out["first_block_cache"] = md_cache.first_block_cache(0.1)
    out["teacache"] = md_cache.teacache(0.2, "flux" if family == "flux" else "identity")
  return out


def _sd(workdir: pathlib.Path, steps: int):
  import md_sd

  folder = workdir / "sd_small"
  if not (folder / "model_index.json").is_file():
    code = (
      "import pathlib, sys; sys.path.insert(0, 'bench'); import sd; "
      f"sd._build_small(pathlib.Path({str(folder)!r}))"
    )
    subprocess.run([str(TORCH_PYTHON), "-c", code], cwd=ROOT, check=True,
                   env=dict(os.environ, HF_HUB_OFFLINE="1"))  # fmt: skip
  pipe = md_sd.load_pipeline(folder)
  kw = dict(prompt=["a photo of a cat"], height=128, width=128, guidance_scale=7.5)
  return pipe, dict(num_inference_steps=steps, seed=0, progress=False, **kw)


def _wan(workdir: pathlib.Path, steps: int):
  import md_wan

  del workdir
  pipe = md_wan.load_pipeline(testing.fixture_path("wan_pipeline") / "t2v")
  kw = dict(prompt="a cat surfing", height=64, width=64, num_frames=9, guidance_scale=5.0)
  return pipe, dict(num_inference_steps=steps, seed=0, progress=False, **kw)


def _sd_default(workdir: pathlib.Path, steps: int):
  import md_sd

  del workdir
  pipe = md_sd.load_pipeline(ROOT / "models" / "shapes-sd")
  kw = dict(prompt=["a red circle in the center on a black background"], height=64, width=64)
  return pipe, dict(num_inference_steps=steps, seed=0, progress=False, guidance_scale=3.0, **kw)


def _wan_default(workdir: pathlib.Path, steps: int):
  import md_wan

  del workdir
  pipe = md_wan.load_pipeline(ROOT / "models" / "shapes-wan")
  kw = dict(prompt="a red circle moving right on a black background", height=64, width=64)
  kw |= dict(num_frames=9, guidance_scale=3.0, max_sequence_length=16, negative_prompt="")
  return pipe, dict(num_inference_steps=steps, seed=0, progress=False, **kw)


def _flux(workdir: pathlib.Path, steps: int):
  import md_flux

  del workdir
  pipe = md_flux.load_pipeline(testing.fixture_path("flux_pipeline") / "dev")
  kw = dict(prompt=["a photo of a cat"], height=64, width=64, guidance_scale=3.5)
  kw |= dict(max_sequence_length=16)
  return pipe, dict(num_inference_steps=steps, seed=0, progress=False, **kw)


def _ltx(workdir: pathlib.Path, steps: int):
  import md_ltx

  del workdir
  pipe = md_ltx.load_pipeline(testing.fixture_path("ltx_pipeline") / "t2v")
  kw = dict(prompt="a cat surfing", height=64, width=64, num_frames=9, guidance_scale=3.0)
  return pipe, dict(num_inference_steps=steps, seed=0, progress=False, **kw)


FAMILIES = {
  "sd": _sd,
  "wan": _wan,
  "flux": _flux,
  "ltx": _ltx,
  "sd-default": _sd_default,
  "wan-default": _wan_default,
}


def quality(family: str, pipe, kw, cache) -> float | None:
  """The default models' quality score (points): mean of the analyser's colour and shape rates (and, for
  video, motion direction) over the model's evaluation prompts x seeds 0, 1, with `cache`; None for the
  random-weight models."""
  import md_data

  if family == "sd-default":
    from md_train import shapes_sd as shapes
  elif family == "wan-default":
    from md_train import shapes_models as shapes
  else:
    return None
  texts = [t for group in shapes.quality_prompts().values() for t in group]
  fixed = {k: v for k, v in kw.items() if k not in ("prompt", "seed")}
  outs = [np.asarray(pipe(**fixed, prompt=texts, seed=seed, cache=cache)) for seed in (0, 1)]
  s = md_data.score(np.concatenate(outs), texts * 2)
  rates = [s.colour, s.shape] + ([] if s.direction is None else [s.direction])
  return 100.0 * float(np.mean(rates))


def psnr(a: np.ndarray, b: np.ndarray) -> float:
  mse = float(np.mean((a.astype(np.float64) - b) ** 2))
  return float("inf") if mse == 0 else 10 * np.log10(1.0 / mse)


def ssim(a: np.ndarray, b: np.ndarray, win: int = 8) -> float:
  """Mean SSIM over non-overlapping `win`² windows of every image / frame and channel (values in [0, 1])."""
  c1, c2 = 0.01**2, 0.03**2
  a = a.reshape(-1, *a.shape[-3:]).astype(np.float64)
  b = b.reshape(-1, *b.shape[-3:]).astype(np.float64)
  n, h, w, ch = a.shape
  h, w = h // win * win, w // win * win

  def blocks(x):
    x = x[:, :h, :w].reshape(n, h // win, win, w // win, win, ch)
    return x.transpose(0, 1, 3, 5, 2, 4).reshape(-1, win * win)

  x, y = blocks(a), blocks(b)
  mx, my = x.mean(1), y.mean(1)
  vx, vy = x.var(1), y.var(1)
  cov = ((x - mx[:, None]) * (y - my[:, None])).mean(1)
  s = ((2 * mx * my + c1) * (2 * cov + c2)) / ((mx**2 + my**2 + c1) * (vx + vy + c2))
  return float(s.mean())


def _once(pipe, kw, cache) -> float:
  start = time.perf_counter()
  jax.block_until_ready(pipe(**kw, cache=cache))
  return time.perf_counter() - start


def _timed(pipe, kw, cache, repeats):
  """The cached run's output, final state and calls, and the best times of the cached and the
  uncached run, taken alternately (a shared, loaded CPU slows both alike)."""
  out = np.asarray(pipe(**kw, cache=cache))  # decoded, for the quality scores
  state, calls = pipe.last_cache, int(pipe.last_calls)
  latent = dict(kw, output_type="latent")  # the timed part: text encoding + the denoising loop
  _once(pipe, latent, cache)  # compile + warm up
  cached = plain = float("inf")
  for _ in range(repeats):
    plain = min(plain, _once(pipe, latent, None))
    cached = min(cached, _once(pipe, latent, cache))
  return out, cached, plain, state, calls


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--steps", type=int, default=20)
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--families", default="sd,wan")
  parser.add_argument("--policies", default="", help="comma-separated policy names (default: all)")
  parser.add_argument("--workdir", default="/tmp/md_bench_cache")
  args = parser.parse_args()
  workdir = pathlib.Path(args.workdir)
  workdir.mkdir(parents=True, exist_ok=True)
  print(f"# {datetime.date.today()} {platform.machine()} {os.cpu_count()} cores, jax {jax.__version__}, "
        f"{args.steps} steps")  # fmt: skip
  print(
    "| family | policy | denoiser calls | steps computed | time vs uncached | PSNR | SSIM | quality |"
  )
  print("|---|---|---|---|---|---|---|---|")
  for family in args.families.split(","):
    pipe, kw = FAMILIES[family](workdir, args.steps)
    plain = np.asarray(pipe(**kw))
    calls = int(pipe.last_calls)
    base_q = quality(family, pipe, kw, None)
    q = "–" if base_q is None else f"{base_q:.1f}"
    print(f"| {family} | none | {calls} | {args.steps} | 1.00x | – | – | {q} |", flush=True)
    chosen = policies(args.steps, family)
    if args.policies:
      unknown = sorted(set(args.policies.split(",")) - set(chosen))
      if unknown:
        raise SystemExit(f"--policies: {unknown} not among {family}'s {sorted(chosen)}")
      chosen = {k: v for k, v in chosen.items() if k in args.policies.split(",")}
    for name, cache in chosen.items():
      out, t, base, state, calls = _timed(pipe, kw, cache, args.repeats)
      done = int(md_cache.computed_steps(state).sum())
      what = " (uncond.)" if name == "faster_cache" else ""
      score = quality(family, pipe, kw, cache)
      q = "–" if score is None else f"{score:.1f} ({score - base_q:+.1f})"
      print(
        f"| {family} | {name} | {calls} | {done}{what} | {base / t:.2f}x ({t:.2f} / {base:.2f} s) | "
        f"{psnr(out, plain):.1f} | {ssim(out, plain):.3f} | {q} |",
        flush=True,
      )


if __name__ == "__main__":
  main()
