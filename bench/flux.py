"""Flux benchmark: one transformer step, md against diffusers on the same weights, and Flux.2's KV-cache
edit step against the plain edit step.

uv run python bench/flux.py                       # small models sized for a CPU
uv run python bench/flux.py --layers=2,4 --dim=1024 --image_tokens=1024 --repeats=5

What runs, in one invocation:
  1. `tools/.venv/bin/python bench/flux.py --torch …` (a subprocess in the reference's virtualenv) builds
     random diffusers `FluxTransformer2DModel` and `Flux2Transformer2DModel`s, saves them with
     `save_pretrained` and random inputs into a temporary folder, and times their forward passes;
  2. md loads the same folders with `md_flux.load_flux` / `load_flux2`, times the jitted forward (best of
     --repeats after a compile run) and checks that its outputs match the reference's.
Rows: Flux.1 step (md vs diffusers, ratio), Flux.2 plain edit step (target + reference tokens attend
jointly, as Flux2KleinPipeline does) in md and diffusers, and Flux.2 KV-cached edit step (reference
K/V from the first step reused: the step sees only the target tokens), md, with the plain/KV ratio.
float32 throughout. Not part of the test suite.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import platform
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _args(argv=None):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument("--layers", default="2,4", help="double,single block counts")
  p.add_argument("--dim", type=int, default=512, help="inner dim (heads x 64)")
  p.add_argument("--image_tokens", type=int, default=512, help="packed target tokens")
  p.add_argument("--text_tokens", type=int, default=128)
  p.add_argument("--refs", type=int, default=2, help="Flux.2 reference images (each image_tokens)")
  p.add_argument("--repeats", type=int, default=3)
  p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
  p.add_argument(
    "--stacked",
    action="store_true",
    help="md: pass the stacked per-layer parameters as they are (scanned), not per layer as the pipelines do",
  )
  p.add_argument("--torch", action="store_true", help=argparse.SUPPRESS)
  p.add_argument("--folder", default="", help=argparse.SUPPRESS)
  return p.parse_args(argv)


def _configs(a):
  double, single = (int(x) for x in a.layers.split(","))
  heads = a.dim // 64
  flux1 = dict(
    patch_size=1,
    in_channels=64,
    num_layers=double,
    num_single_layers=single,
    attention_head_dim=64,
    num_attention_heads=heads,
    joint_attention_dim=a.dim,
    pooled_projection_dim=256,
    guidance_embeds=True,
    axes_dims_rope=[16, 24, 24],
  )
  flux2 = dict(
    patch_size=1,
    in_channels=128,
    num_layers=double,
    num_single_layers=single,
    attention_head_dim=64,
    num_attention_heads=heads,
    joint_attention_dim=a.dim,
    timestep_guidance_channels=256,
    mlp_ratio=3.0,
    axes_dims_rope=[16, 16, 16, 16],
    guidance_embeds=False,
  )
  return flux1, flux2


def _ids(rows, cols, axes, time=0.0):
  import numpy as np

  ids = np.zeros((rows, cols, axes), np.float32)
  ids[..., 0] = time
  ids[..., 1] = np.arange(rows)[:, None]
  ids[..., 2] = np.arange(cols)[None, :]
  return ids.reshape(-1, axes)


# --- the reference side (tools/.venv) ------------------------------------------------------------------------


def _torch_side(a) -> None:
  import numpy as np
  import torch
  from diffusers import Flux2Transformer2DModel, FluxTransformer2DModel

  if a.threads:
    torch.set_num_threads(a.threads)
  torch.manual_seed(0)
  folder = pathlib.Path(a.folder)
  c1, c2 = _configs(a)
  s, t, r = a.image_tokens, a.text_tokens, a.refs * a.image_tokens
  cols = 32
  rows = s // cols
  x1 = torch.randn(1, s, 64)
  ctx = torch.randn(1, t, a.dim)
  pooled = torch.randn(1, 256)
  img1 = torch.from_numpy(_ids(rows, cols, 3))
  txt1 = torch.zeros(t, 3)
  x2 = torch.randn(1, s, 128)
  ref = torch.randn(1, r, 128)
  img2 = np.concatenate(
    [_ids(rows, cols, 4)] + [_ids(rows, cols, 4, 10.0 * (i + 1)) for i in range(a.refs)]
  )
  txt2 = np.zeros((t, 4), np.float32)
  txt2[:, 3] = np.arange(t)
  timestep = torch.tensor([0.7])
  inputs = dict(
    x1=x1, ctx=ctx, pooled=pooled, img1=img1, txt1=txt1, x2=x2, ref=ref, img2=img2, txt2=txt2
  )
  np.savez(folder / "inputs.npz", **{k: np.asarray(v) for k, v in inputs.items()})

  def best(fn):
    fn()
    times = []
    for _ in range(a.repeats):
      start = time.perf_counter()
      fn()
      times.append(time.perf_counter() - start)
    return min(times)

  results = {}
  m1 = FluxTransformer2DModel(**c1).eval()
  m1.save_pretrained(folder / "flux1")
  with torch.no_grad():
    f1 = lambda: (
      m1(  # noqa: E731
        hidden_states=x1,
        encoder_hidden_states=ctx,
        pooled_projections=pooled,
        timestep=timestep,
        img_ids=img1,
        txt_ids=txt1,
        guidance=torch.tensor([3.5]),
      ).sample
    )
    results["flux1_step"] = best(f1)
    out1 = f1()
  m2 = Flux2Transformer2DModel(**c2).eval()
  m2.save_pretrained(folder / "flux2")
  with torch.no_grad():
    f2 = (
      lambda: m2(  # noqa: E731
        hidden_states=torch.cat([x2, ref], 1),
        encoder_hidden_states=ctx,
        timestep=timestep,
        img_ids=torch.from_numpy(img2),
        txt_ids=torch.from_numpy(txt2),
      ).sample[:, :s]
    )
    results["flux2_plain_edit_step"] = best(f2)
    out2 = f2()
  results["threads"] = torch.get_num_threads()
  results["torch"] = torch.__version__
  np.savez(folder / "outputs.npz", flux1=out1.numpy(), flux2=out2.numpy())
  (folder / "torch.json").write_text(json.dumps(results))


# --- md ------------------------------------------------------------------------------------------------------


def _md_side(a, folder: pathlib.Path) -> dict:
  import jax
  import jax.numpy as jnp
  import numpy as np
  from _flops import count_flops, measure_peak  # bench/_flops.py (this script's folder)
  from flax import nnx

  import md_core
  import md_flux

  io = dict(np.load(folder / "inputs.npz"))
  ref_out = dict(np.load(folder / "outputs.npz"))
  s = a.image_tokens

  def best(fn, *args):
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(a.repeats):
      start = time.perf_counter()
      jax.block_until_ready(fn(*args))
      times.append(time.perf_counter() - start)
    return min(times)

  results = {}
  m1 = md_flux.load_flux(folder / "flux1")
  g1, st1 = nnx.split(m1)
  views = (lambda st: st) if a.stacked else md_core.layer_views  # the pipelines' Split.jit_state
  st1 = views(st1)
  f1 = jax.jit(
    lambda st, x, c, p, i, t: nnx.merge(g1, st)(x, c, p, jnp.full((1,), 0.7), i, t, guidance=3.5)
  )
  args1 = (st1, io["x1"], io["ctx"], io["pooled"], io["img1"], io["txt1"])
  results["flux1_step"] = best(f1, *args1)
  results["flux1_gflop"] = count_flops(f1, *args1) / 1e9
  results["flux1_max_abs_diff"] = float(np.abs(np.asarray(f1(*args1)) - ref_out["flux1"]).max())

  m2 = md_flux.load_flux2(folder / "flux2")
  g2, st2 = nnx.split(m2)
  st2 = views(st2)
  t = jnp.full((1,), 0.7)
  img_ids, ref_ids = io["img2"][:s], io["img2"][s:]

  def plain(st, x, ref, c):
    out = nnx.merge(g2, st)(jnp.concatenate([x, ref], 1), c, t, jnp.asarray(io["img2"]), io["txt2"])
    return out[:, :s]

  f_plain = jax.jit(plain)
  results["flux2_plain_edit_step"] = best(f_plain, st2, io["x2"], io["ref"], io["ctx"])
  results["flux2_plain_edit_gflop"] = (
    count_flops(f_plain, st2, io["x2"], io["ref"], io["ctx"]) / 1e9
  )
  results["peak_gflops"] = measure_peak(2048, jnp.float32, a.repeats) / 1e9
  results["flux2_max_abs_diff"] = float(
    np.abs(np.asarray(f_plain(st2, io["x2"], io["ref"], io["ctx"])) - ref_out["flux2"]).max()
  )

  # The KV pipeline: the first step runs [ref; target] with num_ref_tokens and returns the cache.
  def extract(st, x, ref, c):
    return nnx.merge(g2, st)(
      jnp.concatenate([ref, x], 1),
      c,
      t,
      jnp.concatenate([ref_ids, img_ids]),
      io["txt2"],
      num_ref_tokens=ref.shape[1],
    )

  f_extract = jax.jit(extract)
  results["flux2_kv_first_step"] = best(f_extract, st2, io["x2"], io["ref"], io["ctx"])
  _, cache = f_extract(st2, io["x2"], io["ref"], io["ctx"])
  f_cached = jax.jit(
    lambda st, x, c, kv: nnx.merge(g2, st)(x, c, t, img_ids, io["txt2"], kv_cache=kv)
  )
  results["flux2_kv_cached_step"] = best(f_cached, st2, io["x2"], io["ctx"], cache)
  return results


def main(argv=None) -> int:
  a = _args(argv)
  if a.torch:
    _torch_side(a)
    return 0
  python = ROOT / "tools" / ".venv" / "bin" / "python"
  with tempfile.TemporaryDirectory() as tmp:
    flags = [f"--{k}={v}" for k, v in vars(a).items() if k not in ("torch", "folder", "stacked")]
    subprocess.run(
      [str(python), __file__, "--torch", f"--folder={tmp}", *flags],
      check=True,
      env=dict(os.environ, HF_HUB_OFFLINE="1"),
    )
    ref = json.loads((pathlib.Path(tmp) / "torch.json").read_text())
    md = _md_side(a, pathlib.Path(tmp))
  import jax

  print(
    f"# {datetime.date.today()} {platform.node()} {os.cpu_count()} CPUs, {jax.devices()[0].platform},"
    f" jax {jax.__version__}, torch {ref['torch']} ({ref['threads']} threads); layers={a.layers} "
    f"dim={a.dim} image_tokens={a.image_tokens} text_tokens={a.text_tokens} refs={a.refs}, float32, md parameters {'stacked (scan)' if a.stacked else 'per layer (as the pipelines)'}"
  )
  print(
    "| step | md (ms) | diffusers (ms) | diffusers / md | md GFLOP/step | md % of matmul peak |"
  )
  print("|---|---|---|---|---|---|")
  for name, flops in (
    ("flux1_step", "flux1_gflop"),
    ("flux2_plain_edit_step", "flux2_plain_edit_gflop"),
  ):
    share = 100 * md[flops] / md[name] / md["peak_gflops"]
    print(
      f"| {name} | {md[name] * 1e3:.1f} | {ref[name] * 1e3:.1f} | {ref[name] / md[name]:.2f} | "
      f"{md[flops]:.1f} | {share:.0f}% |"
    )
  for name in ("flux2_kv_first_step", "flux2_kv_cached_step"):
    print(f"| {name} | {md[name] * 1e3:.1f} | – | – |")
  print(
    f"KV-cached edit step vs plain edit step (md): "
    f"{md['flux2_plain_edit_step'] / md['flux2_kv_cached_step']:.2f}x faster; max |md − diffusers|: "
    f"flux1 {md['flux1_max_abs_diff']:.1e}, flux2 {md['flux2_max_abs_diff']:.1e}; measured matmul "
    f"peak (2048^3, float32) {md['peak_gflops']:.0f} GFLOP/s"
  )
  return 0


if __name__ == "__main__":
  sys.exit(main())
