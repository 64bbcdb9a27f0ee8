"""Loading an LTX-Video diffusers folder (or an LTX-2 one, handed to `load_ltx2_pipeline`) as md modules."""

from __future__ import annotations

import os
from typing import Any

import jax

import md_core
import md_schedulers as mdsch
import md_text
import md_vae
from md_core import pipeline as mdp
from md_ltx._ltx2_load import load_ltx2_pipeline
from md_ltx._ltx2_pipeline import LTX2_PIPELINE_CLASSES
from md_ltx._pipeline import _CLASSES, LTXVideoPipeline
from md_ltx._transformer import LTXTransformer
from md_ltx._weights import load_transformer


@mdp.with_quantization
def load_pipeline(
  source: str | os.PathLike,
  *,
  transformer: str | os.PathLike | LTXTransformer | None = None,
  condition: bool | None = None,
  mesh: jax.sharding.Mesh | None = None,
  dtype: Any = None,
  rules: Any = None,
  attention: str | None = None,
  attention_config: Any = None,
  remat: str | None = None,
  revision: str | None = None,
  progress: bool = False,
) -> LTXVideoPipeline | Any:
  """Loads an LTX-Video diffusers pipeline (`LTXPipeline`, `LTXConditionPipeline`,
  `LTXImageToVideoPipeline`) as md modules; LTX-2 folders (`LTX2Pipeline`, `LTX2ImageToVideoPipeline`) are
  handed to `load_ltx2_pipeline` and return an `LTX2VideoPipeline`.

  Args:
    source: a local diffusers folder with `model_index.json`, or a hub id (`"Lightricks/LTX-Video"`,
      `"Lightricks/LTX-Video-0.9.5"`, `"Lightricks/LTX-Video-0.9.7-dev"`, ...).
    transformer: another transformer: a loaded `LTXTransformer`, a diffusers transformer folder or an
      original single file (`ltxv-13b-0.9.8-distilled.safetensors`), used with the source's VAE and T5.
    condition: use LTXConditionPipeline semantics without conditions and for `image=` too (default: when
      the folder is an `LTXConditionPipeline`; `LTXPipeline` and `LTXImageToVideoPipeline` folders run
      `image=` as LTXImageToVideoPipeline); needed for `denoise_strength < 1`. A call's `mode=`
      chooses per call.
    mesh: place parameters on this mesh by their logical axes (FSDP over `fsdp`, heads over `tensor`).
    dtype: parameter dtype of the transformer and the text encoder (default float32: bfloat16 files are
      upcast); the VAE stays float32.
    rules: md-sharding logical axis rules.
    attention, attention_config, remat: the transformer's md-attention implementation and settings and
      its rematerialisation policy.
    revision: hub revision.
    progress: progress bars while loading tensors.
    quantization: quantize the denoiser(s) after loading: "int8" (weight-only), "int8-dynamic"
      (weights and activations) or "fp8" (e4m3 weight-only); None keeps the loaded dtype
      (`md_core.quantize`).

  Returns:
    An `LTXVideoPipeline` (conditioning semantics by default for `LTXConditionPipeline` folders,
    image-to-video semantics for `image=` otherwise).

  Raises:
    FileNotFoundError: no folder / hub id, or a component missing (named).
    ValueError: a pipeline class md does not implement.
  """
  root = md_core.resolve_source(source, revision=revision)
  index, cls = mdp.read_index(
    root, (*_CLASSES, *LTX2_PIPELINE_CLASSES),
    "LTX-Video pipeline (transformer/, vae/, text_encoder/, tokenizer/, scheduler/)",
  )  # fmt: skip
  if cls in LTX2_PIPELINE_CLASSES:
    if condition is not None:
      raise ValueError(
        f"{root / 'model_index.json'}: {cls} takes no `condition=` (that is LTX-Video's conditioning "
        "mode)"
      )
    return load_ltx2_pipeline(
      source,
      transformer=transformer,
      mesh=mesh,
      dtype=dtype,
      rules=rules,
      attention=attention,
      attention_config=attention_config,
      remat=remat,
      revision=revision,
      progress=progress,
    )
  overrides = mdp.model_overrides(
    attention=attention, attention_config=attention_config, remat=remat
  )
  kw = dict(mesh=mesh, rules=rules, progress=progress)
  if isinstance(transformer, LTXTransformer):
    model = transformer
  else:
    where = mdp.component(root, "transformer", index) if transformer is None else transformer
    model = load_transformer(where, subfolder=None, dtype=dtype, **kw, **overrides)
  vae = md_vae.load_vae_ltx(mdp.component(root, "vae", index), subfolder=None, **kw)
  te = md_text.load_t5_encoder(mdp.component(root, "text_encoder", index), dtype=dtype, **kw)
  tok = md_text.load_tokenizer(mdp.component(root, "tokenizer", index), subfolder=None)
  sched_cfg = mdsch.read_config(mdp.component(root, "scheduler", index))
  mdsch.from_config(sched_cfg)  # fail now, not at the first call
  return LTXVideoPipeline(
    transformer=model,
    vae=vae,
    text_encoder=te,
    tokenizer=tok,
    scheduler_config=sched_cfg,
    condition_pipeline=cls == "LTXConditionPipeline" if condition is None else bool(condition),
    mesh=mesh,
    source=str(source),
  )
