"""Stable Diffusion pipelines (SD 1.x / 2.x / XL): text-to-image, image-to-image and ControlNet.

Three kinds of jitted programs per shape: text encoding, the denoising steps and VAE decoding. The
steps run on md's one sampling loop (`md_schedulers.run_steps`, driven from the host in chunks by
`md_schedulers.drive`): the loop owns classifier-free guidance (rows `[negative, positive]`),
guidance rescale, the scheduler step, starting and stopping part-way and the step-cache hook; this
module only supplies the denoiser (ControlNet residuals, SDXL's added conditioning, the UNet call). The
models are split once into a graph definition (static) and their state (a jit argument), so calling a
pipeline again with the same shapes and settings reuses the compiled programs.

Behaviour follows diffusers' `StableDiffusionPipeline`, `StableDiffusionImg2ImgPipeline`,
`StableDiffusionXLPipeline`, `StableDiffusionXLImg2ImgPipeline` (also as the SDXL refiner) and their
ControlNet variants (one or several ControlNets, text- or image-to-image): the batch order of classifier-free
guidance (`[negative, positive]`), `guidance_rescale`, `clip_skip`, SDXL's pooled embeddings and `time_ids`
(with the refiner's aesthetic scores), the scheduler's initial noise scale, img2img's strength → first step
with any scheduler (`md_schedulers.strength_start` / `start_at`), SDXL's `denoising_start` /
`denoising_end`, ControlNet guidance windows, and the VAE's scaling.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import md_core
import md_schedulers as mdsch
import md_text
import md_vae
from md_core import call as mdc
from md_core import pipeline as mdp
from md_lora import LoRAPipeline
from md_sd._controlnet import ControlNetModel
from md_sd._unet import UNet2DConditionModel
from md_sd._weights import unet_key_map

_KINDS = {
  "StableDiffusionPipeline": "sd",
  "StableDiffusionImg2ImgPipeline": "sd",
  "StableDiffusionControlNetPipeline": "sd",
  "StableDiffusionXLPipeline": "sdxl",
  "StableDiffusionXLImg2ImgPipeline": "sdxl",
  "StableDiffusionXLControlNetPipeline": "sdxl",
  "StableDiffusionControlNetImg2ImgPipeline": "sd",
  "StableDiffusionXLControlNetImg2ImgPipeline": "sdxl",
}


def check_size(height: int | None, width: int | None, factor: int = 8) -> None:
  """Checks an image size: height and width must be positive multiples of `factor` (None: the default size).

  Raises:
    md_core.pipeline.SizeError: naming each bad value and the nearest valid ones.
  """
  bad = []
  for name, v in (("height", height), ("width", width)):
    if v is None:
      continue
    if isinstance(v, bool) or not isinstance(v, int | np.integer):
      raise mdp.SizeError(f"{name} must be an int, got {v!r}")
    if v % factor or v <= 0:
      bad.append(f"{name}={v} → {' or '.join(map(str, mdp.nearest_multiples(int(v), factor)))}")
  if bad:
    raise mdp.SizeError(
      f"height and width must be positive multiples of {factor} (the VAE's factor); got height={height}, "
      f"width={width}; nearest valid: {', '.join(bad)}"
    )


def rescale_noise_cfg(
  noise_cfg: jax.Array, noise_pred_text: jax.Array, guidance_rescale: jax.Array
) -> jax.Array:
  """diffusers' name for guidance rescale: `md_schedulers.guidance.rescale` (which the loop runs)."""
  return mdsch.guidance.rescale(noise_cfg, noise_pred_text, guidance_rescale)


def _nchw_to_nhwc(x) -> jax.Array:
  x = jnp.asarray(x)
  if x.ndim != 4:
    raise ValueError(f"expected latents [B, C, H, W] (the reference's layout), got shape {x.shape}")
  return jnp.transpose(x, (0, 2, 3, 1))


class StableDiffusionPipeline(LoRAPipeline, mdp.Pipeline):
  """A loaded SD 1.x / 2.x / XL pipeline (see `load_pipeline`); call it to generate images.

  Attributes:
    kind: `"sd"` (SD 1.x / 2.x) or `"sdxl"`.
    unet, vae, text_encoder, text_encoder_2: the md modules (None where absent: the SDXL refiner has no
      `text_encoder`).
    controlnet: one `ControlNetModel`, a list of them (used together), or None.
    tokenizer, tokenizer_2: transformers tokenizers.
    scheduler_config: the checkpoint's `scheduler_config.json` dict.
    force_zeros_for_empty_prompt: SDXL: zero negative embeddings when no negative prompt is given.
    requires_aesthetics_score: SDXL refiner: `time_ids` hold an aesthetic score instead of the target size.
    last_calls: the denoiser calls the last call made (a step reused by a step cache makes none).
  """

  last_calls: int = 0

  family = "sd"
  block_stacks = False  # a UNet: no transformer block stacks for block-level caches
  lora_components = ("unet", "text_encoder", "text_encoder_2")  # what pipe.load_lora adapts
  # The text encoders take a file's LoRA only where it holds their keys (prefixes in this order).
  lora_prefixes = {
    "text_encoder": ("text_encoder.", "lora_te1_", "lora_te_"),
    "text_encoder_2": ("text_encoder_2.", "lora_te2_"),
  }

  def lora_key_map(self, component: str):
    if component == "unet":
      return unet_key_map(self.unet.cfg)
    return md_text.clip_text_convert_key

  def noise_layout(self) -> mdp.NoiseLayout:
    """Noise drawn and taken as `[n, C, H/f, W/f]`."""
    f = int(self.vae_scale_factor)
    return mdp.NoiseLayout("image", f, int(self.unet.cfg.in_channels), f)

  def __init__(
    self,
    *,
    kind: str,
    unet: UNet2DConditionModel,
    vae: md_vae.AutoencoderKL,
    text_encoder: md_text.CLIPTextModel | None,
    tokenizer: Any,
    scheduler_config: Mapping[str, Any],
    text_encoder_2: md_text.CLIPTextModelWithProjection | None = None,
    tokenizer_2: Any = None,
    controlnet: ControlNetModel | Sequence[ControlNetModel] | None = None,
    force_zeros_for_empty_prompt: bool = True,
    requires_aesthetics_score: bool = False,
    mesh: jax.sharding.Mesh | None = None,
    source: str = "",
  ):
    if kind not in ("sd", "sdxl"):
      raise ValueError(f"kind must be 'sd' or 'sdxl', got {kind!r}")
    if kind == "sdxl" and (text_encoder_2 is None or tokenizer_2 is None):
      raise ValueError("an SDXL pipeline needs text_encoder_2 and tokenizer_2")
    if kind == "sd" and (text_encoder is None or tokenizer is None):
      raise ValueError("an SD pipeline needs text_encoder and tokenizer")
    if (text_encoder is None) != (tokenizer is None):
      raise ValueError("text_encoder and tokenizer come together (both or neither)")
    self.kind = kind
    self._init_scaffold(mesh, source)
    self.unet, self.vae, self.controlnet = unet, vae, controlnet
    if controlnet is None:
      nets = []
    elif isinstance(controlnet, ControlNetModel):
      nets = [controlnet]
    else:
      nets = list(controlnet)
      if not nets or not all(isinstance(n, ControlNetModel) for n in nets):
        raise ValueError("controlnet must be a ControlNetModel or a non-empty list of them")
    self.controlnets = nets
    self.text_encoder, self.text_encoder_2 = text_encoder, text_encoder_2
    self.tokenizer, self.tokenizer_2 = tokenizer, tokenizer_2
    self.scheduler_config = dict(scheduler_config)
    self.force_zeros_for_empty_prompt = force_zeros_for_empty_prompt
    self.requires_aesthetics_score = bool(requires_aesthetics_score)
    self._unet, self._vae = mdp.Split.of(unet), mdp.Split.of(vae)
    self._te, self._te2 = mdp.Split.of(text_encoder), mdp.Split.of(text_encoder_2)
    self._cns = [mdp.Split.of(n) for n in nets]

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
    self.unet, self._unet = unet, mdp.Split.of(unet)
    self._memo.clear()

  # --- jitted pieces -----------------------------------------------------------------------------------
  def _encode_fn(self, clip_skip: int | None):
    te, te2, kind = self._te, self._te2, self.kind

    def encode(te_state, te2_state, ids, ids2):
      if kind == "sd":
        model = te.merge(te_state)
        if clip_skip is None:
          return model(ids, output_hidden_states=False).last_hidden_state, None
        # The reference takes an earlier layer's output and applies the final LayerNorm to it.
        hidden = model(ids, output_hidden_states=True).hidden_states[-(clip_skip + 1)]
        return model.final_layer_norm(hidden), None
      # SDXL counts from the penultimate layer; no final LayerNorm. The refiner has only encoder 2.
      index = -((clip_skip or 0) + 2)
      o2 = te2.merge(te2_state)(ids2, output_hidden_states=True)
      parts = [o2.hidden_states[index]]
      if te is not None:
        o1 = te.merge(te_state)(ids, output_hidden_states=True)
        parts.insert(0, o1.hidden_states[index])
      return jnp.concatenate(parts, axis=-1), o2.text_embeds

    return jax.jit(encode)

  def encode_prompt(
    self, prompts: str | Sequence[str], clip_skip: int | None = None
  ) -> tuple[jax.Array, jax.Array | None]:
    """Text embeddings `[B, S, D]` (and SDXL's pooled `[B, P]`) for one prompt (B = 1) or a list.

    `clip_skip` layers are skipped from the end, as the reference does for positive prompts: SD takes
    `hidden_states[-(clip_skip + 1)]` through the final LayerNorm, SDXL `hidden_states[-(clip_skip + 2)]`.
    """
    if clip_skip is not None:
      clip_skip = int(clip_skip)
      encoders = [e for e in (self.text_encoder, self.text_encoder_2) if e is not None]
      layers = min(e.config.num_hidden_layers for e in encoders)
      if not 0 <= clip_skip <= layers - (1 if self.kind == "sdxl" else 0):
        raise ValueError(
          f"clip_skip={clip_skip} is out of range for a {layers}-layer text encoder ({self.kind})"
        )
    prompts = mdp.as_prompts(prompts)
    ids = None if self.tokenizer is None else md_text.tokenize(self.tokenizer, prompts).ids
    ids2 = md_text.tokenize(self.tokenizer_2, prompts).ids if self.kind == "sdxl" else None
    fn = self.jit(("encode", clip_skip), lambda: self._encode_fn(clip_skip))
    te_state = None if self._te is None else self._te.jit_state()
    te2_state = None if self._te2 is None else self._te2.jit_state()
    with self.context():
      return fn(
        te_state,
        te2_state,
        None if ids is None else jnp.asarray(ids),
        None if ids2 is None else jnp.asarray(ids2),
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
    with self.context():
      return self.jit("decode", self._decode_fn)(self._vae.state, latents)

  def _image_latents_fn(self):
    vae = self._vae
    cfg = self.vae.config

    mean = None if cfg.latents_mean is None else np.asarray(cfg.latents_mean, np.float32)
    std = None if cfg.latents_std is None else np.asarray(cfg.latents_std, np.float32)

    def encode(state, images, eps):  # images [B, H, W, 3] in [0, 1]; eps [B, h, w, C]
      posterior = vae.merge(state).encode(images.astype(jnp.float32) * 2 - 1)
      z = posterior.mean + posterior.std * eps
      if mean is not None and std is not None:
        return (z - mean) * cfg.scaling_factor / std
      return vae.merge(state).scale_latents(z) if cfg.shift_factor else z * cfg.scaling_factor

    return jax.jit(encode)

  # --- the loop -------------------------------------------------------------------------------------------
  def _denoiser(self, branches: int, guess_mode: bool):
    """The family part of sampling: the ControlNets' residuals, then the UNet, on every guidance row.

    `x` holds `branches × B` rows (`[negative, positive]` with classifier-free guidance); `cond` the
    text states and SDXL's added conditioning in that row order, the control images (B rows in guess
    mode, else one per row), the per-net scales `[nets]` and guidance-window table `[calls, nets]`.
    """
    unet, nets = self._unet, self._cns

    def denoise(params, x, t, cond, *, step):
      unet_state, cn_states = params
      context, added = cond["context"], cond["added"]
      residuals = {}
      if nets:
        # Guess mode: the ControlNets see only the conditional rows; the others get no residuals.
        lo = x.shape[0] - x.shape[0] // branches if guess_mode else 0
        net_added = None if added is None else {k: v[lo:] for k, v in added.items()}
        down = mid = None
        for j, (net, state) in enumerate(zip(nets, cn_states)):
          # The reference's guidance window: a net outside its share of the run has scale 0.
          scale = cond["control_scales"][j] * cond["control_keep"][step, j]
          d, m = net.merge(state)(
            x[lo:], t[lo:], context[lo:], cond["control_images"][j], conditioning_scale=scale,
            guess_mode=guess_mode, added_cond_kwargs=net_added,
          )  # fmt: skip
          down = list(d) if down is None else [a + b for a, b in zip(down, d)]
          mid = m if mid is None else mid + m
        if lo:
          down = [jnp.concatenate([jnp.zeros((lo, *r.shape[1:]), r.dtype), r]) for r in down]
          mid = jnp.concatenate([jnp.zeros((lo, *mid.shape[1:]), mid.dtype), mid])
        residuals = dict(down_block_additional_residuals=down, mid_block_additional_residual=mid)
      return unet.merge(unet_state)(x, t, context, added_cond_kwargs=added, **residuals)

    return denoise

  def _run_fn(
    self, sched: mdsch.Scheduler, guide: mdsch.guidance.Guidance, guess_mode: bool, cache
  ):
    """One jitted chunk of steps `[lo, hi)` (traced bounds: one program whatever the chunk)."""
    denoise = self._denoiser(guide.num_branches, guess_mode)

    def run(carry, lo, hi, params, cond, scales, key):
      return mdsch.run_steps(
        denoise, sched, carry, lo, hi, cond, params=params, guidance=guide, scales=scales,
        cache=cache, key=key,
      )  # fmt: skip

    return jax.jit(run)

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
    clip_skip: int | None = None,
  ):
    """(positive, negative) embeddings and pooled embeddings for the batch of prompts."""
    sdxl = self.kind == "sdxl"

    def given(embeds, pooled, message):
      pooled = None if pooled is None else jnp.asarray(pooled, jnp.float32)
      if sdxl and pooled is None:
        raise ValueError(message)
      return jnp.asarray(embeds, jnp.float32), pooled

    embeds, pooled = mdc.resolve_prompt(
      prompt, prompt_embeds, encode=lambda p: self.encode_prompt(p, clip_skip),
      given=lambda e: given(e, pooled_prompt_embeds, "SDXL with prompt_embeds also needs "
                            "pooled_prompt_embeds [B, pooled_dim]"),
    )  # fmt: skip
    if not cfg_on:
      return embeds, pooled, None, None
    negs = mdp.as_prompts(negative_prompt, "negative_prompt")
    if (
      negative_prompt_embeds is None and sdxl and negs is None and self.force_zeros_for_empty_prompt
    ):
      return embeds, pooled, jnp.zeros_like(embeds), jnp.zeros_like(pooled)
    neg, neg_pooled = mdc.resolve_negative(
      negs, negative_prompt_embeds, (embeds, pooled), encode=self.encode_prompt,
      given=lambda e: given(e, negative_pooled_prompt_embeds, "SDXL with negative_prompt_embeds "
                            "also needs negative_pooled_prompt_embeds"),
    )  # fmt: skip
    return embeds, pooled, neg, neg_pooled

  # --- the call's steps ------------------------------------------------------------------------------------
  def _check_call(self, *, output_type, image, image_latents, latents, height, width,
                  num_inference_steps, num_images_per_prompt, control_image, denoising_start,
                  denoising_end):  # fmt: skip
    """Validates a call before any work; returns the image (pixels `[B, H, W, 3]` or None), the image
    latents (channels-last or None), whether it is image to image, and the height and width."""
    mdc.check_output_type(output_type)
    if image is not None and image_latents is not None:
      raise ValueError("pass image (pixels) or image_latents, not both")
    img2img = image is not None or image_latents is not None
    f = self.vae_scale_factor
    if image_latents is not None:
      image_latents = _nchw_to_nhwc(image_latents)
      size = (image_latents.shape[1] * f, image_latents.shape[2] * f)
    elif image is not None:
      if isinstance(image, np.ndarray | jax.Array) and image.ndim == 4 and image.shape[-1] != 3:
        if image.shape[1] == self.vae.config.latent_channels:
          raise ValueError(
            f"image must be [B, H, W, 3] (pixels); got shape {image.shape}: latents [B, C, H/8, W/8] "
            "go in image_latents"
          )
      image = jnp.asarray(md_core.images.image_batch(image, what="image"))
      size = tuple(image.shape[1:3])
    else:
      size = (self.default_size, self.default_size)
    height = size[0] if height is None else int(height)
    width = size[1] if width is None else int(width)
    check_size(height, width, f)
    if int(num_inference_steps) < 1:
      raise ValueError(f"num_inference_steps must be >= 1, got {int(num_inference_steps)}")
    if num_images_per_prompt < 1:
      raise ValueError(f"num_images_per_prompt must be >= 1, got {num_images_per_prompt}")
    nets = self.controlnets
    if nets and control_image is None:
      raise ValueError(
        f"this pipeline has {len(nets)} ControlNet(s) ({self.source}): pass control_image [B, H, W, 3]"
        + (" (a list, one per ControlNet)" if len(nets) > 1 else "")
      )
    if not nets and control_image is not None:
      raise ValueError(
        "control_image given but the pipeline has no ControlNet: load_pipeline(..., controlnet=...)"
      )
    if (denoising_start is not None or denoising_end is not None) and self.kind != "sdxl":
      raise ValueError(
        "denoising_start / denoising_end are SDXL options (the base + refiner ensemble)"
      )
    if denoising_start is not None and not img2img:
      raise ValueError(
        "denoising_start continues a run: pass image_latents (the base's output_type='latent' result)"
      )
    return image, image_latents, img2img, height, width

  def _check_inputs(self, img2img: bool, latents) -> None:
    if self.requires_aesthetics_score and not img2img:
      raise ValueError(
        f"{self.source or 'this pipeline'} is an image-to-image model (requires_aesthetics_score, the "
        "SDXL refiner): pass image or image_latents"
      )
    if img2img and latents is not None:
      raise ValueError(
        "image-to-image builds its start latents from the image: pass noise (and encode_noise), not latents"
      )

  def _start(self, sched, state, n, *, img2img, latents, image, image_latents, shape, strength, noise,
             encode_noise, denoising_start, denoising_end, keys):  # fmt: skip
    """`(x, state, start, stop)`: the start latents, the scheduler state at the first call run, and the
    calls run `[start, stop)`: all from noise for text to image; image to image from the image's
    latents noised to the level `strength` (or SDXL's `denoising_start`) leaves; SDXL's base of an
    ensemble stops at `denoising_end`."""
    k_latents, k_encode = keys
    total = mdsch.num_calls(state)
    if not img2img:
      start = 0
      if latents is None:
        x = jax.random.normal(k_latents, shape, jnp.float32)
      else:
        x = self._check_latents(_nchw_to_nhwc(latents), shape, "latents")
      x = x * state.init_noise_sigma
    else:
      if denoising_start is not None:
        start = mdsch.denoising_start_index(sched, state, denoising_start)
      else:
        start = mdsch.strength_start(n, strength, mdsch.scheduler_order(sched))
      if start >= total:
        what = (
          f"denoising_start={denoising_start}"
          if denoising_start is not None
          else f"strength={strength}"
        )
        raise ValueError(
          f"{what} with {n} steps leaves no step to run; lower it or raise the steps"
        )
      z = self._start_latents(image, image_latents, shape, encode_noise, k_encode)
      if denoising_start is None:
        eps = (
          jax.random.normal(k_latents, shape, jnp.float32)
          if noise is None
          else self._check_latents(_nchw_to_nhwc(noise), shape, "noise")
        )
        x = mdsch.add_noise_at(sched, state, start, z, eps)
      else:
        x = z  # the base's latents are already at this noise level
    stop = total
    if denoising_end is not None:
      stop = mdsch.denoising_end_stop(sched, state, start, denoising_end)
      if stop <= start:
        raise ValueError(f"denoising_end={denoising_end} leaves no step to run")
    return x, mdsch.start_at(sched, state, start), start, stop

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
    clip_skip: int | None = None,
    scheduler: str | mdsch.Scheduler | None = None,
    scheduler_options: Mapping[str, Any] | None = None,
    image: Any = None,
    image_latents: Any = None,
    strength: float = 0.8,
    noise: Any = None,
    encode_noise: Any = None,
    denoising_start: float | None = None,
    denoising_end: float | None = None,
    control_image: Any = None,
    controlnet_conditioning_scale: float | Sequence[float] = 1.0,
    control_guidance_start: float | Sequence[float] = 0.0,
    control_guidance_end: float | Sequence[float] = 1.0,
    guess_mode: bool = False,
    original_size: tuple[int, int] | None = None,
    crops_coords_top_left: tuple[int, int] = (0, 0),
    target_size: tuple[int, int] | None = None,
    negative_original_size: tuple[int, int] | None = None,
    negative_crops_coords_top_left: tuple[int, int] = (0, 0),
    negative_target_size: tuple[int, int] | None = None,
    aesthetic_score: float = 6.0,
    negative_aesthetic_score: float = 2.5,
    output_type: str = "np",
    callback: Callable[[int, jax.Array, jax.Array], Any] | None = None,
    cancel: Callable[[], bool] | None = None,
    cache: mdsch.StepCache | None = None,
    chunk: int | str | None = "auto",
    progress: bool = True,
  ) -> jax.Array:
    """Generates images.

    Text-to-image by default; image-to-image when `image` (or `image_latents`) is given; ControlNet when the
    pipeline was loaded with one or several (then `control_image` is required), also with image-to-image.

    Args:
      prompt: one prompt or a list (or pass `prompt_embeds`).
      negative_prompt: one for all prompts or one per prompt (default: empty; SDXL: zero embeddings, as the
        reference's `force_zeros_for_empty_prompt`).
      height: image height in pixels, a multiple of 8 (default: the input image's, else the UNet's
        training size).
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
      clip_skip: skip this many final text-encoder layers for the prompt (as the reference: SD takes
        `hidden_states[-(clip_skip + 1)]` through the final LayerNorm, SDXL `hidden_states[-(clip_skip + 2)]`;
        negative prompts are encoded without it).
      scheduler: a diffusers scheduler class name (`"EulerDiscreteScheduler"`, …) or an md Scheduler;
        default: the checkpoint's. Image-to-image works with every one (multistep solvers restart at the
        first kept step, as the reference's `set_begin_index`).
      scheduler_options: options for the scheduler named by `scheduler` (e.g. `timestep_spacing`).
      image: image-to-image input (one image, or one per generated image): a PIL image, an image file, a
        list of them, or an array `[B, H, W, 3]` / `[H, W, 3]`, uint8 or floats in [0, 1] (read as
        `md_core.images.image_batch`: other dtypes and ranges are refused).
      image_latents: image-to-image input already in latent space, `[B, 4, H/8, W/8]` (the reference's
        4-channel `image`), e.g. an SDXL base run's `output_type="latent"` result for the refiner.
      strength: image-to-image: how much of the schedule to run (1 ignores the image's content).
      noise: image-to-image: the noise added to the image's latents, `[B·n, 4, H/8, W/8]` (default: from `seed`).
      encode_noise: image-to-image: the VAE posterior's sample noise, `[B_image, 4, H/8, W/8]` (default: from
        `seed`).
      denoising_start: SDXL image-to-image: start at this fraction of the training timesteps instead of
        `strength`, without adding noise (the refiner continuing a base run with `denoising_end`).
      denoising_end: SDXL: stop at this fraction of the training timesteps (use with
        `output_type="latent"` and hand the latents to a refiner).
      control_image: ControlNet conditioning image, taken as `image` is (one, or one per generated image; a
        list is a batch); with several ControlNets, a list with one such input per ControlNet.
      controlnet_conditioning_scale: multiplies the ControlNet's residuals (a list: one per ControlNet).
      control_guidance_start: the share of the run's steps before which a ControlNet is off (one per net).
      control_guidance_end: the share of the run's steps after which a ControlNet is off (one per net).
      guess_mode: ControlNet guess mode (residuals only for the conditional half, log-spaced scales).
      original_size: SDXL micro-conditioning (default `(height, width)`).
      crops_coords_top_left: SDXL micro-conditioning.
      target_size: SDXL micro-conditioning (default `(height, width)`).
      negative_original_size: SDXL micro-conditioning of the negative batch half (default: `original_size`).
      negative_crops_coords_top_left: SDXL micro-conditioning of the negative half.
      negative_target_size: SDXL micro-conditioning of the negative half (default: `target_size`).
      aesthetic_score: SDXL refiner (`requires_aesthetics_score`): the positive half's score.
      negative_aesthetic_score: SDXL refiner: the negative half's score.
      output_type: `"np"` for images, `"latent"` for the final latents `[B·n, 4, H/8, W/8]` (the reference's
        layout, not decoded).
      callback: `callback(step, timestep, latents)` after each step run (`step` the scheduler call's
        index, `latents` channels-last `[B·n, H/8, W/8, 4]` after it); returning False stops like
        `cancel`.
      cancel: polled at each step boundary; True stops with `md_schedulers.Cancelled`.
      cache: a step cache (md-cache policy) deciding, on device, which steps reuse a prediction.
      chunk: steps per host dispatch ("auto", the default: about 50 ms of work per dispatch; None: the whole run in one call; progress, callback and cancel
        act at chunk boundaries).
      progress: show a progress bar over the steps.

    Returns:
      Images `[B·n, H, W, 3]`, float32 in [0, 1] (or latents, see `output_type`). The denoiser calls
      made are in `self.last_calls`.

    Raises:
      md_core.pipeline.SizeError: a height or width that is not a multiple of the VAE's factor.
      ValueError: missing, conflicting or mis-shaped inputs.
      md_schedulers.Cancelled: `cancel()` returned True (or `callback` returned False).
    """
    image, image_latents, img2img, height, width = self._check_call(
      output_type=output_type, image=image, image_latents=image_latents, latents=latents,
      height=height, width=width, num_inference_steps=num_inference_steps,
      num_images_per_prompt=num_images_per_prompt, control_image=control_image,
      denoising_start=denoising_start, denoising_end=denoising_end,
    )  # fmt: skip
    controls = None
    if self.controlnets:
      controls = self._control_settings(
        control_image, controlnet_conditioning_scale, control_guidance_start, control_guidance_end
      )
    self._check_inputs(img2img, latents)
    n = int(num_inference_steps)
    cfg_on = guidance_scale > 1.0
    sched = self.make_scheduler(scheduler, **dict(scheduler_options or {}))

    # Text (and SDXL's added conditioning) in the loop's row order.
    embeds, pooled, neg, neg_pooled = self._embeddings(
      prompt, negative_prompt, prompt_embeds, negative_prompt_embeds, pooled_prompt_embeds,
      negative_pooled_prompt_embeds, cfg_on, clip_skip,
    )  # fmt: skip
    reps = num_images_per_prompt
    batch = embeds.shape[0] * reps
    context = mdc.guidance_rows(embeds, neg if cfg_on else None, reps)
    added = None
    if self.kind == "sdxl":
      time_ids = self._time_ids(
        height, width, img2img, original_size, crops_coords_top_left, target_size,
        negative_original_size, negative_crops_coords_top_left, negative_target_size,
        aesthetic_score, negative_aesthetic_score,
      )  # fmt: skip
      added = self._added_cond(pooled, neg_pooled, reps, cfg_on, time_ids)

    # Latents and the steps run.
    f = self.vae_scale_factor
    shape = (batch, height // f, width // f, self.unet.cfg.in_channels)
    k_latents, k_encode, k_steps = jax.random.split(mdp.seed_key(seed), 3)
    state = sched.init(n, shape=shape)
    total = mdsch.num_calls(state)
    x, state, start, stop = self._start(
      sched, state, n, img2img=img2img, latents=latents, image=image, image_latents=image_latents,
      shape=shape, strength=strength, noise=noise, encode_noise=encode_noise,
      denoising_start=denoising_start, denoising_end=denoising_end, keys=(k_latents, k_encode),
    )  # fmt: skip

    # ControlNets and guidance.
    conds = cscales = keep = None
    if self.controlnets:
      conds, cscales, keep = self._controls(
        controls, batch, height, width, cfg_on and not guess_mode, start, total
      )
    guide = mdsch.guidance.Guidance(cfg=cfg_on, rescale=cfg_on and guidance_rescale > 0)
    values = {"guidance": guidance_scale, "rescale": guidance_rescale}
    scales = mdsch.guidance.per_step(total, {k: values[k] for k in guide.scale_names})

    # Per-row inputs go over the batch axes; the per-step tables stay replicated.
    cond = dict(
      context=self.place(context), added=self.place(added), control_images=self.place(conds),
      control_scales=cscales, control_keep=keep,
    )  # fmt: skip
    params = (self._unet.state, [net.state for net in self._cns])
    carry = mdsch.sample_pipeline(
      self, ("loop", sched.name, repr(sorted(sched.config.items())), guide, bool(guess_mode)),
      lambda cache: self._run_fn(sched, guide, bool(guess_mode), cache),
      x, state, args=(params, cond, jax.tree.map(jnp.asarray, scales), k_steps), begin=start,
      stop=stop, cache=cache, chunk=chunk, callback=callback, cancel=cancel, progress=progress,
    )  # fmt: skip
    x = carry.latents
    if output_type == "latent":
      return jnp.transpose(x, (0, 3, 1, 2))
    with self.decoding(progress):
      return self.decode(x)

  # --- helpers ---------------------------------------------------------------------------------------------
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

  def _time_ids(
    self,
    height,
    width,
    img2img,
    original_size,
    crop,
    target_size,
    neg_original,
    neg_crop,
    neg_target,
    aesthetic,
    neg_aesthetic,
  ) -> tuple[np.ndarray, np.ndarray]:
    """SDXL's (positive, negative) `time_ids` as the reference's text- and image-to-image pipelines build
    them (they differ in which negative micro-conditioning they use)."""
    original = tuple(original_size or (height, width))
    target = tuple(target_size or (height, width))
    crop, neg_crop = tuple(crop), tuple(neg_crop)
    if self.requires_aesthetics_score:
      ids = [*original, *crop, aesthetic]
      neg = [*(neg_original or original), *neg_crop, neg_aesthetic]
    elif img2img:
      ids = [*original, *crop, *target]
      neg = [*(neg_original or original), *crop, *(neg_target or target)]
    else:
      ids = [*original, *crop, *target]
      neg = ids
      if neg_original is not None and neg_target is not None:
        neg = [*neg_original, *neg_crop, *neg_target]
    return np.asarray(ids, np.float32), np.asarray(neg, np.float32)

  def _added_cond(self, pooled, neg_pooled, reps, cfg_on, time_ids):
    ids, neg_ids = time_ids
    want = self.unet.cfg.projection_class_embeddings_input_dim
    step = self.unet.cfg.addition_time_embed_dim
    got = pooled.shape[-1] + len(ids) * step
    if got != want:
      hint = "text_encoder_2's projection_dim must fit"
      if want - got == step:
        hint = (
          "the UNet expects one more time id: an SDXL refiner needs requires_aesthetics_score=True"
        )
      elif got - want == step:
        hint = (
          "the UNet expects one time id less: set requires_aesthetics_score=True (a refiner UNet)"
        )
      raise ValueError(
        f"pooled embeddings ({pooled.shape[-1]}) + {len(ids)} time ids give {got} features; the UNet "
        f"expects projection_class_embeddings_input_dim={want} ({hint})"
      )
    text_embeds = jnp.repeat(pooled, reps, axis=0)
    b = text_embeds.shape[0]
    time_ids = jnp.broadcast_to(jnp.asarray(ids), (b, len(ids)))
    if cfg_on:
      text_embeds = jnp.concatenate([jnp.repeat(neg_pooled, reps, axis=0), text_embeds], axis=0)
      neg_time_ids = jnp.broadcast_to(jnp.asarray(neg_ids), (b, len(ids)))
      time_ids = jnp.concatenate([neg_time_ids, time_ids], axis=0)
    return {"text_embeds": text_embeds, "time_ids": time_ids}

  def _control_settings(self, images, scales, starts, ends):
    """Checks the ControlNet settings (before any work) and gives one entry per ControlNet of each."""
    k = len(self.controlnets)
    if k == 1:
      # One ControlNet: a list is a batch of images (as the reference's single-ControlNet pipelines).
      images = [md_core.images.image_batch(images, what="control_image")]
    elif not isinstance(images, (list, tuple)) or len(images) != k:
      got = len(images) if isinstance(images, (list, tuple)) else "1"
      raise ValueError(f"{k} ControlNets need a list of {k} control images, got {got}")
    else:
      images = [
        md_core.images.image_batch(im, what=f"control_image[{j}]") for j, im in enumerate(images)
      ]

    def per_net(value, name):
      values = list(value) if isinstance(value, (list, tuple)) else [value] * k
      if len(values) != k:
        raise ValueError(f"{name} has {len(values)} entries for {k} ControlNets")
      return [float(v) for v in values]

    scales = per_net(scales, "controlnet_conditioning_scale")
    starts = per_net(starts, "control_guidance_start")
    ends = per_net(ends, "control_guidance_end")
    for s, e in zip(starts, ends):
      if not 0.0 <= s < e <= 1.0:
        raise ValueError(
          f"control_guidance_start ({s}) must be below control_guidance_end ({e}), both in [0, 1]"
        )
    return list(images), scales, starts, ends

  def _controls(self, settings, batch, height, width, double, start, total):
    """Per ControlNet: conditioning images, scales `[nets]` and the on/off table `[calls, nets]` of the
    guidance windows (the reference's `controlnet_keep`, over the run's calls)."""
    images, scales, starts, ends = settings
    k = len(images)
    conds = [self._control_image(im, batch, height, width, double) for im in images]
    keep = np.ones((total, k), np.float32)
    run = total - start
    for i in range(run):
      for j, (s, e) in enumerate(zip(starts, ends)):
        keep[start + i, j] = 1.0 - float(i / run < s or (i + 1) / run > e)
    return conds, jnp.asarray(scales, jnp.float32), jnp.asarray(keep)

  def _control_image(self, control_image, batch, height, width, double) -> jax.Array:
    cond = jnp.asarray(control_image, jnp.float32)  # [B, H, W, 3] in [0, 1] (`_control_settings`)
    if cond.shape[1:] != (height, width, 3):
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

  def _start_latents(self, image, image_latents, shape, encode_noise, k_encode) -> jax.Array:
    """Image-to-image: the image's latents (VAE posterior sample, scaled) for the whole batch, repeated
    as the reference does (`[a, b, a, b]` for two images and two per prompt)."""
    b, h, w, c = shape
    f = self.vae_scale_factor
    if image_latents is not None:
      z = image_latents.astype(jnp.float32)
      if z.shape[1:] != (h, w, c):
        raise ValueError(
          f"image_latents have shape {(z.shape[0], z.shape[3], z.shape[1], z.shape[2])}; expected "
          f"[B, {c}, {h}, {w}] for height={h * f}, width={w * f}"
        )
    else:
      if image.ndim != 4 or image.shape[1:] != (h * f, w * f, 3):
        raise ValueError(
          f"image must be [B, {h * f}, {w * f}, 3] in [0, 1] (channels-last) for this height and width; "
          f"got shape {image.shape}"
        )
      lshape = (image.shape[0], h, w, c)
      eps = (
        jax.random.normal(k_encode, lshape, jnp.float32)
        if encode_noise is None
        else self._check_latents(_nchw_to_nhwc(encode_noise), lshape, "encode_noise")
      )
      with self.context():
        z = self.jit("image_latents", self._image_latents_fn)(self._vae.state, image, eps)
    if b % z.shape[0]:
      raise ValueError(f"{z.shape[0]} images for {b} outputs: give 1 image or one per output")
    return jnp.tile(z, (b // z.shape[0], 1, 1, 1))
