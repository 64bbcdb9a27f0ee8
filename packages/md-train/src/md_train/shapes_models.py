"""Recipes for md's default models: a tiny Wan 2.1 text-to-video model trained on md_data's moving shapes.

Two stages, each a recipe `apps/train` runs (`apps/configs/default_models.py`):

  wan-vae   the causal Wan VAE, trained from its random init on shapes clips: L1 + MSE reconstruction of the
            decoded latent sample plus a small KL term; exports vae/ with the latents' per-channel mean and std
  wan       the Wan transformer, trained with the Wan flow-matching loss (`families.wan_loss`) on the trained
            VAE's latents of shapes clips and the frozen UMT5's states of their captions (10% of them the empty
            prompt, so classifier-free guidance works); exports the whole pipeline folder

The starting folder (`tools/default_models/wan_template.py`, made by the PyTorch reference at random init) fixes
the architecture; each stage replaces its component's safetensors with the trained weights, keyed exactly as
the template's (`export_weights` inverts md's key map), so md's `md_wan.load_pipeline` (and diffusers) read
the result.
"""

from __future__ import annotations

import json
import math
import os
import pathlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from flax import nnx

import md_core
import md_data
import md_vae
import md_wan
from md_train import families
from md_train._loop import Recipe
from md_train._losses import FLOW_SAMPLERS
from md_train._optim import ema_of, make_optimizer
from md_train._step import (
  Frozen,
  LossFn,
  init_state,
  make_train_step,
  mixed_precision,
  split_trainable,
)

# --- data --------------------------------------------------------------------------------------------------


def shapes_videos(
  config: md_data.ShapesConfig,
  *,
  seed: int,
  batch_size: int,
  start: int = 0,
  crop: int | None = None,
  crop_on_shape: bool = False,
  masks: bool = False,
) -> Iterator[tuple[np.ndarray, ...]]:
  """Batches `(video [B, F, H, W, 3] in [-1, 1], captions)` of the shapes dataset (endless).

  `crop`: cut one `crop x crop` window per clip, placed at random (drawn from `seed` and the batch's
  position), so a convolutional model trains on full-scale pieces at a fraction of the cost;
  `crop_on_shape`: only among the windows that hold the shape's centre in the middle frame (a uniform
  window misses the small shape about half the time). `masks`: also yield the
  foreground masks `[B, F, H, W, 1]` (1 where a pixel differs from the clip's background colour).
  """
  it = md_data.ShapesIterator(config, seed=seed, batch_size=batch_size, start=start)
  for b, batch in enumerate(it):
    video = (2.0 * batch.pixels - 1.0).astype(np.float32)
    backgrounds = np.asarray([md_data.BACKGROUNDS[x.background] for x in batch.labels], np.float32)
    shape = (len(backgrounds),) + (1,) * (batch.pixels.ndim - 2) + (3,)
    fg = np.abs(batch.pixels - backgrounds.reshape(shape)).sum(-1, keepdims=True) > 0.05
    fg = fg.astype(np.float32)
    if crop is not None:
      if crop > config.size:
        raise ValueError(f"crop={crop} is larger than the clips' size {config.size}")
      rng = np.random.default_rng([seed, start, b])
      corners = [] if crop_on_shape else rng.integers(0, config.size - crop + 1, size=(len(fg), 2))
      for m in fg if crop_on_shape else ():
        mid = m[m.shape[0] // 2, ..., 0] if m.ndim == 4 else m[..., 0]
        ys, xs = np.nonzero(mid)
        centre = (ys.mean(), xs.mean()) if len(ys) else (config.size / 2, config.size / 2)
        corner = []
        for c in centre:
          lo = int(np.clip(np.ceil(c - crop + 1), 0, config.size - crop))
          hi = int(np.clip(np.floor(c), lo, config.size - crop))
          corner.append(int(rng.integers(lo, hi + 1)))
        corners.append(corner)
      video = np.stack([v[..., y : y + crop, x : x + crop, :] for v, (y, x) in zip(video, corners)])
      fg = np.stack([m[..., y : y + crop, x : x + crop, :] for m, (y, x) in zip(fg, corners)])
    yield (video, batch.captions, fg) if masks else (video, batch.captions)


# --- the VAE loss ------------------------------------------------------------------------------------------


def wan_vae_loss(
  vae: Frozen, *, kl_weight: float = 1e-4, mse_weight: float = 1.0, foreground_weight: float = 0.0
) -> LossFn:
  """Reconstruction loss of the Wan VAE: `|x - x̂| + mse_weight (x - x̂)² + kl_weight KL(q(z|x) || N(0, 1))`.

  Batch: `video [B, F, H, W, 3]` in [-1, 1] (F = 1 + 4k; a VAE without patchify) and, with
  `foreground_weight > 0`, `mask [B, F, H, W, 1]` (the shapes' pixels): those pixels weigh
  `1 + foreground_weight` in the reconstruction terms, so the small shapes are not drowned by their flat
  backgrounds. The decoder sees the encoder's mean. Means are over pixels (the KL over latent elements).
  """

  def loss_fn(params, batch, key):
    model = vae.merge(params)
    video = batch["video"]
    dist = model.encode(video)
    # The loss reads the decoder's output before its clamp to [-1, 1]: black and white pixels sit on the
    # clamp, where a clamped output on the wrong side would get no gradient.
    # The decoder reads the mean: at init the encoder's log-variance is ~0, so a sample would bury the
    # latents under unit noise and the decoder would learn nothing but the average colour; the KL term
    # still keeps the means near N(0, 1). (`key` is unused.)
    recon = model._decode_video(dist.mean, finish=False)
    weight = 1.0
    if foreground_weight:
      weight = 1.0 + foreground_weight * batch["mask"]
      weight = weight / jnp.mean(weight)
    l1 = jnp.mean(weight * jnp.abs(recon - video))
    mse = jnp.mean(weight * jnp.square(recon - video))
    kl = 0.5 * jnp.mean(jnp.square(dist.mean) + jnp.exp(dist.logvar) - 1.0 - dist.logvar)
    return l1 + mse_weight * mse + kl_weight * kl, {"l1": l1, "mse": mse, "kl": kl}

  return loss_fn


# --- export ------------------------------------------------------------------------------------------------


def export_weights(
  module: nnx.Module, template: Mapping[str, np.ndarray], convert_key: Callable, dtype: Any = None
) -> dict[str, np.ndarray]:
  """The reference tensors of `module`: for every tensor name of `template`, md's parameter put back in the
  reference's layout (the inverse of loading with `convert_key`), in the template's dtype (floating
  tensors in `dtype` when given).

  Raises:
    ValueError: a template tensor md does not map, or whose converted shape differs from the template's
      (both shapes named).
  """
  flat = {tuple(path): v.get_value() for path, v in nnx.to_flat_state(nnx.state(module))}
  inverse = {
    "linear": (1, 0),
    "conv1d": (2, 1, 0),
    "conv2d": (3, 2, 0, 1),
    "conv3d": (4, 3, 0, 1, 2),
  }
  out = {}
  for name in template:
    want = np.asarray(template[name])
    targets = convert_key(name)
    if targets is None:
      raise ValueError(f"template tensor {name!r} maps to no md parameter")
    targets = [targets] if isinstance(targets, md_core.Target) else list(targets)
    parts = []
    for t in targets:
      if t.path not in flat:
        raise ValueError(
          f"template tensor {name!r} maps to {t.path}, which the module does not have"
        )
      a = np.asarray(flat[t.path], np.float32)
      if t.layer is not None:
        a = a[t.layer]
      perm = inverse.get(t.layout)
      parts.append(a if perm is None else np.transpose(a, perm))
    split = targets[0].split
    a = parts[0] if split is None else np.concatenate(parts, axis=split[2])
    if a.shape != want.shape:
      raise ValueError(f"template tensor {name!r} has shape {want.shape}, md's export {a.shape}")
    floating = np.issubdtype(want.dtype, np.floating) or want.dtype.name == "bfloat16"
    out[name] = a.astype(dtype if dtype is not None and floating else want.dtype)
  return out


def save_component(
  folder: pathlib.Path, module: nnx.Module, convert_key: Callable, dtype: Any = None
) -> None:
  """Overwrites `folder/diffusion_pytorch_model.safetensors` with `module`'s weights in its own keys
  (floating tensors cast to `dtype` when given, e.g. bfloat16 to halve the file)."""
  path = folder / "diffusion_pytorch_model.safetensors"
  template = md_core.open_checkpoint(folder)
  tensors = export_weights(module, template, convert_key, dtype)
  del template
  md_core.save_safetensors(path, tensors, metadata={"format": "pt"})


# --- recipes -----------------------------------------------------------------------------------------------


def _shapes_config(config: ml_collections.ConfigDict, split: str = "train") -> md_data.ShapesConfig:
  """The recipe's shapes data; the options `extent` and `travel`, when set, replace md_data's ranges, and
  `start` its start rule."""
  ranges = {}
  for key in ("extent", "travel"):
    value = config.get(key)
    if value is None:
      continue
    if not isinstance(value, (list, tuple)) or len(value) != 2:
      raise ValueError(f"recipe option {key}={value!r} must be a [low, high] pair")
    ranges[key] = tuple(float(v) for v in value)
  if config.get("start") is not None:
    ranges["start"] = str(config.start)
  return md_data.ShapesConfig(size=config.size, frames=config.frames, split=split, **ranges)


def _copy_folder(src: str | os.PathLike, dst: pathlib.Path) -> None:
  md_core.pipeline.copy_pipeline(src, dst)  # self-contained: shared components copied in


def _optimizer(config: ml_collections.ConfigDict):
  """AdamW with warm-up and a cosine decay over `schedule_steps` (when the options set it; else over the
  run's `steps`), so a run stopped early by `steps` is the start of the longer schedule, step for step;
  with the option `ema_decay`, it also keeps an EMA of the parameters (what the exports then write)."""
  return make_optimizer(
    learning_rate=config.learning_rate,
    schedule="cosine",
    warmup_steps=config.warmup_steps,
    total_steps=int(config.get("schedule_steps") or config.steps),
    end_learning_rate=config.learning_rate * 0.05,
    weight_decay=0.0,
    max_grad_norm=1.0,
    ema_decay=config.get("ema_decay"),
  )


def _trained(config: ml_collections.ConfigDict, state: Any) -> Any:
  """The parameters a recipe exports: the EMA's when the options set `ema_decay`, else the state's."""
  return ema_of(state.opt_state) if config.get("ema_decay") is not None else state.params


def _dtype_option(config: ml_collections.ConfigDict, key: str) -> np.dtype | None:
  """The floating dtype a recipe option names (None when unset or empty), checked before any work."""
  name = config.get(key)
  if not name:
    return None
  try:
    dtype = jnp.dtype(name)
  except TypeError:
    dtype = None
  if dtype is None or not jnp.issubdtype(dtype, jnp.floating):
    raise ValueError(f"recipe_options.{key}={name!r} is not a floating dtype (e.g. 'bfloat16')")
  return dtype


def _data_devices(config: ml_collections.ConfigDict) -> int:
  """The option `data_devices` (default 1), checked against the devices and the batch size."""
  n = int(config.get("data_devices", 1) or 1)
  devices = jax.devices()
  if n > len(devices):
    raise ValueError(
      f"data_devices={n}, but JAX has {len(devices)} device(s) ({devices[0].platform}); on a CPU set "
      f"the app's --config.cpu_devices={n}"
    )
  if n > 1 and config.batch_size % n:
    raise ValueError(f"data_devices={n} does not divide batch_size={config.batch_size}")
  return n


def _data_parallel(n: int, state: Any) -> tuple[Any, dict[str, Any]]:
  """For n > 1 (`data_devices`): the state replicated on the first n devices and the
  `make_train_step` shardings that split each batch over them (data parallelism; on a CPU the app's
  `cpu_devices` makes the devices, and two of them keep both cores busier than one). Else unchanged."""
  if n <= 1:
    return state, {}
  devices = jax.devices()
  mesh = jax.sharding.Mesh(np.asarray(devices[:n]), ("data",))
  replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  state_sharding = jax.tree.map(lambda _: replicated, state)
  split = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
  return jax.device_put(state, state_sharding), dict(
    state_sharding=state_sharding, batch_sharding=split
  )


def _options(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """The recipe's settings: `config.recipe_options` with the run's `steps` and `seed`."""
  opts = ml_collections.ConfigDict(config.recipe_options.to_dict())
  opts.steps, opts.seed = int(config.steps), int(config.seed)
  return opts


def wan_vae_recipe(app_config: ml_collections.ConfigDict) -> Recipe:
  """Trains the template folder's Wan VAE on shapes clips.

  `recipe_options`: `template` (the starting pipeline folder), `size`, `frames` (of the exported latent
  statistics' clips), `train_frames` and `crop` (the training clips: frames and a random square window),
  `batch_size`, `learning_rate`, `warmup_steps`, `kl_weight`, `foreground_weight` (extra weight of the
  shapes' pixels), `crop_on_shape`, `stats_count` (clips for the latent statistics), and optionally
  `inflate_export` (export the still-trained VAE inflated to a clip VAE, `md_vae.inflate_wan_vae`) and
  `train_encoder` (False: train only the decoder side, so the latents, and a transformer trained on them,
  stay those of the starting VAE) and `data_devices` (split each batch over that many devices, the state
  replicated: `_data_parallel`).
  """
  config = _options(app_config)
  data_devices = _data_devices(config)
  vae = md_vae.load_vae_wan(config.template)
  if config.get("train_encoder", True):
    frozen, params = split_trainable(vae)
  else:
    decoder_side = nnx.Any(nnx.PathContains("decoder"), nnx.PathContains("post_quant_conv"))
    frozen, params = split_trainable(vae, nnx.All(nnx.Param, decoder_side))
  optimizer = _optimizer(config)
  state = init_state(params, optimizer, rng=config.seed)
  state, shardings = _data_parallel(data_devices, state)
  foreground = float(config.get("foreground_weight", 0.0))
  loss = wan_vae_loss(frozen, kl_weight=config.kl_weight, foreground_weight=foreground)
  step = make_train_step(loss, optimizer, **shardings)
  data = _shapes_config(config)
  # train_frames=1: still images as one-frame clips (the causal VAE's first-frame path), ~9x cheaper a clip.
  still = config.train_frames == 1
  train = md_data.ShapesConfig(
    size=config.size, frames=None if still else config.train_frames, split="train"
  )
  as_clip = (lambda x: x[:, None]) if still else (lambda x: x)
  batches = (
    {"video": jnp.asarray(as_clip(v)), "mask": jnp.asarray(as_clip(m))}
    for v, _, m in shapes_videos(
      train,
      seed=config.seed,
      batch_size=config.batch_size,
      crop=config.crop,
      crop_on_shape=bool(config.get("crop_on_shape", False)),
      masks=True,
    )
  )

  def export(state, out: str | os.PathLike) -> pathlib.Path:
    out = pathlib.Path(out)
    _copy_folder(config.template, out)
    model = frozen.merge(state.params)
    if config.get("inflate_export", False):
      md_vae.inflate_wan_vae(model)
    mean, std = latent_statistics(model, data, seed=config.seed + 1, count=config.stats_count)
    save_component(out / "vae", model, md_vae.vae_wan_convert_key)
    cfg_path = out / "vae" / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["latents_mean"] = [round(float(m), 5) for m in mean]
    cfg["latents_std"] = [round(float(s), 5) for s in std]
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    return out

  return Recipe(
    state=state, step=step, batches=batches, export=export, fingerprint=config.to_dict()
  )


def latent_statistics(
  vae: md_vae.WanVAE, data: md_data.ShapesConfig, *, seed: int, count: int
) -> tuple[np.ndarray, np.ndarray]:
  """Per-channel mean and std of the encoder means over `count` clips (what the Wan pipelines normalise
  latents with)."""
  encode = jax.jit(lambda v: vae.encode(v).mean)
  lat = [
    encode(jnp.asarray(v))
    for v, _ in _take(shapes_videos(data, seed=seed, batch_size=8), count // 8)
  ]
  lat = np.concatenate([np.asarray(x).reshape(-1, x.shape[-1]) for x in lat])
  return lat.mean(0), lat.std(0)


def reconstruction_scores(
  vae, data: md_data.ShapesConfig, *, seed: int, count: int, batch_size: int = 8
) -> tuple[float, md_data.Scores]:
  """How well `vae` keeps the shapes: the mean absolute error (in [-1, 1] pixels) of its reconstructions
  (encoder mean, decoded) of `count` clips of `data`, and md_data's analyser scores of those
  reconstructions against the clips' captions. Run it before training a denoiser on a VAE's latents: the
  denoiser cannot score better than this. Still images (`data.frames` None) go through as one-frame clips."""
  if count < 1:
    raise ValueError(f"reconstruction_scores: count must be >= 1, got {count}")
  if data.frames is None:
    roundtrip = jax.jit(lambda v: vae.decode(vae.encode(v[:, None]).mean)[:, 0])
  else:
    roundtrip = jax.jit(lambda v: vae.decode(vae.encode(v).mean))
  videos, captions, errors = [], [], []
  for v, caps in _take(
    shapes_videos(data, seed=seed, batch_size=batch_size), -(-count // batch_size)
  ):
    out = np.clip(np.asarray(roundtrip(jnp.asarray(v))), -1.0, 1.0)
    errors.append(np.abs(out - v).mean(axis=tuple(range(1, v.ndim))))
    videos.extend((out + 1.0) / 2.0)
    captions.extend(caps)
  error = float(np.concatenate(errors)[:count].mean())
  return error, md_data.score(videos[:count], captions[:count])


def _take(it, n):
  for _ in range(n):
    yield next(it)


# --- a minimal loop (until md_train.fit) -------------------------------------------------------------------


def run_recipe(
  recipe: Recipe, *, steps: int, workdir: str | os.PathLike, log_every: int = 10
) -> Any:
  """Runs `steps` steps of `recipe`, appending metrics to `workdir/metrics.jsonl`, then exports to
  `workdir/export` (when the recipe exports). Returns the final state."""
  import time

  workdir = pathlib.Path(workdir)
  workdir.mkdir(parents=True, exist_ok=True)
  (workdir / "fingerprint.json").write_text(
    json.dumps(dict(recipe.fingerprint), indent=2, default=str)
  )
  state, start = recipe.state, time.perf_counter()
  with open(workdir / "metrics.jsonl", "w") as log:
    for i in range(steps):
      state, metrics = recipe.step(state, next(recipe.batches))
      if (i + 1) % log_every == 0 or i == 0 or i + 1 == steps:
        row = {k: float(v) for k, v in metrics.items()}
        row |= {"step": i + 1, "wall_s": round(time.perf_counter() - start, 2)}
        log.write(json.dumps(row) + "\n")
        log.flush()
        print(json.dumps(row), flush=True)
  if recipe.export is not None:
    recipe.export(state, workdir / "export")
  print(f"done: {steps} steps in {time.perf_counter() - start:.1f} s", flush=True)
  return state


# --- the transformer ---------------------------------------------------------------------------------------


def train_captions(frames: int | None) -> tuple[str, ...]:
  """Every caption the train split can draw (videos: colour × shape × direction × background)."""
  labels = []
  for colour, shape in md_data.split("train"):
    for background in md_data.BACKGROUNDS:
      if frames is None:
        labels += [
          md_data.ShapeLabel(colour, shape, background, position=p) for p in md_data.POSITIONS
        ]
      else:
        labels += [
          md_data.ShapeLabel(colour, shape, background, direction=d) for d in md_data.DIRECTIONS
        ]
  return tuple(md_data.caption(label) for label in labels)


def encode_clips(
  pipe: md_wan.WanVideoPipeline,
  data: md_data.ShapesConfig,
  *,
  seed: int,
  count: int,
  batch_size: int = 8,
  masks: bool = False,
) -> tuple[np.ndarray, ...]:
  """The normalised VAE latents (encoder means) `[count, f, h, w, z]` of `count` shapes clips, and their
  captions; with `masks`, also the shapes' masks on the latent grid `[count, f, h, w, 1]`
  (`latent_masks`)."""
  vae = pipe.vae
  encode = jax.jit(lambda v: vae.normalize_latents(vae.encode(v).mean))
  lats, caps, fgs = [], [], []
  batches = shapes_videos(data, seed=seed, batch_size=batch_size, masks=True)
  for v, c, fg in _take(batches, -(-count // batch_size)):
    lats.append(np.asarray(encode(jnp.asarray(v))))
    caps += c
    fgs.append(fg)
  latents = np.concatenate(lats)[:count]
  if not masks:
    return latents, caps[:count]
  fg = np.concatenate(fgs)[:count]
  return latents, caps[:count], latent_masks(fg, latents.shape[1:4])


def latent_masks(fg: np.ndarray, grid: tuple[int, int, int]) -> np.ndarray:
  """Pixel masks `[B, T, H, W, 1]` of a causal video VAE's clips carried to its latent `grid` (f, h, w):
  latent frame 0 covers pixel frame 0 and latent frame k the k-th chunk of the rest (as the causal VAE
  groups them), each latent pixel its block of pixels; a latent pixel is 1 where any pixel it covers is,
  grown by one latent pixel on each side so the shape's edge and its nearest background count too."""
  b, t, h, w, _ = fg.shape
  f, gh, gw = grid
  if (t - 1) % max(f - 1, 1) or h % gh or w % gw:
    raise ValueError(f"masks of shape {fg.shape} do not map onto a latent grid {grid}")
  step = (t - 1) // max(f - 1, 1)
  chunks = [fg[:, :1]] + [fg[:, 1 + k * step : 1 + (k + 1) * step] for k in range(f - 1)]
  m = np.stack([c.max(axis=1) for c in chunks], axis=1)  # [B, f, H, W, 1]
  m = m.reshape(b, f, gh, h // gh, gw, w // gw, 1).max(axis=(3, 5))
  grown = np.pad(m, ((0, 0), (0, 0), (1, 1), (1, 1), (0, 0)))
  m = np.max([grown[:, :, y : y + gh, x : x + gw] for y in range(3) for x in range(3)], axis=0)
  return m.astype(np.float32)


def wan_recipe(app_config: ml_collections.ConfigDict) -> Recipe:
  """Trains the transformer of the folder `base` (the wan-vae stage's export) on cached latents of
  `num_clips` shapes clips, with a fraction `drop_caption` of the captions replaced by the empty prompt.

  `recipe_options`: `base`, `size`, `frames`, `num_clips`, `batch_size`, `learning_rate`, `warmup_steps`,
  `shift` (the training sigmas' shift), `drop_caption`, `max_sequence_length` (text tokens; generate
  with the same), `foreground_weight` (the latent pixels on and next to the shape weigh
  `1 + foreground_weight` in the loss, `latent_masks`; 0, the default: the plain MSE), and optionally
  `extent` and `travel` (the clips' shape sizes and travel distances, `md_data.ShapesConfig`'s ranges)
  and `frame_noise` (`families.wan_loss`'s fraction of clips noised frame by frame), `image_fraction` and
  `image_batch_size` (`cached_latents_recipe`'s image steps; measured on this model they cost the
  direction, models/shapes-wan/README.md), `sampler` (the training sigmas' `flow_sigmas` sampler,
  default `shifted`; `logit_normal` takes `logit_mean` and `logit_std`; `shift` is the `shifted`
  sampler's), `caption_weights` (`clip_probabilities`: e.g. `{"star": 2}` draws star clips twice as
  often) and `remat` (the transformer blocks' `md_core.REMAT_POLICIES` name; recomputing in the backward
  pass is the same arithmetic, and on a CPU `"dots"` makes the step faster by not stacking the blocks'
  attention probabilities for it), `data_devices` (split each batch over that many devices, the state
  replicated: `_data_parallel`), `export_dtype` (the exported weights' dtype, e.g. `"bfloat16"`;
  default: the dtypes the `base` folder stores), `compute_dtype` (e.g. `"bfloat16"`: the transformer runs in it
  while the optimizer keeps float32 weights, `md_train.mixed_precision`; the reference's float32 tables
  stay float32).
  """
  config = _options(app_config)
  sampler = str(config.get("sampler", "shifted"))
  if sampler not in FLOW_SAMPLERS:
    raise ValueError(f"recipe_options.sampler={sampler!r}; expected one of {FLOW_SAMPLERS}")
  stray = [k for k in ("logit_mean", "logit_std") if k in config and sampler != "logit_normal"]
  if stray:
    raise ValueError(f"recipe_options {stray} are the logit_normal sampler's; sampler={sampler!r}")
  sampler_options = (
    dict(
      logit_mean=float(config.get("logit_mean", 0.0)), logit_std=float(config.get("logit_std", 1.0))
    )
    if sampler == "logit_normal"
    else {}
  )
  data_devices = _data_devices(config)
  compute_dtype = _dtype_option(config, "compute_dtype")
  _dtype_option(config, "export_dtype")  # checked now: the export runs after the whole training run
  pipe = md_wan.load_pipeline(config.base, remat=str(config.get("remat", "none")))
  data = _shapes_config(config)
  latents, captions, masks = encode_clips(
    pipe, data, seed=config.seed, count=config.num_clips, masks=True
  )
  foreground = float(config.get("foreground_weight", 0.0))
  maps = 1.0 + foreground * masks if foreground else None
  table = ("",) + train_captions(config.frames)
  index = {c: i for i, c in enumerate(table)}
  length = int(config.max_sequence_length)
  embeds = np.concatenate(
    [
      np.asarray(pipe.encode_prompt(list(table[i : i + 32]), max_sequence_length=length))
      for i in range(0, len(table), 32)
    ]
  )  # [len(table), max_sequence_length, D]
  ids = np.asarray([index[c] for c in captions])
  frozen, params = split_trainable(pipe.transformer)
  optimizer = _optimizer(config)
  state = init_state(params, optimizer, rng=config.seed)
  state, shardings = _data_parallel(data_devices, state)
  loss = families.wan_loss(
    frozen,
    sampler=sampler,
    shift=config.shift,
    frame_noise=float(config.get("frame_noise", 0.0)),
    **sampler_options,
  )
  if compute_dtype is not None:
    loss = mixed_precision(loss, params, compute_dtype, keep_f32=md_wan.KEEP_F32)
  step = make_train_step(loss, optimizer, **shardings)
  probs = clip_probabilities(config.get("caption_weights"), captions)
  return cached_latents_recipe(
    config, state, step, frozen, latents, ids, embeds, "transformer", md_wan.convert_key, maps=maps,
    probs=probs,
  )  # fmt: skip


def clip_probabilities(weights, captions) -> np.ndarray | None:
  """Draw probabilities of clips from `caption_weights` (word → positive weight; a clip's weight is
  the product over its caption's words, 1 for a word not named). None for no weights (uniform draws)."""
  if not weights:
    return None
  weights = weights.to_dict() if hasattr(weights, "to_dict") else dict(weights)
  for word, w in weights.items():
    if isinstance(w, bool) or not isinstance(w, int | float) or not 0 < w < math.inf:
      raise ValueError(
        f"caption_weights[{word!r}]={w!r}: each weight must be a positive finite number"
      )
  unknown = sorted(set(weights) - {w for c in captions for w in c.split()})
  if unknown:
    raise ValueError(f"caption_weights names {unknown}, which no training caption contains")
  p = np.asarray([np.prod([weights.get(w, 1.0) for w in c.split()]) for c in captions], np.float64)
  return p / p.sum()


def cached_latents_recipe(
  config: ml_collections.ConfigDict,
  state: Any,
  step: Callable,
  frozen: Frozen,
  latents: np.ndarray,
  ids: np.ndarray,
  states: np.ndarray,
  component: str,
  convert_key: Callable,
  maps: np.ndarray | None = None,
  probs: np.ndarray | None = None,
) -> Recipe:
  """The denoiser stage of a default model: batches of `config.batch_size` cached `latents` drawn from
  `config.seed`, each with the text states `states[ids]` (row 0, the empty prompt, for a fraction
  `config.drop_caption`) and, given `maps` (one per latent), its `loss_map`; and an export that copies
  the folder `config.base` and replaces `component`'s weights with the trained ones.

  With `config.image_fraction` > 0 (video latents only) that share of the batches, drawn from a stream of
  their own, are images as Wan trains jointly on images and videos: one latent frame of each of
  `config.image_batch_size` clips (default `batch_size`) as a one-frame clip, with its clip's caption and
  map. The step compiles once more for that shape.

  `probs` (optional, one per latent: `clip_probabilities`) draws the clips with those probabilities
  instead of uniformly, e.g. a hard shape's clips more often."""

  image_fraction = float(config.get("image_fraction", 0.0) or 0.0)
  image_batch = int(config.get("image_batch_size", 0) or config.batch_size)
  if not 0.0 <= image_fraction < 1.0:
    raise ValueError(f"image_fraction={image_fraction} is not a fraction in [0, 1)")
  if image_fraction and latents.ndim != 5:
    raise ValueError(
      f"image_fraction={image_fraction} takes single frames of video latents [N, F, H, W, C]; "
      f"these latents are {latents.shape}"
    )

  def batches():
    rng = np.random.default_rng([config.seed, 1])
    frames = np.random.default_rng(
      [config.seed, 2]
    )  # its own stream: image_fraction=0 draws as before
    while True:
      still = image_fraction and frames.random() < image_fraction
      size = image_batch if still else config.batch_size
      pick = (
        rng.integers(0, len(latents), size)
        if probs is None
        else rng.choice(len(latents), size, p=probs)
      )
      text = np.where(rng.random(size) < config.drop_caption, 0, ids[pick])
      if (
        still
      ):  # one latent frame of each clip, as a one-frame clip (Wan's joint image-video training)
        index = (pick[:, None], frames.integers(0, latents.shape[1], size)[:, None])
      else:
        index = pick
      batch = {
        "latents": jnp.asarray(latents[index]),
        "encoder_hidden_states": jnp.asarray(states[text]),
      }
      if maps is not None:
        batch["loss_map"] = jnp.asarray(maps[index])
      yield batch

  def export(state, out: str | os.PathLike) -> pathlib.Path:
    out = pathlib.Path(out)
    _copy_folder(config.base, out)
    dtype = _dtype_option(config, "export_dtype")
    save_component(out / component, frozen.merge(_trained(config, state)), convert_key, dtype)
    return out

  return Recipe(
    state=state, step=step, batches=batches(), export=export, fingerprint=config.to_dict()
  )


# --- quality -----------------------------------------------------------------------------------------------


def quality_prompts() -> dict[str, tuple[str, ...]]:
  """The evaluation prompts of the video model: `held_out` (the 5 colour × shape pairs never trained on,
  × 4 directions, backgrounds in turn: 20 prompts) and `train` (16 prompts of trained pairs, one per
  colour × direction, shapes and backgrounds in turn)."""
  backgrounds = tuple(md_data.BACKGROUNDS)
  held = [
    md_data.caption(md_data.ShapeLabel(c, s, backgrounds[(i + j) % 3], direction=d))
    for i, (c, s) in enumerate(md_data.split("held_out"))
    for j, d in enumerate(md_data.DIRECTIONS)
  ]
  pairs = md_data.split("train")
  train = [
    md_data.caption(
      md_data.ShapeLabel(*pairs[(5 * i + 3 * j) % len(pairs)], backgrounds[i % 3], direction=d)
    )
    for i in range(4)
    for j, d in enumerate(md_data.DIRECTIONS)
  ]
  return {"held_out": tuple(held), "train": tuple(train)}


def video_scores(
  pipe: md_wan.WanVideoPipeline,
  *,
  prompts: dict[str, tuple[str, ...]] | None = None,
  seeds: tuple[int, ...] = (0, 1),
  num_inference_steps: int = 20,
  guidance_scale: float = 3.0,
  max_sequence_length: int = 16,
  size: int = 64,
  frames: int = 9,
) -> dict[str, md_data.Scores]:
  """md_data's analyser on videos of `prompts` (default `quality_prompts()`; each prompt once per seed):
  `Scores` per group (`held_out`, `train` by default) and over `all`."""
  groups = quality_prompts() if prompts is None else prompts
  prompts = [p for group in groups.values() for p in group]
  videos = np.stack(
    [
      np.asarray(
        pipe(
          prompts,
          "",
          height=size,
          width=size,
          num_frames=frames,
          num_inference_steps=num_inference_steps,
          guidance_scale=guidance_scale,
          max_sequence_length=max_sequence_length,
          seed=seed,
          progress=False,
        )
      )
      for seed in seeds
    ]
  )  # [seeds, prompts, F, H, W, 3]
  out, start = {}, 0
  for group, texts in groups.items():
    part = videos[:, start : start + len(texts)].reshape(-1, *videos.shape[2:])
    out[group] = md_data.score(part, list(texts) * len(seeds))
    start += len(texts)
  out["all"] = md_data.score(videos.reshape(-1, *videos.shape[2:]), prompts * len(seeds))
  return out
