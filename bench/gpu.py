"""The device checks of bench/gpu.sh: step times, MFU, attention kernels, quantized steps, LoRA hot-swap.

uv run --no-sync python bench/gpu.py --part=all --tiny     # CPU, tiny sizes: checks that every part runs
uv run --no-sync python bench/gpu.py --part=flux            # on the accelerator, at full size

Parts (each prints one markdown table row per measurement):
  peak       the measured bf16 matmul peak (8192^3, best of 5): the MFU denominator;
  flux       Flux.1-dev-sized random weights, bf16, 1024x1024, 28 Euler steps in one jitted loop;
  wan        one Wan 2.1 14B-sized step at 720p x 81 frames (one batch row; CFG doubles it);
  attention  md-attention's cudnn against blockwise at 4k / 16k / 32k tokens (24 heads of 128);
  quant      the Flux step with md_core.quantize "int8" / "fp8" weights against bf16 (skipped with a
             message when md_core has no quantize);
  lora       a Flux step with rank-32 LoRA slots; adapters swapped between steps (md_core.set_lora)
             while it runs: step time with and without swaps, and that nothing recompiled.
Weights are random (made on the device, never downloaded); FLOPs are counted from the jaxpr
(bench/_flops.py: matmul and conv work, scan bodies times their length). MFU = FLOPs / time / measured peak.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _flops import count_flops  # noqa: E402
from _models import flux_plan, wan_plan  # noqa: E402

BF16 = jnp.bfloat16
_PEAK: list[float] = []


def _row(*cells) -> None:
  print("| " + " | ".join(str(c) for c in cells) + " |", flush=True)


def _time(fn, *args, repeats: int = 3) -> float:
  """Best wall time of `fn(*args)` after one warm-up (compile) call."""
  jax.block_until_ready(fn(*args))
  best = float("inf")
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    best = min(best, time.perf_counter() - start)
  return best


def measure_peak(tiny: bool) -> float:
  n = 512 if tiny else 8192
  a = jax.random.normal(jax.random.key(0), (n, n), BF16)
  mm = jax.jit(lambda x, y: x @ y)
  t = _time(mm, a, a, repeats=5)
  peak = 2 * n**3 / t
  _PEAK.append(peak)
  _row("peak", f"bf16 matmul {n}^3", f"{t * 1e3:.2f} ms", f"{peak / 1e12:.3g} TFLOP/s", "")
  return peak


def _peak() -> float:
  return _PEAK[0] if _PEAK else float("nan")


def random_model(plan, seed: int = 0):
  """`plan`'s model with random bfloat16 weights made on the device (no float32 init on the host)."""
  graphdef, abstract = nnx.split(nnx.eval_shape(plan.build))
  leaves, treedef = jax.tree.flatten(abstract)

  @jax.jit
  def make(key):
    keys = jax.random.split(key, len(leaves))
    out = []
    for k, x in zip(keys, leaves, strict=True):
      if jnp.issubdtype(x.dtype, jnp.floating):
        out.append(0.02 * jax.random.normal(k, x.shape, BF16))
      else:
        out.append(jnp.zeros(x.shape, x.dtype))
    return out

  state = jax.tree.unflatten(treedef, make(jax.random.key(seed)))
  return graphdef, state


def random_inputs(plan, seed: int = 1):
  keys = jax.random.split(jax.random.key(seed), len(plan.inputs))
  out = {}
  for k, (name, s) in zip(keys, plan.inputs.items(), strict=True):
    if name in ("timestep",):
      out[name] = jnp.full(s.shape, 0.5, s.dtype)
    elif name == "guidance":
      out[name] = jnp.full(s.shape, 3.5, s.dtype)
    elif name.endswith("_ids"):
      out[name] = jnp.zeros(s.shape, s.dtype)
    else:
      out[name] = jax.random.normal(k, s.shape, s.dtype)
  return out


def _euler_loop(plan, graphdef, steps: int):
  """`steps` Euler steps of the flow in one jitted fori_loop (the sampling loop's shape)."""

  def run(state, inputs):
    def body(i, x):
      t = inputs["timestep"]
      t = jnp.full(t.shape, 1.0 - i / steps, t.dtype)
      v = plan.call(nnx.merge(graphdef, state), **{**inputs, "hidden_states": x, "timestep": t})
      return (x - v.astype(x.dtype) / steps).astype(x.dtype)

    return jax.lax.fori_loop(0, steps, body, inputs["hidden_states"])

  return jax.jit(run)


def _step_fn(plan, graphdef):
  return jax.jit(lambda state, inputs: plan.call(nnx.merge(graphdef, state), **inputs))


def part_flux(tiny: bool, steps: int = 28) -> None:
  plan = flux_plan(tiny)
  graphdef, state = random_model(plan)
  inputs = random_inputs(plan)
  flops = count_flops(lambda s, i: plan.call(nnx.merge(graphdef, s), **i), state, inputs)
  loop = _euler_loop(plan, graphdef, steps)
  t = _time(loop, state, inputs, repeats=1 if not tiny else 2)
  mfu = flops * steps / t / _peak()
  _row(
    "flux",
    f"{plan.name}, {steps} steps",
    f"{t:.2f} s",
    f"{flops / 1e12:.3g} TFLOP/step",
    f"{mfu:.1%}",
  )


def part_wan(tiny: bool) -> None:
  plan = wan_plan("2.1-t2v-14b", tiny)
  plan.inputs = {
    k: jax.ShapeDtypeStruct((1,) + v.shape[1:], v.dtype) for k, v in plan.inputs.items()
  }
  graphdef, state = random_model(plan)
  inputs = random_inputs(plan)
  step = _step_fn(plan, graphdef)
  flops = count_flops(lambda s, i: plan.call(nnx.merge(graphdef, s), **i), state, inputs)
  t = _time(step, state, inputs, repeats=1 if not tiny else 2)
  _row(
    "wan",
    f"{plan.name}, 1 row",
    f"{t:.2f} s",
    f"{flops / 1e12:.3g} TFLOP/step",
    f"{flops / t / _peak():.1%}",
  )


def attention_rows(
  tiny: bool, kernel: str | None, backward: bool = False, dense: bool = False
) -> None:
  """Rows timing md-attention's `kernel` (None: none on this backend) against `blockwise` at 4k / 16k / 32k
  tokens (24 heads of 128, bf16); `backward` adds forward+backward rows (the gradient of the summed output,
  counted as 3.5x the forward's 4 S^2 H D FLOPs), `dense` adds `dot_product` where its scores fit 2 GiB."""
  import md_attention as mda

  lengths = (256, 512) if tiny else (4096, 16384, 32768)
  heads, dim = (4, 32) if tiny else (24, 128)
  impls = ([kernel] if kernel else []) + ["blockwise"]
  for s in lengths:
    q, k, v = (
      jax.random.normal(key, (1, s, heads, dim), BF16)
      for key in jax.random.split(jax.random.key(s), 3)
    )
    fwd_flops = 4 * s * s * heads * dim
    names = impls + (["dot_product"] if dense and heads * s * s * 4 <= 2**31 else [])
    for impl in names:

      def call(q, k, v, impl=impl):
        return mda.attention(q, k, v, implementation=impl)

      runs = [("forward" if backward else "", jax.jit(call), fwd_flops)]
      if backward:
        summed = lambda q, k, v, call=call: jnp.sum(call(q, k, v).astype(jnp.float32))  # noqa: E731
        runs.append(("fwd+bwd", jax.jit(jax.grad(summed, argnums=(0, 1, 2))), 3.5 * fwd_flops))
      for label, fn, flops in runs:
        t = _time(fn, q, k, v)
        _row(
          "attention",
          " ".join(x for x in (impl, label, f"{s} tokens") if x),
          f"{t * 1e3:.2f} ms",
          f"{flops / t / 1e12:.3g} TFLOP/s",
          f"{flops / t / _peak():.1%}",
        )


def part_attention(tiny: bool) -> None:
  on_gpu = jax.default_backend() == "gpu"
  if not on_gpu:
    _row("attention", "cudnn", "skipped: not on an NVIDIA GPU", "", "")
  attention_rows(tiny, "cudnn" if on_gpu else None)


def part_quant(tiny: bool) -> None:
  import md_core

  if not hasattr(md_core, "quantize"):
    _row("quant", "skipped: md_core has no quantize", "", "", "")
    return
  plan = flux_plan(tiny)
  inputs = random_inputs(plan)
  times = {}
  for mode in ("bf16", "int8", "fp8"):
    graphdef, state = random_model(plan)
    if mode != "bf16":
      model = nnx.merge(graphdef, state)
      md_core.quantize(model, mode)
      graphdef, state = nnx.split(model)
    times[mode] = t = _time(_step_fn(plan, graphdef), state, inputs)
    weights = sum(x.nbytes for x in jax.tree.leaves(state))
    _row(
      "quant",
      f"{plan.name} step, {mode} weights",
      f"{t * 1e3:.1f} ms",
      f"{weights / 1e9:.2f} GB weights",
      f"{times['bf16'] / t:.2f}x bf16",
    )
    del state


def part_lora(tiny: bool, rank: int = 32, steps: int = 6) -> None:
  import md_core

  plan = flux_plan(tiny)
  graphdef, state = random_model(plan)
  model = nnx.merge(graphdef, state)
  paths = md_core.add_lora_slots(model, rank, dtype=BF16)
  graphdef, state = nnx.split(model)
  inputs = random_inputs(plan)
  step = _step_fn(plan, graphdef)
  base = _time(step, state, inputs)
  compiled = step._cache_size() if hasattr(step, "_cache_size") else None
  rng = np.random.default_rng(0)
  flat = {".".join(map(str, p)): v for p, v in nnx.to_flat_state(state)}
  adapters = []  # two adapters of rank R/2 on the first 8 slotted layers, swapped every step
  for scale in (1.0, 0.5):
    adapter = {}
    for path in paths[:8]:
      a, b = flat[path + ".lora_a"].shape, flat[path + ".lora_b"].shape
      r = rank // 2
      down = 0.01 * rng.normal(size=tuple(a[:-1]) + (r,)).astype(np.float32)
      up = 0.01 * rng.normal(size=tuple(b[:-2]) + (r, b[-1])).astype(np.float32)
      adapter[path] = md_core.LoRASlotWeight(a=down, b=up, scale=scale)
    adapters.append(adapter)
  swapped = []
  x = None
  for i in range(steps):
    start = time.perf_counter()
    state = md_core.set_lora(state, adapters[i % 2])
    x = step(state, inputs)
    jax.block_until_ready(x)
    swapped.append(time.perf_counter() - start)
  recompiled = (step._cache_size() - compiled) if compiled is not None else "n/a"
  _row(
    "lora",
    f"{plan.name} step, rank {rank}, {len(adapters[0])} layers swapped each step",
    f"{np.median(swapped) * 1e3:.1f} ms (no swap {base * 1e3:.1f} ms)",
    f"recompiles: {recompiled}",
    "",
  )


PARTS = {
  "flux": part_flux,
  "wan": part_wan,
  "attention": part_attention,
  "quant": part_quant,
  "lora": part_lora,
}


def run_parts(
  parts: dict, doc: str, columns: tuple[str, str, str], keep_going: bool = False
) -> None:
  """The command line shared by gpu.py and tpu.py: `--part` (all or a comma list) and `--tiny`; prints
  the table's header, the peak row and each part's rows. `keep_going`: a failing part prints its traceback
  and a row saying so, and the next part runs."""
  parser = argparse.ArgumentParser(description=doc.splitlines()[0])
  parser.add_argument("--part", default="all", help=f"all or a comma list of {sorted(parts)}")
  parser.add_argument("--tiny", action="store_true", help="tiny sizes (any backend)")
  args = parser.parse_args()
  names = list(parts) if args.part == "all" else args.part.split(",")
  unknown = [n for n in names if n not in parts]
  if unknown:
    parser.error(
      f"--part: unknown {', '.join(unknown)}; expected all or some of {', '.join(parts)}"
    )
  print(
    f"# jax {jax.__version__} on {jax.devices()[0].device_kind}; {'tiny' if args.tiny else 'full size'}"
  )
  _row("part", "what", *columns)
  _row("---", "---", "---", "---", "---")
  measure_peak(args.tiny)
  for name in names:
    start = time.perf_counter()
    try:
      parts[name](args.tiny)
    except Exception as e:
      if not keep_going:
        raise
      traceback.print_exc()
      _row(
        name,
        f"failed: {type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}",
        "",
        "",
        "",
      )
    print(f"# {name}: {time.perf_counter() - start:.0f} s", flush=True)


def main() -> None:
  run_parts(PARTS, __doc__, ("time", "work", "MFU / ratio"))


if __name__ == "__main__":
  main()
