"""The Flux.1 text-to-image pipeline (dev, schnell).

Three jitted programs per shape: text encoding (CLIP pooled + T5), the denoising loop (the shared
`md_schedulers.run_steps` over flow-match Euler steps with this module's denoiser; true classifier-free
guidance batched inside as `[negative, positive]` rows) and VAE decoding. The models are split once into
a graph definition (static) and their state (a jit argument), so a second call with the same shapes and
settings reuses the compiled programs.

Behaviour follows diffusers' `FluxPipeline`: CLIP's pooled output and T5's last hidden state (no
attention mask), 2x2 latent packing, image ids `(0, row, col)` and zero text ids, sigmas
`linspace(1, 1/n, n)` with the dynamic shift `mu` from the image token count, the guidance embedding
for guidance-distilled models (dev), true CFG when `true_cfg_scale > 1` and a negative prompt is given,
and the VAE's `latents / scaling_factor + shift_factor` before decoding.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp

import md_flux
import md_schedulers as mdsch
import md_text
import md_vae
from md_core import pipeline as mdp
from md_flux import _pipeline_common as pc
from md_flux._flux1 import FluxTransformer
from md_flux._pipeline_common import check_size, image_ids, pack_latents, unpack_latents
from md_flux._weights1 import load_flux
from md_lora import LoRAPipeline

__all__ = ["FluxPipeline", "check_size", "image_ids", "pack_latents", "unpack_latents"]


def _decode_fn(vae: mdp.Split, cfg: md_vae.AutoencoderKLConfig, h: int, w: int):
  shift = float(cfg.shift_factor or 0.0)

  def decode(state, packed):  # [B, S, 4C] → [B, H, W, 3] in [0, 1]
    z = unpack_latents(packed.astype(jnp.float32), h, w) / cfg.scaling_factor + shift
    images = vae.merge(state).decode(z)
    return jnp.clip(images / 2 + 0.5, 0.0, 1.0)

  return jax.jit(decode)


class FluxPipeline(LoRAPipeline, mdp.Pipeline):
  """A loaded Flux.1 text-to-image pipeline (see `load_pipeline`); call it to generate images.

  Attributes:
    transformer, vae, text_encoder (CLIP), text_encoder_2 (T5): the md modules.
    tokenizer, tokenizer_2: transformers tokenizers (CLIP, T5).
    scheduler_config: the checkpoint's `scheduler_config.json` dict.
    last_calls: the transformer calls the last generation made (a step cache may skip some).
  """

  family = "flux"
  cache_defaults = {"teacache": {"coefficients": "flux"}}  # TeaCache's published Flux.1 polynomial
  lora_components = ("transformer", "text_encoder")  # what pipe.load_lora adapts
  # The CLIP encoder takes a file's LoRA only where it holds its keys (train_dreambooth_lora_flux.py's
  # `--train_text_encoder` writes `text_encoder.`; kohya's Flux LoRAs `lora_te1_`).
  lora_prefixes = {"text_encoder": ("text_encoder.", "lora_te1_", "lora_te_")}

  def lora_key_map(self, component: str):
    if component == "text_encoder":
      return md_text.clip_text_convert_key
    from md_flux._weights1 import convert_key  # noqa: PLC0415

    return convert_key

  def noise_layout(self) -> mdp.NoiseLayout:
    """Noise drawn at the VAE's resolution `[n, H/8, W/8, C/4]`, taken packed (2x2 patches)."""
    f, c = int(self.vae_scale_factor), int(self.transformer.cfg.in_channels)
    return mdp.NoiseLayout("image", 2 * f, c, f, layout="packed")

  @classmethod
  def size_problems(cls, source, height, width, num_frames=1) -> list[str]:
    """Height and width multiples of 16 (VAE factor 8 x the 2x2 packing)."""
    del source, num_frames
    try:
      check_size(height, width)
    except ValueError as e:
      return [str(e)]
    return []

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
    self.last_calls = 0
    self._init_scaffold(mesh, source)
    self._tr, self._vae = mdp.Split.of(transformer), mdp.Split.of(vae)
    self._te, self._te2 = mdp.Split.of(text_encoder), mdp.Split.of(text_encoder_2)

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

  # --- text ---------------------------------------------------------------------------------------------
  def encode_prompt(
    self, prompts: str | Sequence[str], max_sequence_length: int = 512
  ) -> tuple[jax.Array, jax.Array]:
    """T5 embeddings `[B, max_sequence_length, D]` and CLIP pooled embeddings `[B, P]` for one prompt
    (B = 1) or a list."""
    prompts = mdp.as_prompts(prompts)
    ids = md_text.tokenize(self.tokenizer, prompts).ids
    ids2 = md_text.tokenize(self.tokenizer_2, prompts, max_length=max_sequence_length).ids

    def make():
      te, te2 = self._te, self._te2

      def encode(te_state, te2_state, ids, ids2):
        pooled = te.merge(te_state)(ids, output_hidden_states=False).pooler_output
        # The reference runs T5 without an attention mask: padding tokens are attended to.
        return te2.merge(te2_state)(ids2).astype(jnp.float32), pooled.astype(jnp.float32)

      return jax.jit(encode)

    fn = self.jit("encode", make)
    with self.context():
      return fn(self._te.jit_state(), self._te2.jit_state(), jnp.asarray(ids), jnp.asarray(ids2))

  def _embeddings(self, prompt, prompt_embeds, pooled, max_sequence_length, what="prompt"):
    prompts = mdp.as_prompts(prompt, what)
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
  def _denoiser(self):
    """The family part of sampling: the transformer on every guidance row (text states stacked in
    the loop's row order in `cond`), the embedded guidance for guidance-distilled models."""
    tr, guided = self._tr, self.guidance_distilled

    def denoise(params, x, t, cond, *, step):
      del step
      # Looked up on the package at trace time: the one model-input function training uses too.
      inputs = md_flux.flux1_model_inputs(
        x, t / 1000, cond["context"], cond["pooled"], img_ids=cond["img_ids"],
        txt_ids=cond["txt_ids"], guidance=cond["guidance"] if guided else None,
      )  # fmt: skip
      return tr.merge(params)(*inputs)

    return denoise

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
    output_type: str = "np",
    callback: Callable[[int, jax.Array, jax.Array], Any] | None = None,
    cancel: Callable[[], bool] | None = None,
    cache: mdsch.StepCache | None = None,
    chunk: int | str | None = "auto",
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
      output_type: "np" for images, "latent" for the final packed latents `[B, S, 4C]` (the
        reference's `output_type="latent"`, before the VAE).
      callback: `callback(step, timestep, latents)` after each step (packed latents); returning
        False stops like `cancel`.
      cancel: polled at each step boundary; True stops with `md_schedulers.Cancelled`.
      cache: a step cache (md-cache policy) deciding, on device, which steps reuse a prediction.
      chunk: steps per host dispatch ("auto": sized to about 50 ms of work after the first steps;
        None: the whole loop in one call); progress, callback and cancel act
        between chunks.
      progress: show a progress bar over the steps.

    Returns:
      Images `[B * num_images_per_prompt, height, width, 3]` in [0, 1], float32, or latents with
      `output_type="latent"`. The transformer calls made are in `self.last_calls`.

    Raises:
      md_core.pipeline.SizeError: sizes that do not pack (naming the nearest valid ones).
      ValueError: missing or conflicting prompt inputs, latents of the wrong shape.
      md_schedulers.Cancelled: `cancel()` returned True (or `callback` returned False).
    """
    pc.check_output_type(output_type)
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
      negs = mdp.as_prompts(negative_prompt, "negative_prompt")
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
      # The loop's row order: [negative, positive].
      ctx = jnp.concatenate([jnp.repeat(neg, reps, axis=0), ctx], axis=0)
      pooled = jnp.concatenate([jnp.repeat(neg_pooled, reps, axis=0), pooled], axis=0)

    batch = embeds.shape[0] * reps
    f = self.vae_scale_factor
    h, w = height // f, width // f
    c = self.transformer.cfg.in_channels
    shape = (batch, (h // 2) * (w // 2), c)
    if latents is None:
      channels = c // 4
      noise = jax.random.normal(mdp.seed_key(seed), (batch, h, w, channels), jnp.float32)
      x = pack_latents(noise)
    else:
      x = jnp.asarray(latents, jnp.float32)
      if x.shape != shape:
        raise ValueError(
          f"latents have shape {x.shape}; expected the packed {shape} ([B, (H/16)(W/16), "
          f"{c}]) for batch {batch}, height={height}, width={width}"
        )
    mu = mdsch.calculate_shift(
      shape[1],
      self.scheduler_config.get("base_image_seq_len", 256),
      self.scheduler_config.get("max_image_seq_len", 4096),
      self.scheduler_config.get("base_shift", 0.5),
      self.scheduler_config.get("max_shift", 1.15),
    )
    sched, st = pc.schedule(self.scheduler_config, n, sigmas, mu)
    guide = mdsch.guidance.Guidance(cfg=true_cfg)
    scales = mdsch.guidance.per_step(
      mdsch.num_calls(st), {"guidance": true_cfg_scale} if true_cfg else {}
    )
    cond = dict(
      context=self.place(ctx),
      pooled=self.place(pooled),
      img_ids=jnp.asarray(image_ids(h // 2, w // 2)),
      txt_ids=jnp.zeros((ctx.shape[1], 3), jnp.float32),
      guidance=jnp.float32(guidance_scale),
    )
    carry = mdsch.sample_pipeline(
      self, ("loop", repr(sorted(sched.config.items())), guide),
      lambda cache: pc.run_fn(self._denoiser(), sched, guide, cache),
      x, st, args=(self._tr.jit_state(), cond, scales),
      cache=cache, chunk=chunk, callback=callback, cancel=cancel, progress=progress,
    )  # fmt: skip
    if output_type == "latent":
      return carry.latents
    with self.decoding(progress):
      return self.decode(carry.latents, height, width)

  def decode(self, packed: jax.Array, height: int, width: int) -> jax.Array:
    """Packed latents `[B, S, 4C]` → images `[B, height, width, 3]` in [0, 1]."""
    f = self.vae_scale_factor
    h, w = height // f, width // f
    fn = self.jit(("decode", h, w), lambda: _decode_fn(self._vae, self.vae.config, h, w))
    with self.context():
      return fn(self._vae.state, packed)


# --- loading -------------------------------------------------------------------------------------------------


def load_flux1(
  root: os.PathLike,
  index: Mapping[str, Any],
  *,
  mesh: jax.sharding.Mesh | None = None,
  dtype: Any = None,
  text_dtype: Any = None,
  rules: Any = None,
  attention: Any = None,
  progress: bool = False,
  source: str = "",
) -> FluxPipeline:
  """Loads a diffusers `FluxPipeline` folder (see `md_flux.load_pipeline`)."""
  names = ["transformer", "vae", "text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2"]
  folders = {name: mdp.component(root, name, index) for name in [*names, "scheduler"]}
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
    source=source,
  )
