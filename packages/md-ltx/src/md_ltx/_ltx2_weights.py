"""LTX-2 transformer weights: diffusers and original single-file tensor names → md paths, and the loader."""

from __future__ import annotations

import os
import pathlib
import re
from typing import Any

import jax
from flax import nnx

import md_core
from md_ltx._ltx2_config import LTX2Config
from md_ltx._ltx2_transformer import LTX2Transformer

_ATTENTIONS = (
  "attn1",
  "audio_attn1",
  "attn2",
  "audio_attn2",
  "audio_to_video_attn",
  "video_to_audio_attn",
)
_NORMS = (
  "norm1",
  "audio_norm1",
  "norm2",
  "audio_norm2",
  "audio_to_video_norm",
  "video_to_audio_norm",
  "norm3",
  "audio_norm3",
)
_BLOCK_TABLES = (
  "scale_shift_table",
  "audio_scale_shift_table",
  "prompt_scale_shift_table",
  "audio_prompt_scale_shift_table",
  "video_a2v_cross_attn_scale_shift_table",
  "audio_a2v_cross_attn_scale_shift_table",
)
_ADALN = (
  "time_embed",
  "audio_time_embed",
  "av_cross_attn_video_scale_shift",
  "av_cross_attn_audio_scale_shift",
  "av_cross_attn_video_a2v_gate",
  "av_cross_attn_audio_v2a_gate",
  "prompt_adaln",
  "audio_prompt_adaln",
)

# Per-block modules: diffusers name → (md path, kind).
_BLOCK_MODULES = (
  {
    f"{attn}.{name}": (f"{attn}/{md}", kind)
    for attn in _ATTENTIONS
    for name, md, kind in (
      ("to_q", "to_q", "linear"),
      ("to_k", "to_k", "linear"),
      ("to_v", "to_v", "linear"),
      ("to_out.0", "to_out", "linear"),
      ("to_gate_logits", "to_gate_logits", "linear"),
      ("norm_q", "norm_q", "norm"),
      ("norm_k", "norm_k", "norm"),
    )
  }
  | {norm: (norm, "norm") for norm in _NORMS}  # only with norm_elementwise_affine
  | {f"{ff}.net.0.proj": (f"{ff}/proj_in", "linear") for ff in ("ff", "audio_ff")}
  | {f"{ff}.net.2": (f"{ff}/proj_out", "linear") for ff in ("ff", "audio_ff")}
)

_TOP_MODULES = (
  {name: (name, "linear") for name in ("proj_in", "audio_proj_in", "proj_out", "audio_proj_out")}
  | {
    f"{p}.linear_{i}": (f"{p}/{md}", "linear")
    for p in ("caption_projection", "audio_caption_projection")
    for i, md in ((1, "proj_in"), (2, "proj_out"))
  }
  | {
    f"{a}.emb.timestep_embedder.linear_{i}": (f"{a}/timestep_embedder/linear_{i}", "linear")
    for a in _ADALN
    for i in (1, 2)
  }
  | {f"{a}.linear": (f"{a}/linear", "linear") for a in _ADALN}
)
_TOP_PARAMS = ("scale_shift_table", "audio_scale_shift_table", "keyframes_abs_pos_embedding")

_BLOCK = re.compile(r"transformer_blocks\.(\d+)\.(.+)\.(weight|bias)")
_BLOCK_PARAM = re.compile(r"transformer_blocks\.(\d+)\.(\w+)")
_MODULE = re.compile(r"(.+)\.(weight|bias)")

# The modulation tables stay float32 whatever the load dtype (the released file stores them so).
LTX2_KEEP_F32 = (r"scale_shift_table$",)

# The original single file (`ltx-2-19b-dev.safetensors` …): diffusers' `convert_ltx2_transformer_to_diffusers`
# renames, in its order, after dropping this prefix.
LTX2_ORIGINAL_PREFIX = "model.diffusion_model."
_ORIGINAL_RENAMES = (
  ("patchify_proj", "proj_in"),
  ("audio_patchify_proj", "audio_proj_in"),
  ("av_ca_video_scale_shift_adaln_single", "av_cross_attn_video_scale_shift"),
  ("av_ca_a2v_gate_adaln_single", "av_cross_attn_video_a2v_gate"),
  ("av_ca_audio_scale_shift_adaln_single", "av_cross_attn_audio_scale_shift"),
  ("av_ca_v2a_gate_adaln_single", "av_cross_attn_audio_v2a_gate"),
  ("scale_shift_table_a2v_ca_video", "video_a2v_cross_attn_scale_shift_table"),
  ("scale_shift_table_a2v_ca_audio", "audio_a2v_cross_attn_scale_shift_table"),
  ("q_norm", "norm_q"),
  ("k_norm", "norm_k"),
)
# The released files also hold the text connectors, both VAEs, the vocoder and the text feature projection.
LTX2_ORIGINAL_ALLOW_UNUSED = (
  r"model\.diffusion_model\.(video|audio)_embeddings_connector\..*",
  r"(vae|audio_vae|vocoder|text_embedding_projection)\..*",
)


def _leaf(kind: str, suffix: str) -> tuple[str, str]:
  if kind == "linear":
    return ("kernel", "linear") if suffix == "weight" else ("bias", "identity")
  return ("scale" if suffix == "weight" else "bias"), "identity"


def _path(text: str) -> tuple[str, ...]:
  return tuple(text.split("/"))


def ltx2_convert_key(name: str) -> md_core.Target | None:
  """Maps one diffusers `LTX2VideoTransformer3DModel` tensor name to md's `LTX2Transformer` parameter.

  Block tensors `transformer_blocks.<i>.…` go to layer `i` of the stacked (scanned) parameter. Returns None
  for names that are not parameters of the model.

  >>> ltx2_convert_key("transformer_blocks.3.audio_to_video_attn.to_q.weight")
  Target(path=('blocks', 'audio_to_video_attn', 'to_q', 'kernel'), layout='linear', split=None, layer=3)
  """
  if name in _TOP_PARAMS:
    return md_core.Target((name,))
  m = _BLOCK_PARAM.fullmatch(name)
  if m and m.group(2) in _BLOCK_TABLES:
    return md_core.Target(("blocks", m.group(2)), layer=int(m.group(1)))
  m = _BLOCK.fullmatch(name)
  if m:
    layer, module, suffix = int(m.group(1)), m.group(2), m.group(3)
    if module not in _BLOCK_MODULES:
      return None
    path, kind = _BLOCK_MODULES[module]
    leaf, layout = _leaf(kind, suffix)
    return md_core.Target(("blocks",) + _path(path) + (leaf,), layout, layer=layer)
  m = _MODULE.fullmatch(name)
  if m and m.group(1) in _TOP_MODULES:
    path, kind = _TOP_MODULES[m.group(1)]
    leaf, layout = _leaf(kind, m.group(2))
    return md_core.Target(_path(path) + (leaf,), layout)
  return None


def ltx2_original_to_diffusers(name: str) -> str | None:
  """An original LTX-2 single-file transformer name → its diffusers name (None: another component).

  >>> ltx2_original_to_diffusers("model.diffusion_model.audio_adaln_single.linear.weight")
  'audio_time_embed.linear.weight'
  """
  if not name.startswith(LTX2_ORIGINAL_PREFIX):
    return None
  name = name[len(LTX2_ORIGINAL_PREFIX) :]
  if name.startswith(("video_embeddings_connector.", "audio_embeddings_connector.")):
    return None
  for old, new in _ORIGINAL_RENAMES:
    name = name.replace(old, new)
  for old, new in (("adaln_single.", "time_embed."), ("audio_adaln_single.", "audio_time_embed.")):
    if name.startswith(old):
      name = new + name[len(old) :]
  return name


def ltx2_convert_original_key(name: str) -> md_core.Target | None:
  """Maps one original single-file tensor name (`model.diffusion_model.…`) to md's parameter."""
  diffusers = ltx2_original_to_diffusers(name)
  return None if diffusers is None else ltx2_convert_key(diffusers)


def ltx2_original_config(checkpoint, **overrides) -> LTX2Config:
  """The `LTX2Config` of an original LTX-2 single file, read from its tensor shapes.

  The files carry no diffusers config. Widths, depth, caption width and the options that add tensors (gates,
  text-state modulation, feed-forward biases, caption projections) follow from the shapes; the head counts
  do not, so they are LTX-2's (32 video heads, 32 audio heads) unless given. Everything else takes
  `LTX2Config`'s defaults with the released model's `rope_type="split"`.
  """
  p = LTX2_ORIGINAL_PREFIX
  name = getattr(checkpoint, "name", "checkpoint")

  def shape(key):
    if key not in checkpoint:
      raise ValueError(
        f"{name}: tensor {key!r} not found; is this an original LTX-2 single file (ltx-2-19b-*)?"
      )
    return tuple(checkpoint.shape(key)) if hasattr(checkpoint, "shape") else checkpoint[key].shape

  dim, in_channels = shape(p + "patchify_proj.weight")
  adim, audio_in = shape(p + "audio_patchify_proj.weight")
  layers = {
    int(m.group(1))
    for k in checkpoint
    if (m := re.match(re.escape(p) + r"transformer_blocks\.(\d+)\.", k))
  }
  heads = overrides.pop("num_attention_heads", 32)
  aheads = overrides.pop("audio_num_attention_heads", 32)
  for what, width, h in (("video", dim, heads), ("audio", adim, aheads)):
    if width % h:
      raise ValueError(f"{name}: {what} width {width} is not divisible by {h} heads")
  block = p + "transformer_blocks.0."
  has_captions = p + "caption_projection.linear_1.weight" in checkpoint
  kwargs = dict(
    in_channels=in_channels,
    out_channels=shape(p + "proj_out.weight")[0],
    num_attention_heads=heads,
    attention_head_dim=dim // heads,
    cross_attention_dim=shape(block + "attn2.to_k.weight")[1],
    audio_in_channels=audio_in,
    audio_out_channels=shape(p + "audio_proj_out.weight")[0],
    audio_num_attention_heads=aheads,
    audio_attention_head_dim=adim // aheads,
    audio_cross_attention_dim=shape(block + "audio_attn2.to_k.weight")[1],
    num_layers=len(layers),
    rope_type="split",
    norm_elementwise_affine=block + "norm1.weight" in checkpoint,
    use_prompt_embeddings=has_captions,
    gated_attn=block + "attn1.to_gate_logits.weight" in checkpoint,
    audio_gated_attn=block + "audio_attn1.to_gate_logits.weight" in checkpoint,
    cross_attn_mod=shape(block + "scale_shift_table")[0] == 9,
    audio_cross_attn_mod=shape(block + "audio_scale_shift_table")[0] == 9,
    ff_bias=block + "ff.net.0.proj.bias" in checkpoint,
    audio_ff_bias=block + "audio_ff.net.0.proj.bias" in checkpoint,
  )
  if has_captions:
    kwargs["caption_channels"] = shape(p + "caption_projection.linear_1.weight")[1]
  kwargs.update(overrides)
  return LTX2Config(**kwargs)


def load_ltx2_transformer(
  source: str | os.PathLike,
  *,
  subfolder: str | None = "transformer",
  mesh: jax.sharding.Mesh | None = None,
  dtype: Any = None,
  rules: Any = None,
  progress: bool = False,
  **overrides,
) -> LTX2Transformer:
  """Loads an LTX-2 transformer onto `mesh` from diffusers weights or an original single file.

  Args:
    source: a diffusers pipeline folder or hub id (`"Lightricks/LTX-2"`), a transformer folder with
      `subfolder=None`, or an original single `.safetensors` file (`ltx-2-19b-dev.safetensors`; its config
      is read from the tensor shapes, see `ltx2_original_config`).
    subfolder: the component folder (ignored for a single file).
    mesh: place parameters on this mesh (md-sharding rules over their logical axes).
    dtype: floating dtype of the parameters (default float32: a bfloat16 file is upcast); the
      modulation tables stay float32.
    rules: md-sharding logical axis rules.
    progress: show a progress bar over tensors.
    **overrides: `LTX2Config` run-time settings, e.g. `attention="ring"`, `remat="full"`.

  Returns:
    The `LTX2Transformer` with the checkpoint's weights.

  Raises:
    md_core.WeightLoadError: unknown, missing or mis-shaped tensors (all listed, with file and shapes).
    ValueError: a config for another model or with keys md does not implement.
  """
  path = pathlib.Path(os.fspath(source)).expanduser()
  if path.is_file():
    checkpoint = md_core.open_checkpoint(path)
    cfg = ltx2_original_config(checkpoint, **overrides)
    convert, allow_unused = ltx2_convert_original_key, LTX2_ORIGINAL_ALLOW_UNUSED
  else:
    folder = md_core.resolve_source(source, subfolder=subfolder)
    cfg = LTX2Config.from_json(folder / "config.json", **overrides)
    checkpoint = md_core.open_checkpoint(folder)
    convert, allow_unused = ltx2_convert_key, ()
  return md_core.load_weights(
    lambda: LTX2Transformer(cfg, rngs=nnx.Rngs(0)),
    checkpoint,
    convert,
    dtype=dtype,
    keep_f32=LTX2_KEEP_F32,
    mesh=mesh,
    rules=rules,
    allow_unused=allow_unused,
    progress=progress,
  )
