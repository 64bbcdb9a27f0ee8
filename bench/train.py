"""Training step benchmark: md-train's jitted step against a diffusers/PyTorch step, and a Wan 2.1 14B plan.

uv run python bench/train.py                      # SD 1.5-UNet- and Wan 2.1-shaped medium models, f32
uv run python bench/train.py --models=wan --steps=10
uv run python bench/train.py --tiny               # the same path on tiny models (seconds)
uv run python bench/train.py --plan               # lowering + compiling only: Wan 2.1 14B 720p x 81,
                                                  # FSDP over 8 virtual CPU devices, each remat policy
uv run python bench/train.py --plan --tiny        # the same path on Wan's tiny variant (seconds)
uv run python bench/train.py --plan --remat=full --no-compile   # lowered only: no memory numbers

**Side by side** (one run, both sides on the same weights and the same batch): the reference's interpreter
(`tools/.venv/bin/python`, a subprocess running this file) builds a random diffusers model (seeded; norm
weights and biases moved off 1 / 0), saves it in the diffusers layout to a temporary folder, and times its
training step: forward, `F.mse_loss(pred.float(), target.float())`, `loss.backward()`,
`clip_grad_norm_(1.0)`, `torch.optim.AdamW` (f32, train_text_to_image.py's loss). md loads that folder
with its own loader (`md_sd.load_unet` / `md_wan.load_transformer`) and runs `md_train.make_train_step`
with the family loss (`md_train.families.sd_loss`, epsilon target on the DDPM scaled-linear schedule;
`wan_loss`, flow target, timestep 1000 sigma) and `make_optimizer` (clip 1.0 + AdamW, the same lr, betas,
eps and weight decay). The batch carries fixed latents, noise and timesteps / sigmas, so the first-step
losses must agree (printed) and both sides then take identical AdamW steps. Times: median of --steps
steps after --warmup steps (md: the compiled step, compile timed apart). FLOPs: matmul + conv FLOPs of the
loss's forward jaxpr (bench/_flops.py), training = 3x forward (the usual model-FLOPs convention; the
step's own jaxpr count, backward included, is printed as a check); the peak is md_train's measured f32
jitted matmul (`peak_flops_per_second`). Memory: md's from the compiled step's `memory_analysis()`
(arguments = train state + batch; temporaries; the output aliases the donated state); both sides' anonymous
RSS growth (a thread sampling RssAnon, bench/load.py's `PeakAnon`) from before the model is built to the
peak during the timed steps (md's includes the loaded folder's weights and compile-time allocations).

**Plan** (`--plan`): for each remat policy in `md_core.REMAT_POLICIES`, a subprocess with 8 virtual CPU
devices (`--xla_force_host_platform_device_count=8`) builds Wan 2.1 14B abstractly (`nnx.eval_shape`, the
`md_wan.VARIANTS` config), bf16 parameters except the reference's f32 tables (`md_wan.KEEP_F32`), f32
master weights (`md_train.with_master_weights`) with f32 AdamW moments, all sharded by md-sharding's rules
on an `fsdp` 8 mesh; batch 1 per device (8 in all) of 21 x 90 x 160 latents (81 frames of 720 x 1280; patch
(1, 2, 2): 75 600 tokens) and 512 text tokens, noise and sigmas drawn in the step (shifted sampling). The
`make_train_step` program is lowered on `ShapeDtypeStruct`s and compiled for the CPU backend (nothing is
allocated or run); per-device bytes are `compiled.memory_analysis()`'s. Not part of the test suite.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
import pathlib
import platform
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
TORCH_PYTHON = ROOT / "tools" / ".venv" / "bin" / "python"
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from load import PeakAnon, _status  # noqa: E402  (stdlib only: usable in both interpreters)

GB = 1e9
SCHED = dict(beta_schedule="scaled_linear", beta_start=0.00085, beta_end=0.012)
ADAMW = dict(lr=1e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, max_grad_norm=1.0)

# diffusers configs of the side-by-side models. "medium": bench/sd.py's small UNet (SD 1.x block layout,
# 64-128-256 channels) with SD 1.5's text width (768, 77 tokens) at 128 px (16 x 16 latents), batch 2; and
# bench/wan.py's default (Wan 2.1 1.3B-wide blocks, 2 of them, 3 x 16 x 16 latents = 192 tokens, 512 text
# tokens), batch 1.
MODELS = {
  "sd": {
    "medium": dict(
      config=dict(
        sample_size=16, block_out_channels=(64, 128, 256), layers_per_block=2,
        down_block_types=("CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=768, attention_head_dim=8, norm_num_groups=32,
      ),
      latents=(2, 4, 16, 16), text=(77, 768),
    ),
    "tiny": dict(
      config=dict(
        sample_size=8, block_out_channels=(8, 16), layers_per_block=1,
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=16, attention_head_dim=2, norm_num_groups=4,
      ),
      latents=(2, 4, 8, 8), text=(6, 16),
    ),
  },
  "wan": {
    "medium": dict(
      config=dict(
        patch_size=(1, 2, 2), num_attention_heads=12, attention_head_dim=128, in_channels=16,
        out_channels=16, text_dim=4096, freq_dim=256, ffn_dim=8960, num_layers=2,
        cross_attn_norm=True, eps=1e-6,
      ),
      latents=(1, 16, 3, 16, 16), text=(512, 4096),
    ),
    "tiny": dict(
      config=dict(
        patch_size=(1, 2, 2), num_attention_heads=4, attention_head_dim=12, in_channels=4,
        out_channels=4, text_dim=16, freq_dim=16, ffn_dim=32, num_layers=2, cross_attn_norm=True,
        eps=1e-6,
      ),
      latents=(2, 4, 2, 4, 4), text=(6, 16),
    ),
  },
}  # fmt: skip
LABELS = {"sd": "SD 1.x UNet (64-128-256)", "wan": "Wan 2.1 transformer (1.3B-wide, 2 blocks)"}


def _inputs(family: str, preset: dict, seed: int = 0) -> dict:
  """Fixed latents, noise, noise levels and text states, in the reference's layouts (NCHW / BCFHW)."""
  import numpy as np

  rng = np.random.default_rng(seed)
  shape = preset["latents"]
  b = shape[0]
  out = dict(
    latents=rng.standard_normal(shape, np.float32),
    noise=rng.standard_normal(shape, np.float32),
    text=rng.standard_normal((b, *preset["text"]), np.float32),
  )
  if family == "sd":
    out["timesteps"] = np.linspace(150, 850, b).astype(np.int64)
  else:
    out["sigmas"] = np.linspace(0.3, 0.8, b).astype(np.float32)
  return out


def _torch_worker(job: dict) -> dict:
  """The reference's side: build, save, then time warm-up + timed steps of diffusers + torch AdamW."""
  import numpy as np
  import torch
  import torch.nn.functional as F

  torch.set_num_threads(len(os.sched_getaffinity(0)))
  torch.manual_seed(0)
  anon_before = _status("RssAnon")
  family, preset = job["family"], MODELS[job["family"]][job["preset"]]
  if family == "sd":
    from diffusers import DDPMScheduler, UNet2DConditionModel

    model = UNet2DConditionModel(**preset["config"])
  else:
    from diffusers import WanTransformer3DModel

    model = WanTransformer3DModel(**preset["config"])
  with torch.no_grad():  # non-trivial norm affines, so a mis-mapped norm would show in the losses
    for name, p in model.named_parameters():
      if "norm" in name:
        p.copy_((1.0 if name.endswith("weight") else 0.0) + 0.1 * torch.randn_like(p))
  model.save_pretrained(job["folder"])
  model = model.float().train()
  data = {k: torch.from_numpy(v) for k, v in np.load(job["inputs"]).items()}
  latents, noise, text = data["latents"], data["noise"], data["text"]
  if family == "sd":
    sched = DDPMScheduler(**SCHED)
    t = data["timesteps"]

    def forward():
      noisy = sched.add_noise(latents, noise, t)
      return model(noisy, t, text, return_dict=False)[0], noise

  else:
    sigmas = data["sigmas"]

    def forward():
      s = sigmas[:, None, None, None, None]
      noisy = (1 - s) * latents + s * noise
      pred = model(noisy, timestep=sigmas * 1000, encoder_hidden_states=text, return_dict=False)[0]
      return pred, noise - latents

  a = ADAMW
  opt = torch.optim.AdamW(
    model.parameters(), lr=a["lr"], betas=a["betas"], eps=a["eps"], weight_decay=a["weight_decay"]
  )

  def step() -> float:
    opt.zero_grad(set_to_none=True)
    pred, target = forward()
    loss = F.mse_loss(pred.float(), target.float(), reduction="mean")
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), a["max_grad_norm"])
    opt.step()
    return float(loss)

  losses, seconds = [], []
  with PeakAnon() as peak:
    for i in range(job["warmup"] + job["steps"]):
      start = time.perf_counter()
      losses.append(step())
      if i >= job["warmup"]:
        seconds.append(time.perf_counter() - start)
  return dict(
    seconds=seconds,
    losses=losses,
    anon_growth=peak.peak - anon_before,
    params=sum(p.numel() for p in model.parameters()),
    threads=torch.get_num_threads(),
    torch=torch.__version__,
  )


def _md_side(family: str, preset: dict, folder: str, inputs: dict, warmup: int, steps: int) -> dict:
  import jax
  import jax.numpy as jnp
  from _flops import count_flops

  import md_schedulers as mdsch
  import md_train as mdt
  import md_train.families as mtf

  anon_before = _status("RssAnon")
  if family == "sd":
    import md_sd

    model = md_sd.load_unet(folder, subfolder=None, progress=False)
    frozen, params = mdt.split_trainable(model)
    loss_fn = mtf.sd_loss(frozen, alphas_cumprod=mdsch.ddpm(**SCHED).alphas_cumprod)
    batch = dict(
      latents=inputs["latents"].transpose(0, 2, 3, 1),  # NCHW -> NHWC
      noise=inputs["noise"].transpose(0, 2, 3, 1),
      timesteps=inputs["timesteps"].astype("int32"),
      encoder_hidden_states=inputs["text"],
    )
  else:
    import md_wan

    model = md_wan.load_transformer(folder, subfolder=None)
    frozen, params = mdt.split_trainable(model)
    loss_fn = mtf.wan_loss(frozen)
    batch = dict(
      latents=inputs["latents"].transpose(0, 2, 3, 4, 1),  # BCFHW -> BFHWC
      noise=inputs["noise"].transpose(0, 2, 3, 4, 1),
      sigmas=inputs["sigmas"],
      encoder_hidden_states=inputs["text"],
    )
  batch = jax.tree.map(jnp.asarray, batch)
  a = ADAMW
  opt = mdt.make_optimizer(
    learning_rate=a["lr"], b1=a["betas"][0], b2=a["betas"][1], eps=a["eps"],
    weight_decay=a["weight_decay"], max_grad_norm=a["max_grad_norm"],
  )  # fmt: skip
  state = mdt.init_state(params, opt)
  step = mdt.make_train_step(loss_fn, opt)
  forward_flops = count_flops(loss_fn, params, batch, jax.random.key(0))
  step_flops = count_flops(step, state, batch)
  start = time.perf_counter()
  compiled = step.lower(state, batch).compile()
  compile_s = time.perf_counter() - start
  mem = compiled.memory_analysis()
  losses, seconds = [], []
  with PeakAnon() as peak:
    for i in range(warmup + steps):
      start = time.perf_counter()
      state, metrics = compiled(state, batch)
      jax.block_until_ready((state, metrics))
      if i >= warmup:
        seconds.append(time.perf_counter() - start)
      losses.append(float(metrics["loss"]))
  return dict(
    seconds=seconds,
    losses=losses,
    compile_s=compile_s,
    forward_flops=forward_flops,
    step_flops=step_flops,
    argument_bytes=int(mem.argument_size_in_bytes),
    output_bytes=int(mem.output_size_in_bytes),
    alias_bytes=int(mem.alias_size_in_bytes),
    temp_bytes=int(mem.temp_size_in_bytes),
    anon_growth=peak.peak - anon_before,
    params=sum(x.size for x in jax.tree.leaves(params)),
  )


def side_by_side(family: str, preset_name: str, warmup: int, steps: int) -> dict:
  import numpy as np

  if not TORCH_PYTHON.is_file():
    raise SystemExit(f"{TORCH_PYTHON} not found: create it with `bash tools/make_fixtures.sh core`")
  preset = MODELS[family][preset_name]
  inputs = _inputs(family, preset)
  with tempfile.TemporaryDirectory() as tmp:
    tmp = pathlib.Path(tmp)
    np.savez(tmp / "inputs.npz", **inputs)
    job = dict(
      family=family, preset=preset_name, folder=str(tmp / "model"), inputs=str(tmp / "inputs.npz"),
      warmup=warmup, steps=steps,
    )  # fmt: skip
    run = subprocess.run(
      [str(TORCH_PYTHON), __file__, "--torch-worker", json.dumps(job)],
      capture_output=True, text=True, check=False, env=dict(os.environ, HF_HUB_OFFLINE="1"),
    )  # fmt: skip
    if run.returncode:
      raise SystemExit(f"the diffusers side failed:\n{run.stderr[-3000:]}")
    ref = json.loads(run.stdout.strip().splitlines()[-1])
    md = _md_side(family, preset, job["folder"], inputs, warmup, steps)
  return dict(family=family, preset=preset_name, ref=ref, md=md)


def _report(results: list[dict], peak: float) -> None:
  import jax

  print(
    f"# md training step vs diffusers + torch.optim.AdamW, f32, "
    f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC, "
    f"{platform.machine()}, {len(os.sched_getaffinity(0))} core(s) in this process's affinity"
  )
  ref0 = results[0]["ref"]
  print(
    f"jax {jax.__version__} ({jax.devices()[0].platform}, {jax.device_count()} device); torch "
    f"{ref0['torch']} ({ref0['threads']} threads); measured f32 matmul peak {peak / 1e9:.1f} GFLOP/s"
  )
  print(
    "| model | params M | diffusers s/step | md s/step | md / diffusers speed | md compile s | "
    "fwd GFLOP | train GFLOP (3x fwd; step jaxpr) | md TFLOP/s (% peak) | diffusers TFLOP/s | "
    "md args + temp GB (memory_analysis) | md RSS growth GB | diffusers RSS growth GB | "
    "loss step 1 md / diffusers (last) |"
  )
  print("|---|" + "---|" * 13)
  for r in results:
    ref, md = r["ref"], r["md"]
    t_ref, t_md = statistics.median(ref["seconds"]), statistics.median(md["seconds"])
    train = 3 * md["forward_flops"]
    analysed = (md["argument_bytes"] + md["temp_bytes"]) / GB
    print(
      f"| {LABELS[r['family']] if r['preset'] == 'medium' else r['family'] + ' tiny'} "
      f"| {md['params'] / 1e6:.1f} | {t_ref:.3f} | {t_md:.3f} | {t_ref / t_md:.2f} "
      f"| {md['compile_s']:.1f} | {md['forward_flops'] / 1e9:.2f} "
      f"| {train / 1e9:.2f}; {md['step_flops'] / 1e9:.2f} "
      f"| {train / t_md / 1e12:.3f} ({100 * train / t_md / peak:.0f}%) | {train / t_ref / 1e12:.3f} "
      f"| {analysed:.3f} ({md['argument_bytes'] / GB:.3f} + {md['temp_bytes'] / GB:.3f}) "
      f"| {md['anon_growth'] / GB:.3f} | {ref['anon_growth'] / GB:.3f} "
      f"| {md['losses'][0]:.6f} / {ref['losses'][0]:.6f} "
      f"({md['losses'][-1]:.6f} / {ref['losses'][-1]:.6f}) |",
      flush=True,
    )


# ---------------------------------------------------------------------------------------------- plan


def _plan_worker(policy: str, tiny: bool, compile_: bool) -> dict:
  """One remat policy's Wan 2.1 14B training step, lowered (and compiled) on 8 fsdp devices."""
  import re

  import jax
  import jax.numpy as jnp
  import optax
  from _flops import count_flops
  from flax import nnx
  from jax.sharding import NamedSharding, PartitionSpec

  import md_core
  import md_sharding as mds
  import md_train as mdt
  import md_train.families as mtf
  import md_wan

  devices = jax.device_count()
  cfg = dataclasses.replace(md_wan.VARIANTS["tiny" if tiny else "2.1-t2v-14b"], remat=policy)
  f, h, w = (3, 8, 8) if tiny else (21, 90, 160)
  text = 8 if tiny else 512
  mesh = mds.make_mesh(mds.MeshConfig(ici_fsdp_parallelism=devices))
  replicated = NamedSharding(mesh, PartitionSpec())

  model = nnx.eval_shape(lambda: md_wan.WanTransformer(cfg, rngs=nnx.Rngs(0)))
  variables = {tuple(p): v for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}
  frozen, params = mdt.split_trainable(model)

  def model_dtype(path, leaf):  # the loader's bf16 load: the reference's f32 tables stay f32
    keep = any(re.search(p, md_core.path_str(path)) for p in md_wan.KEEP_F32)
    return jnp.float32 if keep else jnp.bfloat16

  flat = []
  for path, leaf in nnx.to_flat_state(params):
    path = tuple(path)
    sharding = mds.logical_to_sharding(
      md_core.logical_axes(variables[path]) or (None,) * leaf.ndim, mesh, shape=leaf.shape
    )
    flat.append(
      (path, jax.ShapeDtypeStruct(leaf.shape, model_dtype(path, leaf), sharding=sharding))
    )
  params = nnx.from_flat_state(flat)

  loss_fn = mtf.wan_loss(frozen)
  made = {}

  def master_of(p):
    master, made["loss"] = mdt.with_master_weights(p, loss_fn)
    return master

  master = jax.eval_shape(master_of, params)
  master = jax.tree.map(
    lambda m, p: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=p.sharding), master, params
  )
  cast_loss = made["loss"]
  opt = mdt.make_optimizer(learning_rate=1e-5)
  # Moments shard like their parameters, counters are replicated: what `init_state` places.
  opt_shapes = jax.eval_shape(opt.tx.init, master)
  opt_shardings = optax.tree_map_params(
    opt.tx, lambda _, p: p.sharding, opt_shapes, master, transform_non_params=lambda _: replicated
  )
  opt_state = jax.tree.map(
    lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), opt_shapes, opt_shardings
  )
  key = jax.eval_shape(lambda: jax.random.key(0))
  state = mdt.TrainState(
    jax.ShapeDtypeStruct((), jnp.int32, sharding=replicated),
    master,
    opt_state,
    jax.ShapeDtypeStruct(key.shape, key.dtype, sharding=replicated),
  )
  b = devices  # one clip per device
  batch_sharding = mdt.batch_sharding(mesh, b)
  batch = dict(
    latents=jax.ShapeDtypeStruct(
      (b, f, h, w, cfg.in_channels), jnp.bfloat16, sharding=batch_sharding
    ),
    encoder_hidden_states=jax.ShapeDtypeStruct(
      (b, text, cfg.text_dim), jnp.bfloat16, sharding=batch_sharding
    ),
  )

  def per_device(tree):
    return sum(
      math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize
      for x in jax.tree.leaves(tree)
      if not jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)
    )

  step = mdt.make_train_step(
    cast_loss, opt, state_sharding=jax.tree.map(lambda x: x.sharding, state),
    batch_sharding=batch_sharding,
  )  # fmt: skip
  start = time.perf_counter()
  with jax.set_mesh(mesh):
    forward = count_flops(cast_loss, master, batch, key)
    lowered = step.lower(state, batch)
  out = dict(
    policy=policy,
    devices=devices,
    tokens=f * (h // cfg.patch_size[1]) * (w // cfg.patch_size[2]),
    text=text,
    params=sum(x.size for x in jax.tree.leaves(master)),
    forward_flops=float(forward),
    master_bytes=per_device(master),
    opt_bytes=per_device(opt_state),
    batch_bytes=per_device(batch),
    lower_s=time.perf_counter() - start,
  )
  if compile_:
    start = time.perf_counter()
    mem = lowered.compile().memory_analysis()
    out.update(
      compile_s=time.perf_counter() - start,
      argument_bytes=int(mem.argument_size_in_bytes),
      output_bytes=int(mem.output_size_in_bytes),
      alias_bytes=int(mem.alias_size_in_bytes),
      temp_bytes=int(mem.temp_size_in_bytes),
    )
  return out


def plan(policies: list[str], tiny: bool, compile_: bool, timeout: float) -> None:
  print(
    f"# Wan 2.1 14B training step plan{' (tiny variant)' if tiny else ''}: fsdp 8 (virtual CPU "
    "devices), batch 1 per device; bf16 model (f32 tables), f32 master weights + f32 AdamW moments; "
    f"{'compiled (CPU backend) memory_analysis' if compile_ else 'lowered only'}, "
    f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC",
    flush=True,
  )
  print(
    "| remat | per-device state GB (master + Adam) | batch GB | arguments GB | temp GB | output GB "
    "(aliased) | args + temp GB | TFLOP / step (3x fwd, all devices) | lower s | compile s |"
  )
  print("|---|---|---|---|---|---|---|---|---|---|", flush=True)
  xla = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
  env = dict(os.environ, XLA_FLAGS=xla.strip(), JAX_PLATFORMS="cpu")
  for policy in policies:
    cmd = [sys.executable, __file__, "--plan-worker", policy]
    cmd += ["--tiny"] * tiny + ["--no-compile"] * (not compile_)
    try:
      run = subprocess.run(
        cmd, capture_output=True, text=True, check=False, env=env, timeout=timeout
      )
    except subprocess.TimeoutExpired:
      print(f"| {policy} | timed out after {timeout:.0f} s |", flush=True)
      continue
    if run.returncode:
      print(f"| {policy} | failed: {run.stderr.strip().splitlines()[-1][:200]} |", flush=True)
      continue
    r = json.loads(run.stdout.strip().splitlines()[-1])
    state = r["master_bytes"] + r["opt_bytes"]
    if "temp_bytes" in r:
      args, temp = r["argument_bytes"] / GB, r["temp_bytes"] / GB
      cells = (
        f"{args:.2f} | {temp:.2f} | {r['output_bytes'] / GB:.2f} ({r['alias_bytes'] / GB:.2f}) "
        f"| {args + temp:.2f}"
      )
      compile_s = f"{r['compile_s']:.0f}"
    else:
      cells, compile_s = "n/a | n/a | n/a | n/a", "-"
    print(
      f"| {policy} | {state / GB:.2f} ({r['master_bytes'] / GB:.2f} + {r['opt_bytes'] / GB:.2f}) "
      f"| {r['batch_bytes'] / GB:.3f} | {cells} | {3 * r['forward_flops'] / 1e12:.4g} "
      f"| {r['lower_s']:.0f} | {compile_s} |",
      flush=True,
    )
  print(f"({r['params'] / 1e9:.2f} B parameters, {r['tokens']} video + {r['text']} text tokens)")


def main() -> int:
  parser = argparse.ArgumentParser(
    description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
  )
  parser.add_argument("--models", default="sd,wan", help="comma-separated: sd, wan")
  parser.add_argument("--tiny", action="store_true", help="tiny sizes (a seconds-long smoke run)")
  parser.add_argument("--warmup", type=int, default=2, help="steps before timing (after compiling)")
  parser.add_argument("--steps", type=int, default=5, help="timed steps (the median is reported)")
  parser.add_argument("--plan", action="store_true", help="the Wan 2.1 14B FSDP 8 plan (no run)")
  parser.add_argument("--remat", default=None, help="comma-separated policies (default: all)")
  parser.add_argument("--no-compile", action="store_true", help="--plan: lower only (no memory)")
  parser.add_argument("--timeout", type=float, default=600, help="--plan: seconds per policy")
  parser.add_argument("--torch-worker", help=argparse.SUPPRESS)
  parser.add_argument("--plan-worker", help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args.torch_worker:
    print(json.dumps(_torch_worker(json.loads(args.torch_worker))))
    return 0
  if args.plan_worker:
    print(json.dumps(_plan_worker(args.plan_worker, args.tiny, not args.no_compile)))
    return 0
  if args.plan:
    import md_core

    policies = args.remat.split(",") if args.remat else list(md_core.REMAT_POLICIES)
    plan(policies, args.tiny, not args.no_compile, args.timeout)
    return 0
  import md_train as mdt

  preset = "tiny" if args.tiny else "medium"
  results = [side_by_side(m, preset, args.warmup, args.steps) for m in args.models.split(",")]
  _report(results, mdt.peak_flops_per_second("float32"))
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
