"""What every family's pipeline shares: components, split modules, the jit memo, the mesh, batch placement.

A family pipeline subclasses `Pipeline`: it keeps its modules split once into graph definition and state
(`Split`; the state is a jit argument, the graph static), builds its jitted programs through `self.jit(key,
make)` (memoised by static settings, bounded), runs them inside `self.context()` (the mesh, when there is
one) and places batch inputs with `self.place(x)` (batch over `data` × `fsdp` where it divides). Loading
goes through `read_index` / `component` / `listed`, so a missing or unknown component fails the same way
in every family. Sizes are checked with `check_multiple`, whose `SizeError` names the nearest valid sizes.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import json
import math
import os
import pathlib
import re
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx

from md_core import _executables
from md_core._sources import SHARED_COMPONENTS, read_json, shared_component


@dataclasses.dataclass
class Split:
  """A module split once into its static graph definition and its state (a jit argument)."""

  graphdef: Any
  state: Any
  module: Any = dataclasses.field(default=None, repr=False, compare=False)
  _views: Any = dataclasses.field(default=None, init=False, repr=False, compare=False)

  @classmethod
  def of(cls, module: nnx.Module | None) -> Split | None:
    return None if module is None else cls(*nnx.split(module), module=module)

  def refresh(self) -> None:
    """Splits the module again (after its graph changed, e.g. LoRA slots were added)."""
    self.graphdef, self.state = nnx.split(self.module)

  def jit_state(self) -> Any:
    """The state to pass to jitted programs: on one CPU device every stacked parameter as per-layer
    views of it (`md_core.layer_views`: XLA's CPU matmuls would copy each layer's weights out of the
    stack on every call), elsewhere `state` itself. Rebuilt (without copying) when `state` changes,
    e.g. after a LoRA swap: same tree, same shapes, so compiled programs are reused."""
    from md_core._scan import layer_views  # noqa: PLC0415

    if self._views is None or self._views[0] is not self.state:
      self._views = (self.state, layer_views(self.state))
    return self._views[1]

  def merge(self, state: Any | None = None) -> nnx.Module:
    """The module with `state` (a traced copy inside jit; default: the stored state)."""
    return nnx.merge(self.graphdef, self.state if state is None else state)


def as_prompts(prompt: str | Sequence[str] | None, what: str = "prompt") -> list[str] | None:
  """A prompt argument as a list: a `str` is one prompt (never split into characters).

  Raises:
    TypeError: something that is neither a string nor a sequence of strings.
  """
  if prompt is None:
    return None
  if isinstance(prompt, str):
    return [prompt]
  if isinstance(prompt, bytes) or not isinstance(prompt, Sequence):
    raise TypeError(f"{what} must be a str or a list of str, got {type(prompt).__name__}")
  bad = [type(p).__name__ for p in prompt if not isinstance(p, str)]
  if bad:
    raise TypeError(f"{what} must be a str or a list of str; the list holds {sorted(set(bad))}")
  return list(prompt)


class SizeError(ValueError):
  """A height, width or frame count the model cannot take; the message names the nearest valid ones."""


def nearest_multiples(value: int, multiple: int) -> list[int]:
  """The valid sizes (multiples of `multiple`, at least one multiple) nearest `value`."""
  low = max(multiple, value // multiple * multiple)
  return [low] if low >= value else [low, low + multiple]


def check_multiple(name: str, value: Any, multiple: int, *, minimum: int | None = None) -> int:
  """Checks that `value` is a positive multiple of `multiple`.

  Raises:
    SizeError: naming `name`, the value, the multiple and the nearest valid sizes.
  """
  if isinstance(value, bool) or not isinstance(value, int | np.integer):
    raise SizeError(f"{name} must be an int, got {value!r}")
  value = int(value)
  floor = multiple if minimum is None else minimum
  if value < floor:
    raise SizeError(f"{name}={value} is too small: the smallest valid {name} is {floor}")
  if value % multiple:
    near = " or ".join(str(v) for v in nearest_multiples(value, multiple))
    raise SizeError(f"{name}={value} is not a multiple of {multiple}; the nearest valid: {near}")
  return value


def batch_spec(mesh: jax.sharding.Mesh | None, batch: int) -> tuple[str, ...] | str | None:
  """The mesh axes a batch of `batch` rows is split over: `data` × `fsdp` where it divides, else
  `data` alone, else none (replicated)."""
  if mesh is None:
    return None
  for axes in (("data", "fsdp"), ("data",), ("fsdp",)):
    sizes = [mesh.shape.get(a, 1) for a in axes]
    size = math.prod(sizes)
    if size > 1 and batch % size == 0:
      used = tuple(a for a, s in zip(axes, sizes) if s > 1)
      return used if len(used) > 1 else used[0]
  return None


def place_batch(mesh: jax.sharding.Mesh | None, x: Any) -> Any:
  """Places every array of the pytree `x` with its leading (batch) axis split as `batch_spec` says."""
  if mesh is None:
    return x

  def put(a):
    a = np.asarray(a) if not isinstance(a, jax.Array) else a
    spec = [batch_spec(mesh, a.shape[0]) if a.ndim else None] + [None] * max(a.ndim - 1, 0)
    return jax.device_put(a, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*spec)))

  return jax.tree.map(put, x)


def seed_key(seed: Any) -> jax.Array:
  """A PRNG key from an int seed (or a key, returned as it is).

  Raises:
    TypeError: a seed that is neither an int nor a key.
  """
  if isinstance(seed, jax.Array) and jax.dtypes.issubdtype(seed.dtype, jax.dtypes.prng_key):
    return seed
  if isinstance(seed, bool) or not isinstance(seed, int | np.integer):
    raise TypeError(f"seed must be an int, got {seed!r}")
  return jax.random.key(int(seed))


NOISE_LAYOUTS = ("channels_first", "channels_last", "packed")


@dataclasses.dataclass(frozen=True)
class NoiseLayout:
  """How a pipeline draws a row's initial noise for a seed, in its `latents=` layout (the family
  contract's `Pipeline.noise_layout()`).

  `draw` gives what the pipeline itself draws for that seed when no `latents` are given (same key, same
  order of elements), so a server that batches requests with different seeds, or searches over seeds,
  gives each row the image a plain `pipe(prompt, seed=seed)` call gives.

  Attributes:
    kind: "image" or "video".
    multiple: height and width must be multiples of this (pixels per latent token).
    channels: latent channels of the `latents=` layout (Flux: the transformer's patchified channels).
    factor: pixels per latent pixel (of the grid the noise is drawn on).
    temporal: frames per latent frame (video), else 0.
    layout: how the pipeline draws its noise and takes `latents=` (one of `NOISE_LAYOUTS`):
      "channels_first": drawn and taken as `[n, C, (F,) h, w]` (md-sd, md-wan);
      "channels_last": drawn `[n, (F,) h, w, C]`, taken channels-first `[n, C, (F,) h, w]` (Flux.2 with
        h = H/16 and C the patchified channels, LTX-Video);
      "packed": drawn `[n, h, w, C/4]`, taken as 2x2 patches packed into tokens `[n, (h/2)(w/2), C]`
        (features channel, then row and column in the patch; Flux.1).
    split: `(count, index)` when the pipeline draws its noise from `jax.random.split(key(seed),
      count)[index]`; None: from `key(seed)` itself.
  """

  kind: str
  multiple: int
  channels: int
  factor: int
  temporal: int = 0
  layout: str = "channels_first"
  split: tuple[int, int] | None = None

  def __post_init__(self):
    if self.layout not in NOISE_LAYOUTS:
      raise ValueError(f"NoiseLayout: layout={self.layout!r}; expected one of {NOISE_LAYOUTS}")
    if self.layout == "packed" and (self.kind != "image" or self.channels % 4):
      raise ValueError(
        f"NoiseLayout: the packed layout is for images with channels a multiple of 4; got "
        f"kind={self.kind!r}, channels={self.channels}"
      )

  def shape(self, n: int, height: int, width: int, num_frames: int = 1) -> tuple[int, ...]:
    """The `latents=` shape of `n` rows (SD, Flux.2: `[n, C, H/f, W/f]`; Wan, LTX-Video:
    `[n, C, (F-1)/t + 1, H/f, W/f]`; Flux.1: `[n, (H/2f)(W/2f), C]`)."""
    h, w = height // self.factor, width // self.factor
    if self.layout == "packed":
      return (n, (h // 2) * (w // 2), self.channels)
    if self.kind == "video":
      return (n, self.channels, (num_frames - 1) // self.temporal + 1, h, w)
    return (n, self.channels, h, w)

  def draw(self, seed: int, n: int, height: int, width: int, num_frames: int = 1) -> np.ndarray:
    """`n` rows of standard normal noise from `seed` (the same seed gives the same rows)."""
    key = jax.random.key(int(seed))
    if self.split is not None:
      count, index = self.split
      key = jax.random.split(key, count)[index]
    shape = self.shape(n, height, width, num_frames)
    if self.layout == "channels_first":
      return np.asarray(jax.random.normal(key, shape, np.float32))
    if self.layout == "channels_last":
      drawn = np.asarray(jax.random.normal(key, (n, *shape[2:], shape[1]), np.float32))
      return np.ascontiguousarray(np.moveaxis(drawn, -1, 1))
    h, w, c = height // self.factor, width // self.factor, self.channels // 4
    drawn = np.asarray(jax.random.normal(key, (n, h, w, c), np.float32))
    patches = drawn.reshape(n, h // 2, 2, w // 2, 2, c).transpose(0, 1, 3, 5, 2, 4)
    return np.ascontiguousarray(patches.reshape(shape))


_UNSET = object()


def _plain(value: Any) -> bool:
  """Whether `value` is made of None, bools, numbers, strings, lists, tuples and dicts only."""
  if value is None or isinstance(value, bool | int | float | str):
    return True
  if isinstance(value, list | tuple):
    return all(_plain(v) for v in value)
  if isinstance(value, dict):
    return all(_plain(k) and _plain(v) for k, v in value.items())
  return False


class JitMemo:
  """Compiled programs by static settings, keeping the `capacity` most recently used."""

  def __init__(self, capacity: int = 32):
    self.capacity = capacity
    self._fns: collections.OrderedDict[Hashable, Any] = collections.OrderedDict()

  def __call__(self, key: Hashable, make: Callable[[], Any]) -> Any:
    fn = self._fns.get(key)
    if fn is None:
      fn = self._fns[key] = make()
      while len(self._fns) > self.capacity:
        self._fns.popitem(last=False)
    else:
      self._fns.move_to_end(key)
    return fn

  def __len__(self) -> int:
    return len(self._fns)

  def clear(self) -> None:
    self._fns.clear()


class Pipeline:
  """The base of every family pipeline: its mesh, its jit memo, batch placement.

  Attributes:
    last_calls: denoiser calls the last generation made (a step cache's reused steps make none).
    last_cache: the step cache's final state of the last generation (None without a cache), e.g. for
      md-cache's reports of steps computed and calibration ratios.
  """

  mesh: jax.sharding.Mesh | None = None
  source: str = ""
  last_calls: int = 0
  last_cache: Any = None

  # --- the family contract: what every family pipeline answers (servers, apps and trainers ask these,
  # never probe attributes) ---------------------------------------------------------------------------
  #: The family's name ("sd", "flux", "flux2", "wan", "ltx", "ltx2").
  family: str = ""
  #: Whether the denoiser runs transformer blocks through `md_core.scan_layers` (block-level caches
  #: apply); a UNet (md-sd) has none.
  block_stacks: bool = True
  #: Step-cache options used where a setting gives none, by md-cache policy name (e.g. TeaCache's
  #: published polynomial for the family: `{"teacache": {"coefficients": "flux"}}`).
  cache_defaults: Mapping[str, Mapping[str, Any]] = {}
  #: What the pipeline makes: "image" or "video".
  media: str = "image"
  #: The square pixel size the model was made for, where its configs say (SD, Flux); else None.
  default_size: int | None = None

  def noise_layout(self) -> NoiseLayout | None:
    """How this pipeline draws a row's initial noise for a seed (what a server batches requests with
    different seeds and searches over seeds with); None: the pipeline cannot take it per row, so each
    call runs one seed."""
    return None

  @classmethod
  def size_problems(
    cls, source: str | os.PathLike, height: int, width: int, num_frames: int = 1
  ) -> list[str]:
    """What is wrong with a size for the checkpoint at `source`, from its configs only (before any
    weight loads; the app's check): one line per problem, naming the nearest valid values; empty when
    it fits (also for a family without config-only rules)."""
    del source, height, width, num_frames
    return []

  def _init_scaffold(self, mesh: jax.sharding.Mesh | None, source: Any = "") -> None:
    self.mesh, self.source = mesh, str(source)
    self._memo = JitMemo()

  def context(self):
    """The mesh as the current one while a program runs (a no-op without a mesh)."""
    return jax.set_mesh(self.mesh) if self.mesh is not None else contextlib.nullcontext()

  def jit(self, key: Hashable, make: Callable[[], Any]) -> Any:
    """The program for `key`, made by `make()` on first use; with an executable store (`use_executables`,
    or the process default of `md_core.set_executable_store`) its executables come from and go to it."""
    store = getattr(self, "_executables", _UNSET)
    if store is _UNSET:
      store = _executables.default_store()
    if store is None:
      return self._memo(key, make)
    return self._memo(
      ("executables", str(store.folder), key),
      lambda: _executables.AotProgram(store, self.fingerprint(), key, make()),
    )

  def clear_programs(self) -> None:
    """Drops this pipeline's compiled programs (they compile again on next use); with
    `jax.clear_caches()` this frees their memory (a server bounds its compiled shapes with it)."""
    self._memo.clear()

  def use_executables(self, store: Any) -> None:
    """Ahead-of-time executables for this pipeline's programs (`md_core.ExecutableStore`): a folder or a
    store; None turns them off for this pipeline even when the process has a default store."""
    if store is not None and not isinstance(store, _executables.ExecutableStore):
      store = _executables.ExecutableStore(store)
    self._executables = store

  def fingerprint(self) -> str:
    """A text naming the pipeline's class and its modules' graphs (structure and static settings, object
    addresses left out): equal in every process that loads the same model the same way."""
    parts = [type(self).__qualname__]
    for name, value in sorted(vars(self).items()):
      if name in ("source", "last_calls", "last_cache"):
        continue
      if _plain(value):  # settings such as a scheduler's config, which programs may bake in
        parts.append(f"{name} = {value!r}")
      for item in value if isinstance(value, list | tuple) else [value]:
        if isinstance(item, Split):
          parts.append(f"{name}: {item.graphdef!r}")
    return re.sub(r" at 0x[0-9a-fA-F]+", "", "\n".join(parts))

  def place(self, x: Any) -> Any:
    """Batch inputs placed on the mesh (see `place_batch`)."""
    return place_batch(self.mesh, x)

  # --- run-time LoRA -------------------------------------------------------------------------------------
  def splits_of(self, component: str) -> tuple[nnx.Module, list[Split]]:
    """A model component and every `Split` of it this pipeline holds (to update their state together).

    Raises:
      ValueError: the pipeline has no model component of that name.
    """
    module = getattr(self, component, None)
    if not isinstance(module, nnx.Module):
      raise ValueError(f"{type(self).__name__} has no model component {component!r}")
    found = []
    for value in vars(self).values():
      for item in value if isinstance(value, list | tuple) else [value]:
        if isinstance(item, Split) and item.module is module:
          found.append(item)
    return module, found

  def add_lora_slots(
    self, rank: int, *, component: str = "transformer", targets: Any = None, gain: bool = False
  ) -> list[str]:
    """Adds run-time LoRA slots of `rank` to a component's Dense layers (see `md_core.add_lora_slots`;
    `gain=True` for DoRA adapters); the programs compile once for them, and `set_lora` then swaps
    adapters without recompiling."""
    from md_core._lora import add_lora_slots  # noqa: PLC0415

    module, splits = self.splits_of(component)
    paths = add_lora_slots(module, rank, targets=targets, gain=gain)
    for split in splits:
      split.refresh()
    self._memo.clear()  # the state's tree changed: programs compiled before take the old one
    return paths

  def set_lora(self, adapters: Any, *, component: str = "transformer") -> None:
    """Puts adapters (`{dense path: md_core.LoRASlotWeight}`, or a list of them used together) into the
    component's LoRA slots; the same compiled programs run them."""
    from md_core._lora import set_lora  # noqa: PLC0415

    module, splits = self.splits_of(component)
    if not splits:
      raise ValueError(f"{component!r} is not a split module of this pipeline")
    state = set_lora(splits[0].state, adapters)
    for split in splits:
      split.state = state
    nnx.update(module, state)  # the module shows the adapters too (e.g. to merge from it)

  # --- LoRA targets (the pipeline LoRA API, `load_lora` & co., is md-lora's `LoRAPipeline`) -----------
  # The components LoRA files adapt (the denoisers), e.g. ("unet",) or ("transformer", "transformer_2").
  lora_components: tuple[str, ...] = ()

  def lora_key_map(self, component: str) -> Any:
    """The family's key map (`convert_key`) for a LoRA component's reference names."""
    raise NotImplementedError(f"{type(self).__name__} does not name its LoRA key map")

  # --- quantization ----------------------------------------------------------------------------------
  #: The components `quantize` converts when none is named: the denoisers.
  DENOISERS = ("transformer", "transformer_2", "unet")

  def quantize(
    self, mode: str | None, *, component: str | Sequence[str] | None = None, targets: Any = None
  ) -> list[str]:
    """Quantizes the denoiser's Dense layers in place (see `md_core.quantize`): int8 / float8 kernels
    with per-output-channel scales, placed with the kernels' shardings; LoRA slots stay float.

    Args:
      mode: "int8", "int8-dynamic" or "fp8"; None does nothing.
      component: the component(s) to quantize; None: every denoiser the pipeline has (`DENOISERS`).
      targets: the Dense paths to quantize (`md_core.quantize`); None: all.

    Returns:
      The quantized paths, each prefixed with its component (`"transformer:blocks.attn.to_q"`).

    Raises:
      ValueError: an unknown mode (naming `quantization`), or a component the pipeline does not have.
    """
    from md_core import quant  # noqa: PLC0415

    if quant.check_mode(mode) is None:
      return []
    if component is None:
      names = [n for n in self.DENOISERS if isinstance(getattr(self, n, None), nnx.Module)]
    else:
      names = [component] if isinstance(component, str) else list(component)
    done = []
    for name in names:
      module, splits = self.splits_of(name)
      done += [f"{name}:{p}" for p in quant.quantize(module, mode, targets=targets)]
      for split in splits:
        split.refresh()
    self._memo.clear()  # the state's tree and dtypes changed
    return done

  def decoding(self, progress: bool = True):
    """The "decoding" phase around a VAE decode (announced on stderr when progress is on)."""
    from md_core import progress as md_progress  # noqa: PLC0415

    return md_progress.phase("decoding", announce=bool(progress))


# --- loading ----------------------------------------------------------------------------------------------


def read_index(
  root: str | os.PathLike, classes: Sequence[str], what: str
) -> tuple[dict[str, Any], str]:
  """`model_index.json` of a diffusers pipeline folder and its `_class_name`.

  Raises:
    FileNotFoundError: no `model_index.json` (the message says what the folder should hold).
    ValueError: a pipeline class not in `classes`.
  """
  index_file = pathlib.Path(root) / "model_index.json"
  if not index_file.is_file():
    raise FileNotFoundError(
      f"{root}: no model_index.json; pass a diffusers {what} folder or hub id"
    )
  index = read_json(index_file)
  cls = index.get("_class_name", "")
  if cls not in classes:
    raise ValueError(
      f"{index_file}: pipeline class {cls!r} is not one md loads here; known: {classes}"
    )
  return index, cls


def with_quantization(load: Callable[..., Pipeline]) -> Callable[..., Pipeline]:
  """A family's `load_pipeline` that also takes `quantization=` ("int8", "int8-dynamic", "fp8" or
  None): the mode is checked before any weight loads, and the loaded pipeline's denoisers are
  quantized (`Pipeline.quantize`). The one path every family's loader goes through."""

  @functools.wraps(load)
  def wrapped(*args: Any, quantization: str | None = None, **kwargs: Any) -> Pipeline:
    from md_core import quant  # noqa: PLC0415

    quant.check_mode(quantization)
    pipe = load(*args, **kwargs)
    pipe.quantize(quantization)
    return pipe

  return wrapped


def model_overrides(**settings: Any) -> dict[str, Any]:
  """The md-only model settings a loader passes on (`attention=`, `attention_config=`, `remat=`…): those
  given, without the ones left at None."""
  return {k: v for k, v in settings.items() if v is not None}


def listed(index: Mapping[str, Any], name: str) -> bool:
  """Whether `model_index.json` names a component `name` (entries of `[None, None]` do not count)."""
  entry = index.get(name)
  return isinstance(entry, list) and bool(entry) and entry[0] is not None


def component(root: str | os.PathLike, name: str, index: Mapping[str, Any]) -> pathlib.Path:
  """The folder of pipeline component `name`: its subfolder, or the folder another pipeline shares it from
  (`"_md_components"` in `model_index.json`: `md_core.shared_component`).

  Raises:
    FileNotFoundError: the folder is missing (naming what `model_index.json` lists).
  """
  folder = pathlib.Path(root) / name
  if not folder.is_dir():
    folder = shared_component(root, name, index) or folder
  if not folder.is_dir():
    have = sorted(k for k in index if listed(index, k))
    raise FileNotFoundError(
      f"{root}: pipeline component {name!r} is missing (no folder {folder}); model_index.json lists "
      f"{have}. Download the whole pipeline, or pass a complete diffusers folder"
    )
  return folder


def copy_pipeline(src: str | os.PathLike, dst: str | os.PathLike) -> pathlib.Path:
  """Copies pipeline folder `src` to `dst` (replacing it) as a self-contained folder: the components `src`
  shares with another pipeline (`"_md_components"` in `model_index.json`) are copied in as subfolders and
  the entry is dropped, so the copy loads wherever it is moved. Returns `dst`."""
  import shutil

  src, dst = pathlib.Path(src), pathlib.Path(dst)
  if dst.exists():
    shutil.rmtree(dst)
  shutil.copytree(src, dst)
  index_file = dst / "model_index.json"
  if index_file.is_file():
    index = read_json(index_file)
    table = index.get(SHARED_COMPONENTS)
    if table is not None:
      for name in table:
        shared = shared_component(src, name, index)
        if shared is not None and not (dst / name).exists():
          shutil.copytree(shared, dst / name)
      del index[SHARED_COMPONENTS]
      index_file.write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
  return dst
