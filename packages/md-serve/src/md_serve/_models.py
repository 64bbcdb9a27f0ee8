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

import md_core


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


def _lora_weights(adapter: Any, dense: Mapping[str, Any], scale: float) -> tuple[dict, int]:
  """An md-lora `Adapter` as `{dense path: md_core.LoRAWeight}` for run-time slots, and how many of its
  sites are not Dense kernels (convolutions: merged LoRA only, not hot-swappable)."""
  out, dropped = {}, 0
  for site, w in adapter.weights.items():
    path = ".".join(str(p) for p in site.path[:-1])
    if site.path[-1] != "kernel" or path not in dense or np.ndim(w.down) != 2:
      dropped += 1
      continue
    out[path] = md_core.LoRAWeight(
      np.asarray(w.down), np.asarray(w.up), float(w.scale) * float(scale), site.layer
    )
  return out, dropped


class ServedModel:
  """A pipeline the server runs, with its registry of hot-swappable LoRA adapters.

  Args:
    name: the model's name in requests (`"model": name`).
    pipe: a loaded md pipeline (`md_sd.load_pipeline(...)`, `md_wan.load_pipeline(...)`).
    loras: `{name: md_lora.Adapter}` read for this pipeline's denoiser; run-time slots are added once
      (rank = the sum of the adapters' ranks, so any combination fits), and each batch puts its requests'
      adapters and scales into them without recompiling.
    lora_component: the pipeline attribute the adapters are for (default: `unet` or `transformer`).
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
    lora_component: str | None = None,
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
    self.lora_component = lora_component or ("unet" if hasattr(pipe, "unet") else "transformer")
    self.loras: dict[str, dict] = {}
    self.lora_dropped: dict[str, int] = {}
    self._active: tuple = ()
    if loras:
      module = getattr(pipe, self.lora_component)
      dense = md_core.dense_layers(module)
      for lora_name, adapter in loras.items():
        weights, dropped = _lora_weights(adapter, dense, 1.0)
        if not weights:
          raise ValueError(f"LoRA {lora_name!r}: none of its sites is a Dense layer of {name}")
        self.loras[lora_name], self.lora_dropped[lora_name] = weights, dropped
      rank = sum(max(w.a.shape[-1] for w in ws.values()) for ws in self.loras.values())
      targets = sorted({p for ws in self.loras.values() for p in ws})
      pipe.add_lora_slots(rank, component=self.lora_component, targets=targets)

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
      adapters = []
      for lora_name, scale in loras:
        adapters.append(
          {p: w._replace(scale=w.scale * scale) for p, w in self.loras[lora_name].items()}
        )
      self.pipe.set_lora(adapters, component=self.lora_component)
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
