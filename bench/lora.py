"""LoRA benchmark: hot-swap time and the per-step cost of run-time LoRA next to merged, on one pipeline.

uv run python bench/lora.py --model=tests/fixtures/sd_pipeline/sd --size=64 --ranks=4,16,64

A random-init SD pipeline (default: the tiny test fixture) with random PEFT LoRAs on the UNet's attention
and conv layers (sd_a's modules in tests/fixtures/lora, at each rank). Rows:
  swap       `pipe.set_adapters` between two loaded adapters (host fill of the slots + transfer), ms,
             and `pipe.load_lora` of a new file (read + map + fill), ms; compilations while swapping.
  per step   one denoising step's UNet call (batch 2, --size px; mean of --steps calls, best of --repeats,
             the variants round-robin) for: the base
             model (no slots), merged (`fuse_lora`, the same programs as the base), run time with slots of
             --max_rank on every Dense and Conv, and run time with slots on the attention projections only
             (`targets=`); each after a warm-up call, best of --repeats.
"""

from __future__ import annotations

import argparse
import pathlib
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import md_core
import md_sd

ROOT = pathlib.Path(__file__).resolve().parents[1]
PROMPTS = ["a photo of a cat"]
ATTENTION = ("to_q", "to_k", "to_v", "to_out.0")  # reference module names in the file
ATTENTION_SLOTS = ("to_q", "to_k", "to_v", "to_out")  # md layer paths


def _peft(
  path: pathlib.Path, template: pathlib.Path, rank: int, seed: int, keep=None
) -> pathlib.Path:
  rng = np.random.default_rng(seed)
  f = md_core.SafetensorsFile(template)
  tensors = {}
  for key in f:
    module = key.partition(".lora_")[0]
    if keep is not None and not any(module.endswith(k) for k in keep):
      continue
    shape = list(np.shape(f[key]))
    shape[0 if ".lora_A." in key else 1] = rank
    tensors[key] = (0.05 * rng.standard_normal(shape)).astype(np.float32)
  md_core.save_safetensors(path, tensors)
  return path


def _call(pipe, steps: int, size: int) -> float:
  start = time.perf_counter()
  out = pipe(PROMPTS, height=size, width=size, num_inference_steps=steps, seed=0, progress=False)
  jax.block_until_ready(out)
  return time.perf_counter() - start


def _per_step(pipes: dict, args) -> dict[str, float]:
  """One denoising step's UNet call (batch 2: CFG's rows) of each pipeline with its own state (slots
  included), timed round-robin (a machine whose load drifts biases none), best of --repeats means."""
  lat = args.size // 8
  x = jnp.asarray(np.random.default_rng(0).standard_normal((2, lat, lat, 4)), jnp.float32)
  t = jnp.asarray([500.0, 500.0], jnp.float32)
  fns = {}
  for name, pipe in pipes.items():
    split = pipe._unet  # the state the pipeline's programs take
    dim = pipe.unet.cfg.cross_attention_dim
    dim = dim[0] if isinstance(dim, tuple | list) else dim
    ctx = jnp.asarray(np.random.default_rng(1).standard_normal((2, 77, dim)), jnp.float32)
    fn = jax.jit(lambda state, x, t, c, g=split.graphdef: nnx.merge(g, state)(x, t, c))
    jax.block_until_ready(fn(split.state, x, t, ctx))  # compile
    fns[name] = (fn, split.state, ctx)
  best = dict.fromkeys(pipes, float("inf"))
  for _ in range(args.repeats):
    for name, (fn, state, ctx) in fns.items():
      start = time.perf_counter()
      for _ in range(args.steps):
        out = fn(state, x, t, ctx)
      jax.block_until_ready(out)
      best[name] = min(best[name], (time.perf_counter() - start) / args.steps)
  return best


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--model", default=str(ROOT / "tests/fixtures/sd_pipeline/sd"))
  ap.add_argument("--template", default=str(ROOT / "tests/fixtures/lora/sd_a.safetensors"))
  ap.add_argument("--size", type=int, default=64)
  ap.add_argument("--steps", type=int, default=8)
  ap.add_argument("--repeats", type=int, default=3)
  ap.add_argument("--ranks", default="4,16,64")
  ap.add_argument("--max_rank", type=int, default=64)
  args = ap.parse_args()
  ranks = [int(r) for r in args.ranks.split(",")]
  tmp = pathlib.Path(tempfile.mkdtemp())
  template = pathlib.Path(args.template)
  files = {r: _peft(tmp / f"r{r}.safetensors", template, r, r) for r in ranks}
  print(
    f"devices: {jax.devices()[0].platform} x {jax.device_count()}; model {args.model}, {args.size} px"
  )

  base = md_sd.load_pipeline(args.model)
  merged = md_sd.load_pipeline(args.model)
  merged.load_lora(files[ranks[-1]], name="m", fuse=True)

  rt = md_sd.load_pipeline(args.model)
  for r, f in files.items():
    rt.load_lora(f, name=f"r{r}", max_rank=args.max_rank if r == ranks[0] else None)
    rt.set_adapters({})  # loaded, not active: the ranks together exceed the slot
  rt.set_adapters({f"r{ranks[-1]}": 1.0})
  _call(rt, 1 + args.steps, args.size)  # compile before counting
  compiles = []

  def listen(event, duration, **kw):
    if event == "/jax/core/compile/backend_compile_duration":
      compiles.append(duration)

  jax.monitoring.register_event_duration_secs_listener(listen)
  swaps = []
  for i in range(10):
    r = ranks[i % len(ranks)]
    start = time.perf_counter()
    rt.set_adapters({f"r{r}": 0.5 + 0.1 * i})
    jax.block_until_ready(jax.tree.leaves(rt._unet.state))
    swaps.append(time.perf_counter() - start)
  start = time.perf_counter()
  rt.load_lora(_peft(tmp / "new.safetensors", template, 8, 99), name="new")
  jax.block_until_ready(jax.tree.leaves(rt._unet.state))
  t_load = time.perf_counter() - start
  _call(rt, 1 + args.steps, args.size)
  jax.monitoring.unregister_event_duration_listener(listen)

  attn = md_sd.load_pipeline(args.model)
  f_attn = _peft(tmp / "attn.safetensors", template, ranks[-1], 7, keep=ATTENTION)
  attn.load_lora(f_attn, name="attn", max_rank=args.max_rank, targets=ATTENTION_SLOTS)
  rt.set_adapters({f"r{ranks[-1]}": 1.0})
  t = _per_step(dict(base=base, merged=merged, runtime=rt, attn=attn), args)
  t_base, t_merged, t_runtime, t_attn = t["base"], t["merged"], t["runtime"], t["attn"]

  print(
    f"swap: set_adapters median {1e3 * float(np.median(swaps)):.1f} ms (max {1e3 * max(swaps):.1f}),"
    f" load_lora {1e3 * t_load:.0f} ms, {len(compiles)} compilations while swapping and running"
  )
  print("per step (ms):")
  print(f"  base (no LoRA)                         {1e3 * t_base:8.2f}")
  print(f"  merged (fuse_lora, rank {ranks[-1]:>3})            {1e3 * t_merged:8.2f}")
  print(f"  run time, every Dense+Conv, slot {args.max_rank:>3}   {1e3 * t_runtime:8.2f}")
  print(f"  run time, attention only, slot {args.max_rank:>3}     {1e3 * t_attn:8.2f}")
  print(
    f"  run time / merged: {t_runtime / t_merged:.2f} (all layers), {t_attn / t_merged:.2f} (attn)"
  )


if __name__ == "__main__":
  main()
