"""md-sd against diffusers on the same weights: one UNet call (CFG batch) and a whole text-to-image run.

Run with the reference's interpreter (torch + diffusers); md runs in a subprocess of the workspace (`uv run`),
because the two environments differ (md needs jax, the reference torch) and this keeps each one clean:

  tools/.venv/bin/python bench/sd.py                      # small: a random SD-shaped UNet, 128 px, 10 steps
  tools/.venv/bin/python bench/sd.py --preset tiny        # the fixture pipeline (tests/fixtures/sd_pipeline/sd)
  tools/.venv/bin/python bench/sd.py --model path/to/pipeline --size 512 --steps 20

Reports seconds per UNet call and per pipeline run (md after compilation; compile time listed apart) and the
ratio diffusers / md (> 1: md is faster). Not part of the test suite.
"""

import argparse
import json
import os
import pathlib
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
PROMPTS = ["a photo of a cat"]


def _time(fn, repeats: int) -> float:
  best = float("inf")
  for _ in range(repeats):
    start = time.perf_counter()
    fn()
    best = min(best, time.perf_counter() - start)
  return best


def _build_small(folder: pathlib.Path) -> None:
  """The fixture pipeline with a wider UNet (SD 1.x block layout, 64-128-256 channels), saved to `folder`."""
  import torch
  from diffusers import StableDiffusionPipeline, UNet2DConditionModel

  torch.manual_seed(0)
  pipe = StableDiffusionPipeline.from_pretrained(
    ROOT / "tests/fixtures/sd_pipeline/sd", safety_checker=None
  )
  pipe.unet = UNet2DConditionModel(
    sample_size=16,
    block_out_channels=(64, 128, 256),
    down_block_types=("CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"),
    up_block_types=("UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"),
    layers_per_block=2,
    cross_attention_dim=pipe.text_encoder.config.hidden_size,
    attention_head_dim=8,
    norm_num_groups=32,
  ).eval()
  pipe.save_pretrained(folder, safe_serialization=True)


def run_reference(model: str, size: int, steps: int, repeats: int) -> dict:
  import torch
  from diffusers import StableDiffusionPipeline

  torch.set_grad_enabled(False)
  pipe = StableDiffusionPipeline.from_pretrained(model, safety_checker=None)
  pipe.set_progress_bar_config(disable=True)
  h = size // pipe.vae_scale_factor
  x = torch.randn(2, pipe.unet.config.in_channels, h, h)
  ctx = torch.randn(2, pipe.tokenizer.model_max_length, pipe.unet.config.cross_attention_dim)
  t = torch.tensor(500)
  unet = _time(lambda: pipe.unet(x, t, ctx), repeats)
  run = lambda: pipe(PROMPTS, height=size, width=size, num_inference_steps=steps, output_type="np")  # noqa: E731
  return {
    "unet_s": unet,
    "pipeline_s": _time(run, max(1, repeats // 2)),
    "threads": torch.get_num_threads(),
  }


def run_md(model: str, size: int, steps: int, repeats: int) -> dict:
  import jax
  import jax.numpy as jnp
  from flax import nnx

  import md_sd

  pipe = md_sd.load_pipeline(model)
  h = size // pipe.vae_scale_factor
  x = jnp.asarray(jax.random.normal(jax.random.key(0), (2, h, h, pipe.unet.cfg.in_channels)))
  ctx = jax.random.normal(
    jax.random.key(1), (2, pipe.tokenizer.model_max_length, pipe.unet.cfg.cross_attention_dim[0])
  )
  graphdef, state = nnx.split(pipe.unet)
  call = jax.jit(lambda s, x, c: nnx.merge(graphdef, s)(x, 500, c))
  start = time.perf_counter()
  call(state, x, ctx).block_until_ready()
  unet_compile = time.perf_counter() - start
  unet = _time(lambda: call(state, x, ctx).block_until_ready(), repeats)
  kw = dict(height=size, width=size, num_inference_steps=steps, progress=False)
  start = time.perf_counter()
  pipe(PROMPTS, **kw).block_until_ready()
  first = time.perf_counter() - start
  run = _time(lambda: pipe(PROMPTS, **kw).block_until_ready(), max(1, repeats // 2))
  return {
    "unet_s": unet,
    "unet_compile_s": unet_compile,
    "pipeline_s": run,
    "pipeline_first_s": first,
  }


def main() -> int:
  parser = argparse.ArgumentParser(
    description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
  )
  parser.add_argument("--preset", choices=["tiny", "small"], default="small")
  parser.add_argument("--model", help="a diffusers SD 1.x/2.x pipeline folder (overrides --preset)")
  parser.add_argument("--size", type=int, help="image size in pixels (default: 32 tiny, 128 small)")
  parser.add_argument("--steps", type=int, default=10)
  parser.add_argument("--repeats", type=int, default=5)
  parser.add_argument("--md-worker", action="store_true", help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args.md_worker:
    print(json.dumps(run_md(args.model, args.size, args.steps, args.repeats)))
    return 0
  model, size = args.model, args.size
  if model is None and args.preset == "tiny":
    model, size = str(ROOT / "tests/fixtures/sd_pipeline/sd"), size or 32
  elif model is None:
    folder = pathlib.Path(os.environ.get("TMPDIR", "/tmp")) / "md_bench_sd_small"
    if not (folder / "model_index.json").is_file():
      _build_small(folder)
    model, size = str(folder), size or 128
  size = size or 512
  ref = run_reference(model, size, args.steps, args.repeats)
  cmd = [
    "uv",
    "run",
    "python",
    str(pathlib.Path(__file__).resolve()),
    "--md-worker",
    "--model",
    model,
  ]
  cmd += ["--size", str(size), "--steps", str(args.steps), "--repeats", str(args.repeats)]
  env = dict(os.environ, MD_PROGRESS="0")
  out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, check=False)
  if out.returncode:
    print(out.stderr[-3000:], file=sys.stderr)
    return out.returncode
  md = json.loads(out.stdout.strip().splitlines()[-1])
  print(f"model {model}, {size}x{size} px, {args.steps} steps, CFG (UNet batch 2), float32")
  print(f"{'':22}{'diffusers':>12}{'md':>12}{'ratio':>8}")
  for name, key in (("UNet call (s)", "unet_s"), ("pipeline run (s)", "pipeline_s")):
    print(f"{name:22}{ref[key]:12.4f}{md[key]:12.4f}{ref[key] / md[key]:8.2f}")
  print(
    f"md compile: UNet {md['unet_compile_s']:.1f}s, first pipeline run {md['pipeline_first_s']:.1f}s"
  )
  print(f"torch threads: {ref['threads']}")
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
