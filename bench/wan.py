"""Wan transformer benchmark: one denoising step (a transformer forward) in md against diffusers, same weights.

uv run python bench/wan.py                                  # 1.3B-wide blocks, 2 layers, 192 video tokens
uv run python bench/wan.py --layers=4 --frames=5 --height=30 --width=52 --dtype=bfloat16

In one run: (1) diffusers builds a random `WanTransformer3DModel` (Wan 2.1 1.3B block sizes, --layers
blocks), saves it as a diffusers folder and times its forward on fixed inputs, in the PyTorch reference's
virtualenv (`tools/.venv/bin/python`, created by `bash tools/make_fixtures.sh`), as a subprocess; (2) md loads
that folder with `md_wan.load_transformer`, checks its output against the reference's, and times the jitted
forward; (3) a large jitted matmul measures the machine's peak FLOP/s. Reported: both times (best of
--repeats after a warm-up), md/diffusers speed ratio, md's FLOPs per step (XLA's cost analysis) and its
achieved FLOP/s as a share of the measured peak. Not part of the test suite.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import platform
import subprocess
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
from _flops import best_seconds, count_flops, measure_peak
from _profile import add_step_options, print_profile

import md_core
import md_wan

ROOT = pathlib.Path(__file__).resolve().parents[1]
TORCH_PYTHON = ROOT / "tools" / ".venv" / "bin" / "python"

_TORCH_SCRIPT = r"""
import json, sys, time
import numpy as np
import torch
from diffusers import WanTransformer3DModel

args = json.loads(sys.argv[1])
torch.manual_seed(0)
model = WanTransformer3DModel(**args["config"]).eval()
with torch.no_grad():
  for name, p in model.named_parameters():
    if "norm" in name:
      p.copy_((1.0 if name.endswith("weight") else 0.0) + 0.1 * torch.randn_like(p))
model.save_pretrained(args["folder"])
dtype = getattr(torch, args["dtype"])
model = model.to(dtype)
inputs = np.load(args["inputs"])
x = torch.from_numpy(inputs["latents"]).to(dtype)
t = torch.from_numpy(inputs["timestep"])
text = torch.from_numpy(inputs["text"]).to(dtype)
with torch.no_grad():
  out = model(x, t, text, return_dict=False)[0]
  best = float("inf")
  for _ in range(args["repeats"]):
    start = time.perf_counter()
    model(x, t, text, return_dict=False)
    best = min(best, time.perf_counter() - start)
np.save(args["output"], out.float().numpy())
print(json.dumps({"seconds": best, "threads": torch.get_num_threads(), "torch": torch.__version__}))
"""


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--layers", type=int, default=2)
  parser.add_argument("--heads", type=int, default=12)
  parser.add_argument("--ffn_dim", type=int, default=8960)
  parser.add_argument("--frames", type=int, default=3, help="latent frames")
  parser.add_argument("--height", type=int, default=16, help="latent rows")
  parser.add_argument("--width", type=int, default=16, help="latent columns")
  parser.add_argument("--text_tokens", type=int, default=512)
  parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--peak_size", type=int, default=2048)
  add_step_options(parser)
  args = parser.parse_args()
  if not TORCH_PYTHON.is_file():
    raise SystemExit(f"{TORCH_PYTHON} not found: create it with `bash tools/make_fixtures.sh core`")

  config = dict(
    patch_size=(1, 2, 2),
    num_attention_heads=args.heads,
    attention_head_dim=128,
    in_channels=16,
    out_channels=16,
    text_dim=4096,
    freq_dim=256,
    ffn_dim=args.ffn_dim,
    num_layers=args.layers,
    cross_attn_norm=True,
    eps=1e-6,
  )
  rng = np.random.default_rng(0)
  latents = rng.standard_normal((1, 16, args.frames, args.height, args.width), np.float32)
  timestep = np.asarray([700], np.int64)
  text = rng.standard_normal((1, args.text_tokens, 4096), np.float32)
  with tempfile.TemporaryDirectory() as tmp:
    tmp = pathlib.Path(tmp)
    np.savez(tmp / "inputs.npz", latents=latents, timestep=timestep, text=text)
    job = dict(
      config=config,
      folder=str(tmp / "transformer"),
      inputs=str(tmp / "inputs.npz"),
      output=str(tmp / "out.npy"),
      dtype=args.dtype,
      repeats=args.repeats,
    )
    run = subprocess.run(
      [str(TORCH_PYTHON), "-c", _TORCH_SCRIPT, json.dumps(job)],
      capture_output=True,
      text=True,
      check=False,
      env=dict(os.environ, HF_HUB_OFFLINE="1"),
    )
    if run.returncode:
      raise SystemExit(f"the diffusers side failed:\n{run.stderr[-3000:]}")
    reference = json.loads(run.stdout.strip().splitlines()[-1])
    want = np.load(tmp / "out.npy")
    dtype = jnp.dtype(args.dtype)
    model = md_wan.load_transformer(tmp / "transformer", subfolder=None, dtype=dtype)

  from flax import nnx

  graphdef, state = nnx.split(model)
  if not args.stacked:
    state = md_core.layer_views(state)  # what the pipelines pass (Split.jit_state)

  def forward(state, x, t, text):
    return nnx.merge(graphdef, state)(x, t, text)

  fwd = jax.jit(forward)
  inputs = (jnp.asarray(latents, dtype), jnp.asarray(timestep, jnp.int32), jnp.asarray(text, dtype))
  # Matmul FLOPs from the jaxpr, loop bodies times their trip counts (XLA's cost analysis counts a
  # scanned stack's body once).
  flops = float(count_flops(forward, state, *inputs))
  got = np.asarray(fwd(state, *inputs).astype(jnp.float32))
  err = float(np.abs(got - want).max())
  md_seconds = best_seconds(lambda: fwd(state, *inputs), args.repeats)
  peak = measure_peak(args.peak_size, dtype, args.repeats)

  tokens = args.frames * (args.height // 2) * (args.width // 2)
  device = jax.devices()[0]
  print(
    f"# Wan transformer step, {datetime.date.today()}, {platform.processor() or platform.machine()}"
  )
  print(
    f"jax {jax.__version__} on {device.platform} ({jax.device_count()} device(s), {os.cpu_count()} cores); "
    f"torch {reference['torch']} ({reference['threads']} threads)"
  )
  print(
    f"config: {args.layers} blocks, {args.heads} heads x 128, ffn {args.ffn_dim}, {tokens} video tokens, "
    f"{args.text_tokens} text tokens, {args.dtype}, "
    f"{'stacked parameters (scan)' if args.stacked else 'per-layer parameters (as the pipelines run it)'}"
  )
  print(f"max |md - diffusers| = {err:.2e}")
  print(f"diffusers: {reference['seconds'] * 1e3:9.1f} ms")
  print(
    f"md:        {md_seconds * 1e3:9.1f} ms   (md is {reference['seconds'] / md_seconds:.2f}x diffusers)"
  )
  print(
    f"md FLOPs/step {flops / 1e9:.2f} G -> {flops / md_seconds / 1e9:.1f} GFLOP/s; measured matmul peak "
    f"({args.peak_size}^3) {peak / 1e9:.1f} GFLOP/s -> {100 * flops / md_seconds / peak:.0f}% of peak"
  )
  if args.profile:
    print_profile(fwd, state, *inputs)


if __name__ == "__main__":
  main()
