"""Recipes for `md_train.fit` / `apps/train`: the tiny SD 1.5, Flux.1 and Wan 2.1 pipelines of
tests/fixtures trained on md_data's shapes dataset.

Each recipe is a function of the whole app config (`apps/configs/train.py`) returning a `Recipe`: the
family's denoiser from the fixture folder (its config and random-init weights, as the PyTorch reference
saved them), md_data shapes images (SD, Flux) or clips (Wan) encoded by that folder's VAE, the captions'
states from its text encoder (encoded once per caption), the family loss of `md_train.families`, and an
exporter that writes the trained denoiser back in the diffusers layout (config.json + safetensors under the
reference's tensor names), which md's loaders (and diffusers) read.

    uv run apps/train --config=apps/configs/train.py:wan21-tiny --workdir=/tmp/wan
"""

from __future__ import annotations

import pathlib
import shutil
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import md_core
import md_data
from md_train import _dreambooth, families
from md_train._eval import eval_loss
from md_train._loop import Recipe, batch_sharding
from md_train._lora import LoRA, LoRAConfig, add_lora, lora_loss, save_lora, split_lora
from md_train._optim import make_optimizer
from md_train._step import TrainState, init_state, make_train_step, split_trainable

# --- data ----------------------------------------------------------------------------------------------


class EncodedBatches:
  """Shapes batches turned into a loss's inputs: pixels through a jitted VAE encode, captions through a
  cached text encode; resumable through the shapes iterator's `state()` / `restore(s)`.

  Args:
    shapes: the `md_data.ShapesIterator`.
    encode_pixels: `pixels [B, (F,) H, W, 3] in [0, 1] -> latents` (jitted by the caller).
    encode_captions: `captions -> {name: [B, ...] array}` (the text conditioning).
    sharding: where the batch's arrays go (leading axis split over data-parallel devices), or None.
  """

  def __init__(
    self,
    shapes: md_data.ShapesIterator,
    encode_pixels: Callable[[np.ndarray], jax.Array],
    encode_captions: Callable[[list[str]], Mapping[str, jax.Array]],
    sharding: Any = None,
  ):
    self.shapes, self.sharding = shapes, sharding
    self.encode_pixels, self.encode_captions = encode_pixels, encode_captions

  def __iter__(self) -> EncodedBatches:
    return self

  def __next__(self) -> dict[str, jax.Array]:
    batch = next(self.shapes)
    out = {"latents": self.encode_pixels(batch.pixels), **self.encode_captions(batch.captions)}
    if self.sharding is not None:
      out = {
        k: jax.device_put(v, self.sharding) if v.shape[:1] == (len(batch.captions),) else v
        for k, v in out.items()
      }
    return out

  def state(self) -> dict[str, Any]:
    return self.shapes.state()

  def restore(self, state: Mapping[str, Any]) -> None:
    self.shapes.restore(dict(state))


class CaptionCache:
  """Text states per caption, computed once (the shapes grammar repeats captions)."""

  def __init__(self, encode: Callable[[list[str]], Mapping[str, np.ndarray]]):
    self.encode, self.cache = encode, {}

  def __call__(self, captions: list[str]) -> dict[str, jax.Array]:
    todo = sorted({c for c in captions if c not in self.cache})
    if todo:
      encoded = {k: np.asarray(v) for k, v in self.encode(todo).items()}
      for i, c in enumerate(todo):
        self.cache[c] = {k: v[i] for k, v in encoded.items()}
    keys = self.cache[captions[0]].keys()
    return {k: jnp.asarray(np.stack([self.cache[c][k] for c in captions])) for k in keys}


def import_recipe(spec: str) -> Callable[[Any], Recipe]:
  """The recipe function `"module.path:function"` names (what `apps/train`'s `recipe` key holds).

  Raises:
    ValueError: a malformed string, a module that does not import, or a name it lacks (with the
      nearest one it has).
  """
  import difflib
  import importlib

  module_name, sep, attr = (spec or "").partition(":")
  if not sep or not module_name or not attr:
    raise ValueError(
      f"recipe={spec!r} must be 'module.path:function' (e.g. md_train.recipes:wan21_tiny)"
    )
  try:
    module = importlib.import_module(module_name)
  except ImportError as e:
    raise ValueError(f"recipe={spec!r}: cannot import {module_name!r} ({e})") from None
  fn = getattr(module, attr, None)
  if not callable(fn):
    known = [n for n in dir(module) if not n.startswith("_") and callable(getattr(module, n))]
    near = difflib.get_close_matches(attr, known, n=1)
    hint = f"; did you mean {module_name}:{near[0]}?" if near else ""
    raise ValueError(f"recipe={spec!r}: {module_name} has no function {attr!r}{hint}")
  return fn


# --- options ---------------------------------------------------------------------------------------------


def _options(config: Any) -> dict[str, Any]:
  return dict(config.recipe_options.to_dict() if hasattr(config, "recipe_options") else {})


def _mesh(config: Any) -> jax.sharding.Mesh | None:
  mesh = config.get("mesh") if hasattr(config, "get") else None
  if mesh is None:
    return None
  import md_sharding as mds

  return mds.make_mesh(mds.MeshConfig.from_dict(dict(mesh)))


def _fixture(config: Any, default: str) -> pathlib.Path:
  """The pipeline folder `recipe_options.model` names (default: a tiny fixture), relative paths taken
  from the working directory, else from the repository root."""
  value = _options(config).get("model") or default
  path = pathlib.Path(value).expanduser()
  if not path.is_absolute() and not path.exists():
    path = pathlib.Path(__file__).resolve().parents[4] / value
  if not (path / "model_index.json").is_file():
    raise FileNotFoundError(
      f"recipe_options.model={value!r}: {path} is not a diffusers pipeline folder (no "
      "model_index.json)"
    )
  return path


def _optimizer(opts: Mapping[str, Any]):
  return make_optimizer(
    learning_rate=float(opts.get("learning_rate", 1e-3)),
    warmup_steps=int(opts.get("warmup_steps", 0)),
    max_grad_norm=opts.get("max_grad_norm", 1.0),
    weight_decay=float(opts.get("weight_decay", 1e-2)),
  )


def _fingerprint(name: str, model: pathlib.Path, opts: Mapping[str, Any], config: Any) -> dict:
  return {
    "recipe": name,
    "model": model.name,
    "seed": int(config.seed),
    "options": {k: v for k, v in sorted(opts.items()) if k != "model"},
  }


def _shapes(opts: Mapping[str, Any], config: Any, *, frames: int | None) -> md_data.ShapesIterator:
  cfg = md_data.ShapesConfig(size=int(opts.get("size", 32)), frames=frames)
  return md_data.ShapesIterator(cfg, seed=int(config.seed), batch_size=int(opts["batch_size"]))


def _eval_batches(opts, config, frames, encode_pixels, encode_captions, count=2):
  """A fixed held-out evaluation set: `count` batches of the `held_out` split (other seed)."""
  cfg = md_data.ShapesConfig(size=int(opts.get("size", 32)), frames=frames, split="held_out")
  it = md_data.ShapesIterator(cfg, seed=int(config.seed) + 1, batch_size=int(opts["batch_size"]))
  out = []
  for _ in range(count):
    b = next(it)
    out.append({"latents": encode_pixels(b.pixels), **encode_captions(b.captions)})
  return out


def _split_jit(module: nnx.Module, fn: Callable) -> Callable:
  graphdef, state = nnx.split(module)
  run = jax.jit(lambda s, x: fn(nnx.merge(graphdef, s), x))
  return lambda x: run(state, jnp.asarray(x))


# --- export ---------------------------------------------------------------------------------------------


def export_denoiser(
  frozen: Any,
  params: Any,
  source: pathlib.Path,
  folder: pathlib.Path,
  convert_key: Callable[[str], Any],
) -> pathlib.Path:
  """Writes the trained denoiser to `folder` in the diffusers layout: `source`'s config.json and one
  safetensors file with every tensor of `source`'s file, named as there, holding md's trained values
  put back in the reference's layout (the inverse of loading through `convert_key`).

  Raises:
    ValueError: a tensor of the source that md does not map, or whose exported shape differs.
  """
  module = frozen.merge(params)
  flat = {md_core.path_str(p): v for p, v in _flat_values(module).items()}
  template = md_core.open_checkpoint(source)
  out = {}
  for name in template:
    want = template[name]
    targets = convert_key(name)
    if targets is None:
      raise ValueError(f"{source}: tensor {name!r} maps to no md parameter; cannot export it")
    targets = [targets] if isinstance(targets, md_core.Target) else list(targets)
    targets = sorted(targets, key=lambda t: (t.split or (0, 1, 0))[0])
    parts = []
    for t in targets:
      key = md_core.path_str(t.path)
      if key not in flat:
        raise ValueError(f"{source}: tensor {name!r} maps to {key}, which the model does not have")
      a = np.asarray(flat[key], np.float32)
      if t.layer is not None:
        a = a[t.layer]
      parts.append(_to_reference_layout(a, t.layout, name))
    split = getattr(targets[0], "split", None)
    a = parts[0] if split is None or len(parts) == 1 else np.concatenate(parts, axis=split[2])
    if tuple(a.shape) != tuple(want.shape):
      raise ValueError(
        f"{source}: tensor {name!r} has shape {tuple(want.shape)}, md's export {tuple(a.shape)}"
      )
    out[name] = a.astype(np.asarray(want).dtype)
  folder.mkdir(parents=True, exist_ok=True)
  shutil.copy(source / "config.json", folder / "config.json")
  md_core.save_safetensors(
    folder / "diffusion_pytorch_model.safetensors", out, metadata={"format": "pt"}
  )
  return folder


# Reference → md permutations of md_core.Target layouts; exporting applies their inverses.
_PERMUTATIONS = {
  "identity": None,
  "linear": (1, 0),
  "conv1d": (2, 1, 0),
  "conv2d": (2, 3, 1, 0),
  "conv3d": (2, 3, 4, 1, 0),
}


def _to_reference_layout(array: np.ndarray, layout: str, name: str) -> np.ndarray:
  perm = _PERMUTATIONS.get(layout)
  if layout not in _PERMUTATIONS:
    raise ValueError(f"tensor {name!r}: layout {layout!r} has no inverse")
  return array if perm is None else np.transpose(array, np.argsort(perm))


def _flat_values(module: nnx.Module) -> dict[tuple, np.ndarray]:
  out = {}
  for path, var in nnx.to_flat_state(nnx.state(module)):
    value = var.get_value() if hasattr(var, "get_value") else var.value
    out[tuple(path)] = np.asarray(jax.device_get(value))
  return out


# --- the recipes -------------------------------------------------------------------------------------------

_WAN = "tests/fixtures/wan_pipeline/t2v"
_SD = "tests/fixtures/sd_pipeline/sd"
_FLUX = "tests/fixtures/flux_pipeline/dev"
# Timesteps (x 1000 sigma for the flow models) at which the recipes' `eval` reports the loss.
EVAL_TIMESTEPS = (100, 500, 900)


def _evaluator(loss_fn, make_batches: Callable[[], list], *, key: str, scale: float):
  batches = []  # encoded at the first evaluation

  def evaluate(state: TrainState) -> dict[str, float]:
    if not batches:
      batches.extend(make_batches())
    losses = eval_loss(loss_fn, state.params, batches, EVAL_TIMESTEPS, key=key, scale=scale)
    out = {f"eval/loss_t{t}": v for t, v in losses.items()}
    out["eval/loss"] = float(np.mean(list(losses.values())))
    return out

  return evaluate


LORA_FILE = "pytorch_lora_weights.safetensors"  # diffusers' name for a saved LoRA


def _trainable(
  config: Any, module: nnx.Module, *, family: str, source: pathlib.Path, key_map: Callable
) -> tuple[Any, Any, LoRA | None]:
  """(frozen part, trainable state, the LoRA or None): the whole module, or with a `lora` option
  (`recipe_options.lora`: rank, alpha, targets, init, seed) only LoRA slots on the base."""
  spec = _options(config).get("lora")
  if not spec:
    frozen, params = split_trainable(module)
    return frozen, params, None
  if not isinstance(spec, Mapping):
    raise ValueError(
      f"recipe_options.lora={spec!r} must be a mapping (rank, alpha, targets, init, seed)"
    )
  spec = {"seed": int(config.seed), **spec}
  names = list(md_core.open_checkpoint(source))
  lora = add_lora(
    module, LoRAConfig.from_options(spec), convert_key=key_map, reference_names=names,
    family=family,
  )  # fmt: skip
  frozen, params = split_lora(module)
  return frozen, params, lora


def _denoiser_recipe(
  name: str,
  config: Any,
  opts: dict,
  model: pathlib.Path,
  *,
  frozen: Any,
  params: Any,
  loss_fn: Any,
  pixels: Callable,
  captions: Callable,
  sharding: Any,
  frames: int | None,
  component: str,
  convert_key: Callable,
  eval_key: str,
  eval_scale: float,
  lora: LoRA | None = None,
  lora_key_map: Callable | None = None,
  batches: Any = None,
  evaluate: bool = True,
) -> Recipe:
  """The part every denoiser recipe shares: optimizer, state, shapes batches (unless `batches` are
  given), held-out eval, export of `component` in the diffusers layout (with a `lora`: the adapter as
  `<folder>/<component>/pytorch_lora_weights.safetensors`, PEFT names under `unet.` /
  `transformer.`), fingerprint."""
  optimizer = _optimizer(opts)
  if lora is not None:
    loss_fn = lora_loss(loss_fn, lora)
  state = init_state(params, optimizer, rng=int(config.seed))
  if batches is None:
    batches = EncodedBatches(_shapes(opts, config, frames=frames), pixels, captions, sharding)
  held_out = lambda: _eval_batches(opts, config, frames, pixels, captions)  # noqa: E731
  source = model / component

  def export(s: TrainState, folder) -> pathlib.Path:
    out = pathlib.Path(folder) / component
    if lora is None:
      return export_denoiser(frozen, s.params, source, out, convert_key)
    out.mkdir(parents=True, exist_ok=True)
    names = list(md_core.open_checkpoint(source))
    prefix = "unet" if component == "unet" else "transformer"
    return save_lora(
      lora, s.params, out / LORA_FILE, convert_key=lora_key_map, reference_names=names,
      prefix=prefix,
    )  # fmt: skip

  return Recipe(
    state=state,
    step=make_train_step(loss_fn, optimizer),
    batches=batches,
    eval=_evaluator(loss_fn, held_out, key=eval_key, scale=eval_scale) if evaluate else None,
    export=export,
    fingerprint=_fingerprint(name, model, opts, config),
  )


def wan21_tiny(config: Any) -> Recipe:
  """The tiny Wan 2.1 T2V transformer (tests/fixtures/wan_pipeline/t2v) on shapes clips.

  `config.recipe_options`: `model` (the pipeline folder), `batch_size`, `size` (pixels), `frames`
  (4k + 1), `max_sequence_length`, `learning_rate`, `warmup_steps`, `max_grad_norm`, `weight_decay`,
  `shift` (the sigma sampler's shift), `lora` (train a LoRA only: see `_trainable`).
  """
  import md_wan

  opts = _options(config)
  model = _fixture(config, _WAN)
  mesh = _mesh(config)
  sharding = batch_sharding(mesh, int(opts["batch_size"]))
  frames = int(opts.get("frames", 5))
  pipe = md_wan.load_pipeline(model, mesh=mesh)
  length = int(opts.get("max_sequence_length", 64))
  captions = CaptionCache(
    lambda c: {"encoder_hidden_states": pipe.encode_prompt(c, max_sequence_length=length)}
  )
  pixels = _split_jit(pipe.vae, lambda vae, x: vae.normalize_latents(vae.encode(x * 2 - 1).mode()))
  key_map = pipe.lora_key_map("transformer")
  frozen, params, lora = _trainable(
    config, pipe.transformer, family="wan", source=model / "transformer", key_map=key_map
  )
  loss_fn = families.wan_loss(frozen, shift=float(opts.get("shift", 5.0)))
  return _denoiser_recipe(
    "wan21-tiny", config, opts, model, frozen=frozen, params=params, loss_fn=loss_fn, pixels=pixels,
    captions=captions, sharding=sharding, frames=frames, component="transformer", convert_key=md_wan.convert_key,
    eval_key="sigmas", eval_scale=1e-3, lora=lora, lora_key_map=key_map,
  )  # fmt: skip


def _image_latents(vae: nnx.Module, scale: Callable) -> Callable[[np.ndarray], jax.Array]:
  """Images `[B, H, W, 3]` in [0, 1] → the denoiser's latents: the posterior mean, scaled."""
  return _split_jit(vae, lambda m, x: scale(m, m.encode(x * 2 - 1).mean))


def sd15_tiny(config: Any) -> Recipe:
  """The tiny SD 1.5 UNet (tests/fixtures/sd_pipeline/sd) on shapes images, diffusers'
  train_text_to_image.py loss (epsilon target; Min-SNR-γ when `snr_gamma` > 0).

  `config.recipe_options`: `model`, `batch_size`, `size`, `learning_rate`, `warmup_steps`,
  `max_grad_norm`, `weight_decay`, `snr_gamma`, `lora` (rank, alpha, targets, init, seed: only
  the LoRA trains, as in train_text_to_image_lora.py; exported as a PEFT file).
  """
  import md_schedulers as mdsch
  import md_sd

  opts = _options(config)
  model = _fixture(config, _SD)
  mesh = _mesh(config)
  sharding = batch_sharding(mesh, int(opts["batch_size"]))
  pipe = md_sd.load_pipeline(model, mesh=mesh)
  sched = pipe.scheduler_config
  keys = ("num_train_timesteps", "beta_start", "beta_end", "beta_schedule")
  acp = mdsch.ddpm(**{k: sched[k] for k in keys if k in sched}).alphas_cumprod
  captions = CaptionCache(lambda c: {"encoder_hidden_states": pipe.encode_prompt(c)[0]})
  factor = float(pipe.vae.config.scaling_factor)
  pixels = _image_latents(pipe.vae, lambda m, z: z * factor)
  key_map = pipe.lora_key_map("unet")
  frozen, params, lora = _trainable(
    config, pipe.unet, family="sd", source=model / "unet", key_map=key_map
  )
  gamma = float(opts.get("snr_gamma", 0.0) or 0.0)
  prediction = sched.get("prediction_type", "epsilon")
  loss_fn = families.sd_loss(
    frozen, alphas_cumprod=acp, prediction_type=prediction, snr_gamma=gamma or None
  )
  return _denoiser_recipe(
    "sd15-tiny", config, opts, model, frozen=frozen, params=params, loss_fn=loss_fn, pixels=pixels,
    captions=captions, sharding=sharding, frames=None, component="unet", convert_key=md_sd.convert_unet_key,
    eval_key="timesteps", eval_scale=1.0, lora=lora, lora_key_map=key_map,
  )  # fmt: skip


def flux1_tiny(config: Any) -> Recipe:
  """The tiny Flux.1 dev transformer (tests/fixtures/flux_pipeline/dev) on shapes images, diffusers'
  train_dreambooth_flux.py loss (logit-normal sigmas, embedded guidance `guidance`).

  `config.recipe_options`: `model`, `batch_size`, `size`, `max_sequence_length`, `learning_rate`,
  `warmup_steps`, `max_grad_norm`, `weight_decay`, `guidance`, `lora` (train_dreambooth_lora_flux.py's
  default targets unless named).
  """
  import md_flux

  opts = _options(config)
  model = _fixture(config, _FLUX)
  mesh = _mesh(config)
  sharding = batch_sharding(mesh, int(opts["batch_size"]))
  pipe = md_flux.load_pipeline(model, mesh=mesh)
  length = int(opts.get("max_sequence_length", 64))

  def encode(c):
    t5, pooled = pipe.encode_prompt(c, max_sequence_length=length)
    return {"encoder_hidden_states": t5, "pooled_projections": pooled}

  cache = CaptionCache(encode)
  txt_ids = jnp.zeros((length, 3), jnp.float32)
  captions = lambda c: {**cache(c), "txt_ids": txt_ids}  # noqa: E731
  pixels = _image_latents(pipe.vae, lambda m, z: m.scale_latents(z))
  key_map = pipe.lora_key_map("transformer")
  frozen, params, lora = _trainable(
    config, pipe.transformer, family="flux", source=model / "transformer", key_map=key_map
  )
  guided = bool(pipe.transformer.cfg.guidance_embeds)
  loss_fn = families.flux_loss(
    frozen, guidance=float(opts.get("guidance", 3.5)) if guided else None
  )
  return _denoiser_recipe(
    "flux1-tiny", config, opts, model, frozen=frozen, params=params, loss_fn=loss_fn, pixels=pixels,
    captions=captions, sharding=sharding, frames=None, component="transformer", convert_key=md_flux.convert_key,
    eval_key="sigmas", eval_scale=1e-3, lora=lora, lora_key_map=key_map,
  )  # fmt: skip


def dreambooth_sd(config: Any) -> Recipe:
  """Dreambooth for the SD 1.x UNet (default: the tiny tests/fixtures/sd_pipeline/sd), diffusers'
  train_dreambooth.py: the instance images of `instance_dir` with `instance_prompt`; with
  `with_prior_preservation`, `num_class_images` images of `class_prompt` in `class_dir` (the missing
  ones generated first by md's SD pipeline, `class_steps` steps at guidance `class_guidance`) fill the
  second half of every batch, and the loss adds `prior_loss_weight` times their MSE. Images are
  center-cropped and resized to `size`, encoded once (posterior mean, scaled); the prompts are encoded
  once. With a `lora` option only a LoRA trains (train_dreambooth_lora.py), exported as a PEFT file.

  `config.recipe_options`: `model`, `instance_dir`, `instance_prompt`, `class_dir`, `class_prompt`,
  `with_prior_preservation`, `prior_loss_weight`, `num_class_images`, `class_steps`,
  `class_guidance`, `batch_size` (examples per half), `size`, `learning_rate`, `warmup_steps`,
  `max_grad_norm`, `weight_decay`, `snr_gamma`, `lora`.

  Raises:
    FileNotFoundError / ValueError: a missing, empty or unreadable instance folder (named), a
      `class_dir` that is a file, missing prompts.
  """
  import md_schedulers as mdsch
  import md_sd

  opts = _options(config)
  for key in ("instance_dir", "instance_prompt"):
    if not opts.get(key):
      raise ValueError(f"recipe_options.{key} is required for dreambooth_sd")
  prior = bool(opts.get("with_prior_preservation", True))
  if prior and not (opts.get("class_dir") and opts.get("class_prompt")):
    raise ValueError(
      "with_prior_preservation needs recipe_options.class_dir and recipe_options.class_prompt"
    )
  size = int(opts.get("size", 32))
  instance_files = _dreambooth.image_files(_path(opts["instance_dir"]), what="instance_dir")
  instance_pixels = _dreambooth.load_images(instance_files, size, what="instance_dir")
  model = _fixture(config, _SD)
  mesh = _mesh(config)
  batch = int(opts["batch_size"])
  sharding = batch_sharding(mesh, 2 * batch if prior else batch)
  pipe = md_sd.load_pipeline(model, mesh=mesh)
  class_pixels = None
  if prior:

    def generate(prompts, seed):
      return pipe(
        prompts, height=size, width=size, num_inference_steps=int(opts.get("class_steps", 25)),
        guidance_scale=float(opts.get("class_guidance", 7.5)), seed=seed, progress=False,
      )  # fmt: skip

    class_files = _dreambooth.class_images(
      generate, _path(opts["class_dir"]), opts["class_prompt"],
      int(opts.get("num_class_images", 100)), seed=int(config.seed),
    )  # fmt: skip
    class_pixels = _dreambooth.load_images(class_files, size, what="class_dir")
  sched = pipe.scheduler_config
  keys = ("num_train_timesteps", "beta_start", "beta_end", "beta_schedule")
  acp = mdsch.ddpm(**{k: sched[k] for k in keys if k in sched}).alphas_cumprod
  factor = float(pipe.vae.config.scaling_factor)
  pixels = _image_latents(pipe.vae, lambda m, z: z * factor)
  encode = lambda x: np.concatenate([np.asarray(pixels(x[i : i + 8])) for i in range(0, len(x), 8)])  # noqa: E731
  states = lambda p: {"encoder_hidden_states": np.asarray(pipe.encode_prompt([p])[0][0])}  # noqa: E731
  batches = _dreambooth.DreamboothBatches(
    encode(instance_pixels), None if class_pixels is None else encode(class_pixels),
    states(opts["instance_prompt"]), states(opts["class_prompt"]) if prior else None,
    batch_size=batch, seed=int(config.seed), sharding=sharding,
  )  # fmt: skip
  key_map = pipe.lora_key_map("unet")
  frozen, params, lora = _trainable(
    config, pipe.unet, family="sd", source=model / "unet", key_map=key_map
  )
  gamma = float(opts.get("snr_gamma", 0.0) or 0.0)
  loss_fn = families.sd_loss(
    frozen, alphas_cumprod=acp, prediction_type=sched.get("prediction_type", "epsilon"),
    snr_gamma=gamma or None,
    prior_loss_weight=float(opts.get("prior_loss_weight", 1.0)) if prior else None,
  )  # fmt: skip
  return _denoiser_recipe(
    "dreambooth-sd", config, opts, model, frozen=frozen, params=params, loss_fn=loss_fn,
    pixels=pixels, captions=None, sharding=sharding, frames=None, component="unet",
    convert_key=md_sd.convert_unet_key, eval_key="timesteps", eval_scale=1.0, lora=lora,
    lora_key_map=key_map, batches=batches, evaluate=False,
  )  # fmt: skip


def _path(value: str) -> pathlib.Path:
  """A folder option: as given (relative to the working directory), else under the repository root
  when only that exists (the tiny variants' fixture folders)."""
  path = pathlib.Path(value).expanduser()
  if not path.is_absolute() and not path.exists():
    root = pathlib.Path(__file__).resolve().parents[4] / value
    if root.exists():
      return root
  return path
