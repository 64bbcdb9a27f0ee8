"""Attention benchmark: time and peak temporary memory per implementation and sequence length.

uv run python bench/attention.py --seq_lengths=1024,4096,16384 --implementations=dot_product,blockwise

Each row is one implementation at one sequence length: forward and forward+backward wall time (best
of --repeats, after a warm-up/compile run) and the compiled forward+backward program's temporary bytes
(`memory_analysis().temp_size_in_bytes`, per device), next to `dot_product` at the same length. On CPU
the context-parallel variants run on virtual devices (XLA_FLAGS device count, default 8) that share
the host's cores: their times show overhead, not speed-up. dot_product is skipped where its S x S
scores would not fit --max_dense_bytes, and every implementation from --compile_only_from on; their
memory is then still reported from compilation alone.
"""

from __future__ import annotations

import argparse
import datetime
import os
import time

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
  ).strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import md_attention as mda  # noqa: E402
import md_attention.testing as mdat  # noqa: E402

CONTEXT_PARALLEL = ("ring", "ulysses", "ulysses_ring")


def _time(fn, args, repeats: int) -> float:
  jax.block_until_ready(fn(*args))
  best = float("inf")
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    best = min(best, time.perf_counter() - start)
  return best


def bench_one(implementation, s, args, mesh):
  shape = (args.batch, s, args.heads, args.head_dim)
  dtype = jnp.dtype(args.dtype)
  config = mda.AttentionConfig(
    implementation=implementation, block_q=args.block, block_kv=args.block, ulysses_degree=2
  )
  use_mesh = mesh if implementation in CONTEXT_PARALLEL else None

  def forward(q, k, v):
    return mda.attention(q, k, v, causal=args.causal, mesh=use_mesh, config=config)

  def loss(q, k, v):
    return jnp.sum(forward(q, k, v).astype(jnp.float32))

  fwd = jax.jit(forward)
  fwd_bwd = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
  abstract = [jax.ShapeDtypeStruct(shape, dtype)] * 3
  temp = fwd_bwd.lower(*abstract).compile().memory_analysis().temp_size_in_bytes
  dense = args.batch * args.heads * s * s * 4
  if s >= args.compile_only_from or (
    implementation == "dot_product" and dense > args.max_dense_bytes
  ):
    return dict(fwd=None, fwd_bwd=None, temp=temp)
  rng = np.random.default_rng(0)
  qkv = [jnp.asarray(rng.standard_normal(shape), dtype) for _ in range(3)]
  return dict(
    fwd=_time(fwd, qkv, args.repeats), fwd_bwd=_time(fwd_bwd, qkv, args.repeats), temp=temp
  )


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--seq_lengths", default="1024,4096,16384")
  parser.add_argument(
    "--implementations", default="dot_product,blockwise,ring,ulysses,ulysses_ring"
  )
  parser.add_argument("--batch", type=int, default=1)
  parser.add_argument("--heads", type=int, default=8)
  parser.add_argument("--head_dim", type=int, default=64)
  parser.add_argument("--dtype", default="float32")
  parser.add_argument("--block", type=int, default=512)
  parser.add_argument("--causal", action="store_true")
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--context", type=int, default=8, help="context axis size for ring/ulysses")
  parser.add_argument("--max_dense_bytes", type=float, default=4e9)
  parser.add_argument(
    "--compile_only_from", type=int, default=1 << 62, help="only compile (memory) from this S on"
  )
  args = parser.parse_args()

  mesh = mdat.make_mesh((1, 1, args.context, 1)) if len(jax.devices()) >= args.context else None
  device = jax.devices()[0]
  print(
    f"# {datetime.date.today()} · {device.platform} {device.device_kind} · {len(jax.devices())} "
    f"devices · {os.cpu_count()} CPUs · jax {jax.__version__}"
  )
  print(
    f"# B={args.batch} H={args.heads} D={args.head_dim} {args.dtype} causal={args.causal} "
    f"block={args.block} context={args.context}"
  )
  print("| implementation | S | fwd ms | fwd+bwd ms | temp MiB (fwd+bwd) | time / dot_product |")
  print("|---|---:|---:|---:|---:|---:|")
  ms = lambda t: "skipped" if t is None else f"{t * 1e3:.1f}"
  for s in (int(x) for x in args.seq_lengths.split(",")):
    reference = None
    for implementation in args.implementations.split(","):
      if implementation in CONTEXT_PARALLEL and mesh is None:
        continue
      r = bench_one(implementation, s, args, mesh)
      if implementation == "dot_product":
        reference = r["fwd_bwd"]
      ratio = "" if reference is None or r["fwd_bwd"] is None else f"{r['fwd_bwd'] / reference:.2f}"
      print(
        f"| {implementation} | {s} | {ms(r['fwd'])} | {ms(r['fwd_bwd'])} | "
        f"{r['temp'] / 2**20:.1f} | {ratio} |",
        flush=True,
      )


if __name__ == "__main__":
  main()
