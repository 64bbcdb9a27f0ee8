"""A loaded pipeline as the server sees it: its kind, sizes, per-row noise and its LoRA registry.

md-serve imports no family package: it reads what it needs off the pipeline object. md-sd (a `unet`),
md-wan (a temporal VAE factor), Flux.1 (packed tokens), Flux.2 Klein (batch-norm statistics over
patchified latents) and LTX-Video (LTX compression ratios, no audio VAE) pipelines get per-row initial
noise, so requests with different seeds share one batched call; other pipelines (LTX-2) run one request
per call with its seed.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np

LAYOUTS = ("channels_first", "channels_last", "packed")


@dataclasses.dataclass(frozen=True)
class NoiseSpec:
  """How to draw a row's initial noise in the pipeline's `latents=` layout.

  The Flux and LTX-Video specs draw what the pipeline itself draws for that seed when no `latents` are
  given (same key, same order of elements), so a request alone or in a batch gives the image a plain
  `pipe(prompt, seed=seed)` call gives.

  Attributes:
    kind: "image" or "video".
    multiple: height and width must be multiples of this (pixels per latent token).
    channels: latent channels of the `latents=` layout (Flux: the transformer's patchified channels).
    factor: pixels per latent pixel (of the grid the noise is drawn on).
    temporal: frames per latent frame (video), else 0.
    layout: how the pipeline draws its noise and takes `latents=` (one of `LAYOUTS`):
      "channels_first": drawn and taken as `[n, C, (F,) h, w]` (md-sd, md-wan);
      "channels_last": drawn `[n, (F,) h, w, C]`, taken channels-first `[n, C, (F,) h, w]` (Flux.2 with
        h = H/16 and C the patchified channels, LTX-Video);
      "packed": drawn `[n, h, w, C/4]`, taken as 2x2 patches packed into tokens `[n, (h/2)(w/2), C]`
        (features channel, then row and column in the patch; Flux.1).
    split: `(count, index)` when the pipeline draws its noise from `jax.random.split(key(seed),
      count)[index]` (LTX-Video: (5, 0)); None: from `key(seed)` itself.
  """

  kind: str
  multiple: int
  channels: int
  factor: int
  temporal: int = 0
  layout: str = "channels_first"
  split: tuple[int, int] | None = None

  def __post_init__(self):
    if self.layout not in LAYOUTS:
      raise ValueError(f"NoiseSpec: layout={self.layout!r}; expected one of {LAYOUTS}")
    if self.layout == "packed" and (self.kind != "image" or self.channels % 4):
      raise ValueError(
        f"NoiseSpec: the packed layout is for images with channels a multiple of 4; got "
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


def noise_spec(pipe: Any) -> NoiseSpec | None:
  """The noise layout of a pipeline md-serve knows (md-sd, md-wan, Flux.1, Flux.2 Klein, LTX-Video),
  else None (one request per call).

  LTX-2 gets None: its joint transformer makes each video depend on its audio noise as well, which the
  pipeline takes only unnormalised (`audio_latents`, normalised again inside) beside `latents=`.
  """
  if hasattr(pipe, "unet") and hasattr(pipe, "vae_scale_factor"):
    f = int(pipe.vae_scale_factor)
    return NoiseSpec("image", f, int(pipe.unet.cfg.in_channels), f)
  if hasattr(pipe, "vae_scale_factor_temporal") and hasattr(pipe, "size_multiple"):
    return NoiseSpec(
      "video",
      int(max(pipe.size_multiple)),
      int(pipe.vae.config.z_dim),
      int(pipe.vae_scale_factor_spatial),
      int(pipe.vae_scale_factor_temporal),
    )
  if hasattr(pipe, "transformer") and hasattr(pipe, "vae_scale_factor"):
    f, c = int(pipe.vae_scale_factor), int(pipe.transformer.cfg.in_channels)
    if hasattr(pipe, "bn_mean"):
      # Flux.2: noise drawn on the 2x2-patchified grid `[n, H/16, W/16, 4C]`, taken as NCHW.
      return NoiseSpec("image", 2 * f, c, 2 * f, layout="channels_last")
    if hasattr(pipe, "guidance_distilled"):
      # Flux.1: noise drawn at the VAE's resolution `[n, H/8, W/8, C/4]`, taken packed.
      return NoiseSpec("image", 2 * f, c, f, layout="packed")
  if (
    hasattr(pipe, "vae_temporal_compression_ratio")
    and hasattr(pipe, "size_multiple")
    and not hasattr(pipe, "audio_vae")
  ):
    # LTX-Video: `[n, F', h, w, C]` from the first of five keys, taken as `[n, C, F', h, w]`.
    return NoiseSpec(
      "video",
      int(pipe.size_multiple),
      int(pipe.vae.config.latent_channels),
      int(pipe.vae_spatial_compression_ratio),
      int(pipe.vae_temporal_compression_ratio),
      layout="channels_last",
      split=(5, 0),
    )
  return None


class ServedModel:
  """A pipeline the server runs, with its registry of hot-swappable LoRA adapters.

  Args:
    name: the model's name in requests (`"model": name`).
    pipe: a loaded md pipeline (`md_sd.load_pipeline(...)`, `md_wan.load_pipeline(...)`).
    loras: `{name: LoRA file}`, loaded at run time into the pipeline's LoRA slots (`pipe.load_lora`);
      each batch selects its requests' adapters and scales with `pipe.set_adapters` (never a recompile).
    lora_rank: the slots' rank (adapters used together share it; default: the pipeline's, 64).
    default_size: (height, width) when a request gives no size (default: the pipeline's own).
    max_pixels: the largest height × width a request may ask for (default: 4 × the default size's,
      e.g. 1024 x 1024 for a 512 x 512 model).
    num_frames: a video model's default frame count.
    max_frames: the most frames a video request may ask for.
    max_steps: the most denoising steps a request may ask for.
    call_kwargs: settings every call of this model gets, below the request's own (e.g. a checkpoint's
      `max_sequence_length`, or LTX-2's `spatio_temporal_guidance_blocks` for a small transformer).
    mag_ratios: `{name: ratios or a JSON file from md_cache.save_mag_ratios}`, read here at start-up:
      the MagCache ratio sets requests may name (`"cache_options": {"mag_ratios": name}`); a request
      never names a file.
  """

  def __init__(
    self,
    name: str,
    pipe: Any,
    *,
    loras: Mapping[str, Any] | None = None,
    lora_rank: int | None = None,
    default_size: tuple[int, int] | None = None,
    max_pixels: int | None = None,
    num_frames: int = 5,
    max_frames: int = 81,
    max_steps: int = 100,
    call_kwargs: Mapping[str, Any] | None = None,
    mag_ratios: Mapping[str, Any] | None = None,
  ):
    self.name, self.pipe = name, pipe
    self.call_kwargs = dict(call_kwargs or {})
    self.spec = noise_spec(pipe)
    self.kind = (
      self.spec.kind if self.spec else ("video" if "num_frames" in self.params else "image")
    )
    self.multiple = self.spec.multiple if self.spec else 16
    size = default_size or (getattr(pipe, "default_size", None) or 512,) * 2
    self.default_size = (int(size[0]), int(size[1]))
    h, w = self.default_size
    self.max_pixels = int(max_pixels) if max_pixels else 4 * h * w
    self.num_frames, self.max_frames, self.max_steps = (
      int(num_frames),
      int(max_frames),
      int(max_steps),
    )
    for what, value in (("max_pixels", self.max_pixels), ("max_frames", self.max_frames),
                        ("max_steps", self.max_steps), ("num_frames", self.num_frames)):  # fmt: skip
      if value < 1:
        raise ValueError(f"ServedModel {name!r}: {what}={value} must be >= 1")
    self.mag_ratios: dict[str, tuple[float, ...]] = {}
    for ratio_name, ratios in (mag_ratios or {}).items():
      if isinstance(ratios, str | os.PathLike):
        import md_cache  # noqa: PLC0415

        ratios = md_cache.load_mag_ratios(ratios)
      values = np.asarray(ratios, np.float64).reshape(-1)
      if not values.size or not np.isfinite(values).all():
        raise ValueError(f"ServedModel {name!r}: mag_ratios[{ratio_name!r}] must be finite numbers")
      self.mag_ratios[str(ratio_name)] = tuple(float(v) for v in values)
    self.loras: dict[str, str] = {}
    self._active: tuple = ()
    for lora_name, file in (loras or {}).items():
      pipe.load_lora(file, name=lora_name, max_rank=lora_rank)
      self.loras[lora_name] = str(file)
    if self.loras:
      pipe.set_adapters({})  # loaded, none active until a request names them

  @property
  def params(self) -> set[str]:
    """The keyword arguments the pipeline's call takes."""
    return set(inspect.signature(self.pipe.__call__).parameters)

  def set_loras(self, loras: Sequence[tuple[str, float]]) -> bool:
    """Puts `(name, scale)` adapters into the slots (none: the base model); returns whether it changed.

    The slots keep their shapes, so the compiled programs are reused.
    """
    loras = tuple((n, float(s)) for n, s in loras)
    if loras == self._active:
      return False
    if self.loras:
      self.pipe.set_adapters({n: s for n, s in loras})
    self._active = loras
    return True

  def describe(self) -> dict:
    """What `/v1/models` lists for this model."""
    h, w = self.default_size
    out = {
      "id": self.name,
      "kind": self.kind,
      "default_size": f"{w}x{h}",
      "size_multiple": self.multiple,
      "max_pixels": self.max_pixels,
      "max_steps": self.max_steps,
      "loras": sorted(self.loras),
      "mag_ratios": sorted(self.mag_ratios),
      "batched_seeds": self.spec is not None,
    }
    if self.kind == "video":
      out.update(num_frames=self.num_frames, max_frames=self.max_frames)
    return out
