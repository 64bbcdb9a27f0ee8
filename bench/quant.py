"""Quantized denoisers: weight bytes of the real-size models, and output PSNR on the tiny fixtures.

uv run --no-sync python bench/quant.py              # the bytes table (abstract models: no memory, ~1 min)
uv run --no-sync python bench/quant.py --only=unet  # the rows whose name contains "unet"
uv run --no-sync python bench/quant.py --psnr       # PSNR of every mode on every family's tiny fixture
uv run --no-sync python bench/quant.py --defaults   # md's default models: PSNR and analyser quality, ~4 min

Bytes: each denoiser is built abstractly from its real config (`nnx.eval_shape`) and quantized abstractly
(`md_core.quantize` on shapes), so the table is the exact on-device footprint of the weights: bf16 counts
every floating parameter at 2 bytes (a bfloat16 load), int8 / fp8 count the quantized Dense and Conv kernels
at 1 byte plus their float32 scales, with every other parameter (norms, biases, embeddings) at 2 bytes.
PSNR: against the PyTorch reference's float32 output of each fixture (tests/test_quantization.py's cases),
peak = the reference's largest magnitude. Defaults: md's shipped image and video models (models/shapes-sd,
models/shapes-wan) loaded in float32, in bfloat16 and quantized in each mode, sampled on their evaluation
prompts × seeds 0, 1 (20 steps, guidance 3); PSNR of the decoded pixels against the float32 run (peak 1)
and md_data's analyser quality (the mean of the right-colour and right-shape rates, video also
right-direction, in points). Not part of the test suite.
"""

from __future__ import annotations

import argparse
import importlib.util
import pathlib

import jax
import jax.numpy as jnp
from flax import nnx

import md_core
import md_flux
import md_ltx
import md_sd
import md_wan

ROOT = pathlib.Path(__file__).resolve().parents[1]

MODELS = {
  "Flux.1-dev transformer": lambda: md_flux.FluxTransformer(
    md_flux.FLUX_VARIANTS["dev"], rngs=nnx.Rngs(0)
  ),
  "Flux.2 Klein 4B transformer": lambda: md_flux.Flux2Transformer(
    md_flux.FLUX2_VARIANTS["klein-4b"], rngs=nnx.Rngs(0)
  ),
  "Wan 2.1 T2V 14B transformer": lambda: md_wan.WanTransformer(
    md_wan.VARIANTS["2.1-t2v-14b"], rngs=nnx.Rngs(0)
  ),
  "Wan 2.1 T2V 1.3B transformer": lambda: md_wan.WanTransformer(
    md_wan.VARIANTS["2.1-t2v-1.3b"], rngs=nnx.Rngs(0)
  ),
  "LTX-Video 0.9.7 13B transformer": lambda: md_ltx.LTXTransformer(
    md_ltx.VARIANTS["0.9.7-13b"], rngs=nnx.Rngs(0)
  ),
  "LTX-2 transformer": lambda: md_ltx.LTX2Transformer(
    md_ltx.LTX2_VARIANTS["2.0"], rngs=nnx.Rngs(0)
  ),
  "SDXL base UNet": lambda: md_sd.UNet2DConditionModel(
    md_sd.VARIANTS["sdxl-base"], rngs=nnx.Rngs(0)
  ),
  "SD 1.5 UNet": lambda: md_sd.UNet2DConditionModel(md_sd.VARIANTS["sd1.5"], rngs=nnx.Rngs(0)),
}


def _bytes(state, quantized: bool) -> int:
  """On-device bytes with floating parameters at bf16 (quantized kernels and scales as they are)."""
  total = 0
  for _, var in nnx.to_flat_state(state):
    value = var.get_value()
    dtype = jnp.dtype(value.dtype)
    keep = quantized and (isinstance(var, md_core.QuantScale) or dtype.itemsize == 1)
    size = dtype.itemsize if keep or not jnp.issubdtype(dtype, jnp.floating) else 2
    total += int(value.size) * size
  return total


def bytes_table(only: str = "") -> None:
  print(
    f"{'model':34s} {'params':>8s} {'bf16 GB':>9s} {'int8 GB':>9s} {'fp8 GB':>9s} {'int8/bf16':>9s}"
  )
  for name, make in MODELS.items():
    if only.lower() not in name.lower():
      continue
    model = nnx.eval_shape(make)
    params = sum(int(x.size) for x in jax.tree.leaves(nnx.state(model)))
    bf16 = _bytes(nnx.state(model), False)
    row = {}
    for mode in ("int8", "fp8"):
      q = nnx.eval_shape(make)
      md_core.quantize(q, mode)
      row[mode] = _bytes(nnx.state(q), True)
    print(
      f"{name:34s} {params / 1e9:7.2f}B {bf16 / 1e9:9.2f} {row['int8'] / 1e9:9.2f} "
      f"{row['fp8'] / 1e9:9.2f} {row['int8'] / bf16:9.3f}"
    )


def psnr_table() -> None:
  spec = importlib.util.spec_from_file_location("tq", ROOT / "tests" / "test_quantization.py")
  tq = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(tq)
  modes = md_core.quant.MODES
  print(
    f"{'family':12s} " + " ".join(f"{m:>13s}" for m in modes) + "   (dB vs the float32 reference)"
  )
  for family in tq.FAMILIES:
    got = [tq.psnr(*tq.quantized_output(family, mode)[:2]) for mode in modes]
    print(f"{family:12s} " + " ".join(f"{g:13.1f}" for g in got), flush=True)


def defaults_table() -> None:
  import numpy as np

  import md_data
  from md_train import shapes_models, shapes_sd

  def quality(scores) -> float:
    s = scores["all"]
    rates = [s.colour, s.shape] + ([] if s.direction is None else [s.direction])
    return 100.0 * float(np.mean(rates))

  models = {
    "shapes-sd (image)": (md_sd.load_pipeline, ROOT / "models" / "shapes-sd", shapes_sd.image_scores),
    "shapes-wan (video)": (
      md_wan.load_pipeline, ROOT / "models" / "shapes-wan", shapes_models.video_scores,
    ),
  }  # fmt: skip
  print(
    "| model | weights | PSNR vs float32 (dB) | quality (points) | colour | shape | direction |"
  )
  print("|---|---|---|---|---|---|---|")
  for name, (load, folder, score) in models.items():
    ref = None
    for label, kw in (
      ("float32", {}), ("bfloat16", dict(dtype=jnp.bfloat16)),
      *((m, dict(quantization=m)) for m in md_core.quant.MODES),
    ):  # fmt: skip
      pipe = load(folder, **kw)
      images = {}
      original = md_data.score

      def keep(samples, captions, _images=images, _score=original):
        _images["x"] = np.asarray(samples, np.float32)  # the last call scores "all"
        return _score(samples, captions)

      md_data.score = keep
      try:
        scores = score(pipe)
      finally:
        md_data.score = original
      x = images["x"]
      if ref is None:
        ref = x
      mse = float(np.mean((x.astype(np.float64) - ref) ** 2))
      db = "–" if label == "float32" else ("inf" if mse == 0 else f"{10 * np.log10(1 / mse):.1f}")
      s = scores["all"]
      direction = "–" if s.direction is None else f"{100 * s.direction:.0f}%"
      print(
        f"| {name} | {label} | {db} | {quality(scores):.1f} | {100 * s.colour:.0f}% | "
        f"{100 * s.shape:.0f}% | {direction} |",
        flush=True,
      )


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument(
    "--psnr", action="store_true", help="PSNR on the tiny fixtures instead of bytes"
  )
  parser.add_argument("--only", default="", help="only the models whose name contains this")
  parser.add_argument(
    "--defaults", action="store_true", help="md's default models: PSNR and analyser quality"
  )
  args = parser.parse_args()
  if args.defaults:
    defaults_table()
  else:
    psnr_table() if args.psnr else bytes_table(args.only)


if __name__ == "__main__":
  main()
