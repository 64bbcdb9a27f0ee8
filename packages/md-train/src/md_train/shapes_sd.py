"""Recipes for md's default image model: a tiny Stable Diffusion 1.5 model trained on md_data's shapes images.

Two stages, each a recipe `apps/train` runs (`apps/configs/default_models.py`):

  sd-vae   the `AutoencoderKL`, trained from its random init on shapes images: L1 + MSE of the decoded
           posterior mean plus a small KL term; exports vae/ with a measured `scaling_factor` (1 / the std of
           the latents, as SD's 0.18215 was measured)
  sd       the UNet, trained with SD's epsilon loss (`families.sd_loss`) on cached, scaled latents of the
           trained VAE and the frozen CLIP's states of the captions (10% of them the empty prompt, so
           classifier-free guidance works); exports the whole pipeline folder

and a LoRA on the finished model (`sd_lora_recipe`, variant `sd-lora-purple`): the UNet's attention
adapted on images whose every shape is recoloured to one colour, the captions unchanged, so the adapter
paints whatever shape the prompt asks in that colour; exported as a PEFT file diffusers and md load.

The starting folder (`tools/default_models/sd_template.py`, made by the PyTorch reference at random init)
fixes the architecture; each stage replaces its component's safetensors with the trained weights under the
template's own keys (`shapes_models.export_weights`), so `md_sd.load_pipeline` (and diffusers) read the
result.
"""

from __future__ import annotations

import json
import os
import pathlib
from collections.abc import Iterator

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

import md_data
import md_sd
import md_vae
from md_train import families
from md_train._loop import Recipe
from md_train._step import Frozen, LossFn, init_state, make_train_step, split_trainable
from md_train.shapes_models import (
  _copy_folder,
  _data_devices,
  _data_parallel,
  _optimizer,
  _options,
  cached_latents_recipe,
  save_component,
)

# --- data --------------------------------------------------------------------------------------------------


def shapes_images(
  size: int,
  *,
  seed: int,
  batch_size: int,
  split: str = "train",
  start: int = 0,
  crop: int | None = None,
  crop_on_shape: bool = False,
) -> Iterator[tuple[np.ndarray, list[str]]]:
  """Batches `(images [B, H, W, 3] in [-1, 1], captions)` of md_data's still shapes (endless).

  `crop`: cut one random `crop x crop` window per image (drawn from `seed` and the batch's position), so
  the convolutional VAE trains on full-scale pieces at a fraction of the cost. `crop_on_shape`: the window
  is drawn around the shape's centre (within a quarter window of it), so every window holds the shape
  rather than a flat background most of the time.

  Raises:
    ValueError: `crop` is larger than `size`, or `crop_on_shape` without a `crop`.
  """
  if crop is not None and crop > size:
    raise ValueError(f"crop={crop} is larger than the images' size {size}")
  if crop_on_shape and crop is None:
    raise ValueError("crop_on_shape=True needs a crop (the window's side); got crop=None")
  config = md_data.ShapesConfig(size=size, frames=None, split=split)
  it = md_data.ShapesIterator(config, seed=seed, batch_size=batch_size, start=start)
  for b, batch in enumerate(it):
    images = (2.0 * batch.pixels - 1.0).astype(np.float32)
    if crop is not None:
      rng = np.random.default_rng([seed, start, b])
      corners = rng.integers(0, size - crop + 1, size=(batch_size, 2))
      if crop_on_shape:
        off = np.abs(images - np.median(images, axis=(1, 2), keepdims=True)).max(-1) > 0.2
        for i, mask in enumerate(off):
          ys, xs = np.nonzero(mask)
          if len(ys):
            centre = np.array([ys.mean(), xs.mean()]) - crop / 2
            jitter = rng.integers(-(crop // 4), crop // 4 + 1, size=2)
            corners[i] = np.clip(np.round(centre).astype(int) + jitter, 0, size - crop)
      images = np.stack([x[y : y + crop, z : z + crop] for x, (y, z) in zip(images, corners)])
    yield images, batch.captions


def train_captions() -> tuple[str, ...]:
  """Every caption the train split's images can carry (colour × shape × position × background)."""
  return tuple(
    md_data.caption(md_data.ShapeLabel(c, s, b, position=p))
    for c, s in md_data.split("train")
    for b in md_data.BACKGROUNDS
    for p in md_data.POSITIONS
  )


# --- the VAE -----------------------------------------------------------------------------------------------


def sd_vae_loss(
  vae: Frozen, *, kl_weight: float = 1e-6, mse_weight: float = 1.0, fg_weight: float = 0.0
) -> LossFn:
  """Reconstruction loss of an `AutoencoderKL`: `|x - x̂| + mse_weight (x - x̂)² + kl_weight KL(q(z|x) ||
  N(0, 1))`, x̂ the decoding of the posterior mean (what the UNet is trained on).

  Batch: `images [B, H, W, 3]` in [-1, 1]. The pixel terms are means weighted `1 + fg_weight` on the
  shape (pixels off the image's median colour, its background) and 1 elsewhere: a shape covers a few
  percent of the pixels, and an unweighted loss is met by a blurred blob. The KL is a mean over latent
  elements. `key` is unused.
  """

  def loss_fn(params, batch, key):
    model = vae.merge(params)
    images = batch["images"]
    posterior = model.encode(images)
    recon = model.decode(posterior.mean)
    background = jnp.median(images, axis=(1, 2), keepdims=True)
    shape = jnp.max(jnp.abs(images - background), axis=-1, keepdims=True) > 0.1
    weight = 1.0 + fg_weight * shape.astype(images.dtype)
    weight = weight / jnp.mean(weight)
    l1 = jnp.mean(weight * jnp.abs(recon - images))
    mse = jnp.mean(weight * jnp.square(recon - images))
    mean, logvar = posterior.mean, posterior.logvar
    kl = 0.5 * jnp.mean(jnp.square(mean) + jnp.exp(logvar) - 1.0 - logvar)
    return l1 + mse_weight * mse + kl_weight * kl, {"l1": l1, "mse": mse, "kl": kl}

  return loss_fn


def latent_std(vae: md_vae.AutoencoderKL, *, size: int, seed: int, count: int) -> float:
  """The std of the posterior means over `count` shapes images: `1 / scaling_factor`.

  Raises:
    ValueError: `count` is under 8 (too few images to measure).
  """
  if count < 8:
    raise ValueError(f"latent_std: count={count} is too few images; use at least 8")
  encode = jax.jit(lambda x: vae.encode(x).mean)
  batches = shapes_images(size, seed=seed, batch_size=8)
  lat = np.concatenate(
    [np.asarray(encode(jnp.asarray(next(batches)[0]))) for _ in range(count // 8)]
  )
  return float(lat.std())


def sd_vae_recipe(app_config: ml_collections.ConfigDict) -> Recipe:
  """Trains the template folder's `AutoencoderKL` on shapes images.

  `recipe_options`: `template` (the starting pipeline folder), `size`, `crop` (the training windows'
  side), `crop_on_shape` (windows around the shape), `batch_size`, `learning_rate`, `warmup_steps`,
  `kl_weight`, `fg_weight` (the shape pixels' extra weight), `schedule_steps` (the cosine's length), `stats_count` (images the scaling factor is measured on, full size).
  """
  config = _options(app_config)
  vae = md_vae.load_vae_kl(config.template, progress=False)
  frozen, params = split_trainable(vae)
  optimizer = _optimizer(config)
  state = init_state(params, optimizer, rng=config.seed)
  step = make_train_step(
    sd_vae_loss(frozen, kl_weight=config.kl_weight, fg_weight=config.fg_weight), optimizer
  )
  batches = (
    {"images": jnp.asarray(x)}
    for x, _ in shapes_images(
      config.size,
      seed=config.seed,
      batch_size=config.batch_size,
      crop=config.crop,
      crop_on_shape=bool(config.get("crop_on_shape", False)),
    )
  )

  def export(state, out: str | os.PathLike) -> pathlib.Path:
    out = pathlib.Path(out)
    _copy_folder(config.template, out)
    model = frozen.merge(state.params)
    std = latent_std(model, size=config.size, seed=config.seed + 1, count=config.stats_count)
    save_component(out / "vae", model, md_vae.vae_kl_convert_key)
    cfg_path = out / "vae" / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["scaling_factor"] = round(1.0 / std, 5)
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    return out

  return Recipe(
    state=state, step=step, batches=batches, export=export, fingerprint=config.to_dict()
  )


# --- the UNet ----------------------------------------------------------------------------------------------


def recolour(images: np.ndarray, colour: str) -> np.ndarray:
  """Shapes images `[B, H, W, 3]` in [-1, 1] with every shape pixel (one that differs from the image's
  median, its background, by more than 0.1 in [0, 1] units) painted `colour` (an `md_data.COLOURS` name).

  Raises:
    ValueError: an unknown colour (the known ones named).
  """
  if colour not in md_data.COLOURS:
    raise ValueError(f"colour={colour!r}; expected one of {', '.join(md_data.COLOURS)}")
  rgb = 2.0 * np.asarray(md_data.COLOURS[colour], np.float32) - 1.0
  shape = (
    np.abs(images - np.median(images, axis=(1, 2), keepdims=True)).max(-1, keepdims=True) > 0.2
  )
  return np.where(shape, rgb, images).astype(np.float32)


def encode_images(
  pipe: md_sd.StableDiffusionPipeline,
  *,
  size: int,
  seed: int,
  count: int,
  batch_size: int = 64,
  colour: str | None = None,
) -> tuple[np.ndarray, list[str]]:
  """The scaled VAE latents (posterior means × `scaling_factor`) `[count, h, w, c]` of `count` shapes images
  of the train split, and their captions; with `colour`, of the images `recolour`ed (captions kept)."""
  vae = pipe.vae
  factor = float(vae.config.scaling_factor)
  encode = jax.jit(lambda x: vae.encode(x).mean * factor)
  lats, caps = [], []
  batches = shapes_images(size, seed=seed, batch_size=batch_size)
  for _ in range(-(-count // batch_size)):
    x, c = next(batches)
    if colour is not None:
      x = recolour(x, colour)
    lats.append(np.asarray(encode(jnp.asarray(x))))
    caps += c
  return np.concatenate(lats)[:count], caps[:count]


def caption_states(pipe: md_sd.StableDiffusionPipeline, table: tuple[str, ...]) -> np.ndarray:
  """The frozen CLIP's last states `[len(table), S, D]` of every caption of `table`."""
  return np.concatenate(
    [np.asarray(pipe.encode_prompt(list(table[i : i + 64]))[0]) for i in range(0, len(table), 64)]
  )


def sd_recipe(app_config: ml_collections.ConfigDict) -> Recipe:
  """Trains the UNet of the folder `base` (the sd-vae stage's export) on cached latents of `num_images`
  shapes images, with a fraction `drop_caption` of the captions replaced by the empty prompt.

  `recipe_options`: `base`, `size`, `num_images`, `batch_size`, `learning_rate`, `warmup_steps`,
  `drop_caption`, `snr_gamma` (Min-SNR-γ weighting; 0 for the plain MSE), `noise_offset` (`sd_loss`'s),
  `data_devices` (split each batch over that many devices, the state replicated: `_data_parallel`).
  """

  config = _options(app_config)
  data_devices = _data_devices(config)
  pipe = md_sd.load_pipeline(config.base)
  latents, ids, states = _cached_inputs(config, pipe)
  frozen, params = split_trainable(pipe.unet)
  optimizer = _optimizer(config)
  state = init_state(params, optimizer, rng=config.seed)
  state, shardings = _data_parallel(data_devices, state)
  step = make_train_step(_unet_loss(config, pipe, frozen), optimizer, **shardings)
  return cached_latents_recipe(
    config, state, step, frozen, latents, ids, states, "unet", md_sd.convert_unet_key
  )


def _cached_inputs(config, pipe, colour: str | None = None):
  """`(latents, caption ids, caption states)` of `config.num_images` shapes images (`encode_images`)."""
  latents, captions = encode_images(
    pipe, size=config.size, seed=config.seed, count=config.num_images, colour=colour
  )
  table = ("",) + train_captions()
  index = {c: i for i, c in enumerate(table)}
  return latents, np.asarray([index[c] for c in captions]), caption_states(pipe, table)


def _unet_loss(config, pipe, frozen: Frozen) -> LossFn:
  """SD's loss on the pipeline's noise schedule, with the recipe's Min-SNR-γ and noise offset."""
  import md_schedulers as mdsch

  sched = pipe.scheduler_config
  keys = ("num_train_timesteps", "beta_start", "beta_end", "beta_schedule")
  acp = mdsch.ddpm(**{k: sched[k] for k in keys if k in sched}).alphas_cumprod
  gamma = float(config.snr_gamma or 0.0)
  return families.sd_loss(
    frozen,
    alphas_cumprod=acp,
    prediction_type=sched.get("prediction_type", "epsilon"),
    snr_gamma=gamma or None,
    noise_offset=float(config.get("noise_offset", 0.0)),
  )


LORA_FILE = "pytorch_lora_weights.safetensors"


def sd_lora_recipe(app_config: ml_collections.ConfigDict) -> Recipe:
  """A LoRA on the UNet of the finished image model `base`, trained on cached latents of `num_images`
  shapes images whose shapes are all `recolour`ed to `colour` (captions unchanged): the adapter makes the
  model paint every prompt's shape in that colour. Only the LoRA trains (`md_train.add_lora`, peft's
  initialisation); the export is `<folder>/pytorch_lora_weights.safetensors` with diffusers' PEFT names
  (`unet.` prefix), which `pipe.load_lora` and diffusers' `load_lora_weights` read.

  `recipe_options`: those of `sd_recipe` less `base`'s role (the model to adapt), plus `colour` and `lora`
  (rank, alpha, targets, init: `md_train.LoRAConfig.from_options`).
  """
  import md_core
  from md_train._lora import LoRAConfig, add_lora, lora_loss, save_lora, split_lora

  config = _options(app_config)
  colour, spec = config.get("colour"), config.get("lora")
  if colour not in md_data.COLOURS:
    raise ValueError(
      f"recipe_options.colour={colour!r}; the LoRA's colour must be one of {', '.join(md_data.COLOURS)}"
    )
  if not spec:
    raise ValueError(
      "recipe_options.lora is missing: give the adapter's rank and alpha, e.g. {rank: 4}"
    )
  pipe = md_sd.load_pipeline(config.base)
  latents, ids, states = _cached_inputs(config, pipe, colour=colour)
  names = list(md_core.open_checkpoint(pathlib.Path(config.base) / "unet"))
  key_map = pipe.lora_key_map("unet")
  spec = {"seed": int(config.seed), **dict(spec)}
  lora = add_lora(
    pipe.unet, LoRAConfig.from_options(spec), convert_key=key_map, reference_names=names,
    family="sd",
  )  # fmt: skip
  frozen, params = split_lora(pipe.unet)
  optimizer = _optimizer(config)
  state = init_state(params, optimizer, rng=config.seed)
  step = make_train_step(lora_loss(_unet_loss(config, pipe, frozen), lora, frozen), optimizer)
  recipe = cached_latents_recipe(
    config, state, step, frozen, latents, ids, states, "unet", md_sd.convert_unet_key
  )

  def export(state, out: str | os.PathLike) -> pathlib.Path:
    out = pathlib.Path(out)
    out.mkdir(parents=True, exist_ok=True)
    return save_lora(
      lora, state.params, out / LORA_FILE, convert_key=key_map, reference_names=names, prefix="unet"
    )

  return recipe._replace(export=export)


# --- quality -----------------------------------------------------------------------------------------------


def quality_prompts() -> dict[str, tuple[str, ...]]:
  """The evaluation prompts of the image model, each with a position and a background: `held_out` (the 5
  colour × shape pairs never trained on, × 4 positions: 20 prompts) and `train` (20 prompts of trained
  pairs, every pair once, positions and backgrounds in turn)."""
  backgrounds = tuple(md_data.BACKGROUNDS)
  positions = md_data.POSITIONS
  held = [
    md_data.caption(
      md_data.ShapeLabel(c, s, backgrounds[(i + j) % 3], position=positions[(2 * i + 3 * j) % 9])
    )
    for i, (c, s) in enumerate(md_data.split("held_out"))
    for j in range(4)
  ]
  train = [
    md_data.caption(md_data.ShapeLabel(c, s, backgrounds[i % 3], position=positions[(4 * i) % 9]))
    for i, (c, s) in enumerate(md_data.split("train"))
  ]
  return {"held_out": tuple(held), "train": tuple(train)}


def image_scores(
  pipe: md_sd.StableDiffusionPipeline,
  *,
  prompts: dict[str, tuple[str, ...]] | None = None,
  seeds: tuple[int, ...] = (0, 1),
  num_inference_steps: int = 20,
  guidance_scale: float = 3.0,
  size: int = 64,
) -> dict[str, md_data.Scores]:
  """md_data's analyser on images of `prompts` (default `quality_prompts()`; each prompt once per seed):
  `Scores` per group and over `all`."""
  groups = quality_prompts() if prompts is None else prompts
  texts = [p for group in groups.values() for p in group]
  images = np.stack(
    [
      np.asarray(
        pipe(
          texts,
          "",
          height=size,
          width=size,
          num_inference_steps=num_inference_steps,
          guidance_scale=guidance_scale,
          seed=seed,
          progress=False,
        )
      )
      for seed in seeds
    ]
  )  # [seeds, prompts, H, W, 3]
  out, start = {}, 0
  for group, part in groups.items():
    chosen = images[:, start : start + len(part)].reshape(-1, *images.shape[2:])
    out[group] = md_data.score(chosen, list(part) * len(seeds))
    start += len(part)
  out["all"] = md_data.score(images.reshape(-1, *images.shape[2:]), texts * len(seeds))
  return out


def colour_prompts(colour: str) -> tuple[str, ...]:
  """The image model's `quality_prompts()` (both groups) whose colour is not `colour`: what a colour
  LoRA is checked on."""
  every = [p for group in quality_prompts().values() for p in group]
  return tuple(p for p in every if md_data.parse_caption(p).colour != colour)


def lora_colour_scores(
  pipe: md_sd.StableDiffusionPipeline,
  colour: str,
  *,
  prompts: tuple[str, ...] | None = None,
  seeds: tuple[int, ...] = (0,),
  num_inference_steps: int = 20,
  guidance_scale: float = 3.0,
) -> md_data.Scores:
  """md_data's analyser on images of `prompts` (default `colour_prompts(colour)`) scored against the
  captions with their colour replaced by `colour`: `colour` is then the share of images drawn in
  `colour` (what a colour LoRA should raise from 0), `shape`, `position` and `background` the prompt's
  own (what it should keep). Call it with and without the LoRA loaded."""
  if colour not in md_data.COLOURS:
    raise ValueError(f"colour={colour!r}; expected one of {', '.join(md_data.COLOURS)}")
  texts = list(colour_prompts(colour) if prompts is None else prompts)
  want = [md_data.caption(md_data.parse_caption(t)._replace(colour=colour)) for t in texts]
  images = [
    np.asarray(
      pipe(
        texts,
        "",
        height=64,
        width=64,
        num_inference_steps=num_inference_steps,
        guidance_scale=guidance_scale,
        seed=seed,
        progress=False,
      )
    )  # fmt: skip
    for seed in seeds
  ]
  return md_data.score(np.concatenate(images), want * len(seeds))
