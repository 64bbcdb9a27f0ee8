"""`load_pipeline`: a Flux diffusers folder or hub id → the Flux.1 or the Flux.2 Klein pipeline."""

from __future__ import annotations

import os
from typing import Any

import jax

import md_core
from md_core import pipeline as mdp
from md_flux._pipeline import FluxPipeline, load_flux1
from md_flux._pipeline2 import Flux2KleinPipeline, load_klein

_FLUX1_CLASSES = ("FluxPipeline",)
_FLUX2_CLASSES = ("Flux2KleinPipeline", "Flux2KleinKVPipeline")


@mdp.with_quantization
def load_pipeline(
  source: str | os.PathLike,
  *,
  mesh: jax.sharding.Mesh | None = None,
  dtype: Any = None,
  text_dtype: Any = None,
  rules: Any = None,
  attention: Any = None,
  revision: str | None = None,
  progress: bool = False,
) -> FluxPipeline | Flux2KleinPipeline:
  """Loads a Flux diffusers pipeline as md modules.

  Args:
    source: a local diffusers pipeline folder (with `model_index.json`) or a hub id
      (`"black-forest-labs/FLUX.1-dev"`, `"black-forest-labs/FLUX.2-klein-4B"`), resolved through
      md-core (the hub cache; downloads when online).
    mesh: place every parameter on this mesh by its logical axes (and split the batch over data ×
      fsdp).
    dtype: parameter dtype of the transformer (default float32, the model's own: a bfloat16 file is
      upcast; pass bfloat16 on accelerators).
    text_dtype: parameter dtype of the T5 encoder or of Klein's Qwen3 encoder (default float32: a
      bfloat16 file is upcast); CLIP and the VAEs stay float32.
    rules: md-sharding logical axis rules (default: `md_sharding.DEFAULT_RULES`).
    attention: an `md_attention.AttentionConfig` for the transformer (e.g. context parallelism
      `AttentionConfig(implementation="ulysses")` over the mesh's `context` axis).
    revision: hub revision.
    progress: progress bars while loading tensors.
    quantization: quantize the denoiser(s) after loading: "int8" (weight-only), "int8-dynamic"
      (weights and activations) or "fp8" (e4m3 weight-only); None keeps the loaded dtype
      (`md_core.quantize`).

  Returns:
    A `FluxPipeline` (Flux.1; call it to generate images) or a `Flux2KleinPipeline` (Flux.2 Klein,
    `Flux2KleinPipeline` / `Flux2KleinKVPipeline` folders: text-to-image and editing with up to 4
    reference images).

  Raises:
    FileNotFoundError: no such folder or hub id, no `model_index.json`, or a component folder is
      missing (named).
    md_core.WeightLoadError: weights that do not fit their config.
    ValueError: a pipeline class md does not implement.
  """
  root = md_core.resolve_source(source, revision=revision)
  index, cls = mdp.read_index(root, _FLUX1_CLASSES + _FLUX2_CLASSES, "Flux pipeline")
  load = load_klein if cls in _FLUX2_CLASSES else load_flux1
  return load(
    root, index, mesh=mesh, dtype=dtype, text_dtype=text_dtype, rules=rules, attention=attention,
    progress=progress, source=str(source),
  )  # fmt: skip
