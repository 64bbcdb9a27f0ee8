"""Real-size plans without running them: per-device weight and activation bytes, FLOPs per denoiser step.

uv run --no-sync python bench/plans.py                    # lowered: FLOPs; weights from the abstract state
uv run --no-sync python bench/plans.py --compile          # also compile (CPU) for memory_analysis()
uv run --no-sync python bench/plans.py --tiny             # the same path on the families' tiny variants

Each model is built with `nnx.eval_shape` from its real config (the families' VARIANTS), bfloat16, and one
jitted denoiser call (the transformer forward at the step's batch) is lowered on `jax.ShapeDtypeStruct`
inputs: nothing is allocated or run. FLOPs are the matmul/conv FLOPs of the step's jaxpr with every scan body
counted times its length (bench/_flops.py; XLA's `lowered.cost_analysis()` counts a loop body once, so a
scanned 40-block stack would read as one block). Weight bytes
are exact (abstract parameter shapes; per device from the shard shapes of md-sharding's rules on an 8-device
`fsdp` mesh, faked with --xla_force_host_platform_device_count=8); int8 counts 1 byte per element for
the >= 2-d matmul / conv kernels and keeps the rest in bfloat16. Activation (temporary) bytes are compiled
numbers (`compiled.memory_analysis().temp_size_in_bytes`, CPU backend) with --compile, else marked "n/a".
"""

from __future__ import annotations

import argparse
import os
import sys
import time

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
  ).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

import md_sharding as mds  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _flops import count_flops  # noqa: E402
from _models import Plan, flux_plan, ltx2_plan, wan_plan  # noqa: E402

BF16 = jnp.bfloat16
GiB = 2**30
ACCELERATORS = {"H200": 141, "v5p": 95, "v6e": 32, "v5e": 16}  # GB of HBM per chip


def _bf16_state(model):
  """The model's abstract state in bfloat16 (floating leaves), and the int8 byte count."""
  graphdef, state = nnx.split(model)
  leaves = jax.tree.leaves(state)
  bf16 = sum(
    x.size * (2 if jnp.issubdtype(x.dtype, jnp.floating) else x.dtype.itemsize) for x in leaves
  )
  int8 = sum(x.size * (1 if x.ndim >= 2 and x.size >= 2**16 else 2) for x in leaves)
  state = jax.tree.map(
    lambda x: jax.ShapeDtypeStruct(
      x.shape, BF16 if jnp.issubdtype(x.dtype, jnp.floating) else x.dtype
    ),
    state,
  )
  return graphdef, state, bf16, int8


def analyse(plan: Plan, devices: int, compile_: bool) -> dict:
  model = nnx.eval_shape(plan.build)
  graphdef, state, bf16, int8 = _bf16_state(model)
  mesh = None
  per_device_weights = bf16
  in_shardings = None
  if devices > 1:
    mesh = mds.make_mesh(mds.MeshConfig(ici_fsdp_parallelism=devices))
    from md_core import _loading

    variables = dict(nnx.to_flat_state(nnx.state(model)))
    shard_flat = []
    total = 0
    for path, leaf in nnx.to_flat_state(state):
      sharding = _loading.placement(variables[path], tuple(leaf.shape), mesh)
      shard_flat.append((path, sharding))
      total += int(np.prod(sharding.shard_shape(tuple(leaf.shape)))) * leaf.dtype.itemsize
    per_device_weights = total
    param_shardings = nnx.from_flat_state(shard_flat)
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    in_shardings = (param_shardings, {k: replicated for k in plan.inputs})

  def step(state, inputs):
    return plan.call(nnx.merge(graphdef, state), **inputs)

  start = time.perf_counter()
  jitted = jax.jit(step, in_shardings=in_shardings) if in_shardings else jax.jit(step)
  if mesh is not None:
    with jax.set_mesh(mesh):
      lowered = jitted.lower(state, plan.inputs)
  else:
    lowered = jitted.lower(state, plan.inputs)
  result = {
    "flops": float(count_flops(step, state, plan.inputs)),
    "weights": bf16 * plan.experts,
    "weights_int8": int8 * plan.experts,
    "per_device_weights": per_device_weights * plan.experts,
    "temp": None,
    "lower_s": time.perf_counter() - start,
  }
  if compile_:
    start = time.perf_counter()
    mem = lowered.compile().memory_analysis()
    result["temp"] = int(mem.temp_size_in_bytes)
    result["compile_s"] = time.perf_counter() - start
  return result


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--tiny", action="store_true", help="the tiny variants (a quick check)")
  parser.add_argument("--compile", action="store_true", help="compile for memory_analysis()")
  parser.add_argument("--models", default="flux,wan14b,wan22,ltx2")
  parser.add_argument("--devices", default="1,8")
  args = parser.parse_args()
  makers = {
    "flux": lambda: flux_plan(args.tiny),
    "wan14b": lambda: wan_plan("2.1-t2v-14b", args.tiny),
    "wan22": lambda: wan_plan("2.2-t2v-a14b", args.tiny),
    "ltx2": lambda: ltx2_plan(args.tiny),
  }
  print(
    f"# jax {jax.__version__}, {jax.device_count()} CPU devices; bf16 weights; "
    f"temp = {'compiled (CPU backend)' if args.compile else 'not compiled'}"
  )
  print(
    "| model | devices | TFLOP / step | weights GB bf16 (int8) | per-device weights GB | "
    "per-device temp GB | lower s |"
  )
  print("|---|---|---|---|---|---|---|")
  for name in args.models.split(","):
    plan = makers[name]()
    for devices in (int(d) for d in args.devices.split(",")):
      r = analyse(plan, devices, args.compile)
      temp = "n/a" if r["temp"] is None else f"{r['temp'] / 1e9:.4g}"
      print(
        f"| {plan.name} | {devices} | {r['flops'] / 1e12:.4g} | {r['weights'] / 1e9:.4g} "
        f"({r['weights_int8'] / 1e9:.4g}) | {r['per_device_weights'] / 1e9:.4g} | {temp} "
        f"| {r['lower_s']:.0f} |",
        flush=True,
      )
  sys.stdout.flush()


if __name__ == "__main__":
  main()
