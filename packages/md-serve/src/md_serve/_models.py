"""A loaded pipeline as the server sees it: its kind, sizes, per-row noise and its LoRA registry.

md-serve imports no family package: it reads what it needs off the pipeline object. An image pipeline with
a `unet` (md-sd) and a video pipeline with a temporal VAE factor (md-wan) get per-row initial noise, so
requests with different seeds share one batched call; other pipelines run one request per call with its
seed.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np


@dataclasses.dataclass(frozen=True)
class NoiseSpec:
  """How to draw a row's initial noise in the pipeline's `latents=` layout.

  Attributes:
    kind: "image" or "video".
    multiple: height and width must be multiples of this (pixels per latent token).
    channels: latent channels.
    factor: pixels per latent pixel.
    temporal: frames per latent frame (video), else 0.
  """

  kind: str
  multiple: int
  channels: int
  factor: int
  temporal: int = 0

  def shape(self, n: int, height: int, width: int, num_frames: int = 1) -> tuple[int, ...]:
    """The noise shape of `n` rows (SD: `[n, C, H/f, W/f]`; Wan: `[n, C, (F-1)/t + 1, H/f, W/f]`)."""
    h, w = height // self.factor, width // self.factor
    if self.kind == "video":
      return (n, self.channels, (num_frames - 1) // self.temporal + 1, h, w)
    return (n, self.channels, h, w)

  def draw(self, seed: int, n: int, height: int, width: int, num_frames: int = 1) -> np.ndarray:
    """`n` rows of standard normal noise from `seed` (the same seed gives the same rows)."""
    key = jax.random.key(int(seed))
    return np.asarray(jax.random.normal(key, self.shape(n, height, width, num_frames), np.float32))


def noise_spec(pipe: Any) -> NoiseSpec | None:
  """The noise layout of a pipeline md-serve knows (md-sd, md-wan), else None (one request per call)."""
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
    max_pixels: the largest height × width a request may ask for.
    num_frames: a video model's default frame count.
    max_frames: the most frames a video request may ask for.
  """

  def __init__(
    self,
    name: str,
    pipe: Any,
    *,
    loras: Mapping[str, Any] | None = None,
    lora_rank: int | None = None,
    default_size: tuple[int, int] | None = None,
    max_pixels: int = 1024 * 1024,
    num_frames: int = 5,
    max_frames: int = 81,
  ):
    self.name, self.pipe = name, pipe
    self.spec = noise_spec(pipe)
    self.kind = (
      self.spec.kind if self.spec else ("video" if "num_frames" in self.params else "image")
    )
    self.multiple = self.spec.multiple if self.spec else 16
    size = default_size or (getattr(pipe, "default_size", None) or 512,) * 2
    self.default_size = (int(size[0]), int(size[1]))
    self.max_pixels, self.num_frames, self.max_frames = (
      int(max_pixels),
      int(num_frames),
      int(max_frames),
    )
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
    return {
      "id": self.name,
      "kind": self.kind,
      "default_size": f"{w}x{h}",
      "size_multiple": self.multiple,
      "max_pixels": self.max_pixels,
      "loras": sorted(self.loras),
      "batched_seeds": self.spec is not None,
    }
