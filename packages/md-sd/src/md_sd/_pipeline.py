"""Stable Diffusion pipelines (SD 1.x / 2.x / XL): text-to-image, image-to-image and ControlNet.

Three jitted programs per shape: text encoding, the denoising loop (one `fori_loop` over scheduler calls with
classifier-free guidance and the ControlNet inside) and VAE decoding. The models are split once into a
graph definition (static) and their state (a jit argument), so calling a pipeline again with the same
shapes and settings reuses the compiled programs.

Behaviour follows diffusers' `StableDiffusionPipeline`, `StableDiffusionImg2ImgPipeline`,
`StableDiffusionXLPipeline` and their ControlNet variants: the batch order of classifier-free guidance
(`[negative, positive]`), `guidance_rescale`, SDXL's pooled embeddings and `time_ids`, the scheduler's
initial noise scale, img2img's strength → first step, and the VAE's scaling.
"""

from __future__ import annotations

import dataclasses
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
from md_sd._config import UNetConfig
from md_sd._controlnet import ControlNetModel
from md_sd._unet import UNet2DConditionModel
from md_sd._weights import load_controlnet, load_unet, unet_key_map

# Schedulers whose noisy sample is `x0 + sigma * noise` (k-diffusion style); the others use
# `sqrt(alphā) x0 + sqrt(1 - alphā) noise`. Decides how image-to-image noises the image's latents.
_SIGMA_SCHEDULERS = frozenset(
  {
    "EulerDiscreteScheduler",
    "EulerAncestralDiscreteScheduler",
    "LMSDiscreteScheduler",
    "HeunDiscreteScheduler",
  }
)
_KINDS = {
  "StableDiffusionPipeline": "sd",
  "StableDiffusionImg2ImgPipeline": "sd",
  "StableDiffusionControlNetPipeline": "sd",
  "StableDiffusionXLPipeline": "sdxl",
  "StableDiffusionXLImg2ImgPipeline": "sdxl",
  "StableDiffusionXLControlNetPipeline": "sdxl",
}


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


def nearest_multiples(value: int, factor: int) -> tuple[int, int]:
  """The multiples of `factor` just below and above `value` (the lower one at least `factor`)."""
  low = max(factor, value // factor * factor)
  return low, low + factor if low < value else low


def check_size(height: int, width: int, factor: int = 8) -> None:
  """Raises a ValueError naming the nearest valid sizes when height or width is not a multiple of `factor`."""
  bad = [(name, v) for name, v in (("height", height), ("width", width)) if v % factor or v <= 0]
  if bad:
    hints = ", ".join(
      f"{name}={v} → {' or '.join(map(str, nearest_multiples(v, factor)))}" for name, v in bad
    )
    raise ValueError(
      f"height and width must be positive multiples of {factor} (the VAE's factor); got height={height}, "
      f"width={width}; nearest valid: {hints}"
    )


def rescale_noise_cfg(
  noise_cfg: jax.Array, noise_pred_text: jax.Array, guidance_rescale: jax.Array
):
  """Guidance rescale (Lin et al. 2023, §3.4): match the guided prediction's per-example std to the
  text-conditioned one's, then mix by `guidance_rescale`. Unbiased std, as the reference's `torch.std`."""
  axes = tuple(range(1, noise_cfg.ndim))
  std_text = jnp.std(noise_pred_text, axis=axes, keepdims=True, ddof=1)
  std_cfg = jnp.std(noise_cfg, axis=axes, keepdims=True, ddof=1)
  rescaled = noise_cfg * (std_text / std_cfg)
  return guidance_rescale * rescaled + (1 - guidance_rescale) * noise_cfg


def _as_list(prompt: str | Sequence[str] | None) -> list[str] | None:
  if prompt is None:
    return None
  return [prompt] if isinstance(prompt, str) else list(prompt)


def _nchw_to_nhwc(x) -> jax.Array:
  x = jnp.asarray(x)
  if x.ndim != 4:
    raise ValueError(f"expected latents [B, C, H, W] (the reference's layout), got shape {x.shape}")
  return jnp.transpose(x, (0, 2, 3, 1))


class StableDiffusionPipeline:
  """A loaded SD 1.x / 2.x / XL pipeline (see `load_pipeline`); call it to generate images.

  Attributes:
    kind: `"sd"` (SD 1.x / 2.x) or `"sdxl"`.
    unet, vae, text_encoder, text_encoder_2, controlnet: the md modules (None where absent).
    tokenizer, tokenizer_2: transformers tokenizers.
    scheduler_config: the checkpoint's `scheduler_config.json` dict.
    force_zeros_for_empty_prompt: SDXL: zero negative embeddings when no negative prompt is given.
  """

  def __init__(
    self,
    *,
    kind: str,
    unet: UNet2DConditionModel,
    vae: md_vae.AutoencoderKL,
    text_encoder: md_text.CLIPTextModel,
    tokenizer: Any,
    scheduler_config: Mapping[str, Any],
    text_encoder_2: md_text.CLIPTextModelWithProjection | None = None,
    tokenizer_2: Any = None,
    controlnet: ControlNetModel | None = None,
    force_zeros_for_empty_prompt: bool = True,
    mesh: jax.sharding.Mesh | None = None,
    source: str = "",
  ):
    if kind not in ("sd", "sdxl"):
      raise ValueError(f"kind must be 'sd' or 'sdxl', got {kind!r}")
    if kind == "sdxl" and (text_encoder_2 is None or tokenizer_2 is None):
      raise ValueError("an SDXL pipeline needs text_encoder_2 and tokenizer_2")
    self.kind, self.source, self.mesh = kind, source, mesh
    self.unet, self.vae, self.controlnet = unet, vae, controlnet
    self.text_encoder, self.text_encoder_2 = text_encoder, text_encoder_2
    self.tokenizer, self.tokenizer_2 = tokenizer, tokenizer_2
    self.scheduler_config = dict(scheduler_config)
    self.force_zeros_for_empty_prompt = force_zeros_for_empty_prompt
    self._unet, self._vae = _Split.of(unet), _Split.of(vae)
    self._te, self._te2 = _Split.of(text_encoder), _Split.of(text_encoder_2)
    self._cn = _Split.of(controlnet)
    self._compiled: dict[Any, Any] = {}

  # --- facts --------------------------------------------------------------------------------------------
  @property
  def vae_scale_factor(self) -> int:
    return self.vae.config.downscale

  @property
  def default_size(self) -> int:
    """The pixel size the UNet was trained at (`sample_size` × the VAE factor)."""
    return int(self.unet.cfg.sample_size) * self.vae_scale_factor

  def make_scheduler(self, scheduler: str | mdsch.Scheduler | None = None, **options: Any):
    """The checkpoint's scheduler, or another one by diffusers class name with `options` overridden."""
    if isinstance(scheduler, mdsch.Scheduler):
      if options:
        raise ValueError(
          "scheduler options apply to a scheduler given by name, not a built Scheduler"
        )
      return scheduler
    return mdsch.from_config(self.scheduler_config, name=scheduler, **options)

  def replace_unet(self, unet: UNet2DConditionModel) -> None:
    """Swaps the UNet (e.g. a distilled one with the same config); compiled programs are rebuilt."""
    self.unet, self._unet = unet, _Split.of(unet)
    self._compiled.clear()

  # --- jitted pieces -----------------------------------------------------------------------------------
  def _jit(self, key, make):
    fn = self._compiled.get(key)
    if fn is None:
      fn = self._compiled[key] = make()
    return fn

  def _encode_fn(self):
    te, te2, kind = self._te, self._te2, self.kind

    def encode(te_state, te2_state, ids, ids2):
      if kind == "sd":
        return te.merge(te_state)(ids, output_hidden_states=False).last_hidden_state, None
      o1 = te.merge(te_state)(ids, output_hidden_states=True)
      o2 = te2.merge(te2_state)(ids2, output_hidden_states=True)
      embeds = jnp.concatenate([o1.hidden_states[-2], o2.hidden_states[-2]], axis=-1)
      return embeds, o2.text_embeds

    return jax.jit(encode)

  def encode_prompt(self, prompts: Sequence[str]) -> tuple[jax.Array, jax.Array | None]:
    """Text embeddings `[B, S, D]` (and SDXL's pooled `[B, P]`) for a list of prompts."""
    ids = md_text.tokenize(self.tokenizer, list(prompts)).ids
    ids2 = md_text.tokenize(self.tokenizer_2, list(prompts)).ids if self.kind == "sdxl" else None
    fn = self._jit("encode", self._encode_fn)
    te2_state = None if self._te2 is None else self._te2.state
    return fn(
      self._te.state, te2_state, jnp.asarray(ids), None if ids2 is None else jnp.asarray(ids2)
    )

  def _decode_fn(self):
    vae = self._vae
    cfg = self.vae.config
    mean = None if cfg.latents_mean is None else np.asarray(cfg.latents_mean, np.float32)
    std = None if cfg.latents_std is None else np.asarray(cfg.latents_std, np.float32)

    def decode(state, latents):  # [B, h, w, C] → [B, H, W, 3] in [0, 1]
      model = vae.merge(state)
      if mean is not None and std is not None:
        # SDXL-style VAEs that publish latent statistics (the reference's has_latents_mean branch).
        z = latents * std / cfg.scaling_factor + mean
      else:
        z = latents / cfg.scaling_factor
      images = model.decode(z.astype(jnp.float32))
      return jnp.clip(images / 2 + 0.5, 0.0, 1.0)

    return jax.jit(decode)

  def decode(self, latents: jax.Array) -> jax.Array:
    """The denoiser's latents `[B, h, w, C]` (channels-last) → images `[B, H, W, 3]` in [0, 1]."""
    return self._jit("decode", self._decode_fn)(self._vae.state, latents)

  def _image_latents_fn(self):
    vae = self._vae
    cfg = self.vae.config

    def encode(state, images, eps):  # images [B, H, W, 3] in [0, 1]; eps [B, h, w, C]
      posterior = vae.merge(state).encode(images.astype(jnp.float32) * 2 - 1)
      z = posterior.mean + posterior.std * eps
      return vae.merge(state).scale_latents(z) if cfg.shift_factor else z * cfg.scaling_factor

    return jax.jit(encode)

  def _loop_fn(self, sched, *, start, cfg_on, rescale_on, control, guess_mode, total, show):
    unet, cn = self._unet, self._cn
    kind = self.kind

    def loop(
      unet_state,
      cn_state,
      latents,
      sched_state,
      context,
      added,
      cond,
      guidance,
      rescale,
      cscale,
      key,
    ):
      model = unet.merge(unet_state)
      net = None if cn is None or cond is None else cn.merge(cn_state)
      tick = md_progress.make_step_callback(total - start, desc="denoising") if show else None

      def body(i, carry):
        x, st = carry
        t = mdsch.current_timestep(st)
        xin = sched.scale_model_input(st, x)
        if cfg_on:
          xin = jnp.concatenate([xin, xin], axis=0)
        added_kw = None if kind == "sd" else added
        residuals = {}
        if net is not None:
          c_in, c_ctx, c_added = xin, context, added_kw
          if cfg_on and guess_mode:
            # Guess mode: the ControlNet sees only the conditional half.
            half = x.shape[0]
            c_in, c_ctx = xin[half:], context[half:]
            c_added = None if added_kw is None else {k: v[half:] for k, v in added_kw.items()}
          down, mid = net(
            c_in,
            t,
            c_ctx,
            cond,
            conditioning_scale=cscale,
            guess_mode=guess_mode,
            added_cond_kwargs=c_added,
          )
          if cfg_on and guess_mode:
            down = [jnp.concatenate([jnp.zeros_like(d), d]) for d in down]
            mid = jnp.concatenate([jnp.zeros_like(mid), mid])
          residuals = dict(down_block_additional_residuals=down, mid_block_additional_residual=mid)
        out = model(xin, t, context, added_cond_kwargs=added_kw, **residuals)
        if cfg_on:
          uncond, text = jnp.split(out, 2, axis=0)
          out = uncond + guidance * (text - uncond)
          if rescale_on:
            out = rescale_noise_cfg(out, text, rescale)
        step_key = None if not sched.stochastic else jax.random.fold_in(key, i)
        x, st = sched.step(st, out.astype(x.dtype), x, step_key)
        if tick is not None:
          tick(i - start)
        return x, st

      x, _ = jax.lax.fori_loop(start, total, body, (latents, sched_state))
      return x

    return jax.jit(loop)

  # --- the call --------------------------------------------------------------------------------------------
  def _embeddings(
    self,
    prompt,
    negative_prompt,
    prompt_embeds,
    negative_prompt_embeds,
    pooled_prompt_embeds,
    negative_pooled_prompt_embeds,
    cfg_on: bool,
  ):
    """(positive, negative) embeddings and pooled embeddings for the batch of prompts."""
    prompts = _as_list(prompt)
    if prompt_embeds is None:
      if not prompts:
        raise ValueError("pass prompt (a string or a list) or prompt_embeds")
      embeds, pooled = self.encode_prompt(prompts)
    else:
      if prompts:
        raise ValueError("pass either prompt or prompt_embeds, not both")
      embeds = jnp.asarray(prompt_embeds, jnp.float32)
      pooled = (
        None if pooled_prompt_embeds is None else jnp.asarray(pooled_prompt_embeds, jnp.float32)
      )
      if self.kind == "sdxl" and pooled is None:
        raise ValueError("SDXL with prompt_embeds also needs pooled_prompt_embeds [B, pooled_dim]")
    b = embeds.shape[0]
    if not cfg_on:
      return embeds, pooled, None, None
    negs = _as_list(negative_prompt)
    if negative_prompt_embeds is not None:
      neg = jnp.asarray(negative_prompt_embeds, jnp.float32)
      neg_pooled = (
        None
        if negative_pooled_prompt_embeds is None
        else jnp.asarray(negative_pooled_prompt_embeds, jnp.float32)
      )
      if self.kind == "sdxl" and neg_pooled is None:
        raise ValueError(
          "SDXL with negative_prompt_embeds also needs negative_pooled_prompt_embeds"
        )
    elif self.kind == "sdxl" and negs is None and self.force_zeros_for_empty_prompt:
      neg, neg_pooled = jnp.zeros_like(embeds), jnp.zeros_like(pooled)
    else:
      negs = negs or [""]
      if len(negs) == 1 and b > 1:
        negs = negs * b
      if len(negs) != b:
        raise ValueError(
          f"negative_prompt has {len(negs)} entries for {b} prompts; give one or {b}"
        )
      neg, neg_pooled = self.encode_prompt(negs)
    if neg.shape != embeds.shape:
      raise ValueError(
        f"negative_prompt_embeds have shape {neg.shape}, prompt_embeds {embeds.shape}; they must match"
      )
    return embeds, pooled, neg, neg_pooled

  def __call__(
    self,
    prompt: str | Sequence[str] | None = None,
    negative_prompt: str | Sequence[str] | None = None,
    *,
    height: int | None = None,
    width: int | None = None,
    num_inference_steps: int = 50,
    guidance_scale: float = 7.5,
    guidance_rescale: float = 0.0,
    num_images_per_prompt: int = 1,
    seed: int = 0,
    latents: Any = None,
    prompt_embeds: Any = None,
    negative_prompt_embeds: Any = None,
    pooled_prompt_embeds: Any = None,
    negative_pooled_prompt_embeds: Any = None,
    scheduler: str | mdsch.Scheduler | None = None,
    scheduler_options: Mapping[str, Any] | None = None,
    image: Any = None,
    strength: float = 0.8,
    noise: Any = None,
    encode_noise: Any = None,
    control_image: Any = None,
    controlnet_conditioning_scale: float = 1.0,
    guess_mode: bool = False,
    original_size: tuple[int, int] | None = None,
    crops_coords_top_left: tuple[int, int] = (0, 0),
    target_size: tuple[int, int] | None = None,
    progress: bool = True,
  ) -> jax.Array:
    """Generates images.

    Text-to-image by default; image-to-image when `image` is given; ControlNet when the pipeline was loaded
    with one (then `control_image` is required).

    Args:
      prompt: one prompt or a list (or pass `prompt_embeds`).
      negative_prompt: one for all prompts or one per prompt (default: empty; SDXL: zero embeddings, as the
        reference's `force_zeros_for_empty_prompt`).
      height: image height in pixels, a multiple of 8 (default: the UNet's training size).
      width: image width in pixels, a multiple of 8.
      num_inference_steps: scheduler steps (image-to-image runs the last `strength` share of them).
      guidance_scale: classifier-free guidance; at most 1 disables it (one UNet batch instead of two).
      guidance_rescale: mixes in the std-rescaled guided prediction (0 disables).
      num_images_per_prompt: images per prompt; prompts are repeated in place (`[p0, p0, p1, p1]`).
      seed: the random seed of initial noise (and of stochastic schedulers).
      latents: initial noise `[B·n, 4, H/8, W/8]` in the reference's layout (default: drawn from `seed`).
      prompt_embeds: `[B, S, D]` text embeddings instead of `prompt`.
      negative_prompt_embeds: `[B, S, D]`.
      pooled_prompt_embeds: SDXL `[B, P]` (with `prompt_embeds`).
      negative_pooled_prompt_embeds: SDXL `[B, P]` (with `negative_prompt_embeds`).
      scheduler: a diffusers scheduler class name (`"EulerDiscreteScheduler"`, …) or an md Scheduler;
        default: the checkpoint's.
      scheduler_options: options for the scheduler named by `scheduler` (e.g. `timestep_spacing`).
      image: image-to-image input `[B, H, W, 3]` in [0, 1] (one image, or one per generated image).
      strength: image-to-image: how much of the schedule to run (1 ignores the image's content).
      noise: image-to-image: the noise added to the image's latents, `[B·n, 4, H/8, W/8]` (default: from `seed`).
      encode_noise: image-to-image: the VAE posterior's sample noise, `[B_image, 4, H/8, W/8]` (default: from
        `seed`).
      control_image: ControlNet conditioning image `[B, H, W, 3]` in [0, 1] (one, or one per generated image).
      controlnet_conditioning_scale: multiplies the ControlNet's residuals.
      guess_mode: ControlNet guess mode (residuals only for the conditional half, log-spaced scales).
      original_size: SDXL micro-conditioning (default `(height, width)`).
      crops_coords_top_left: SDXL micro-conditioning.
      target_size: SDXL micro-conditioning (default `(height, width)`).
      progress: show a progress bar over the steps.

    Returns:
      Images `[B·n, H, W, 3]`, float32 in [0, 1].
    """
    height = self.default_size if height is None else int(height)
    width = self.default_size if width is None else int(width)
    check_size(height, width, self.vae_scale_factor)
    n = int(num_inference_steps)
    if n < 1:
      raise ValueError(f"num_inference_steps must be >= 1, got {n}")
    if num_images_per_prompt < 1:
      raise ValueError(f"num_images_per_prompt must be >= 1, got {num_images_per_prompt}")
    if self.controlnet is not None and control_image is None:
      raise ValueError(
        f"this pipeline has a ControlNet ({self.source}): pass control_image [B, H, W, 3]"
      )
    if self.controlnet is None and control_image is not None:
      raise ValueError(
        "control_image given but the pipeline has no ControlNet: load_pipeline(..., controlnet=...)"
      )
    if image is not None and control_image is not None:
      raise ValueError(
        "image-to-image with a ControlNet is not implemented; pass image or control_image"
      )
    cfg_on = guidance_scale > 1.0
    sched = self.make_scheduler(scheduler, **dict(scheduler_options or {}))

    embeds, pooled, neg, neg_pooled = self._embeddings(
      prompt,
      negative_prompt,
      prompt_embeds,
      negative_prompt_embeds,
      pooled_prompt_embeds,
      negative_pooled_prompt_embeds,
      cfg_on,
    )
    reps = num_images_per_prompt
    batch = embeds.shape[0] * reps
    context = jnp.repeat(embeds, reps, axis=0)
    if cfg_on:
      context = jnp.concatenate([jnp.repeat(neg, reps, axis=0), context], axis=0)
    added = None
    if self.kind == "sdxl":
      added = self._added_cond(
        pooled,
        neg_pooled,
        reps,
        cfg_on,
        height,
        width,
        original_size,
        crops_coords_top_left,
        target_size,
      )

    h, w = height // self.vae_scale_factor, width // self.vae_scale_factor
    c = self.unet.cfg.in_channels
    shape = (batch, h, w, c)
    key = jax.random.key(int(seed))
    k_latents, k_encode, k_steps = jax.random.split(key, 3)
    state = sched.init(n, shape=shape)
    total = mdsch.num_calls(state)

    if image is None:
      start = 0
      if latents is None:
        x = jax.random.normal(k_latents, shape, jnp.float32)
      else:
        x = self._check_latents(_nchw_to_nhwc(latents), shape, "latents")
      x = x * state.init_noise_sigma
    else:
      start, x = self._image_start(
        sched, state, n, strength, image, shape, noise, encode_noise, k_latents, k_encode
      )

    cond = None
    if control_image is not None:
      cond = self._control_image(control_image, batch, height, width, cfg_on and not guess_mode)

    key_name = (
      "loop",
      sched.name,
      repr(sorted(sched.config.items())),
      start,
      total,
      cfg_on,
      cfg_on and guidance_rescale > 0,
      cond is not None,
      bool(guess_mode),
      bool(progress) and md_progress.progress_enabled(),
    )
    loop = self._jit(
      key_name,
      lambda: self._loop_fn(
        sched,
        start=start,
        cfg_on=cfg_on,
        rescale_on=cfg_on and guidance_rescale > 0,
        control=cond is not None,
        guess_mode=bool(guess_mode),
        total=total,
        show=key_name[-1],
      ),
    )
    x = self._place(x)
    state = state._replace(step=jnp.asarray(start, jnp.int32))
    x = loop(
      self._unet.state,
      None if self._cn is None else self._cn.state,
      x,
      state,
      self._place(context),
      None if added is None else {k: self._place(v) for k, v in added.items()},
      None if cond is None else self._place(cond),
      jnp.float32(guidance_scale),
      jnp.float32(guidance_rescale),
      jnp.float32(controlnet_conditioning_scale),
      k_steps,
    )
    return self.decode(x)

  # --- helpers ---------------------------------------------------------------------------------------------
  def _place(self, x: jax.Array) -> jax.Array:
    """Splits the batch over the mesh's `data` axis where it divides; replicated otherwise.

    Only `data`: with the batch split over `data` × `fsdp` while the UNet's parameters are split over
    `fsdp` and `tensor`, XLA's CPU partitioner (jax 0.10) returned UNet outputs off by ~1e-2 on the
    (2, 2, 1, 2) mesh, while `data` alone or `fsdp` alone matched the single-device run to 5e-7.
    """
    if self.mesh is None:
      return x
    size = self.mesh.shape.get("data", 1)
    spec = [None] * x.ndim
    if size > 1 and x.shape[0] % size == 0:
      spec[0] = "data"
    return jax.device_put(
      x, jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec(*spec))
    )

  @staticmethod
  def _check_latents(x: jax.Array, shape: tuple[int, ...], what: str) -> jax.Array:
    if x.shape != shape:
      b, h, w, c = shape
      got = (x.shape[0], x.shape[3], x.shape[1], x.shape[2])
      raise ValueError(
        f"{what} have shape {got} ([B, C, H/8, W/8]); expected {(b, c, h, w)} for this batch, height "
        "and width"
      )
    return x.astype(jnp.float32)

  def _added_cond(
    self, pooled, neg_pooled, reps, cfg_on, height, width, original_size, crop, target_size
  ):
    original = tuple(original_size or (height, width))
    target = tuple(target_size or (height, width))
    ids = np.asarray([*original, *crop, *target], np.float32)
    want = self.unet.cfg.projection_class_embeddings_input_dim
    got = pooled.shape[-1] + len(ids) * self.unet.cfg.addition_time_embed_dim
    if got != want:
      raise ValueError(
        f"pooled embeddings ({pooled.shape[-1]}) + 6 time ids give {got} features; the UNet expects "
        f"projection_class_embeddings_input_dim={want} (text_encoder_2's projection_dim must fit)"
      )
    text_embeds = jnp.repeat(pooled, reps, axis=0)
    time_ids = jnp.broadcast_to(jnp.asarray(ids), (text_embeds.shape[0], len(ids)))
    if cfg_on:
      text_embeds = jnp.concatenate([jnp.repeat(neg_pooled, reps, axis=0), text_embeds], axis=0)
      time_ids = jnp.concatenate([time_ids, time_ids], axis=0)
    return {"text_embeds": text_embeds, "time_ids": time_ids}

  def _control_image(self, control_image, batch, height, width, double) -> jax.Array:
    cond = jnp.asarray(control_image, jnp.float32)
    if cond.ndim == 3:
      cond = cond[None]
    if cond.ndim != 4 or cond.shape[1:] != (height, width, 3):
      raise ValueError(
        f"control_image must be [B, {height}, {width}, 3] (channels-last, in [0, 1]) for height={height}, "
        f"width={width}; got shape {cond.shape}"
      )
    if cond.shape[0] == 1:
      cond = jnp.repeat(cond, batch, axis=0)
    elif cond.shape[0] * (batch // cond.shape[0]) == batch:
      cond = jnp.repeat(cond, batch // cond.shape[0], axis=0)
    else:
      raise ValueError(
        f"control_image has {cond.shape[0]} images for {batch} outputs; give 1 or one per prompt"
      )
    return jnp.concatenate([cond, cond], axis=0) if double else cond

  def _image_start(
    self, sched, state, n, strength, image, shape, noise, encode_noise, k_noise, k_encode
  ):
    """Image-to-image: the first call index and the noised latents of `image` (the reference's
    `get_timesteps` + `prepare_latents`)."""
    if not 0.0 <= strength <= 1.0:
      raise ValueError(f"strength must be in [0, 1], got {strength}")
    if state.memory:
      raise ValueError(
        f"image-to-image with {sched.name} is not supported: it carries a history of model outputs that md "
        "builds from the first step of the full schedule; use DDIMScheduler, EulerDiscreteScheduler, "
        "EulerAncestralDiscreteScheduler, DDPMScheduler or LCMScheduler"
      )
    total = mdsch.num_calls(state)
    order = total // n
    init_steps = min(int(n * strength), n)
    t_start = max(n - init_steps, 0) * order
    if t_start >= total:
      raise ValueError(
        f"strength={strength} with {n} steps leaves no step to run; raise strength or steps"
      )
    images = jnp.asarray(image, jnp.float32)
    if images.ndim == 3:
      images = images[None]
    b, h, w, c = shape
    f = self.vae_scale_factor
    if images.ndim != 4 or images.shape[1:] != (h * f, w * f, 3):
      raise ValueError(
        f"image must be [B, {h * f}, {w * f}, 3] in [0, 1] (channels-last) for this height and width; got "
        f"shape {images.shape}"
      )
    lshape = (images.shape[0], h, w, c)
    eps = (
      jax.random.normal(k_encode, lshape, jnp.float32)
      if encode_noise is None
      else self._check_latents(_nchw_to_nhwc(encode_noise), lshape, "encode_noise")
    )
    z = self._jit("image_latents", self._image_latents_fn)(self._vae.state, images, eps)
    if b % z.shape[0]:
      raise ValueError(f"{z.shape[0]} images for {b} outputs: give 1 image or one per output")
    z = jnp.repeat(z, b // z.shape[0], axis=0)
    eps = (
      jax.random.normal(k_noise, shape, jnp.float32)
      if noise is None
      else self._check_latents(_nchw_to_nhwc(noise), shape, "noise")
    )
    if sched.name in _SIGMA_SCHEDULERS or sched.alphas_cumprod is None:
      sigma = state.sigmas[t_start]
      if sched.alphas_cumprod is None:  # flow matching
        return t_start, (1 - sigma) * z + sigma * eps
      return t_start, z + sigma * eps
    t = jnp.full((b,), state.timesteps[t_start]).astype(jnp.int32)
    return t_start, mdsch.add_noise(sched.alphas_cumprod, z, eps, t)


# --- loading ----------------------------------------------------------------------------------------------------


def _component(root: pathlib.Path, name: str, index: Mapping[str, Any]) -> pathlib.Path:
  folder = root / name
  if not folder.is_dir():
    have = sorted(
      k for k, v in index.items() if not k.startswith("_") and isinstance(v, list) and v[0]
    )
    raise FileNotFoundError(
      f"{root}: pipeline component {name!r} is missing (no folder {folder}); model_index.json lists {have}. "
      "Download the whole pipeline, or pass a complete diffusers folder"
    )
  return folder


def load_pipeline(
  source: str | os.PathLike,
  *,
  controlnet: str | os.PathLike | None = None,
  unet_file: str | os.PathLike | None = None,
  mesh: jax.sharding.Mesh | None = None,
  dtype: Any = None,
  rules: Any = None,
  revision: str | None = None,
  progress: bool = False,
) -> StableDiffusionPipeline:
  """Loads an SD 1.x / 2.x / XL diffusers pipeline as md modules.

  Args:
    source: a local diffusers pipeline folder (with `model_index.json`) or a hub id
      (`"stable-diffusion-v1-5/stable-diffusion-v1-5"`, `"stabilityai/stable-diffusion-xl-base-1.0"`),
      resolved through md-core (the hub cache; downloads when online).
    controlnet: a ControlNet folder or hub id (e.g. `"lllyasviel/sd-controlnet-canny"`); the pipeline then
      needs `control_image`.
    unet_file: a UNet-only safetensors file (diffusers tensor names) loaded over the base UNet's config,
      e.g. SDXL-Lightning's `sdxl_lightning_4step_unet.safetensors`.
    mesh: place every parameter on this mesh by its logical axes (and split the batch over data × fsdp).
    dtype: parameter dtype of the UNet and ControlNet (default float32); text encoders and the VAE stay
      float32 (the reference upcasts the VAE).
    rules: md-sharding logical axis rules (default: `md_sharding.DEFAULT_RULES`).
    revision: hub revision.
    progress: progress bars while loading tensors.

  Returns:
    A `StableDiffusionPipeline`; call it to generate images.

  Raises:
    FileNotFoundError: no such folder or hub id, or a component folder is missing (named).
    md_core.SafetensorsError: a truncated or corrupt weights file.
    md_core.WeightLoadError: weights that do not fit their config.
    ValueError: a pipeline class md does not implement.
  """
  root = md_core.resolve_source(source, revision=revision)
  index_file = root / "model_index.json"
  if not index_file.is_file():
    raise FileNotFoundError(
      f"{root}: no model_index.json; pass a diffusers pipeline folder (with unet/, vae/, text_encoder/, "
      "tokenizer/, scheduler/) or its hub id"
    )
  index = md_core.read_json(index_file)
  cls = index.get("_class_name", "")
  kind = _KINDS.get(cls)
  if kind is None:
    raise ValueError(
      f"{index_file}: pipeline class {cls!r} is not an SD pipeline md loads; known: {sorted(_KINDS)}"
    )
  names = ["unet", "vae", "text_encoder", "tokenizer", "scheduler"]
  if kind == "sdxl":
    names += ["text_encoder_2", "tokenizer_2"]
  folders = {name: _component(root, name, index) for name in names}
  kw = dict(mesh=mesh, rules=rules, progress=progress)
  if unet_file is None:
    unet = load_unet(folders["unet"], subfolder=None, dtype=dtype, **kw)
  else:
    unet = load_unet_file(unet_file, folders["unet"] / "config.json", dtype=dtype, **kw)
  vae = md_vae.load_vae_kl(folders["vae"], subfolder=None, **kw)
  te = md_text.load_clip_text(folders["text_encoder"], subfolder=None, with_projection=False, **kw)
  tok = md_text.load_tokenizer(folders["tokenizer"], subfolder=None)
  te2 = tok2 = None
  if kind == "sdxl":
    te2 = md_text.load_clip_text(
      folders["text_encoder_2"], subfolder=None, with_projection=True, **kw
    )
    tok2 = md_text.load_tokenizer(folders["tokenizer_2"], subfolder=None)
  net = None
  if controlnet is not None:
    net = load_controlnet(controlnet, subfolder=None, dtype=dtype, **kw)
  sched_cfg = mdsch.read_config(folders["scheduler"])
  mdsch.from_config(sched_cfg)  # fail now, not at the first call, on a scheduler md lacks
  return StableDiffusionPipeline(
    kind=kind,
    unet=unet,
    vae=vae,
    text_encoder=te,
    tokenizer=tok,
    scheduler_config=sched_cfg,
    text_encoder_2=te2,
    tokenizer_2=tok2,
    controlnet=net,
    force_zeros_for_empty_prompt=bool(index.get("force_zeros_for_empty_prompt", True)),
    mesh=mesh,
    source=str(source),
  )


def resolve_file(path: str | os.PathLike) -> pathlib.Path:
  """A local file, or `org/name/path/in/repo` on the hub (the hub cache; downloaded when online)."""
  local = pathlib.Path(path).expanduser()
  if local.is_file():
    return local
  parts = str(path).split("/")
  if local.exists() or len(parts) < 3 or str(path).startswith((".", "/")):
    raise FileNotFoundError(f"{path}: no such file (a local file, or org/name/file on the hub)")
  import huggingface_hub

  repo, filename = "/".join(parts[:2]), "/".join(parts[2:])
  try:
    return pathlib.Path(
      huggingface_hub.hf_hub_download(
        repo,
        filename,
        cache_dir=str(md_core.hub_cache_dir()),
        local_files_only=md_core.hub_offline(),
      )
    )
  except Exception as e:  # noqa: BLE001 - huggingface_hub raises many kinds; all mean "not available"
    how = (
      "HF_HUB_OFFLINE=1: only the cache is read"
      if md_core.hub_offline()
      else "the hub could not provide it"
    )
    raise FileNotFoundError(
      f"{path}: file {filename!r} of hub repo {repo!r} is not available ({how}; {type(e).__name__}); "
      f"download it (`huggingface-cli download {repo} {filename}`) or pass a local file"
    ) from None


def load_unet_file(
  path: str | os.PathLike,
  config: str | os.PathLike,
  *,
  mesh: jax.sharding.Mesh | None = None,
  dtype: Any = None,
  rules: Any = None,
  progress: bool = False,
) -> UNet2DConditionModel:
  """Loads a UNet-only safetensors file (diffusers names) with the config of a base UNet (`config.json`),
  as SDXL-Lightning and similar distilled UNets ship.

  Args:
    path: a local safetensors file, or `org/name/file.safetensors` on the hub.
    config: the base UNet's `config.json`.
    mesh: place parameters on this mesh.
    dtype: parameter dtype.
    rules: md-sharding logical axis rules.
    progress: progress bar while loading.

  Raises:
    FileNotFoundError: no such file.
    md_core.SafetensorsError: a truncated or corrupt file.
    md_core.WeightLoadError: tensors that do not fit the base config.
  """
  path = resolve_file(path)
  cfg = UNetConfig.from_json(config)
  checkpoint = md_core.open_checkpoint(path)
  return md_core.load_weights(
    lambda: UNet2DConditionModel(cfg, rngs=nnx.Rngs(0), dtype=dtype),
    checkpoint,
    unet_key_map(cfg),
    dtype=dtype,
    mesh=mesh,
    rules=rules,
    progress=progress,
  )
