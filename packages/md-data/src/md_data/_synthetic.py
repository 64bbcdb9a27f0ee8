"""Synthetic batches of latents and text states for benchmarks: the shapes of a family, overridable."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np

# Shapes of the real models (their VAE and text encoder); `SyntheticConfig.for_family(name, **overrides)`.
FAMILY_SHAPES: dict[str, dict[str, Any]] = {
  "sd15": dict(height=512, width=512, text_length=77, text_dim=768, latent_channels=4),
  "sd21": dict(height=768, width=768, text_length=77, text_dim=1024, latent_channels=4),
  "sdxl": dict(height=1024, width=1024, text_length=77, text_dim=2048, latent_channels=4),
  "flux": dict(height=1024, width=1024, text_length=512, text_dim=4096, latent_channels=16),
  "wan": dict(height=480, width=832, frames=81, text_length=512, text_dim=4096, latent_channels=16),
}


@dataclasses.dataclass(frozen=True)
class SyntheticConfig:
  """The shapes of synthetic batches.

  Attributes:
    batch_size: examples per batch (this process's).
    height, width: the picture's size in pixels (multiples of `vae_spatial`).
    frames: frames of a video (1 + a multiple of `vae_temporal`, the causal video VAEs' rule); None:
      images.
    text_length, text_dim: `encoder_hidden_states` is `[B, text_length, text_dim]`.
    latent_channels: channels of the latents.
    vae_spatial, vae_temporal: the VAE's downsampling in space and time.
    timesteps: also yield int64 `timesteps` `[B]` in [0, 1000) (as eval records carry).
  """

  batch_size: int = 1
  height: int = 64
  width: int = 64
  frames: int | None = None
  text_length: int = 77
  text_dim: int = 768
  latent_channels: int = 4
  vae_spatial: int = 8
  vae_temporal: int = 4
  timesteps: bool = False

  def __post_init__(self):
    for name in (
      "batch_size",
      "height",
      "width",
      "text_length",
      "text_dim",
      "latent_channels",
      "vae_spatial",
      "vae_temporal",
    ):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"SyntheticConfig.{name} must be a positive int, got {value!r}")
    for name in ("height", "width"):
      if getattr(self, name) % self.vae_spatial:
        raise ValueError(
          f"SyntheticConfig.{name}={getattr(self, name)} must be a multiple of "
          f"vae_spatial={self.vae_spatial}"
        )
    if self.frames is not None and (self.frames < 1 or (self.frames - 1) % self.vae_temporal):
      raise ValueError(
        f"SyntheticConfig.frames={self.frames} must be 1 + a multiple of "
        f"vae_temporal={self.vae_temporal} (e.g. {1 + self.vae_temporal * 4})"
      )

  @classmethod
  def for_family(cls, family: str, **overrides: Any) -> SyntheticConfig:
    """A real model family's shapes (`FAMILY_SHAPES`), with `overrides` on top."""
    if family not in FAMILY_SHAPES:
      raise ValueError(f"unknown family {family!r}; choose one of {', '.join(FAMILY_SHAPES)}")
    return cls(**{**FAMILY_SHAPES[family], **overrides})

  @property
  def latent_shape(self) -> tuple[int, ...]:
    """One batch's latents: `[B, h, w, c]`, or `[B, f, h, w, c]` for videos."""
    h, w = self.height // self.vae_spatial, self.width // self.vae_spatial
    if self.frames is None:
      return (self.batch_size, h, w, self.latent_channels)
    f = (self.frames - 1) // self.vae_temporal + 1
    return (self.batch_size, f, h, w, self.latent_channels)


class SyntheticIterator:
  """Endless synthetic batches `{"latents", "encoder_hidden_states"[, "timesteps"]}` (float32 normal).

  Batch `k` is drawn from `np.random.default_rng([seed, k])`, so the stream depends only on the seed
  and `state()` is one index.
  """

  def __init__(self, config: SyntheticConfig | None = None, *, seed: int = 0):
    self.config = config or SyntheticConfig()
    self._seed = int(seed)
    self._index = 0

  def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
    return self

  def __next__(self) -> dict[str, np.ndarray]:
    c = self.config
    rng = np.random.default_rng([self._seed, self._index])
    self._index += 1
    out = {
      "latents": rng.standard_normal(c.latent_shape, np.float32),
      "encoder_hidden_states": rng.standard_normal(
        (c.batch_size, c.text_length, c.text_dim), np.float32
      ),
    }
    if c.timesteps:
      out["timesteps"] = rng.integers(0, 1000, (c.batch_size,), dtype=np.int64)
    return out

  def state(self) -> dict[str, int]:
    """The position: the next batch's index."""
    return {"index": self._index}

  def restore(self, state: Mapping[str, Any]) -> None:
    index = int(state["index"])
    if index < 0:
      raise ValueError(f"SyntheticIterator.restore: index must be >= 0, got {index}")
    self._index = index
