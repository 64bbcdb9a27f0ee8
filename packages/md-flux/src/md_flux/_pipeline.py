"""The Flux.1 text-to-image pipeline (dev, schnell) and `load_pipeline`.

Three jitted programs per shape: text encoding (CLIP pooled + T5), the denoising loop (one `fori_loop`
over flow-match Euler steps, with true classifier-free guidance batched inside) and VAE decoding. The
models are split once into a graph definition (static) and their state (a jit argument), so a second
call with the same shapes and settings reuses the compiled programs.

Behaviour follows diffusers' `FluxPipeline`: CLIP's pooled output and T5's last hidden state (no
attention mask), 2x2 latent packing, image ids `(0, row, col)` and zero text ids, sigmas
`linspace(1, 1/n, n)` with the dynamic shift `mu` from the image token count, the guidance embedding
for guidance-distilled models (dev), true CFG when `true_cfg_scale > 1` and a negative prompt is given,
and the VAE's `latents / scaling_factor + shift_factor` before decoding.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import pathlib
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import md_core
import md_schedulers as mdsch
import md_text
import md_vae
from md_core import progress as md_progress
from md_flux._flux1 import FluxTransformer
from md_flux._weights1 import load_flux


@dataclasses.dataclass
class _Split:
  """A module split once: the static graph definition and the state passed to jitted functions."""

  graphdef: Any
  state: Any

  @classmethod
  def of(cls, module: nnx.Module | None) -> _Split | None:
    if module is None:
      return None
    graphdef, state = nnx.split(module)
    return cls(graphdef, state)

  def merge(self, state: Any) -> nnx.Module:
    return nnx.merge(self.graphdef, state)


# --- packing and ids (shared by the Flux.1 and Flux.2 pipelines) ------------------------------------------


def check_size(height: int, width: int, factor: int = 16) -> None:
  """Raises a ValueError naming the nearest valid sizes when height or width is not a positive
  multiple of `factor` (the VAE's factor times the 2x2 packing: 16 for Flux)."""
  bad = [(n, v) for n, v in (("height", height), ("width", width)) if v <= 0 or v % factor]
  if bad:

    def near(v):
      low = max(factor, v // factor * factor)
      return f"{low} or {low + factor}" if low < v else str(low)

    hints = ", ".join(f"{n}={v} → {near(v)}" for n, v in bad)
    raise ValueError(
      f"height and width must be positive multiples of {factor} (the VAE's factor × 2x2 packing); got "
      f"height={height}, width={width}; nearest valid: {hints}"
    )


def pack_latents(latents: jax.Array) -> jax.Array:
  """`[B, h, w, C]` channels-last latents → the reference's packed `[B, h/2 * w/2, C * 4]`
  (features ordered channel, then row and column within the 2x2 patch)."""
  b, h, w, c = latents.shape
  x = latents.reshape(b, h // 2, 2, w // 2, 2, c).transpose(0, 1, 3, 5, 2, 4)
  return x.reshape(b, (h // 2) * (w // 2), c * 4)


def unpack_latents(packed: jax.Array, h: int, w: int) -> jax.Array:
  """The inverse of `pack_latents`: `[B, h/2 * w/2, C * 4]` → `[B, h, w, C]`."""
  b, _, f = packed.shape
  c = f // 4
  x = packed.reshape(b, h // 2, w // 2, c, 2, 2).transpose(0, 1, 4, 2, 5, 3)
  return x.reshape(b, h, w, c)


def image_ids(rows: int, cols: int, *, time: float = 0.0, axes: int = 3) -> np.ndarray:
  """Position ids `[rows * cols, axes]` of packed image tokens: `(time, row, col)` for Flux.1 (3
  axes) and `(time, row, col, 0)` for Flux.2 (4 axes)."""
  ids = np.zeros((rows, cols, axes), np.float32)
  ids[..., 0] = time
  ids[..., 1] = np.arange(rows, dtype=np.float32)[:, None]
  ids[..., 2] = np.arange(cols, dtype=np.float32)[None, :]
  return ids.reshape(rows * cols, axes)


def _as_list(prompt: str | Sequence[str] | None) -> list[str] | None:
  if prompt is None:
    return None
  return [prompt] if isinstance(prompt, str) else list(prompt)


def _place(mesh, x: jax.Array) -> jax.Array:
  """Splits the batch over the mesh's data and fsdp axes where it divides; replicated otherwise."""
  if mesh is None:
    return x
  axes = tuple(a for a in ("data", "fsdp") if mesh.shape.get(a, 1) > 1)
  size = math.prod(mesh.shape[a] for a in axes) if axes else 1
  spec = [None] * x.ndim
  if axes and x.shape[0] % size == 0:
    spec[0] = axes
  return jax.device_put(x, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*spec)))


def _using(mesh):
  return contextlib.nullcontext() if mesh is None else jax.sharding.set_mesh(mesh)


def _decode_fn(vae: _Split, cfg: md_vae.AutoencoderKLConfig, h: int, w: int):
  shift = float(cfg.shift_factor or 0.0)

  def decode(state, packed):  # [B, S, 4C] → [B, H, W, 3] in [0, 1]
    z = unpack_latents(packed.astype(jnp.float32), h, w) / cfg.scaling_factor + shift
    images = vae.merge(state).decode(z)
    return jnp.clip(images / 2 + 0.5, 0.0, 1.0)

  return jax.jit(decode)


class FluxPipeline:
  """A loaded Flux.1 text-to-image pipeline (see `load_pipeline`); call it to generate images.

  Attributes:
    transformer, vae, text_encoder (CLIP), text_encoder_2 (T5): the md modules.
    tokenizer, tokenizer_2: transformers tokenizers (CLIP, T5).
    scheduler_config: the checkpoint's `scheduler_config.json` dict.
  """

  def __init__(
    self,
    *,
    transformer: FluxTransformer,
    vae: md_vae.AutoencoderKL,
    text_encoder: md_text.CLIPTextModel,
    tokenizer: Any,
    text_encoder_2: md_text.T5Encoder,
    tokenizer_2: Any,
    scheduler_config: Mapping[str, Any],
    mesh: jax.sharding.Mesh | None = None,
    source: str = "",
  ):
    self.transformer, self.vae = transformer, vae
    self.text_encoder, self.text_encoder_2 = text_encoder, text_encoder_2
    self.tokenizer, self.tokenizer_2 = tokenizer, tokenizer_2
    self.scheduler_config = dict(scheduler_config)
    self.mesh, self.source = mesh, source
    self._tr, self._vae = _Split.of(transformer), _Split.of(vae)
    self._te, self._te2 = _Split.of(text_encoder), _Split.of(text_encoder_2)
    self._compiled: dict[Any, Any] = {}

  # --- facts ------------------------------------------------------------------------------------------
  @property
  def vae_scale_factor(self) -> int:
    return self.vae.config.downscale

  @property
  def default_size(self) -> int:
    """The reference's default pixel size (128 latent rows × the VAE factor: 1024)."""
    return 128 * self.vae_scale_factor

  @property
  def guidance_distilled(self) -> bool:
    """Whether the transformer embeds the guidance scale (dev) or not (schnell)."""
    return bool(self.transformer.cfg.guidance_embeds)

  def _jit(self, key, make):
    fn = self._compiled.get(key)
    if fn is None:
      fn = self._compiled[key] = make()
    return fn

  # --- text ---------------------------------------------------------------------------------------------
  def encode_prompt(
    self, prompts: str | Sequence[str], max_sequence_length: int = 512
  ) -> tuple[jax.Array, jax.Array]:
    """T5 embeddings `[B, max_sequence_length, D]` and CLIP pooled embeddings `[B, P]` for one prompt
    (B = 1) or a list."""
    prompts = _as_list(prompts)
    ids = md_text.tokenize(self.tokenizer, prompts).ids
    ids2 = md_text.tokenize(self.tokenizer_2, prompts, max_length=max_sequence_length).ids

    def make():
      te, te2 = self._te, self._te2

      def encode(te_state, te2_state, ids, ids2):
        pooled = te.merge(te_state)(ids, output_hidden_states=False).pooler_output
        # The reference runs T5 without an attention mask: padding tokens are attended to.
        return te2.merge(te2_state)(ids2).astype(jnp.float32), pooled.astype(jnp.float32)

      return jax.jit(encode)

    fn = self._jit("encode", make)
    return fn(self._te.state, self._te2.state, jnp.asarray(ids), jnp.asarray(ids2))

  def _embeddings(self, prompt, prompt_embeds, pooled, max_sequence_length, what="prompt"):
    prompts = _as_list(prompt)
    if prompt_embeds is None:
      if not prompts:
        raise ValueError(f"pass {what} (a string or a list) or {what}_embeds")
      return self.encode_prompt(prompts, max_sequence_length)
    if prompts:
      raise ValueError(f"pass either {what} or {what}_embeds, not both")
    if pooled is None:
      raise ValueError(
        f"{what}_embeds [B, S, {self.transformer.cfg.joint_attention_dim}] also need "
        f"pooled_{what}_embeds [B, {self.transformer.cfg.pooled_projection_dim}]"
      )
    return jnp.asarray(prompt_embeds, jnp.float32), jnp.asarray(pooled, jnp.float32)

  # --- the loop -----------------------------------------------------------------------------------------
  def _loop_fn(self, sched: mdsch.Scheduler, *, steps: int, true_cfg: bool, show: bool):
    tr = self._tr
    guided = self.guidance_distilled

    def loop(state, x, sched_state, ctx, pooled, img_ids, txt_ids, guidance, cfg_scale):
      model = tr.merge(state)
      tick = md_progress.make_step_callback(steps, desc="denoising") if show else None
      b = x.shape[0]

      def body(i, carry):
        x, st = carry
        t = mdsch.current_timestep(st) / 1000
        xin = jnp.concatenate([x, x], axis=0) if true_cfg else x
        g = jnp.full((xin.shape[0],), guidance, jnp.float32) if guided else None
        v = model(xin, ctx, pooled, jnp.full((xin.shape[0],), t), img_ids, txt_ids, g)
        v = v.astype(jnp.float32)
        if true_cfg:
          pos, neg = v[:b], v[b:]
          v = neg + cfg_scale * (pos - neg)
        x, st = sched.step(st, v, x)
        if tick is not None:
          tick(i)
        return x, st

      return jax.lax.fori_loop(0, steps, body, (x, sched_state))[0]

    return jax.jit(loop)

  def __call__(
    self,
    prompt: str | Sequence[str] | None = None,
    negative_prompt: str | Sequence[str] | None = None,
    *,
    height: int | None = None,
    width: int | None = None,
    num_inference_steps: int = 28,
    guidance_scale: float = 3.5,
    true_cfg_scale: float = 1.0,
    num_images_per_prompt: int = 1,
    seed: int = 0,
    latents: Any = None,
    prompt_embeds: Any = None,
    pooled_prompt_embeds: Any = None,
    negative_prompt_embeds: Any = None,
    negative_pooled_prompt_embeds: Any = None,
    max_sequence_length: int = 512,
    sigmas: Sequence[float] | None = None,
    progress: bool = True,
  ) -> jax.Array:
    """Generates images from text.

    Args:
      prompt: one prompt or a list (or pass `prompt_embeds` + `pooled_prompt_embeds`).
      negative_prompt: used only with `true_cfg_scale > 1` (true classifier-free guidance).
      height, width: pixels, multiples of 16 (default 1024).
      num_inference_steps: denoising steps (dev: 28-50; schnell: 4).
      guidance_scale: the embedded guidance of guidance-distilled models (dev); ignored by schnell.
      true_cfg_scale: > 1 with a negative prompt runs the model twice per step and mixes.
      num_images_per_prompt: images per prompt.
      seed: the noise seed (same seed and inputs → same images).
      latents: the initial noise in the reference's packed layout `[B, (H/16)(W/16), 4C]`.
      prompt_embeds, pooled_prompt_embeds: T5 `[B, S, D]` and CLIP pooled `[B, P]` embeddings.
      negative_prompt_embeds, negative_pooled_prompt_embeds: the same for the negative prompt.
      max_sequence_length: T5 tokens (at most 512; schnell was trained with 256).
      sigmas: custom sigmas (default `linspace(1, 1/n, n)`), shifted as the scheduler says.
      progress: show a progress bar over the steps.

    Returns:
      Images `[B * num_images_per_prompt, height, width, 3]` in [0, 1], float32.

    Raises:
      ValueError: sizes that do not pack, missing or conflicting prompt inputs, latents of the wrong
        shape.
    """
    height = height or self.default_size
    width = width or self.default_size
    check_size(height, width, 2 * self.vae_scale_factor)
    if not 1 <= max_sequence_length <= 512:
      raise ValueError(f"max_sequence_length must be in [1, 512], got {max_sequence_length}")
    n = int(num_inference_steps)
    if n < 1:
      raise ValueError(f"num_inference_steps must be at least 1, got {n}")
    embeds, pooled = self._embeddings(
      prompt, prompt_embeds, pooled_prompt_embeds, max_sequence_length
    )
    has_neg = negative_prompt is not None or (
      negative_prompt_embeds is not None and negative_pooled_prompt_embeds is not None
    )
    true_cfg = true_cfg_scale > 1 and has_neg
    reps = int(num_images_per_prompt)
    ctx, pooled = jnp.repeat(embeds, reps, axis=0), jnp.repeat(pooled, reps, axis=0)
    if true_cfg:
      negs = _as_list(negative_prompt)
      if negs is not None and len(negs) == 1 and embeds.shape[0] > 1:
        negs = negs * embeds.shape[0]
      neg, neg_pooled = self._embeddings(
        negs,
        negative_prompt_embeds,
        negative_pooled_prompt_embeds,
        max_sequence_length,
        "negative_prompt",
      )
      if neg.shape != embeds.shape:
        raise ValueError(
          f"negative prompt embeddings have shape {neg.shape}, the prompt's {embeds.shape}; give one "
          "negative prompt or one per prompt, with the same max_sequence_length"
        )
      ctx = jnp.concatenate([ctx, jnp.repeat(neg, reps, axis=0)], axis=0)
      pooled = jnp.concatenate([pooled, jnp.repeat(neg_pooled, reps, axis=0)], axis=0)

    batch = embeds.shape[0] * reps
    f = self.vae_scale_factor
    h, w = height // f, width // f
    c = self.transformer.cfg.in_channels
    shape = (batch, (h // 2) * (w // 2), c)
    if latents is None:
      channels = c // 4
      noise = jax.random.normal(jax.random.key(int(seed)), (batch, h, w, channels), jnp.float32)
      x = pack_latents(noise)
    else:
      x = jnp.asarray(latents, jnp.float32)
      if x.shape != shape:
        raise ValueError(
          f"latents have shape {x.shape}; expected the packed {shape} ([B, (H/16)(W/16), "
          f"{c}]) for batch {batch}, height={height}, width={width}"
        )
    sched = mdsch.from_config(self.scheduler_config)
    mu = mdsch.calculate_shift(
      shape[1],
      self.scheduler_config.get("base_image_seq_len", 256),
      self.scheduler_config.get("max_image_seq_len", 4096),
      self.scheduler_config.get("base_shift", 0.5),
      self.scheduler_config.get("max_shift", 1.15),
    )
    if sigmas is None:
      sigmas = np.linspace(1.0, 1.0 / n, n)
    if self.scheduler_config.get("use_flow_sigmas"):
      sigmas = None  # as the reference: the scheduler's own flow sigmas win
    st = sched.init(n, sigmas=sigmas, mu=mu)
    steps = len(st.timesteps)

    s_txt = ctx.shape[1]
    img = jnp.asarray(image_ids(h // 2, w // 2))
    txt = jnp.zeros((s_txt, 3), jnp.float32)
    show = bool(progress) and md_progress.progress_enabled()
    loop = self._jit(
      ("loop", repr(sorted(sched.config.items())), steps, true_cfg, show),
      lambda: self._loop_fn(sched, steps=steps, true_cfg=true_cfg, show=show),
    )
    place = lambda a: _place(self.mesh, a)  # noqa: E731
    # Under the mesh, context-parallel attention (ring / Ulysses) finds its `context` axis.
    with _using(self.mesh):
      x = loop(
        self._tr.state,
        place(x),
        st,
        place(ctx),
        place(pooled),
        img,
        txt,
        jnp.float32(guidance_scale),
        jnp.float32(true_cfg_scale),
      )
    return self.decode(x, height, width)

  def decode(self, packed: jax.Array, height: int, width: int) -> jax.Array:
    """Packed latents `[B, S, 4C]` → images `[B, height, width, 3]` in [0, 1]."""
    f = self.vae_scale_factor
    h, w = height // f, width // f
    fn = self._jit(("decode", h, w), lambda: _decode_fn(self._vae, self.vae.config, h, w))
    return fn(self._vae.state, packed)


# --- loading -------------------------------------------------------------------------------------------------

_FLUX1_CLASSES = ("FluxPipeline",)
_FLUX2_CLASSES = ("Flux2KleinPipeline", "Flux2KleinKVPipeline")


def _component(root: pathlib.Path, name: str, index: Mapping[str, Any]) -> pathlib.Path:
  folder = root / name
  if not folder.is_dir():
    have = sorted(
      k for k, v in index.items() if not k.startswith("_") and isinstance(v, list) and v[0]
    )
    raise FileNotFoundError(
      f"{root}: pipeline component {name!r} is missing (no folder {folder}); model_index.json lists "
      f"{have}. Download the whole pipeline, or pass a complete diffusers folder"
    )
  return folder


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
) -> Any:
  """Loads a Flux diffusers pipeline as md modules.

  Args:
    source: a local diffusers pipeline folder (with `model_index.json`) or a hub id
      (`"black-forest-labs/FLUX.1-dev"`, `"black-forest-labs/FLUX.2-klein-4B"`), resolved through
      md-core (the hub cache; downloads when online).
    mesh: place every parameter on this mesh by its logical axes (and split the batch over data ×
      fsdp).
    dtype: parameter dtype of the transformer (default float32; bfloat16 on accelerators).
    text_dtype: parameter dtype of the T5 encoder (default float32) or of Klein's Qwen3 encoder (default:
      as stored); CLIP and the VAEs stay float32.
    rules: md-sharding logical axis rules (default: `md_sharding.DEFAULT_RULES`).
    attention: an `md_attention.AttentionConfig` for the transformer (e.g. context parallelism
      `AttentionConfig(implementation="ulysses")` over the mesh's `context` axis).
    revision: hub revision.
    progress: progress bars while loading tensors.

  Returns:
    A `FluxPipeline` (Flux.1; call it to generate images) or a `Flux2KleinPipeline` (Flux.2 Klein,
    `Flux2KleinPipeline` / `Flux2KleinKVPipeline` folders: text-to-image and editing with up to 4
    reference images).

  Raises:
    FileNotFoundError: no such folder or hub id, or a component folder is missing (named).
    md_core.WeightLoadError: weights that do not fit their config.
    ValueError: a pipeline class md does not implement.
  """
  root = md_core.resolve_source(source, revision=revision)
  index_file = root / "model_index.json"
  if not index_file.is_file():
    raise FileNotFoundError(
      f"{root}: no model_index.json; pass a diffusers Flux pipeline folder (transformer/, vae/, "
      "text_encoder/, tokenizer/, text_encoder_2/, tokenizer_2/, scheduler/) or its hub id"
    )
  index = md_core.read_json(index_file)
  cls = index.get("_class_name", "")
  if cls in _FLUX2_CLASSES:
    from md_flux._pipeline2 import load_klein

    return load_klein(
      root,
      index,
      mesh=mesh,
      dtype=dtype,
      text_dtype=text_dtype,
      rules=rules,
      attention=attention,
      progress=progress,
      source=str(source),
    )
  if cls not in _FLUX1_CLASSES:
    raise ValueError(
      f"{index_file}: pipeline class {cls!r} is not a Flux pipeline md loads; known: "
      f"{list(_FLUX1_CLASSES + _FLUX2_CLASSES)}"
    )
  names = ["transformer", "vae", "text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2"]
  folders = {name: _component(root, name, index) for name in [*names, "scheduler"]}
  kw = dict(mesh=mesh, rules=rules, progress=progress)
  transformer = load_flux(folders["transformer"], dtype=dtype, attention=attention, **kw)
  vae = md_vae.load_vae_kl(folders["vae"], subfolder=None, **kw)
  te = md_text.load_clip_text(folders["text_encoder"], subfolder=None, with_projection=False, **kw)
  te2 = md_text.load_t5_encoder(folders["text_encoder_2"], dtype=text_dtype, **kw)
  tok = md_text.load_tokenizer(folders["tokenizer"], subfolder=None)
  tok2 = md_text.load_tokenizer(folders["tokenizer_2"], subfolder=None)
  sched_cfg = mdsch.read_config(folders["scheduler"])
  mdsch.from_config(sched_cfg)  # fail now, not at the first call, on a scheduler md lacks
  return FluxPipeline(
    transformer=transformer,
    vae=vae,
    text_encoder=te,
    tokenizer=tok,
    text_encoder_2=te2,
    tokenizer_2=tok2,
    scheduler_config=sched_cfg,
    mesh=mesh,
    source=str(source),
  )
