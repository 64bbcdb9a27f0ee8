"""Loading LTX-2's text connectors: diffusers names (the `connectors/` folder) and the original single-file
names (`ltx-2-19b-dev.safetensors` …, where the connectors sit beside the transformer, VAEs and vocoder)."""

from __future__ import annotations

import os
import pathlib
from typing import Any

import jax
from flax import nnx

import md_attention as mda
import md_core
from md_text._ltx2_text import LTX2_CONNECTORS_VARIANTS, LTX2ConnectorsConfig, LTX2TextConnectors

_ATTN_NAMES = {
  "to_q": "to_q",
  "to_k": "to_k",
  "to_v": "to_v",
  "to_out.0": "to_out",
  "norm_q": "norm_q",
  "norm_k": "norm_k",
  "to_gate_logits": "to_gate_logits",
}
_FF_NAMES = {"ff.net.0.proj": "proj_in", "ff.net.2": "proj_out"}
_PARAM = {"weight": "kernel", "bias": "bias"}


def convert_ltx2_connectors_key(name: str) -> md_core.Target | None:
  """Maps a diffusers `LTX2TextConnectors` tensor name to md's `LTX2TextConnectors` parameter (None: not
  one of its)."""
  for proj in ("text_proj_in", "video_text_proj_in", "audio_text_proj_in"):
    if name.startswith(proj + "."):
      kind = _PARAM.get(name[len(proj) + 1 :])
      if kind is None:
        return None
      return md_core.Target((proj, kind), "linear" if kind == "kernel" else "identity")
  stream, _, rest = name.partition("_connector.")
  if stream not in ("video", "audio") or not rest:
    return None
  connector = f"{stream}_connector"
  if rest == "learnable_registers":
    return md_core.Target((connector, "learnable_registers"))
  if not rest.startswith("transformer_blocks."):
    return None
  index, _, rest = rest[len("transformer_blocks.") :].partition(".")
  if not index.isdigit():
    return None
  module, _, param = rest.rpartition(".")
  if module.startswith("attn1."):
    sub = _ATTN_NAMES.get(module[len("attn1.") :])
    path = None if sub is None else ("attn", sub)
  else:
    sub = _FF_NAMES.get(module)
    path = None if sub is None else ("ff", sub)
  if path is None:
    return None
  is_norm = path[1].startswith("norm_")
  kind = ("scale" if param == "weight" else None) if is_norm else _PARAM.get(param)
  if kind is None:
    return None
  layout = "linear" if kind == "kernel" else "identity"
  return md_core.Target((connector, "blocks") + path + (kind,), layout, layer=int(index))


# The original single file: the connectors under this prefix, the feature projection at the top level.
LTX2_ORIGINAL_PREFIX = "model.diffusion_model."
# Original name pieces → diffusers', in the order diffusers' LTX-2 conversion script applies them.
_ORIGINAL_RENAMES = (
  ("video_embeddings_connector.", "video_connector."),
  ("audio_embeddings_connector.", "audio_connector."),
  ("transformer_1d_blocks.", "transformer_blocks."),
  ("text_embedding_projection.aggregate_embed.", "text_proj_in."),
  ("text_embedding_projection.video_aggregate_embed.", "video_text_proj_in."),
  ("text_embedding_projection.audio_aggregate_embed.", "audio_text_proj_in."),
  (".q_norm.", ".norm_q."),
  (".k_norm.", ".norm_k."),
)
_ORIGINAL_ROOTS = (
  "video_embeddings_connector.",
  "audio_embeddings_connector.",
  "text_embedding_projection.",
)

# The rest of an original single file: the transformer, both VAEs and the vocoder.
LTX2_CONNECTORS_ORIGINAL_ALLOW_UNUSED = (
  r"model\.diffusion_model\.(?!(video|audio)_embeddings_connector\.).*",
  r"(vae|audio_vae|vocoder)\..*",
)


def ltx2_connectors_original_to_diffusers(name: str) -> str | None:
  """An original single-file tensor name as diffusers names it in `LTX2TextConnectors` (None: not a
  connectors tensor).

  >>> ltx2_connectors_original_to_diffusers(
  ...   "model.diffusion_model.video_embeddings_connector.transformer_1d_blocks.0.attn1.q_norm.weight")
  'video_connector.transformer_blocks.0.attn1.norm_q.weight'
  """
  name = name.removeprefix(LTX2_ORIGINAL_PREFIX)
  if not name.startswith(_ORIGINAL_ROOTS):
    return None
  for old, new in _ORIGINAL_RENAMES:
    name = name.replace(old, new)
  return name


def convert_ltx2_connectors_original_key(name: str) -> md_core.Target | None:
  """Maps an original single-file tensor name to md's `LTX2TextConnectors` parameter (None: not one of its)."""
  diffusers_name = ltx2_connectors_original_to_diffusers(name)
  return None if diffusers_name is None else convert_ltx2_connectors_key(diffusers_name)


def load_ltx2_connectors(
  source: str | os.PathLike,
  *,
  subfolder: str | None = "connectors",
  mesh: jax.sharding.Mesh | None = None,
  dtype: Any = None,
  rules: Any = None,
  attention: mda.AttentionConfig | None = None,
  progress: bool = False,
) -> LTX2TextConnectors:
  """Loads LTX-2's text connectors from a diffusers folder or hub id.

  Args:
    source: a diffusers LTX-2 pipeline folder or hub id (`"Lightricks/LTX-2"`) with `subfolder`, or the
      component's own folder with `subfolder=None`.
    subfolder: the component, "connectors".
    mesh: place parameters on this mesh (md-sharding rules over their logical axes).
    dtype: floating dtype of the parameters (default float32: a bfloat16 file is upcast).
    rules: md-sharding logical axis rules.
    attention: the md-attention implementation and its settings.
    progress: show a progress bar.

  Raises:
    FileNotFoundError: the folder, component or config is missing.
    ValueError: a config md cannot run.
    md_core.WeightLoadError: tensors that do not fit the config (all listed).
  """
  folder = md_core.resolve_source(source, subfolder=subfolder)
  cfg = LTX2ConnectorsConfig.from_json(folder / "config.json")
  return md_core.load_weights(
    lambda: LTX2TextConnectors(cfg, attention=attention, rngs=nnx.Rngs(0)),
    md_core.open_checkpoint(folder),
    convert_ltx2_connectors_key,
    dtype=dtype,
    mesh=mesh,
    rules=rules,
    progress=progress,
  )


def load_ltx2_connectors_original(
  path: str | os.PathLike,
  *,
  config: LTX2ConnectorsConfig | str = "ltx-2",
  mesh: jax.sharding.Mesh | None = None,
  dtype: Any = None,
  rules: Any = None,
  attention: mda.AttentionConfig | None = None,
  progress: bool = False,
) -> LTX2TextConnectors:
  """Loads LTX-2's text connectors from an original single-file checkpoint (`ltx-2-19b-dev.safetensors`,
  names `model.diffusion_model.video_embeddings_connector.…` and `text_embedding_projection.…`); the file's
  other tensors (transformer, VAEs, vocoder) are skipped.

  Args:
    path: the `.safetensors` file (or a folder of shards).
    config: an `LTX2ConnectorsConfig` or a key of `LTX2_CONNECTORS_VARIANTS` ("ltx-2", "ltx-2.3"); the
      single file carries no diffusers config.
    mesh, dtype, rules, attention, progress: as `load_ltx2_connectors`.

  Raises:
    FileNotFoundError: the file is missing.
    ValueError: an unknown variant name.
    md_core.WeightLoadError: tensors that do not fit the config (all listed).
  """
  if isinstance(config, str):
    if config not in LTX2_CONNECTORS_VARIANTS:
      raise ValueError(
        f"config={config!r} is not one of {sorted(LTX2_CONNECTORS_VARIANTS)}; or pass an "
        "LTX2ConnectorsConfig"
      )
    config = LTX2_CONNECTORS_VARIANTS[config]
  path = pathlib.Path(path)
  if not path.exists():
    raise FileNotFoundError(f"{path}: no such checkpoint file")
  return md_core.load_weights(
    lambda: LTX2TextConnectors(config, attention=attention, rngs=nnx.Rngs(0)),
    md_core.open_checkpoint(path),
    convert_ltx2_connectors_original_key,
    dtype=dtype,
    mesh=mesh,
    rules=rules,
    allow_unused=LTX2_CONNECTORS_ORIGINAL_ALLOW_UNUSED,
    progress=progress,
  )
