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
import dataclasses
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

BF16 = jnp.bfloat16
GiB = 2**30
ACCELERATORS = {"H200": 141, "v5p": 95, "v6e": 32, "v5e": 16}  # GB of HBM per chip


@dataclasses.dataclass
class Plan:
  name: str
  build: object  # () -> nnx.Module
  inputs: dict  # name -> ShapeDtypeStruct
  call: object  # (model, **inputs) -> output
  experts: int = 1  # Wan 2.2 A14B keeps two same-sized experts


def _sds(shape, dtype=BF16):
  return jax.ShapeDtypeStruct(tuple(shape), dtype)


def flux_plan(tiny: bool) -> Plan:
  import md_flux

  cfg = md_flux.FLUX_VARIANTS["tiny" if tiny else "dev"]
  side = 64 if tiny else 1024  # pixels; latents are 8x smaller, packed 2x2
  tokens, text = (side // 16) ** 2, 8 if tiny else 512
  inputs = dict(
    hidden_states=_sds((1, tokens, cfg.in_channels)),
    encoder_hidden_states=_sds((1, text, cfg.joint_attention_dim)),
    pooled_projections=_sds((1, cfg.pooled_projection_dim)),
    timestep=_sds((1,), jnp.float32),
    img_ids=_sds((tokens, 3), jnp.float32),
    txt_ids=_sds((text, 3), jnp.float32),
    guidance=_sds((1,), jnp.float32),
  )
  return Plan(
    f"Flux.1-dev {side}x{side}",
    lambda: md_flux.FluxTransformer(cfg, rngs=nnx.Rngs(0)),
    inputs,
    lambda m, **kw: m(**kw),
  )


def wan_plan(variant: str, tiny: bool) -> Plan:
  import md_wan

  cfg = md_wan.VARIANTS["tiny" if tiny else variant]
  f, h, w = (3, 8, 8) if tiny else (21, 90, 160)  # 81 frames of 720x1280: 4x temporal, 8x spatial
  text = 8 if tiny else 512
  inputs = dict(
    hidden_states=_sds((2, f, h, w, cfg.in_channels)),  # CFG: negative and positive rows
    timestep=_sds((2,), jnp.float32),
    encoder_hidden_states=_sds((2, text, cfg.text_dim)),
  )
  label = {"2.1-t2v-14b": "Wan 2.1 14B", "2.2-t2v-a14b": "Wan 2.2 A14B (2 experts)"}[variant]
  return Plan(
    f"{label} {'tiny' if tiny else '720p x 81'}",
    lambda: md_wan.WanTransformer(cfg, rngs=nnx.Rngs(0)),
    inputs,
    lambda m, **kw: m(**kw, layout="BFHWC"),
    experts=2 if variant.startswith("2.2") else 1,
  )


def ltx2_plan(tiny: bool) -> Plan:
  import md_ltx

  cfg = md_ltx.LTX2_VARIANTS["tiny" if tiny else "2.0"]
  frames, height, width = (9, 64, 64) if tiny else (121, 512, 768)
  f, h, w = (frames - 1) // 8 + 1, height // 32, width // 32
  audio = round(frames / 24 * 25)  # audio latents at 25 per second of 24 fps video
  text = 8 if tiny else 1024
  inputs = dict(
    hidden_states=_sds((2, f * h * w, cfg.in_channels)),
    audio_hidden_states=_sds((2, audio, cfg.audio_in_channels)),
    encoder_hidden_states=_sds((2, text, cfg.caption_channels)),
    audio_encoder_hidden_states=_sds((2, text, cfg.caption_channels)),
    timestep=_sds((2,), jnp.float32),
  )

  def call(m, **kw):
    grid = dict(num_frames=f, height=h, width=w, audio_num_frames=audio)
    return m(**kw, **grid)

  return Plan(
    f"LTX-2 {'tiny' if tiny else f'{width}x{height} x {frames}'}",
    lambda: md_ltx.LTX2Transformer(cfg, rngs=nnx.Rngs(0)),
    inputs,
    call,
  )


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
