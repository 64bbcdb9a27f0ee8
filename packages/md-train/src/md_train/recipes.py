"""Recipes for `md_train.fit` / `apps/train`: the tiny SD 1.5, Flux.1 and Wan 2.1 pipelines of
tests/fixtures trained on md_data's shapes dataset.

Each recipe is a function of the whole app config (`apps/configs/train.py`) returning a `Recipe`: the
family's denoiser from the fixture folder (its config and random-init weights, as the PyTorch reference
saved them), md_data shapes images (SD, Flux) or clips (Wan) encoded by that folder's VAE, the captions'
states from its text encoder (encoded once per caption), the family loss of `md_train.families`, and an
exporter that writes the trained denoiser back in the diffusers layout (config.json + safetensors under the
reference's tensor names), which md's loaders (and diffusers) read. With `recipe_options.records` (an
`apps/prepare_data` workdir), the SD and Wan recipes train on its cached-latent records instead
(`prepared_data`, `record_batches`) and evaluate on its eval/ records at their fixed timesteps.

    uv run apps/train --config=apps/configs/train.py:wan21-tiny --workdir=/tmp/wan
    uv run apps/train --config=apps/configs/train.py:sd15-records --config.recipe_options.records=W
"""

from __future__ import annotations

import functools
import os
import pathlib
import shutil
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import md_core
import md_data
from md_train import _dreambooth, families
from md_train._eval import eval_loss
from md_train._loop import Recipe, batch_sharding
from md_train._lora import (
  LoRA,
  LoRAConfig,
  add_lora,
  flux_prompt_embeds,
  lora_loss,
  save_lora,
  sd_prompt_embeds,
  sdxl_prompt_embeds,
  split_lora,
  text_encoders_lora_loss,
)
from md_train._losses import WAN22_EXPERTS, expert_range, flow_training_table
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
    out = {
      **_pixel_inputs(self.encode_pixels, batch.pixels),
      **self.encode_captions(batch.captions),
    }
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


def _pixel_inputs(encode_pixels: Callable, pixels: np.ndarray) -> dict[str, Any]:
  """`encode_pixels(pixels)` as loss inputs: its dict (latents and, e.g., an image condition), or
  `{"latents": it}`."""
  out = encode_pixels(pixels)
  return dict(out) if isinstance(out, Mapping) else {"latents": out}


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


# --- cached-latent records (apps/prepare_data) ---------------------------------------------------------

# What apps/prepare_data writes last, once every shard is complete.
PREPARED_SETTINGS = "settings.json"


class PreparedData(NamedTuple):
  """A checked folder of cached-latent records (`prepared_data`): an `apps/prepare_data` workdir
  (train/, eval/, settings.json) or records written elsewhere (MaxDiffusion's layout, no settings.json).

  Attributes:
    workdir: the folder.
    settings: its settings.json (prepare_data's config: family, model, channels_first, splits, ...);
      for records without one, what the recipe options said (`family`, `model`, `channels_first`,
      `source: "records without settings.json"`).
    model: the pipeline folder the records were encoded with (settings.json's `model`, resolved).
    latents: one train record's latents shape, channels last (`[h, w, c]`, video `[f, h, w, c]`).
    encoder_hidden_states: one record's text states shape `[S, D]`.
    eval: whether eval/ holds records (each with a fixed `timesteps`).
    train_dir: the folder of the train records (`workdir/train`, or `workdir` itself for records
      without settings.json that keep their files at the top).
  """

  workdir: pathlib.Path
  settings: dict
  model: pathlib.Path
  latents: tuple[int, ...]
  encoder_hidden_states: tuple[int, ...]
  eval: bool
  train_dir: pathlib.Path

  @property
  def channels_first(self) -> bool:
    """The records store latents channels first (MaxDiffusion's layout: prepare_data's option)."""
    return bool(self.settings.get("channels_first", False))


def _record_files(folder: pathlib.Path) -> list[pathlib.Path]:
  # What md_data's reader reads: the folder's files, less hidden ones and unfinished `.tmp` ones.
  return sorted(
    p for p in folder.iterdir()
    if p.is_file() and not p.name.startswith(".") and not p.name.endswith(".tmp")
  )  # fmt: skip


def _first_record(folder: pathlib.Path, what: str) -> dict[str, tuple[int, ...]]:
  """The feature shapes of the first record in `folder` (channels as stored), without TensorFlow."""
  files = _record_files(folder)
  if not files:
    raise ValueError(f"{what}: {folder} holds no record files; run apps/prepare_data into it again")
  first = next(md_data.iter_tfrecord(files[0]), None)
  if first is None:
    raise ValueError(f"{what}: {files[0]} holds no records")
  features = md_data.decode_example(first)
  missing = [n for n in md_data.LATENT_FEATURES if n not in features]
  if missing:
    raise ValueError(
      f"{what}: {files[0]}: a record has no feature {missing[0]!r} (it has "
      f"{', '.join(sorted(features)) or 'none'}); cached-latent records need "
      f"{', '.join(md_data.LATENT_FEATURES)}"
    )
  return {n: tuple(md_data.parse_tensor(features[n][0]).shape) for n in md_data.LATENT_FEATURES}


def _local_model(value: str, what: str) -> pathlib.Path:
  path = _path(value)
  if (path / "model_index.json").is_file():
    return path
  try:  # a hub id: the local hub cache (downloaded when online)
    return pathlib.Path(md_core.resolve_source(value))
  except (FileNotFoundError, ValueError, OSError) as e:
    raise FileNotFoundError(f"{what}: the model {value!r} is not available ({e})") from None


def prepared_data(
  workdir: str | os.PathLike,
  *,
  family: str,
  model: str | None = None,
  channels_first: bool = True,
) -> PreparedData:
  """Checks a folder of cached-latent records for training a `family` ("sd" or "wan") denoiser.

  An `apps/prepare_data` workdir names its family and model in settings.json. Records written
  elsewhere (MaxDiffusion's cached-latent TFRecords: `latents` and `encoder_hidden_states`, latents
  channels first) have no settings.json: give `model`, the pipeline folder they were encoded with, and
  `channels_first` (their layout; True, MaxDiffusion's, by default); their files lie in train/ or at
  the folder's top, eval records (with `timesteps`) in eval/. Reads the first record of each split
  (their shapes); no TensorFlow.

  Raises:
    FileNotFoundError: a missing workdir, train/ or settings.json (the path named; without
      settings.json, unless `model` is given).
    ValueError: a file for a folder, no records, records of another family, or eval records whose
      shapes differ from the train records' (both named).
  """
  what = f"recipe_options.records={os.fspath(workdir)!r}"
  path = pathlib.Path(workdir).expanduser()
  make = (
    f"uv run apps/prepare_data --config=apps/configs/prepare_data.py:<variant> --workdir={path}"
  )
  if not os.fspath(workdir):
    raise ValueError(f"{what} is empty: give the --workdir of an apps/prepare_data run")
  if not path.exists():
    raise FileNotFoundError(f"{what}: {path} does not exist; write the records first: {make}")
  if not path.is_dir():
    raise ValueError(
      f"{what}: {path} is a file, not a prepare_data workdir (train/, settings.json)"
    )
  settings_file = path / PREPARED_SETTINGS
  train_dir = path / "train"
  if settings_file.is_file():
    settings = md_core.read_json(settings_file)
  elif model:
    # Records made elsewhere: the recipe options say what settings.json would.
    settings = dict(
      family=family, model=str(model), channels_first=bool(channels_first),
      source="records without settings.json",
    )  # fmt: skip
    if not train_dir.is_dir():
      train_dir = path
  else:
    raise FileNotFoundError(
      f"{what}: {path} has no {PREPARED_SETTINGS}, so it is not a finished apps/prepare_data "
      f"workdir (settings.json is written last); run {make}. For records written elsewhere "
      "(MaxDiffusion's layout), name the pipeline folder they were encoded with: "
      "recipe_options.model=<folder> (and recipe_options.records_channels_first=False if their "
      "latents are stored channels last)"
    )
  got = settings.get("family")
  if got != family:
    raise ValueError(
      f"{what}: the records in {path} were prepared for family={got!r} (model "
      f"{settings.get('model')!r}, settings.json), this recipe trains a {family!r} denoiser; use "
      f"the {_RECORDS_VARIANTS.get(got, 'matching')} variant or prepare the data with family={family}"
    )
  if not train_dir.is_dir():
    raise FileNotFoundError(f"{what}: {path} has no train/ folder of records; run {make}")
  shapes = _first_record(train_dir, what)
  eval_dir = path / "eval"
  has_eval = eval_dir.is_dir() and bool(_record_files(eval_dir))
  if has_eval:
    for name, shape in _first_record(eval_dir, what).items():
      if shape != shapes[name]:
        raise ValueError(
          f"{what}: eval/ records have {name!r} of shape {shape}, train/ records {shapes[name]}; "
          "prepare both splits with one model and size"
        )
  latents = shapes["latents"]
  if settings.get("channels_first", False):
    latents = latents[1:] + latents[:1]
  if not settings.get("model"):
    raise ValueError(f"{what}: {settings_file} names no model")
  return PreparedData(
    workdir=path,
    settings=settings,
    model=_local_model(str(settings["model"]), what),
    latents=tuple(latents),
    encoder_hidden_states=shapes["encoder_hidden_states"],
    eval=has_eval,
    train_dir=train_dir,
  )


# The apps/configs/train.py variants that train each family's records (for the errors).
_RECORDS_VARIANTS = {"sd": "sd15-records", "wan": "wan21-records"}


def _check_records_fit(
  data: PreparedData,
  model: pathlib.Path,
  *,
  denoiser: str,
  latents: tuple[int | str, ...],
  multiple: int,
  text_dim: int,
  max_timestep: int,
) -> None:
  """The records fit the denoiser of `model`: `latents` is the expected shape with letters for free
  sizes (spatial ones multiples of `multiple`), `text_dim` the text states' width; eval timesteps
  lie below `max_timestep`; and a model other than the records' one has the same VAE.

  Raises:
    ValueError: naming the workdir, the feature and both shapes (or both VAE configs).
  """
  where = f"{data.workdir}"
  want = "(" + ", ".join(str(x) for x in latents) + ")"
  got = data.latents
  spatial = [i for i, x in enumerate(latents) if x in ("h", "w")]
  fits = len(got) == len(latents) and all(
    g == x if isinstance(x, int) else (i not in spatial or g % multiple == 0)
    for i, (g, x) in enumerate(zip(got, latents))
  )
  if not fits:
    layout = " (channels last" + ("; stored channels first)" if data.channels_first else ")")
    extra = f", h and w multiples of {multiple}" if multiple > 1 else ""
    raise ValueError(
      f"{where}: feature 'latents' has shape {got}{layout} per record; the {denoiser} of {model} "
      f"takes {want}{extra}; prepare the records with this model's VAE (apps/prepare_data "
      "--config.model=...) or train the model they were made with"
    )
  states = data.encoder_hidden_states
  if len(states) != 2 or states[1] != text_dim:
    raise ValueError(
      f"{where}: feature 'encoder_hidden_states' has shape {states} per record; the {denoiser} of "
      f"{model} takes (S, {text_dim}); prepare the records with this model's text encoder"
    )
  top = int(data.settings.get("num_train_timesteps", 1000))
  if data.eval and top > max_timestep:
    raise ValueError(
      f"{where}: the eval records' timesteps go up to num_train_timesteps={top} (settings.json), "
      f"the {denoiser} of {model} trains on {max_timestep}"
    )
  if model.resolve() != data.model.resolve():
    mine, theirs = model / "vae" / "config.json", data.model / "vae" / "config.json"
    if mine.is_file() and theirs.is_file():
      skip = ("_diffusers_version", "_name_or_path")
      a, b = md_core.read_json(mine), md_core.read_json(theirs)
      differ = sorted(k for k in set(a) | set(b) if k not in skip and a.get(k) != b.get(k))
      if differ:
        raise ValueError(
          f"{where}: the records hold latents of {data.model}'s VAE, recipe_options.model={model} "
          f"has another VAE ({theirs} and {mine} differ in {', '.join(differ)}); leave "
          "recipe_options.model empty to train the records' model, or prepare the records with "
          "this one"
        )


class RecordBatches:
  """Training batches from cached-latent records: `{"latents", "encoder_hidden_states"}` arrays with
  the leading (batch) axis split over `sharding`'s mesh, latents channels last; resumable through the
  records iterator's `state()` / `restore(s)` (batches served).

  Args:
    records: the `md_data.read_latent_records` iterator (this process's part of each batch).
    channels_first: the records store latents channels first.
    sharding: where the batch's arrays go (a `NamedSharding` over the data-parallel axes), or None.
  """

  def __init__(
    self, records: md_data.TFRecordIterator, *, channels_first: bool = False, sharding: Any = None
  ):
    self.records, self.channels_first, self.sharding = records, channels_first, sharding

  def __iter__(self) -> RecordBatches:
    return self

  def __next__(self) -> dict[str, jax.Array]:
    batch = next(self.records)
    latents = batch["latents"]
    if self.channels_first:
      latents = np.moveaxis(latents, 1, -1)
    out = {"latents": latents, "encoder_hidden_states": batch["encoder_hidden_states"]}
    if self.sharding is None:
      return {k: jnp.asarray(v) for k, v in out.items()}
    import md_sharding as mds

    return mds.host_local_to_global(out, self.sharding.mesh, self.sharding.spec)

  def state(self) -> dict[str, Any]:
    return self.records.state()

  def restore(self, state: Mapping[str, Any]) -> None:
    self.records.restore(state)


def record_batches(
  data: PreparedData,
  *,
  batch_size: int,
  seed: int,
  sharding: Any = None,
  shuffle_buffer: int = 1024,
) -> RecordBatches:
  """The endless, shuffled (files and records, from `seed`) train/ batches of `data`.

  `batch_size` is the global batch; each process reads its own files (`md_data.read_latent_records`)
  for its part of it.

  Raises:
    ValueError: fewer train records than `batch_size` (settings.json's count).
  """
  count = (data.settings.get("splits") or {}).get("train", {}).get("records")
  if count is not None and int(count) < batch_size:
    raise ValueError(
      f"{data.workdir}: train/ holds {count} records, fewer than batch_size={batch_size}; prepare "
      "more examples or lower recipe_options.batch_size"
    )
  per_process = batch_size
  if sharding is not None:
    sizes = md_data.batch_sizes(sharding.mesh, global_batch_size=batch_size)
    per_process = sizes.per_process_batch_size
  records = md_data.read_latent_records(
    data.train_dir, batch_size=per_process, seed=seed, shuffle_buffer=shuffle_buffer,
    timesteps=False,
  )  # fmt: skip
  return RecordBatches(records, channels_first=data.channels_first, sharding=sharding)


def eval_records(data: PreparedData, *, batch_size: int) -> list[dict[str, np.ndarray]]:
  """Every eval/ record of `data`, unshuffled (file order for one file; the reader interleaves several
  files, deterministically), in batches of up to `batch_size` (numpy, latents channels last,
  `timesteps [B]` int64)."""
  reader = md_data.read_latent_records(
    data.workdir / "eval", batch_size=batch_size, seed=None, repeat=False, drop_remainder=False,
    timesteps=True, process_index=0, process_count=1,
  )  # fmt: skip
  out = []
  for batch in reader:
    if data.channels_first:
      batch["latents"] = np.moveaxis(batch["latents"], 1, -1)
    out.append(batch)
  return out


def _records_evaluator(loss_fn, make_batches: Callable[[], list], *, key: str, scale: float):
  """MaxDiffusion's eval on records with fixed timesteps: each record's loss at its own timestep (the
  same noise at every evaluation), averaged per timestep; `eval/loss` is the mean over timesteps."""
  batches = []  # read at the first evaluation
  base = jax.random.key(0)

  def evaluate(state: TrainState) -> dict[str, float]:
    if not batches:
      batches.extend(make_batches())
    by_step: dict[int, list[float]] = {}
    index = 0
    for batch in batches:
      timesteps = np.asarray(batch["timesteps"])
      n = len(timesteps)
      dtype = jnp.int32 if key == "timesteps" else jnp.float32
      levels = jnp.asarray(timesteps * scale, dtype)
      keys = jax.vmap(lambda i: jax.random.fold_in(base, i))(jnp.arange(index, index + n))
      inputs = {k: jnp.asarray(v) for k, v in batch.items() if k != "timesteps"}
      losses = _example_losses(loss_fn, state.params, inputs, levels, keys, key=key)
      for t, loss in zip(timesteps.tolist(), np.asarray(losses).tolist()):
        by_step.setdefault(int(t), []).append(loss)
      index += n
    means = {t: float(np.mean(v)) for t, v in sorted(by_step.items())}
    out = {f"eval/loss_t{t}": v for t, v in means.items()}
    out["eval/loss"] = float(np.mean(list(means.values())))
    return out

  return evaluate


@functools.partial(jax.jit, static_argnames=("loss_fn", "key"))
def _example_losses(loss_fn, params, batch, levels, keys, *, key):
  """`[B]` losses, one per example: the loss of a batch of one, vmapped over the batch."""

  def one(example, level, k):
    single = {name: value[None] for name, value in example.items()}
    return loss_fn(params, {**single, key: level[None]}, k)[0]

  return jax.vmap(one)(batch, levels, keys)


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


def _fingerprint(
  name: str, model: pathlib.Path, opts: Mapping[str, Any], config: Any, records: Any = None
) -> dict:
  out = {
    "recipe": name,
    "model": model.name,
    "seed": int(config.seed),
    "options": {k: v for k, v in sorted(opts.items()) if k != "model"},
  }
  if records is not None:  # re-prepared records (other counts) would change the batches
    out["records"] = {"splits": records.settings.get("splits"), "latents": list(records.latents)}
  return out


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
    out.append({**_pixel_inputs(encode_pixels, b.pixels), **encode_captions(b.captions)})
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
_SDXL = "tests/fixtures/sd_pipeline/sdxl"
_LTX = "tests/fixtures/ltx_pipeline/t2v"
_KLEIN = "tests/fixtures/flux2_pipeline/klein"
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


class _TextLoRA(NamedTuple):
  """A text encoder's LoRA trained beside the denoiser's: the LoRA, the encoder's frozen part, its
  trainable slots, its key map and checkpoint names (for the export)."""

  lora: LoRA
  frozen: Any
  params: Any
  key_map: Callable
  names: list[str]


def _trains_text_encoder(opts: Mapping[str, Any], pipe: Any, model: pathlib.Path) -> bool:
  """Whether `train_text_encoder` is on, checked (a bool, with a `lora`, a pipeline with `text_encoder`)."""
  value = opts.get("train_text_encoder", False)
  if not isinstance(value, bool):
    raise ValueError(f"recipe_options.train_text_encoder={value!r} must be True or False")
  if not value:
    return False
  if not opts.get("lora"):
    raise ValueError(
      "recipe_options.train_text_encoder trains a LoRA on the text encoder beside the UNet's; give "
      "recipe_options.lora too (md does not train a whole text encoder)"
    )
  if pipe.text_encoder is None:
    raise ValueError(
      f"recipe_options.train_text_encoder: {model} has no text_encoder (an SDXL refiner?); md trains "
      "the CLIP text encoders of SD 1.x / 2.x, SDXL base and Flux.1 pipelines"
    )
  return True


def _text_encoder_loras(
  config: Any, opts: Mapping[str, Any], pipe: Any, model: pathlib.Path
) -> tuple[dict[str, _TextLoRA], Callable]:
  """The text encoders' LoRAs of `train_text_encoder` (train_dreambooth_lora.py / _sdxl.py / _flux.py:
  the `lora` option's rank and alpha, gaussian init, on the CLIP attention's q / k / v / out projections
  of `text_encoder` and, SDXL, `text_encoder_2`; Flux's T5 stays frozen), added to the pipeline's
  encoders; and the prompt embedding function (`sd_prompt_embeds`, `sdxl_prompt_embeds`,
  `flux_prompt_embeds`)."""
  kind = pipe.kind if pipe.family == "sd" else pipe.family  # SD: "sd" / "sdxl"
  names = ("text_encoder", "text_encoder_2") if kind == "sdxl" else ("text_encoder",)
  out = {}
  for i, name in enumerate(names):
    spec = {
      **{k: v for k, v in dict(opts["lora"]).items() if k != "targets"},
      "seed": int(config.seed) + 1 + i, "init": "gaussian",
      "targets": "q_proj,k_proj,v_proj,out_proj",
    }  # fmt: skip
    key_map = pipe.lora_key_map(name)
    checkpoint = list(md_core.open_checkpoint(model / name))
    module = getattr(pipe, name)
    lora = add_lora(
      module, LoRAConfig.from_options(spec), convert_key=key_map, reference_names=checkpoint
    )
    frozen, params = split_lora(module)
    out[name] = _TextLoRA(lora, frozen, params, key_map, checkpoint)
  embeds = {"sd": sd_prompt_embeds, "sdxl": sdxl_prompt_embeds, "flux": flux_prompt_embeds}[kind]
  return out, embeds


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
  records: PreparedData | None = None,
  text_loras: tuple[dict[str, _TextLoRA], Callable] | None = None,
) -> Recipe:
  """The part every denoiser recipe shares: optimizer, state, shapes batches (unless `batches` are
  given; with `records`, the prepare_data workdir's train/ records), held-out eval (with `records`:
  its eval/ records at their fixed timesteps, none without eval/), export of `component` in the
  diffusers layout (with a `lora`: the adapter as `<folder>/<component>/pytorch_lora_weights.safetensors`,
  PEFT names under `unet.` / `transformer.`), fingerprint. With `text_loras` (`{encoder name: its
  LoRA}`, the prompt embedding function) the text encoders' LoRAs train beside the denoiser's
  (`text_encoders_lora_loss`; parameters `{"denoiser", "text_encoder", ...}`), written into the same
  file under their names."""
  optimizer = _optimizer(opts)
  if lora is not None:
    loss_fn = lora_loss(loss_fn, lora, frozen)
  if text_loras is not None:
    encoders, encode = text_loras
    loss_fn = text_encoders_lora_loss(
      loss_fn, {name: (t.lora, t.frozen) for name, t in encoders.items()}, encode
    )
    params = {"denoiser": params, **{name: t.params for name, t in encoders.items()}}
  state = init_state(params, optimizer, rng=int(config.seed))
  batch_size = int(opts["batch_size"])
  evaluator = None
  if records is not None:
    batches = record_batches(
      records, batch_size=batch_size, seed=int(config.seed), sharding=sharding,
      shuffle_buffer=int(opts.get("shuffle_buffer", 1024)),
    )  # fmt: skip
    if evaluate and records.eval:
      evaluator = _records_evaluator(
        loss_fn, lambda: eval_records(records, batch_size=batch_size), key=eval_key,
        scale=eval_scale,
      )  # fmt: skip
  else:
    if batches is None:
      batches = EncodedBatches(_shapes(opts, config, frames=frames), pixels, captions, sharding)
    held_out = lambda: _eval_batches(opts, config, frames, pixels, captions)  # noqa: E731
    if evaluate:
      evaluator = _evaluator(loss_fn, held_out, key=eval_key, scale=eval_scale)
  source = model / component

  def export(s: TrainState, folder) -> pathlib.Path:
    out = pathlib.Path(folder) / component
    if lora is None:
      return export_denoiser(frozen, s.params, source, out, convert_key)
    out.mkdir(parents=True, exist_ok=True)
    names = list(md_core.open_checkpoint(source))
    prefix = "unet" if component == "unet" else "transformer"
    params, also = s.params, []
    if text_loras is not None:
      params = s.params["denoiser"]
      also = [
        (t.lora, s.params[name], t.key_map, t.names, name) for name, t in text_loras[0].items()
      ]
    return save_lora(
      lora, params, out / LORA_FILE, convert_key=lora_key_map, reference_names=names,
      prefix=prefix, also=also,
    )  # fmt: skip

  return Recipe(
    state=state,
    step=make_train_step(loss_fn, optimizer),
    batches=batches,
    eval=evaluator,
    export=export,
    fingerprint=_fingerprint(name, model, opts, config, records),
  )


def _records(opts: Mapping[str, Any], family: str) -> PreparedData | None:
  """The `records` option's folder of records, checked (None when the option is absent); `model` and
  `records_channels_first` describe records without settings.json (`prepared_data`)."""
  if "records" not in opts:
    return None
  return prepared_data(
    opts["records"] or "", family=family, model=opts.get("model") or None,
    channels_first=bool(opts.get("records_channels_first", True)),
  )  # fmt: skip


def _wan_expert(
  opts: Mapping[str, Any], model: pathlib.Path
) -> tuple[str, str | None, float | None]:
  """`(component, expert, boundary_ratio)`: the transformer a Wan recipe trains. With the `expert`
  option ("high" or "low") a Wan 2.2 A14B folder's high-noise `transformer` or low-noise
  `transformer_2`, and the folder's `boundary_ratio` (model_index.json); without it `transformer`."""
  expert = opts.get("expert") or None
  if expert is None:
    return "transformer", None, None
  if expert not in WAN22_EXPERTS:
    raise ValueError(
      f"recipe_options.expert={expert!r}; expected one of {WAN22_EXPERTS} (Wan 2.2's high-noise "
      "`transformer` or low-noise `transformer_2`), or empty for a one-transformer model"
    )
  index = md_core.read_json(model / "model_index.json")
  ratio = index.get("boundary_ratio")
  if "transformer_2" not in index or ratio is None:
    raise ValueError(
      f"recipe_options.expert={expert!r}: {model} has one transformer (no transformer_2 and "
      "boundary_ratio in model_index.json); leave expert empty, or name a Wan 2.2 A14B folder"
    )
  return ("transformer" if expert == "high" else "transformer_2"), expert, float(ratio)


def wan21_tiny(config: Any) -> Recipe:
  """The tiny Wan 2.1 T2V transformer (tests/fixtures/wan_pipeline/t2v) on shapes clips, or on the
  cached latents of an `apps/prepare_data` workdir (`records`); with `expert`, one expert of a Wan 2.2
  A14B folder (the `wan22-tiny` variants: tests/fixtures/wan_pipeline/t2v_a14b).

  `config.recipe_options`: `model` (the pipeline folder; with `records` and empty: the records'
  model), `batch_size`, `size` (pixels), `frames` (4k + 1), `max_sequence_length`, `learning_rate`,
  `warmup_steps`, `max_grad_norm`, `weight_decay`, `shift` (the sigma sampler's shift), `lora` (train a
  LoRA only: see `_trainable`), `records` (a prepare_data workdir of family wan: train on its train/
  records, shuffled with `shuffle_buffer` from the seed; eval loss on its eval/ records at their
  timesteps, sigma = timestep / 1000; `size`, `frames`, `max_sequence_length` are then the records'),
  `expert` ("high" or "low": train only that Wan 2.2 expert, `transformer` or `transformer_2`, on the
  timesteps it samples: DiffSynth's way, the bell-weighted `flow_training_table` of `shift` drawn in
  `expert_range` of the folder's `boundary_ratio`; exported as that component).
  """
  import md_wan

  opts = _options(config)
  records = _records(opts, "wan")
  model = _fixture(config, _WAN if records is None else str(records.model))
  component, expert, boundary = _wan_expert(opts, model)
  mesh = _mesh(config)
  sharding = batch_sharding(mesh, int(opts["batch_size"]))
  pixels = captions = None
  clean_first_frame = False
  if records is None:
    frames = int(opts.get("frames", 5))
    pipe = md_wan.load_pipeline(model, mesh=mesh)
    transformer, key_map = getattr(pipe, component), pipe.lora_key_map(component)
    length = int(opts.get("max_sequence_length", 64))
    captions = CaptionCache(
      lambda c: {"encoder_hidden_states": pipe.encode_prompt(c, max_sequence_length=length)}
    )
    pixels = _split_jit(
      pipe.vae, lambda vae, x: vae.normalize_latents(vae.encode(x * 2 - 1).mode())
    )
    clean_first_frame = bool(pipe.expand_timesteps)
    if pipe.image_to_video and not pipe.expand_timesteps:
      pixels = _wan_i2v_inputs(pipe, pixels)
  else:
    frames = None
    cfg = md_wan.WanConfig.from_json(model / component)
    _, ph, pw = cfg.patch_size
    _check_records_fit(
      records, model, denoiser=component, latents=("f", "h", "w", cfg.in_channels),
      multiple=int(np.lcm(ph, pw)), text_dim=cfg.text_dim, max_timestep=1000,
    )  # fmt: skip
    transformer = md_wan.load_transformer(model / component, subfolder=None, mesh=mesh)
    key_map = md_wan.convert_key
  frozen, params, lora = _trainable(
    config, transformer, family="wan", source=model / component, key_map=key_map
  )
  shift = float(opts.get("shift", 5.0))
  if expert is None:
    loss_fn = families.wan_loss(frozen, shift=shift, clean_first_frame=clean_first_frame)
  else:
    table = flow_training_table(1000, shift=shift)
    loss_fn = families.wan_loss(
      frozen, table=table, table_range=expert_range(table, boundary, expert),
      clean_first_frame=clean_first_frame,
    )  # fmt: skip
  return _denoiser_recipe(
    "wan21-tiny", config, opts, model, frozen=frozen, params=params, loss_fn=loss_fn, pixels=pixels,
    captions=captions, sharding=sharding, frames=frames, component=component, convert_key=md_wan.convert_key,
    eval_key="sigmas", eval_scale=1e-3, lora=lora, lora_key_map=key_map, records=records,
  )  # fmt: skip


def _wan_i2v_inputs(pipe: Any, latents: Callable) -> Callable[[np.ndarray], dict[str, jax.Array]]:
  """Clips `[B, F, H, W, 3]` → the I2V loss inputs, as md_wan's pipeline conditions on a first frame
  (DiffSynth trains so): `latents`, `condition` = the frame mask (1 on the first latent frame, `t`
  channels for the VAE's temporal factor `t`) and the normalised posterior mode of the first frame
  followed by black frames, and, for Wan 2.1 I2V, the first frames' CLIP tokens
  (`encoder_hidden_states_image`)."""
  t = pipe.vae_scale_factor_temporal

  def condition(model, x):
    first = x[:, :1] * 2 - 1
    video = jnp.concatenate([first, jnp.zeros_like(x[:, 1:])], axis=1)
    z = model.normalize_latents(model.encode(video).mode())  # [B, f, h, w, z]
    b, f, h, w, _ = z.shape
    mask = jnp.zeros((f, t), z.dtype).at[0].set(1.0)
    mask = jnp.broadcast_to(mask[None, :, None, None, :], (b, f, h, w, t))
    return jnp.concatenate([mask, z], axis=-1)

  fn = _split_jit(pipe.vae, condition)

  def inputs(pixels):
    out = {"latents": latents(pixels), "condition": fn(pixels)}
    if pipe.transformer.cfg.image_dim is not None:
      out["encoder_hidden_states_image"] = pipe.encode_image(np.asarray(pixels)[:, 0])
    return out

  return inputs


def _image_latents(vae: nnx.Module, scale: Callable) -> Callable[[np.ndarray], jax.Array]:
  """Images `[B, H, W, 3]` in [0, 1] → the denoiser's latents: the posterior mean, scaled."""
  return _split_jit(vae, lambda m, x: scale(m, m.encode(x * 2 - 1).mean))


def sd15_tiny(config: Any) -> Recipe:
  """The tiny SD 1.5 UNet (tests/fixtures/sd_pipeline/sd) on shapes images, or on the cached latents
  of an `apps/prepare_data` workdir (`records`); diffusers' train_text_to_image.py loss (epsilon
  target; Min-SNR-γ when `snr_gamma` > 0). An SDXL `model` trains as `sdxl_tiny` does.

  `config.recipe_options`: `model` (with `records` and empty: the records' model), `batch_size`,
  `size`, `learning_rate`, `warmup_steps`, `max_grad_norm`, `weight_decay`, `snr_gamma`, `lora` (rank,
  alpha, targets, init, seed: only the LoRA trains, as in train_text_to_image_lora.py; exported as a
  PEFT file), `records` (a prepare_data workdir of family sd: train on its train/ records, shuffled
  with `shuffle_buffer` from the seed; eval loss on its eval/ records at their timesteps; only the
  UNet is loaded).
  """
  return _sd_recipe(config, _SD, "sd15-tiny")


def sdxl_tiny(config: Any) -> Recipe:
  """The tiny SDXL UNet (tests/fixtures/sd_pipeline/sdxl) on shapes images: diffusers'
  train_text_to_image_sdxl.py loss (epsilon target; Min-SNR-γ when `snr_gamma` > 0) with its added
  conditioning, the second text encoder's pooled embedding as `text_embeds` and the micro-conditioning
  `time_ids` = original size, crop top-left (0, 0), target size, all `(size, size)` here (the shapes
  images are rendered at the training size, never cropped).

  `config.recipe_options`: as `sd15_tiny`'s but `records` (SDXL's records would need the pooled
  embeddings, which apps/prepare_data does not write).
  """
  return _sd_recipe(config, _SDXL, "sdxl-tiny")


def _sd_recipe(config: Any, default: str, name: str) -> Recipe:
  import md_schedulers as mdsch
  import md_sd

  opts = _options(config)
  records = _records(opts, "sd")
  model = _fixture(config, default if records is None else str(records.model))
  mesh = _mesh(config)
  sharding = batch_sharding(mesh, int(opts["batch_size"]))
  pixels = captions = None
  if records is None:
    pipe = md_sd.load_pipeline(model, mesh=mesh)
    unet, sched, key_map = pipe.unet, pipe.scheduler_config, pipe.lora_key_map("unet")
    if pipe.kind == "sdxl":
      size = int(opts.get("size", 32))
      time_ids = np.asarray([size, size, 0, 0, size, size], np.float32)

      def encode(c):
        embeds, pooled = pipe.encode_prompt(c)
        ids = np.broadcast_to(time_ids, (len(c), 6))
        return {"encoder_hidden_states": embeds, "text_embeds": pooled, "time_ids": ids}

      captions = CaptionCache(encode)
    else:
      captions = CaptionCache(lambda c: {"encoder_hidden_states": pipe.encode_prompt(c)[0]})
    factor = float(pipe.vae.config.scaling_factor)
    pixels = _image_latents(pipe.vae, lambda m, z: z * factor)
  else:
    cfg = md_sd.UNetConfig.from_json(model / "unet" / "config.json")
    if cfg.addition_embed_type is not None:
      raise ValueError(
        f"recipe_options.records: {model} has an SDXL UNet (addition_embed_type="
        f"{cfg.addition_embed_type!r}), whose added conditioning (pooled text embeddings, time ids) "
        "the records do not hold; train it on shapes images (the sdxl-tiny variant, no records)"
      )
    sched = mdsch.read_config(model / "scheduler")
    _check_records_fit(
      records, model, denoiser="UNet", latents=("h", "w", cfg.in_channels),
      multiple=2 ** (len(cfg.block_out_channels) - 1), text_dim=int(cfg.cross_attention_dim[0]),
      max_timestep=int(sched.get("num_train_timesteps", 1000)),
    )  # fmt: skip
    unet = md_sd.load_unet(model, mesh=mesh, progress=False)
    key_map = md_sd.unet_key_map(unet.cfg)
  keys = ("num_train_timesteps", "beta_start", "beta_end", "beta_schedule")
  acp = mdsch.ddpm(**{k: sched[k] for k in keys if k in sched}).alphas_cumprod
  frozen, params, lora = _trainable(
    config, unet, family="sd", source=model / "unet", key_map=key_map
  )
  gamma = float(opts.get("snr_gamma", 0.0) or 0.0)
  prediction = sched.get("prediction_type", "epsilon")
  loss_fn = families.sd_loss(
    frozen, alphas_cumprod=acp, prediction_type=prediction, snr_gamma=gamma or None
  )
  return _denoiser_recipe(
    name, config, opts, model, frozen=frozen, params=params, loss_fn=loss_fn, pixels=pixels,
    captions=captions, sharding=sharding, frames=None, component="unet", convert_key=md_sd.unet_key_map(unet.cfg),
    eval_key="timesteps", eval_scale=1.0, lora=lora, lora_key_map=key_map, records=records,
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


def _flux_pipeline(model: pathlib.Path, mesh: Any, cls: type, what: str) -> Any:
  """The md_flux pipeline of `model`, which must be a `cls` folder (else an error saying `what`)."""
  import md_flux

  pipe = md_flux.load_pipeline(model, mesh=mesh)
  if not isinstance(pipe, cls):
    raise ValueError(
      f"recipe_options.model={str(model)!r} is a {type(pipe).__name__} folder; {what}"
    )
  return pipe


def _klein_text(opts: Mapping[str, Any]) -> dict[str, Any]:
  """Klein's prompt options: `max_sequence_length` and the stacked Qwen3 layers
  (`text_encoder_out_layers`, a list or a comma string; empty: Klein's 9, 18, 27)."""
  import md_text

  layers = opts.get("text_encoder_out_layers") or md_text.FLUX2_KLEIN_LAYERS
  layers = tuple(int(i) for i in (layers.split(",") if isinstance(layers, str) else layers))
  return dict(
    max_sequence_length=int(opts.get("max_sequence_length", 64)), text_encoder_out_layers=layers
  )


def klein_tiny(config: Any) -> Recipe:
  """The tiny Flux.2 Klein transformer (tests/fixtures/flux2_pipeline/klein) on shapes images: diffusers'
  train_dreambooth_lora_flux2_klein.py loss (`families.klein_loss`: logit-normal sigmas, no guidance;
  the images through the VAE's posterior mode, 2x2 patchified and normalised as the pipeline encodes
  reference images; the prompts' stacked Qwen3 states).

  `config.recipe_options`: `model`, `batch_size`, `size` (a multiple of 16), `max_sequence_length`,
  `text_encoder_out_layers` (the Qwen3 hidden states stacked; empty: Klein's 9, 18, 27), `learning_rate`, `warmup_steps`, `max_grad_norm`, `weight_decay`, `lora` (targets required: Klein has
  no default list).
  """
  import md_flux

  opts = _options(config)
  model = _fixture(config, _KLEIN)
  mesh = _mesh(config)
  sharding = batch_sharding(mesh, int(opts["batch_size"]))
  pipe = _flux_pipeline(
    model, mesh, md_flux.Flux2KleinPipeline,
    "klein_tiny trains a Flux.2 Klein transformer (flux1_tiny trains Flux.1)",
  )  # fmt: skip
  kw = _klein_text(opts)
  captions = CaptionCache(lambda c: {"encoder_hidden_states": pipe.encode_prompt(c, **kw)})
  pixels = _split_jit(pipe.vae, lambda m, x: m.encode_latents(x * 2 - 1))
  key_map = pipe.lora_key_map("transformer")
  frozen, params, lora = _trainable(
    config, pipe.transformer, family="klein", source=model / "transformer", key_map=key_map
  )
  loss_fn = families.klein_loss(frozen)
  return _denoiser_recipe(
    "klein-tiny", config, opts, model, frozen=frozen, params=params, loss_fn=loss_fn, pixels=pixels,
    captions=captions, sharding=sharding, frames=None, component="transformer",
    convert_key=md_flux.convert_key_flux2, eval_key="sigmas", eval_scale=1e-3, lora=lora,
    lora_key_map=key_map,
  )  # fmt: skip


def ltx_tiny(config: Any) -> Recipe:
  """The tiny LTX-Video transformer (tests/fixtures/ltx_pipeline/t2v) on shapes clips: Lightricks'
  LTX-Video-Trainer loss (`families.ltx_loss`: shifted logit-normal sigmas, integer timesteps, the
  caption mask; first-frame conditioning with probability `first_frame_conditioning_p`), the clips
  through the VAE's posterior mean, normalised by its latent statistics as the pipeline does, the rotary
  positions scaled by the VAE's own compression and `frame_rate`, as md's pipeline samples.

  `config.recipe_options`: `model`, `batch_size`, `size` (a multiple of the VAE × patch factor),
  `frames` (1 + k × the VAE's temporal factor), `max_sequence_length`, `frame_rate`,
  `first_frame_conditioning_p`, `learning_rate`, `warmup_steps`, `max_grad_norm`, `weight_decay`, `lora`.
  """
  import md_ltx

  opts = _options(config)
  model = _fixture(config, _LTX)
  mesh = _mesh(config)
  sharding = batch_sharding(mesh, int(opts["batch_size"]))
  pipe = md_ltx.load_pipeline(model, mesh=mesh)
  size, frames = int(opts.get("size", 32)), int(opts.get("frames", 5))
  try:
    pipe.check_size(size, size, frames)
  except ValueError as e:
    raise ValueError(f"recipe_options.size={size} / frames={frames}: {e}") from None
  length = int(opts.get("max_sequence_length", 64))

  def encode(c):
    states, mask = pipe.encode_prompt(c, max_sequence_length=length)
    return {"encoder_hidden_states": states, "encoder_attention_mask": mask.astype(jnp.float32)}

  def latents(vae, x):
    z = vae.encode(x * 2 - 1).mean
    stats = (1,) * (z.ndim - 1) + (-1,)
    mean = vae.latents_mean[...].astype(z.dtype).reshape(stats)
    std = vae.latents_std[...].astype(z.dtype).reshape(stats)
    return (z - mean) / std

  pixels = _split_jit(pipe.vae, latents)
  key_map = pipe.lora_key_map("transformer")
  frozen, params, lora = _trainable(
    config, pipe.transformer, family="ltx", source=model / "transformer", key_map=key_map
  )
  loss_fn = families.ltx_loss(
    frozen, frame_rate=float(opts.get("frame_rate", 25)),
    temporal_compression=pipe.vae_temporal_compression_ratio,
    spatial_compression=pipe.vae_spatial_compression_ratio,
    first_frame_conditioning_p=float(opts.get("first_frame_conditioning_p", 0.0)),
  )  # fmt: skip
  return _denoiser_recipe(
    "ltx-tiny", config, opts, model, frozen=frozen, params=params, loss_fn=loss_fn, pixels=pixels,
    captions=CaptionCache(encode), sharding=sharding, frames=frames, component="transformer",
    convert_key=md_ltx.convert_key, eval_key="sigmas", eval_scale=1e-3, lora=lora,
    lora_key_map=key_map,
  )  # fmt: skip


def _dreambooth_options(opts: Mapping[str, Any], recipe: str) -> bool:
  """Checks the options every Dreambooth recipe needs; returns whether prior preservation is on."""
  for key in ("instance_dir", "instance_prompt"):
    if not opts.get(key):
      raise ValueError(f"recipe_options.{key} is required for {recipe}")
  prior = bool(opts.get("with_prior_preservation", True))
  if prior and not (opts.get("class_dir") and opts.get("class_prompt")):
    raise ValueError(
      "with_prior_preservation needs recipe_options.class_dir and recipe_options.class_prompt"
    )
  return prior


def _dreambooth_batches(
  opts: Mapping[str, Any],
  config: Any,
  *,
  prior: bool,
  generate: Callable[[list[str], int], np.ndarray],
  encode_pixels: Callable[[np.ndarray], jax.Array],
  encode_prompt: Callable[[str], Mapping[str, np.ndarray]],
  sharding: Any,
) -> _dreambooth.DreamboothBatches:
  """The instance images (and, with `prior`, the class images, the missing ones made by `generate`),
  each encoded once (8 at a time), with their prompts' conditioning: train_dreambooth*.py's batches."""
  size = int(opts.get("size", 32))
  files = _dreambooth.image_files(_path(opts["instance_dir"]), what="instance_dir")
  instance = _dreambooth.load_images(files, size, what="instance_dir")
  klass = None
  if prior:
    class_files = _dreambooth.class_images(
      generate, _path(opts["class_dir"]), opts["class_prompt"],
      int(opts.get("num_class_images", 100)), seed=int(config.seed),
    )  # fmt: skip
    klass = _dreambooth.load_images(class_files, size, what="class_dir")

  def encode(x):
    return np.concatenate([np.asarray(encode_pixels(x[i : i + 8])) for i in range(0, len(x), 8)])

  return _dreambooth.DreamboothBatches(
    encode(instance), None if klass is None else encode(klass),
    encode_prompt(opts["instance_prompt"]), encode_prompt(opts["class_prompt"]) if prior else None,
    batch_size=int(opts["batch_size"]), seed=int(config.seed), sharding=sharding,
  )  # fmt: skip


def dreambooth_sd(config: Any) -> Recipe:
  """Dreambooth for the SD 1.x / 2.x / XL UNet (default: the tiny tests/fixtures/sd_pipeline/sd),
  diffusers' train_dreambooth.py (SDXL: train_dreambooth_lora_sdxl.py, its added conditioning: the
  pooled embedding and `time_ids` = (size, size, 0, 0, size, size)): the instance images of
  `instance_dir` with `instance_prompt`; with `with_prior_preservation`, `num_class_images` images of
  `class_prompt` in `class_dir` (the missing ones generated first by md's SD pipeline, `class_steps`
  steps at guidance `class_guidance`) fill the second half of every batch, and the loss adds
  `prior_loss_weight` times their MSE. Images are center-cropped and resized to `size`, encoded once
  (posterior mean, scaled); the prompts are encoded once. With a `lora` option only a LoRA trains
  (train_dreambooth_lora.py / _sdxl.py), exported as a PEFT file.

  `config.recipe_options`: `model`, `instance_dir`, `instance_prompt`, `class_dir`, `class_prompt`,
  `with_prior_preservation`, `prior_loss_weight`, `num_class_images`, `class_steps`,
  `class_guidance`, `batch_size` (examples per half), `size`, `learning_rate`, `warmup_steps`,
  `max_grad_norm`, `weight_decay`, `snr_gamma`, `lora`, `train_text_encoder` (with `lora`:
  train_dreambooth_lora.py's / _sdxl.py's `--train_text_encoder`, a LoRA of the same rank and alpha on
  the CLIP encoders' attention projections (SDXL: both), the prompts encoded in every step; every LoRA
  in the exported file).

  Raises:
    FileNotFoundError / ValueError: a missing, empty or unreadable instance folder (named), a
      `class_dir` that is a file, missing prompts.
  """
  import md_schedulers as mdsch
  import md_sd
  import md_text

  opts = _options(config)
  prior = _dreambooth_options(opts, "dreambooth_sd")
  size = int(opts.get("size", 32))
  _dreambooth.image_files(
    _path(opts["instance_dir"]), what="instance_dir"
  )  # before the model loads
  model = _fixture(config, _SD)
  mesh = _mesh(config)
  batch = int(opts["batch_size"])
  sharding = batch_sharding(mesh, 2 * batch if prior else batch)
  pipe = md_sd.load_pipeline(model, mesh=mesh)

  def generate(prompts, seed):
    return pipe(
      prompts, height=size, width=size, num_inference_steps=int(opts.get("class_steps", 25)),
      guidance_scale=float(opts.get("class_guidance", 7.5)), seed=seed, progress=False,
    )  # fmt: skip

  train_text = _trains_text_encoder(opts, pipe, model)

  def encode_prompt(prompt):
    if train_text:  # the text encoders train: the prompt's token ids, encoded in every step
      out = {"input_ids": np.asarray(md_text.tokenize(pipe.tokenizer, [prompt]).ids[0], np.int32)}
      if pipe.kind == "sdxl":
        ids = md_text.tokenize(pipe.tokenizer_2, [prompt]).ids[0]
        out["input_ids_2"] = np.asarray(ids, np.int32)
    else:
      embeds, pooled = pipe.encode_prompt([prompt])
      out = {"encoder_hidden_states": np.asarray(embeds[0])}
      if pipe.kind == "sdxl":
        out["text_embeds"] = np.asarray(pooled[0])
    if pipe.kind == "sdxl":
      out["time_ids"] = np.asarray([size, size, 0, 0, size, size], np.float32)
    return out

  sched = pipe.scheduler_config
  keys = ("num_train_timesteps", "beta_start", "beta_end", "beta_schedule")
  acp = mdsch.ddpm(**{k: sched[k] for k in keys if k in sched}).alphas_cumprod
  factor = float(pipe.vae.config.scaling_factor)
  pixels = _image_latents(pipe.vae, lambda m, z: z * factor)
  batches = _dreambooth_batches(
    opts, config, prior=prior, generate=generate, encode_pixels=pixels,
    encode_prompt=encode_prompt, sharding=sharding,
  )  # fmt: skip
  key_map = pipe.lora_key_map("unet")
  frozen, params, lora = _trainable(
    config, pipe.unet, family="sd", source=model / "unet", key_map=key_map
  )
  # after the class images: the pipeline generated them with its text encoder as loaded
  text_loras = _text_encoder_loras(config, opts, pipe, model) if train_text else None
  gamma = float(opts.get("snr_gamma", 0.0) or 0.0)
  loss_fn = families.sd_loss(
    frozen, alphas_cumprod=acp, prediction_type=sched.get("prediction_type", "epsilon"),
    snr_gamma=gamma or None,
    prior_loss_weight=float(opts.get("prior_loss_weight", 1.0)) if prior else None,
  )  # fmt: skip
  return _denoiser_recipe(
    "dreambooth-sd", config, opts, model, frozen=frozen, params=params, loss_fn=loss_fn,
    pixels=pixels, captions=None, sharding=sharding, frames=None, component="unet",
    convert_key=md_sd.unet_key_map(pipe.unet.cfg), eval_key="timesteps", eval_scale=1.0, lora=lora,
    lora_key_map=key_map, batches=batches, evaluate=False, text_loras=text_loras,
  )  # fmt: skip


def _flux_dreambooth(config: Any, recipe: str, default: str, cls: type, what: str):
  """What the Flux.1 and Klein Dreambooth recipes share before they differ: `(options, prior, size,
  model folder, batch sharding, pipeline)`, the options and the instance folder checked before the model
  loads."""
  opts = _options(config)
  prior = _dreambooth_options(opts, recipe)
  if recipe == "dreambooth_klein" and opts.get("train_text_encoder", False) is not False:
    raise ValueError(
      f"{recipe}: recipe_options.train_text_encoder={opts['train_text_encoder']!r}; md trains the CLIP "
      "text encoders of SD, SDXL and Flux.1 (dreambooth_sd, dreambooth_flux), not Klein's Qwen3"
    )
  _dreambooth.image_files(_path(opts["instance_dir"]), what="instance_dir")
  model = _fixture(config, default)
  mesh = _mesh(config)
  batch = int(opts["batch_size"])
  sharding = batch_sharding(mesh, 2 * batch if prior else batch)
  pipe = _flux_pipeline(model, mesh, cls, what)
  return opts, prior, int(opts.get("size", 32)), model, sharding, pipe


def dreambooth_flux(config: Any) -> Recipe:
  """Dreambooth for the Flux.1 transformer (default: the tiny tests/fixtures/flux_pipeline/dev),
  diffusers' train_dreambooth_flux.py / train_dreambooth_lora_flux.py: the instance images with
  `instance_prompt`, with prior preservation the class images (generated by md's Flux pipeline when
  missing: `class_steps` steps at guidance `class_guidance`) as the batch's second half and
  `prior_loss_weight` times their loss; `families.flux_loss` (logit-normal sigmas, the embedded
  `guidance` for dev-style models). With a `lora` option only a LoRA trains (the script's twelve
  default targets unless named), exported as a PEFT file.

  `config.recipe_options`: those of `dreambooth_sd` (without `snr_gamma`) plus `guidance` and
  `max_sequence_length`.
  """
  import md_flux
  import md_text

  opts, prior, size, model, sharding, pipe = _flux_dreambooth(
    config, "dreambooth_flux", _FLUX, md_flux.FluxPipeline,
    "dreambooth_flux trains a Flux.1 transformer",
  )  # fmt: skip
  length = int(opts.get("max_sequence_length", 64))

  def generate(prompts, seed):
    return pipe(
      prompts, height=size, width=size, num_inference_steps=int(opts.get("class_steps", 28)),
      guidance_scale=float(opts.get("class_guidance", 3.5)), seed=seed,
      max_sequence_length=length, progress=False,
    )  # fmt: skip

  train_text = _trains_text_encoder(opts, pipe, model)

  def encode_prompt(prompt):
    t5, pooled = pipe.encode_prompt([prompt], max_sequence_length=length)
    out = {"encoder_hidden_states": np.asarray(t5[0])}  # the T5 states: frozen, encoded once
    if train_text:  # CLIP trains: the prompt's token ids, its pooled output computed in every step
      out["input_ids"] = np.asarray(md_text.tokenize(pipe.tokenizer, [prompt]).ids[0], np.int32)
    else:
      out["pooled_projections"] = np.asarray(pooled[0])
    return out

  pixels = _image_latents(pipe.vae, lambda m, z: m.scale_latents(z))
  batches = _dreambooth_batches(
    opts, config, prior=prior, generate=generate, encode_pixels=pixels,
    encode_prompt=encode_prompt, sharding=sharding,
  )  # fmt: skip
  key_map = pipe.lora_key_map("transformer")
  frozen, params, lora = _trainable(
    config, pipe.transformer, family="flux", source=model / "transformer", key_map=key_map
  )
  # after the class images: the pipeline generated them with its text encoder as loaded
  text_loras = _text_encoder_loras(config, opts, pipe, model) if train_text else None
  guided = bool(pipe.transformer.cfg.guidance_embeds)
  loss_fn = families.flux_loss(
    frozen, guidance=float(opts.get("guidance", 3.5)) if guided else None,
    prior_loss_weight=float(opts.get("prior_loss_weight", 1.0)) if prior else None,
  )  # fmt: skip
  return _denoiser_recipe(
    "dreambooth-flux", config, opts, model, frozen=frozen, params=params, loss_fn=loss_fn,
    pixels=pixels, captions=None, sharding=sharding, frames=None, component="transformer",
    convert_key=md_flux.convert_key, eval_key="sigmas", eval_scale=1e-3, lora=lora,
    lora_key_map=key_map, batches=batches, evaluate=False, text_loras=text_loras,
  )  # fmt: skip


def dreambooth_klein(config: Any) -> Recipe:
  """Dreambooth for the Flux.2 Klein transformer (default: the tiny tests/fixtures/flux2_pipeline/klein),
  diffusers' train_dreambooth_lora_flux2_klein.py: the instance images with `instance_prompt`, with prior
  preservation the class images (generated by md's Klein pipeline when missing: `class_steps` steps at
  guidance `class_guidance`) as the batch's second half and `prior_loss_weight` times their loss;
  `families.klein_loss` (logit-normal sigmas, no guidance), the images through the VAE as `klein_tiny`
  encodes them. With a `lora` option only a LoRA trains (targets required: Klein has no default list),
  exported as a PEFT file.

  `config.recipe_options`: those of `dreambooth_sd` (without `snr_gamma`) plus `max_sequence_length`
  and `text_encoder_out_layers` (empty: Klein's 9, 18, 27).
  """
  import md_flux

  opts, prior, size, model, sharding, pipe = _flux_dreambooth(
    config, "dreambooth_klein", _KLEIN, md_flux.Flux2KleinPipeline,
    "dreambooth_klein trains a Flux.2 Klein transformer (dreambooth_flux trains Flux.1)",
  )  # fmt: skip
  text = _klein_text(opts)

  def generate(prompts, seed):
    return pipe(
      prompts, height=size, width=size, num_inference_steps=int(opts.get("class_steps", 28)),
      guidance_scale=float(opts.get("class_guidance", 4.0)), seed=seed, progress=False, **text,
    )  # fmt: skip

  def encode_prompt(prompt):
    return {"encoder_hidden_states": np.asarray(pipe.encode_prompt([prompt], **text)[0])}

  pixels = _split_jit(pipe.vae, lambda m, x: m.encode_latents(x * 2 - 1))
  batches = _dreambooth_batches(
    opts, config, prior=prior, generate=generate, encode_pixels=pixels,
    encode_prompt=encode_prompt, sharding=sharding,
  )  # fmt: skip
  key_map = pipe.lora_key_map("transformer")
  frozen, params, lora = _trainable(
    config, pipe.transformer, family="klein", source=model / "transformer", key_map=key_map
  )
  loss_fn = families.klein_loss(
    frozen, prior_loss_weight=float(opts.get("prior_loss_weight", 1.0)) if prior else None
  )
  return _denoiser_recipe(
    "dreambooth-klein", config, opts, model, frozen=frozen, params=params, loss_fn=loss_fn,
    pixels=pixels, captions=None, sharding=sharding, frames=None, component="transformer",
    convert_key=md_flux.convert_key_flux2, eval_key="sigmas", eval_scale=1e-3, lora=lora,
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
