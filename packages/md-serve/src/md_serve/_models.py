"""A loaded pipeline as the server sees it: its kind, sizes, per-row noise and its LoRA registry.

md-serve imports no family package: it asks the pipeline through the family contract
(`md_core.pipeline.Pipeline`). A pipeline with a noise layout (md-sd, md-wan, Flux.1, Flux.2 Klein,
LTX-Video) gets per-row initial noise, so requests with different seeds share one batched call; the
others (LTX-2) run one request per call with its seed.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from md_core.pipeline import NOISE_LAYOUTS, NoiseLayout

# The noise layout is the family contract's (`md_core.pipeline.Pipeline.noise_layout`); md-serve's names.
NoiseSpec = NoiseLayout
LAYOUTS = NOISE_LAYOUTS


def noise_spec(pipe: Any) -> NoiseSpec | None:
  """The pipeline's per-row noise layout (`pipe.noise_layout()`), or None: one request per call."""
  return pipe.noise_layout()


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
    self.kind = pipe.media  # "image" or "video" (the family contract)
    self.multiple = self.spec.multiple if self.spec else 16
    size = default_size or (pipe.default_size or 512,) * 2
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
