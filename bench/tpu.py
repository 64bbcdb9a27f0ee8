"""TPU checks (never run in CI): the splash kernel on the chip, its numerics and speed, and a Wan step.

uv run --no-sync python bench/tpu.py                 # every part, on a TPU
uv run --no-sync python bench/tpu.py --part=splash   # one part (splash, attention, wan, flux_quant)
uv run --no-sync python bench/tpu.py --tiny          # tiny sizes anywhere (splash through the Pallas interpreter)

Parts (each prints markdown table rows; bench/README.md, "TPU checks", has a measured table):
  peak            the bf16 matmul peak (8192^3, best of 5): the MFU denominator;
  splash          md-attention's splash wrapper against `dot_product` in float32 at the highest matmul
                  precision: output and dq, dk, dv max abs errors for full, causal, windowed, padded-key,
                  odd-length, grouped-K/V and bf16 cases, beside `blockwise` on the same inputs;
  attention       splash against blockwise (and dot_product where the scores fit) at 4k / 16k / 32k tokens,
                  24 heads of 128, bf16, forward and forward + backward;
  wan             one Wan 2.1 1.3B step at 480p x 81 frames (32 760 tokens, one row, random bf16 weights)
                  with splash and with blockwise self-attention;
  flux_quant      Flux.1-dev-sized random weights at 1024x1024 made quantized on the chip: half the blocks in
                  bf16 / int8 / fp8 / int8-dynamic, and the whole model in int8 (one step, 28 steps);
Each part runs under its own try, so a failing part leaves a row saying why and the others still run.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _flops import count_flops  # noqa: E402
from gpu import (  # noqa: E402
  _peak,
  _row,
  _step_fn,
  _time,
  attention_rows,
  random_inputs,
  random_model,
  run_parts,
)

F32 = jnp.float32
BF16 = jnp.bfloat16


def _on_tpu() -> bool:
  return jax.default_backend() == "tpu"


@dataclasses.dataclass(frozen=True)
class Case:
  name: str
  s_q: int
  s_kv: int
  heads: int = 8
  kv_heads: int = 8
  dim: int = 128
  causal: bool = False
  window: int | None = None
  padded: int = 0  # this many trailing keys masked out in every row
  dtype: object = F32


def _cases(tiny: bool) -> list[Case]:
  n = 256 if tiny else 1024
  return [
    Case("full", n, n),
    Case("causal", n, n, causal=True),
    Case("window 128, causal", n, n, causal=True, window=128),
    Case("padded keys, odd lengths, D=64", n - 24, n // 2 + 9, dim=64, padded=n // 8),
    Case("grouped K/V 8:2", n, n, kv_heads=2),
    Case("full, bf16", n, n, dtype=BF16),
  ]


def _inputs(case: Case, seed: int = 0):
  ks = jax.random.split(jax.random.key(seed), 4)
  q = jax.random.normal(ks[0], (1, case.s_q, case.heads, case.dim), F32)
  k = jax.random.normal(ks[1], (1, case.s_kv, case.kv_heads, case.dim), F32)
  v = jax.random.normal(ks[2], (1, case.s_kv, case.kv_heads, case.dim), F32)
  ct = jax.random.normal(ks[3], (1, case.s_q, case.heads, case.dim), F32)
  keep = jnp.arange(case.s_kv)[None, :] < case.s_kv - case.padded
  return q, k, v, ct, keep


def _value_and_grads(fn, q, k, v, ct):
  """`fn(q, k, v)` and the gradients of `sum(fn(q, k, v) * ct)` by q, k and v, all float32."""

  def loss(q, k, v):
    out = fn(q, k, v)
    return jnp.sum(out.astype(F32) * ct), out

  (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
  return [np.asarray(x, np.float32) for x in (out, *grads)]


def part_splash(tiny: bool) -> None:
  import md_attention as mda

  interpret = not _on_tpu()
  for case in _cases(tiny):
    q, k, v, ct, keep = _inputs(case)
    common = dict(causal=case.causal, window=case.window)
    with jax.default_matmul_precision("highest"):
      ref = _value_and_grads(
        lambda q, k, v, keep=keep, common=common: mda.attention(
          q, k, v, mask=keep, implementation="dot_product", **common
        ),
        q, k, v, ct,
      )  # fmt: skip
    qc, kc, vc = (x.astype(case.dtype) for x in (q, k, v))
    runs = {
      "splash": lambda q, k, v, keep=keep, common=common: mda.splash_attention(
        q, k, v, keep, interpret=interpret, **common
      ),
      "blockwise": lambda q, k, v, keep=keep, common=common: mda.attention(
        q, k, v, mask=keep, implementation="blockwise", **common
      ),
    }
    # float32 inputs at the backend's default matmul precision (bf16 passes on TPU) and at "highest".
    precisions = ("default", "highest") if case.dtype == F32 else ("default",)
    for (name, fn), precision in itertools.product(runs.items(), precisions):
      with jax.default_matmul_precision(None if precision == "default" else precision):
        got = _value_and_grads(fn, qc, kc, vc, ct)
      errs = [float(np.max(np.abs(g - r))) for g, r in zip(got, ref, strict=True)]
      scale = max(float(np.max(np.abs(r))) for r in ref[1:])
      _row(
        "splash",
        f"{case.name} ({case.s_q}x{case.s_kv}, {jnp.dtype(case.dtype).name}): {name}, {precision}",
        f"out {errs[0]:.1e}",
        f"dq {errs[1]:.1e} dk {errs[2]:.1e} dv {errs[3]:.1e}",
        f"grads' max |ref| {scale:.2g}",
      )


def part_attention(tiny: bool) -> None:
  attention_rows(tiny, "splash" if _on_tpu() else None, backward=True, dense=True)


def part_wan(tiny: bool) -> None:
  from _models import Plan
  from flax import nnx

  import md_wan

  base = md_wan.VARIANTS["tiny" if tiny else "2.1-t2v-1.3b"]
  f, h, w = (3, 8, 8) if tiny else (21, 60, 104)  # 81 frames of 480x832
  text = 8 if tiny else 512
  inputs = dict(
    hidden_states=jax.ShapeDtypeStruct((1, f, h, w, base.in_channels), BF16),
    timestep=jax.ShapeDtypeStruct((1,), F32),
    encoder_hidden_states=jax.ShapeDtypeStruct((1, text, base.text_dim), BF16),
  )

  def plan(impl):
    cfg = dataclasses.replace(base, attention=impl)
    return Plan(
      "Wan 2.1 1.3B 480p x 81",
      lambda: md_wan.WanTransformer(cfg, rngs=nnx.Rngs(0)),
      inputs,
      lambda m, **kw: m(**kw, layout="BFHWC"),
    )

  # FLOPs from the blockwise model's jaxpr, for every row: a Pallas kernel's work is opaque to the count.
  reference = plan("blockwise")
  graphdef, abstract = nnx.split(nnx.eval_shape(reference.build))
  flops = count_flops(lambda s, i: reference.call(nnx.merge(graphdef, s), **i), abstract, inputs)
  for impl in ["splash", "blockwise"] if _on_tpu() else ["blockwise"]:
    plan_ = plan(impl)
    graphdef, state = random_model(plan_)
    args = random_inputs(plan_)
    t = _time(_step_fn(plan_, graphdef), state, args, repeats=3)
    _row(
      "wan",
      f"{plan_.name if not tiny else 'Wan tiny'}, 1 row, {impl}",
      f"{t:.3f} s",
      f"{flops / 1e12:.3g} TFLOP/step",
      f"{flops / t / _peak():.1%}",
    )
    del state


def _random_quantized(build, mode: str | None, seed: int = 0):
  """`build()`'s model, quantized abstractly to `mode` (None: bf16), with random weights made on the chip.

  The full-precision weights never exist: a Flux.1-dev-sized bf16 model (24 GB) does not fit a 16 GB chip,
  its int8 form does. Integer leaves get int8 values spread over [-127, 127], float leaves (bf16 weights,
  fp8 values, scales; float32 ones stored as bf16) values in [-0.02, 0.02], from a hash of the
  position; the step's time does not depend on the values.
  """
  from flax import nnx

  import md_core

  def make_abstract():
    model = build()
    if mode is not None:
      md_core.quantize(model, mode)
    return model

  graphdef, abstract = nnx.split(nnx.eval_shape(make_abstract))
  leaves, treedef = jax.tree.flatten(abstract)

  def fill(x, salt: int):
    # A hash of each element's position, elementwise so XLA writes the leaf's own dtype in one fusion:
    # no float32 or int32 copy of a stacked (layers, in, out) weight is ever held.
    h = jnp.full(x.shape, salt, jnp.int32)
    for axis in range(len(x.shape)):
      h = h * 1000003 + jax.lax.broadcasted_iota(jnp.int32, x.shape, axis)
    h = h * jnp.int32(-1640531535)
    h = h ^ (h >> 15)
    if jnp.issubdtype(x.dtype, jnp.integer):
      return (h % 255 - 127).astype(x.dtype)
    if jnp.issubdtype(
      x.dtype, jnp.floating
    ):  # float32 leaves (weights, scales) made bf16, fp8 kept
      return ((h % 2001 - 1000).astype(F32) * 2e-5).astype(BF16 if x.dtype == F32 else x.dtype)
    return jnp.zeros(x.shape, x.dtype)

  make = jax.jit(lambda: [fill(x, seed * 7919 + i) for i, x in enumerate(leaves)])
  return graphdef, jax.tree.unflatten(treedef, make())


def _compiled(fn, *args):
  """`fn` compiled for `args`, and its temporary bytes on the device (XLA's memory analysis)."""
  compiled = fn.lower(*args).compile()
  analysis = compiled.memory_analysis()
  return compiled, (analysis.temp_size_in_bytes if analysis is not None else float("nan"))


def part_flux_quant(tiny: bool, steps: int = 28) -> None:
  from _models import flux_plan
  from flax import nnx
  from gpu import _euler_loop

  import md_flux
  from md_core.quant import weight_bytes

  full = flux_plan(tiny)
  inputs = random_inputs(full)
  base = md_flux.FLUX_VARIANTS["tiny" if tiny else "dev"]
  half = dataclasses.replace(
    base, num_layers=base.num_layers // 2, num_single_layers=base.num_single_layers // 2
  )
  half_build = lambda: md_flux.FluxTransformer(half, rngs=nnx.Rngs(0))  # noqa: E731
  graphdef, abstract = nnx.split(nnx.eval_shape(half_build))
  half_flops = count_flops(lambda s, i: full.call(nnx.merge(graphdef, s), **i), abstract, inputs)
  graphdef, abstract = nnx.split(nnx.eval_shape(full.build))
  full_flops = count_flops(lambda s, i: full.call(nnx.merge(graphdef, s), **i), abstract, inputs)
  times = {}
  # Half the blocks (the bf16 model must fit beside nothing else): bf16 against int8 and fp8 weights.
  for mode in (None, "int8", "fp8", "int8-dynamic"):
    graphdef, state = _random_quantized(half_build, mode)
    label = mode or "bf16"
    step, temp = _compiled(_step_fn(full, graphdef), state, inputs)
    times[label] = t = _time(step, state, inputs)
    _row(
      "flux_quant",
      f"Flux.1-dev half depth ({half.num_layers}+{half.num_single_layers} blocks), 1 step, {label}",
      f"{t * 1e3:.1f} ms",
      f"{weight_bytes(state) / 1e9:.2f} GB weights + {temp / 1e9:.2f} GB temp, "
      f"{half_flops / 1e12:.3g} TFLOP",
      f"{half_flops / t / _peak():.1%}; {times['bf16'] / t:.2f}x bf16",
    )
    del state
  # The whole Flux.1-dev-sized model fits one 16 GB chip only quantized.
  graphdef, state = _random_quantized(full.build, "int8")
  step, temp = _compiled(_step_fn(full, graphdef), state, inputs)
  t = _time(step, state, inputs)
  _row(
    "flux_quant",
    f"{full.name}, 1 step, int8 weights",
    f"{t * 1e3:.1f} ms",
    f"{weight_bytes(state) / 1e9:.2f} GB weights + {temp / 1e9:.2f} GB temp, "
    f"{full_flops / 1e12:.3g} TFLOP",
    f"{full_flops / t / _peak():.1%}",
  )
  t = _time(_euler_loop(full, graphdef, steps), state, inputs, repeats=1)
  _row(
    "flux_quant",
    f"{full.name}, {steps} steps in one jitted loop, int8 weights",
    f"{t:.2f} s",
    f"{full_flops * steps / 1e12:.4g} TFLOP",
    f"{full_flops * steps / t / _peak():.1%}",
  )


PARTS = {
  "splash": part_splash,
  "attention": part_attention,
  "wan": part_wan,
  "flux_quant": part_flux_quant,
}


def main() -> None:
  run_parts(PARTS, __doc__, ("time / error", "work", "MFU / note"), keep_going=True)


if __name__ == "__main__":
  main()
