"""Saving an LTX-2 result (video with its audio track) and loading an LTX-2 diffusers folder as md modules."""

from __future__ import annotations

import os
import pathlib
from typing import Any

import jax
import numpy as np

import md_core
import md_schedulers as mdsch
import md_text
from md_core import pipeline as mdp
from md_ltx._ltx2_pipeline import LTX2_PIPELINE_CLASSES, LTX2Output, LTX2VideoPipeline
from md_ltx._ltx2_transformer import LTX2Transformer
from md_ltx._ltx2_weights import load_ltx2_transformer
from md_vae._ltx2_audio_weights import load_vae_ltx2_audio
from md_vae._ltx2_vae_weights import load_vae_ltx2
from md_vae._ltx2_vocoder_weights import load_vocoder_ltx2

# --- saving ------------------------------------------------------------------------------------------------------


def save_ltx2_video(
  path: str | os.PathLike,
  result: LTX2Output,
  fps: float | None = None,
  *,
  index: int = 0,
  crf: int = 18,
) -> pathlib.Path:
  """Writes video `index` of an `LTX2Output` as MP4 (H.264) with its audio track muxed in (AAC).

  Args:
    path: the `.mp4` to write.
    result: what the pipeline returned (`output_type="np"`).
    fps: frames per second (default: the result's frame rate).
    index: which video of the batch.
    crf: H.264 quality.
  """
  frames, audio = np.asarray(result.frames), np.asarray(result.audio)
  if frames.ndim != 5 or frames.shape[-1] != 3:
    raise ValueError(f"result.frames must be [B, F, H, W, 3] frames, got shape {frames.shape}")
  if audio.ndim != 3:
    raise ValueError(f"result.audio must be [B, channels, samples], got shape {audio.shape}")
  return md_core.media.save_video(
    path,
    frames[index],
    result.frame_rate if fps is None else fps,
    audio=np.clip(audio[index], -1.0, 1.0),
    sample_rate=result.sample_rate,
    crf=crf,
  )


# --- loading ---------------------------------------------------------------------------------------------------


@mdp.with_quantization
def load_ltx2_pipeline(
  source: str | os.PathLike,
  *,
  transformer: str | os.PathLike | LTX2Transformer | None = None,
  image_to_video: bool | None = None,
  mesh: jax.sharding.Mesh | None = None,
  dtype: Any = None,
  rules: Any = None,
  attention: str | None = None,
  attention_config: Any = None,
  remat: str | None = None,
  revision: str | None = None,
  progress: bool = False,
) -> LTX2VideoPipeline:
  """Loads an LTX-2 diffusers pipeline (`LTX2Pipeline`, `LTX2ImageToVideoPipeline`) as md modules.

  Args:
    source: a local diffusers folder with `model_index.json`, or a hub id (`"Lightricks/LTX-2"`).
    transformer: another transformer: a loaded `LTX2Transformer`, a diffusers transformer folder or an
      original single file (`ltx-2-19b-dev.safetensors`).
    image_to_video: require an image (default: when the folder is an `LTX2ImageToVideoPipeline`); any
      pipeline conditions on `image=` when one is given.
    mesh: place parameters on this mesh by their logical axes.
    dtype: parameter dtype of the transformer, Gemma 3 and the connectors (default float32: bfloat16
      files are upcast); the VAEs and the vocoder stay float32.
    rules: md-sharding logical axis rules.
    attention, attention_config, remat: the transformer's md-attention implementation, its settings and
      the rematerialisation policy.
    revision: hub revision.
    progress: progress bars while loading tensors.
    quantization: quantize the transformer after loading: "int8", "int8-dynamic" or "fp8"
      (`md_core.quantize`); None keeps the loaded dtype.

  Raises:
    FileNotFoundError: no folder / hub id, or a component missing (named).
    ValueError: a pipeline class this loader does not implement.
  """
  root = md_core.resolve_source(source, revision=revision)
  index, cls = mdp.read_index(
    root,
    LTX2_PIPELINE_CLASSES,
    "LTX-2 pipeline (transformer/, vae/, audio_vae/, vocoder/, text_encoder/, connectors/, "
    "tokenizer/, scheduler/)",
  )
  overrides = mdp.model_overrides(
    attention=attention, attention_config=attention_config, remat=remat
  )
  kw = dict(mesh=mesh, rules=rules, progress=progress)
  if isinstance(transformer, LTX2Transformer):
    model = transformer
  else:
    where = mdp.component(root, "transformer", index) if transformer is None else transformer
    model = load_ltx2_transformer(where, subfolder=None, dtype=dtype, **kw, **overrides)
  vae = load_vae_ltx2(mdp.component(root, "vae", index), subfolder=None, **kw)
  audio_vae = load_vae_ltx2_audio(mdp.component(root, "audio_vae", index), subfolder=None, **kw)
  vocoder = load_vocoder_ltx2(mdp.component(root, "vocoder", index), subfolder=None, **kw)
  te = md_text.load_gemma3_encoder(
    mdp.component(root, "text_encoder", index), subfolder=None, dtype=dtype, **kw
  )
  connectors = md_text.load_ltx2_connectors(
    mdp.component(root, "connectors", index), subfolder=None, dtype=dtype, **kw
  )
  tok = md_text.load_tokenizer(mdp.component(root, "tokenizer", index), subfolder=None)
  sched_cfg = mdsch.read_config(mdp.component(root, "scheduler", index))
  mdsch.from_config(sched_cfg)  # fail now, not at the first call
  return LTX2VideoPipeline(
    transformer=model,
    vae=vae,
    audio_vae=audio_vae,
    vocoder=vocoder,
    text_encoder=te,
    connectors=connectors,
    tokenizer=tok,
    scheduler_config=sched_cfg,
    image_to_video=cls == "LTX2ImageToVideoPipeline" if image_to_video is None else image_to_video,
    mesh=mesh,
    source=str(source),
  )
