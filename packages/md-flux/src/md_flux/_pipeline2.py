"""The Flux.2 Klein pipelines (diffusers' `Flux2KleinPipeline` and `Flux2KleinKVPipeline`).

Text → Qwen3 (chat-templated, right-padded to `max_sequence_length`; the hidden states of layers 9, 18
and 27 stacked per token) → the Flux.2 transformer's denoising loop → the Flux.2 VAE. Reference images
are read (paths, PIL images or arrays), prepared as the reference's image processor does (at most 1024²
pixels by a Lanczos resize, then centre-cropped to multiples of 16), encoded by the VAE (posterior
mode, 2x2 patchify, batch-norm normalisation), packed, appended after the target tokens with their own
time offsets in the ids (10, 20, …), and left unchanged by the update (only the target tokens'
prediction is used). In KV-cache mode (`Flux2KleinKVPipeline`) the references run only at the first
step, which returns their keys/values, reused by the later steps that see the target tokens alone.

Three kinds of jitted programs per shape: text encoding, image encoding (one per reference size), the
denoising loop (the shared `md_schedulers.run_steps` with this module's denoiser; in KV-cache mode step 0
is a program of its own that also returns the references' K/V, and the later steps read them from the
loop's conditioning), and decoding. Behaviour follows the reference: 4-axis ids
`(t, row, col, 0)` for image tokens and `(0, 0, 0, l)` for text, sigmas `linspace(1, 1/n, n)` shifted
with Flux.2's empirical `mu`, and classifier-free guidance (`neg + s * (pos - neg)`, the negative prompt
"" by default) when `guidance_scale > 1` and the model is not distilled.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import md_core
import md_flux
import md_schedulers as mdsch
import md_text
import md_vae
from md_core import pipeline as mdp
from md_flux import _pipeline_common as pc
from md_flux._flux2 import Flux2Transformer
from md_flux._pipeline_common import check_size, image_ids, unpack_latents
from md_flux._weights2 import load_flux2
from md_lora import LoRAPipeline

MAX_REFERENCE_IMAGES = 4
# The reference image processor's limits (diffusers' Flux2ImageProcessor).
_MIN_SIDE = 64
_MAX_ASPECT = 8
_MAX_AREA = 1024 * 1024


def text_ids(length: int) -> np.ndarray:
  """Flux.2's text position ids `[length, 4]`: `(0, 0, 0, l)`."""
  ids = np.zeros((length, 4), np.float32)
  ids[:, 3] = np.arange(length, dtype=np.float32)
  return ids


def _open_image(image: Any, what: str):
  """A reference image as a PIL image: files are decoded (EXIF orientation applied, RGB, as
  diffusers' `load_image`), arrays `[H, W, 3]` / `[H, W]` (uint8, or floats in [0, 1]) are
  quantised to 8 bits, PIL images are used as they are."""
  from PIL import Image

  if isinstance(image, Image.Image):
    return image
  if isinstance(image, str | os.PathLike):
    try:
      pixels = md_core.media.load_image(image)
    except FileNotFoundError as e:
      raise FileNotFoundError(f"{what}: {e}") from None
    except (ValueError, OSError) as e:
      raise ValueError(f"{what}: cannot read {os.fspath(image)!r}: {e}") from None
  else:
    arr = np.asarray(image)
    if arr.ndim == 4 and arr.shape[0] == 1:
      arr = arr[0]
    if arr.ndim not in (2, 3) or (arr.ndim == 3 and arr.shape[-1] not in (1, 3, 4)):
      raise ValueError(
        f"{what}: an image array must be [H, W, 3] (or [H, W] grey), uint8 or floats in [0, 1]; "
        f"got shape {arr.shape}"
      )
    if arr.dtype != np.uint8:
      # Refuses ambiguous scales (other integers, [-1, 1] or [0, 255] floats) instead of clipping them.
      arr = md_core.images.pixel_values(arr, what=what)
    try:
      pixels = md_core.media.load_image(arr)
    except ValueError as e:
      raise ValueError(f"{what}: {e}") from None
  return Image.fromarray(np.round(pixels * 255.0).astype(np.uint8), "RGB")


def prepare_reference_image(
  image: Any, *, multiple_of: int = 16, what: str = "image"
) -> np.ndarray:
  """A reference image as diffusers' Flux2Klein pipelines prepare it: float32 `[H, W, 3]` in [-1, 1].

  Both sides must be at least 64 pixels and the aspect ratio at most 8:1; an image of more than 1024²
  pixels is first scaled to about that area (Lanczos); then height and width are floored to multiples
  of `multiple_of` by a centre crop (`Flux2ImageProcessor.resize(..., resize_mode="crop")`).

  Raises:
    FileNotFoundError: a path that does not exist (named).
    ValueError: a file that cannot be decoded (named), or a size the reference rejects.
  """
  from PIL import Image

  pil = _open_image(image, what)
  w, h = pil.size
  if w < _MIN_SIDE or h < _MIN_SIDE:
    raise ValueError(
      f"{what}: {w}x{h} pixels is too small; Flux.2 reference images need both sides at least "
      f"{_MIN_SIDE} pixels"
    )
  if max(w / h, h / w) > _MAX_ASPECT:
    raise ValueError(
      f"{what}: {w}x{h} pixels has an aspect ratio of {max(w / h, h / w):.1f}:1; Flux.2 takes at "
      f"most {_MAX_ASPECT}:1"
    )
  lanczos = Image.Resampling.LANCZOS
  if w * h > _MAX_AREA:
    s = math.sqrt(_MAX_AREA / (w * h))
    pil = pil.resize((int(w * s), int(h * s)), lanczos)
    w, h = pil.size
  tw, th = w // multiple_of * multiple_of, h // multiple_of * multiple_of
  left, top = (w - tw) // 2, (h - th) // 2  # the centre crop (Flux2ImageProcessor._resize_and_crop)
  pil = pil.crop((left, top, left + tw, top + th)).convert("RGB")
  pixels = np.asarray(pil, np.float32) / 255.0
  return 2.0 * pixels - 1.0


class Flux2KleinPipeline(LoRAPipeline, mdp.Pipeline):
  """A loaded Flux.2 Klein pipeline (see `load_pipeline`); call it to generate or edit images.

  Attributes:
    transformer: the md `Flux2Transformer`.
    vae: the md `AutoencoderKLFlux2` (None: latents out only).
    text_encoder, tokenizer: the md `Qwen3Encoder` and its transformers tokenizer (None: prompt
      embeddings only).
    scheduler_config: the checkpoint's `scheduler_config.json` dict.
    is_distilled: guidance-distilled checkpoints never run classifier-free guidance.
    use_kv_cache: the default of `kv_cache` (True for `Flux2KleinKVPipeline` checkpoints).
    bn_mean, bn_std: the VAE's batch-norm statistics over patchified channels `[4C]`.
    last_calls: the transformer calls the last generation made (a step cache may skip some).
  """

  family = "flux2"
  lora_components = ("transformer",)  # what pipe.load_lora adapts

  def lora_key_map(self, component: str):
    from md_flux._weights2 import convert_key_flux2  # noqa: PLC0415

    return convert_key_flux2

  def noise_layout(self) -> mdp.NoiseLayout:
    """Noise drawn on the 2x2-patchified grid `[n, H/16, W/16, 4C]`, taken channels-first."""
    f, c = int(self.vae_scale_factor), int(self.transformer.cfg.in_channels)
    return mdp.NoiseLayout("image", 2 * f, c, 2 * f, layout="channels_last")

  def __init__(
    self,
    *,
    transformer: Flux2Transformer,
    scheduler_config: Mapping[str, Any],
    vae: md_vae.AutoencoderKLFlux2 | None = None,
    text_encoder: md_text.Qwen3Encoder | None = None,
    tokenizer: Any = None,
    bn_mean: np.ndarray | None = None,
    bn_std: np.ndarray | None = None,
    is_distilled: bool = False,
    use_kv_cache: bool = False,
    vae_scale_factor: int | None = None,
    mesh: jax.sharding.Mesh | None = None,
    source: str = "",
  ):
    self.transformer, self.vae = transformer, vae
    self.text_encoder, self.tokenizer = text_encoder, tokenizer
    self.scheduler_config = dict(scheduler_config)
    if vae is not None:
      eps = vae.config.batch_norm_eps
      bn_mean = np.asarray(jax.device_get(vae.bn.running_mean[...]), np.float32)
      var = np.asarray(jax.device_get(vae.bn.running_var[...]), np.float32)
      bn_std = np.sqrt(var + eps)
      vae_scale_factor = vae.config.downscale
    if bn_mean is None or bn_std is None:
      raise ValueError(
        "Flux2KleinPipeline needs the VAE or its batch-norm statistics (bn_mean, bn_std)"
      )
    self.bn_mean = np.asarray(bn_mean, np.float32)
    self.bn_std = np.asarray(bn_std, np.float32)
    self.is_distilled = bool(is_distilled)
    self.use_kv_cache = bool(use_kv_cache)
    self.vae_scale_factor = int(vae_scale_factor or 8)
    self.last_calls = 0
    self._init_scaffold(mesh, source)
    self._tr = mdp.Split.of(transformer)
    self._vae, self._te = mdp.Split.of(vae), mdp.Split.of(text_encoder)

  @property
  def default_size(self) -> int:
    """The reference's default pixel size without reference images (128 × the VAE factor: 1024)."""
    return 128 * self.vae_scale_factor

  # --- text ---------------------------------------------------------------------------------------------
  def encode_prompt(
    self,
    prompts: str | Sequence[str],
    *,
    max_sequence_length: int = md_text.FLUX2_KLEIN_MAX_LENGTH,
    text_encoder_out_layers: Sequence[int] = md_text.FLUX2_KLEIN_LAYERS,
  ) -> jax.Array:
    """Prompt embeddings `[B, max_sequence_length, len(layers) * hidden]` (the reference's
    `_get_qwen3_prompt_embeds`: chat template, right padding, stacked hidden states)."""
    if self.text_encoder is None or self.tokenizer is None:
      raise ValueError(
        f"{self.source or 'this pipeline'}: no text encoder / tokenizer was loaded (model_index.json "
        "lists none); pass prompt_embeds [B, S, joint_attention_dim] instead of a prompt"
      )
    layers = tuple(int(i) for i in text_encoder_out_layers)
    for i in layers:
      self.text_encoder.output_index(i)  # a clear error for a layer the encoder does not have
    tokens = md_text.qwen3_tokenize(self.tokenizer, prompts, max_length=int(max_sequence_length))

    def make():
      te = self._te

      def encode(state, ids, mask):
        embeds = md_text.encode_flux2_prompt(te.merge(state), ids, mask, layers=layers)
        return embeds.astype(jnp.float32)

      return jax.jit(encode)

    fn = self.jit(("encode", layers), make)
    with self.context():
      return fn(self._te.jit_state(), jnp.asarray(tokens.ids), jnp.asarray(tokens.mask))

  # --- images -------------------------------------------------------------------------------------------
  def encode_image(self, pixels: np.ndarray) -> jax.Array:
    """A prepared reference image `[H, W, 3]` in [-1, 1] → the transformer's latents
    `[1, H/16, W/16, 4C]` (posterior mode, patchified, normalised)."""
    if self.vae is None:
      raise ValueError(
        f"{self.source or 'this pipeline'}: no VAE was loaded; pass image_latents instead of images"
      )

    def make():
      vae = self._vae
      return jax.jit(lambda state, x: vae.merge(state).encode_latents(x).astype(jnp.float32))

    fn = self.jit(("encode_image", pixels.shape), make)
    with self.context():
      return fn(self._vae.state, jnp.asarray(pixels, jnp.float32)[None])

  def decode(self, latents: jax.Array, rows: int, cols: int) -> jax.Array:
    """The transformer's packed latents `[B, rows * cols, 4C]` → images `[B, 16 rows, 16 cols, 3]`
    in [0, 1]."""
    if self.vae is None:
      raise ValueError(
        f"{self.source or 'this pipeline'}: no VAE was loaded; call with output_type='latent'"
      )

    def make():
      vae = self._vae

      def decode(state, packed):
        b, _, c = packed.shape
        images = vae.merge(state).decode_latents(packed.reshape(b, rows, cols, c))
        return jnp.clip(images.astype(jnp.float32) / 2 + 0.5, 0.0, 1.0)

      return jax.jit(decode)

    fn = self.jit(("decode", rows, cols), make)
    with self.context():
      return fn(self._vae.state, latents)

  def _reference_latents(self, images: Sequence[Any]) -> tuple[list[jax.Array], tuple[int, int]]:
    """Prepared and encoded reference images, and the first one's pixel size `(height, width)`."""
    m = 2 * self.vae_scale_factor
    latents, size = [], None
    for i, image in enumerate(images):
      pixels = prepare_reference_image(image, multiple_of=m, what=f"reference image {i}")
      size = size or pixels.shape[:2]
      latents.append(self.encode_image(pixels))
    return latents, size

  # --- the loop -----------------------------------------------------------------------------------------
  def _denoiser(self, mode: str, s_img: int):
    """The family part of sampling: the transformer on every guidance row (text states stacked in the
    loop's row order in `cond`).

    `mode`: "plain" (the target tokens alone), "append" (the references appended after the target on
    every row; only the target's prediction is kept) or "cached" (the target alone, attending over the
    references' keys/values in `cond["kv"]`).
    """
    tr = self._tr

    def denoise(params, x, t, cond, *, step):
      del step
      model, t = tr.merge(params), t / 1000
      if mode == "cached":
        inputs = md_flux.flux2_model_inputs(
          x, t, cond["context"], img_ids=cond["img_ids"], txt_ids=cond["txt_ids"]
        )
        return model(*inputs, kv_cache=cond["kv"])
      # Looked up on the package at trace time: the one model-input function training uses too.
      inputs = md_flux.flux2_model_inputs(
        x, t, cond["context"], img_ids=cond["ids"], txt_ids=cond["txt_ids"],
        references=cond["refs"] if mode == "append" else None,
      )  # fmt: skip
      return model(*inputs)[:, :s_img]

    return denoise

  def _first_step_fn(self, sched, cache):
    """Step 0 of the KV-cache mode (`Flux2KleinKVPipeline`), its own program: the transformer over
    `[references; target]` (references modulated at the fixed timestep, attending to themselves)
    gives the target's prediction and the references' K/V; the shared loop's step 0 then takes that
    prediction. Returns the carry after step 0 and the cache."""
    tr = self._tr

    def given(params, x, t, prediction, *, step):
      del params, x, t, step
      return prediction

    def first(params, carry, cond):
      st, x, refs = carry.scheduler, carry.latents, cond["refs"]
      t = jnp.full((x.shape[0],), mdsch.current_timestep(st) / 1000)
      xin = jnp.concatenate([refs, sched.scale_model_input(st, x)], axis=1)
      v, kv = tr.merge(params)(
        xin, cond["context"], t, cond["ids"], cond["txt_ids"], num_ref_tokens=refs.shape[1]
      )
      return mdsch.run_steps(given, sched, carry, 0, 1, v, cache=cache), kv

    return jax.jit(first)

  def _embeddings(self, prompts, embeds, what, text_kw) -> jax.Array:
    if embeds is not None:
      if prompts:
        raise ValueError(f"pass either {what} or {what}_embeds, not both")
      embeds = jnp.asarray(embeds, jnp.float32)
      d = self.transformer.cfg.joint_attention_dim
      if embeds.ndim != 3 or embeds.shape[-1] != d:
        raise ValueError(f"{what}_embeds have shape {embeds.shape}; expected [B, S, {d}]")
      return embeds
    if not prompts:
      raise ValueError(f"pass {what} (a string or a list) or {what}_embeds [B, S, D]")
    return self.encode_prompt(prompts, **text_kw)

  # --- the call's steps ------------------------------------------------------------------------------------
  def _check_call(self, output_type, image, images, image_latents, height, width,
                  num_inference_steps, guidance_scale, kv_cache):  # fmt: skip
    """Validates a call before any encoding; returns the reference images (a list or None), whether
    guidance runs and whether the KV-cache mode runs."""
    pc.check_output_type(output_type)
    if image is not None and images is not None:
      raise ValueError("pass reference images as image= or images=, not both")
    refs_in = image if image is not None else images
    if refs_in is not None and not isinstance(refs_in, list | tuple):
      refs_in = [refs_in]
    if refs_in is not None and image_latents is not None:
      raise ValueError("pass reference images or image_latents, not both")
    n_refs = len(refs_in if refs_in is not None else image_latents or [])
    if n_refs > MAX_REFERENCE_IMAGES:
      raise ValueError(
        f"{n_refs} reference images given; Flux.2 Klein takes at most {MAX_REFERENCE_IMAGES}"
      )
    if refs_in is None:  # fail before encoding anything
      size = self.default_size
      check_size(height or size, width or size, 2 * self.vae_scale_factor)
    if int(num_inference_steps) < 1:
      raise ValueError(f"num_inference_steps must be at least 1, got {int(num_inference_steps)}")
    cfg_on = guidance_scale > 1 and not self.is_distilled
    kv = self.use_kv_cache if kv_cache is None else bool(kv_cache)
    if kv and cfg_on:
      raise ValueError(
        f"the KV-cache mode runs without guidance (as Flux2KleinKVPipeline); got guidance_scale="
        f"{guidance_scale} on a non-distilled model: pass guidance_scale=1 or kv_cache=False"
      )
    return refs_in, cfg_on, kv

  def _text_rows(self, prompt, negative_prompt, prompt_embeds, negative_prompt_embeds, *, reps,
                 cfg_on, guidance_scale, max_sequence_length, text_encoder_out_layers):  # fmt: skip
    """The loop's text rows (`[negative;] positive`, each prompt's `reps` times) and the number of
    images."""
    text_kw = dict(
      max_sequence_length=max_sequence_length, text_encoder_out_layers=text_encoder_out_layers
    )
    prompts = mdp.as_prompts(prompt)
    embeds = self._embeddings(prompts, prompt_embeds, "prompt", text_kw)
    if reps < 1:
      raise ValueError(f"num_images_per_prompt must be at least 1, got {reps}")
    ctx = jnp.repeat(embeds, reps, axis=0)
    if cfg_on:
      if negative_prompt_embeds is None:
        if self.text_encoder is None:
          raise ValueError(
            f"guidance_scale={guidance_scale} > 1 runs classifier-free guidance: pass "
            "negative_prompt_embeds (the reference encodes the empty prompt), or guidance_scale=1"
          )
        negs = mdp.as_prompts(negative_prompt if negative_prompt is not None else "")
        if len(negs) not in (1, embeds.shape[0]):
          raise ValueError(
            f"{len(negs)} negative prompts for {embeds.shape[0]} prompts; give one or one per prompt"
          )
        neg = self.encode_prompt(negs, **text_kw)
        neg = jnp.broadcast_to(neg, (embeds.shape[0], *neg.shape[1:]))
      else:
        if negative_prompt is not None:
          raise ValueError("pass either negative_prompt or negative_prompt_embeds, not both")
        neg = jnp.asarray(negative_prompt_embeds, jnp.float32)
      neg = jnp.repeat(neg, reps, axis=0)
      if neg.shape != ctx.shape:
        raise ValueError(
          f"negative prompt embeddings have shape {neg.shape}; the prompt's {ctx.shape}; they must "
          "match (same max_sequence_length, one negative per prompt)"
        )
      ctx = jnp.concatenate([neg, ctx], axis=0)  # the loop's row order: [negative, positive]
    return ctx, embeds.shape[0] * reps

  def _initial_latents(self, latents, seed, batch, rows, cols, height, width) -> jax.Array:
    """The initial noise as packed tokens `[B, rows * cols, C]`: drawn from `seed`, or given in the
    reference's layout `[B, 4C, H/16, W/16]`."""
    ch = self.transformer.cfg.in_channels
    if latents is None:
      noise = jax.random.normal(mdp.seed_key(seed), (batch, rows, cols, ch), jnp.float32)
    else:
      noise = jnp.asarray(latents, jnp.float32)
      if noise.shape != (batch, ch, rows, cols):
        raise ValueError(
          f"latents have shape {noise.shape}; expected [B, 4C, H/16, W/16] = "
          f"{(batch, ch, rows, cols)} for this batch, height={height}, width={width}"
        )
      noise = noise.transpose(0, 2, 3, 1)
    return noise.reshape(batch, rows * cols, ch)

  def _references(self, image_latents, batch):
    """`(refs, ids)`: the reference latents packed after each other `[B, R, C]` and their position ids
    `[R, 4]` (reference i at time 10 (i + 1)), or None each without references."""
    ch = self.transformer.cfg.in_channels
    ids = []
    refs = None
    if image_latents is not None and len(image_latents):
      packed = []
      for i, ref in enumerate(image_latents):
        ref = jnp.asarray(ref, jnp.float32)
        if ref.ndim != 4 or ref.shape[-1] != ch or ref.shape[0] not in (1, batch):
          raise ValueError(
            f"image_latents[{i}] has shape {ref.shape}; expected [1 or {batch}, h, w, {ch}] "
            "(normalised, patchified, channels-last)"
          )
        _, h_r, w_r, _ = ref.shape
        packed.append(jnp.broadcast_to(ref, (batch, h_r, w_r, ch)).reshape(batch, h_r * w_r, ch))
        ids.append(image_ids(h_r, w_r, time=10.0 * (i + 1), axes=4))
      refs = jnp.concatenate(packed, axis=1)
    return refs, (jnp.asarray(np.concatenate(ids)) if ids else None)

  def _kv_chunks(self, run, sched, sched_key, params, cond, scales, refs, ref_ids, img_ids, cache):
    """The KV-cache mode's chunk (step 0 in its own program, making the references' K/V; the later
    steps reading them), its arguments, and the cache adapted to size its slots from step 1."""
    first = self.jit(("first", sched_key, cache), lambda: self._first_step_fn(sched, cache))
    first_cond = dict(
      context=cond["context"],
      txt_ids=cond["txt_ids"],
      refs=self.place(refs),
      ids=jnp.concatenate([ref_ids, img_ids]),
    )
    kv_cache = []

    def chunk_fn(carry, lo, hi):
      if lo == 0:  # step 0 returns the references' K/V; the later steps read them from cond
        carry, cache_kv = first(params, carry, first_cond)
        kv_cache.append(cache_kv)
        lo = np.int32(1)
      if lo < hi:
        carry = run(carry, lo, hi, params, {**cond, "kv": kv_cache[0]}, scales)
      return carry

    if cache is not None and cache.prepare is not None:
      # Step 0 runs outside the block hook (it counts as computed; a block cache starts at step 1,
      # whose hidden states have the cached-KV layout): size the cache's slots from step 1.
      plain_first = self.jit(("first", sched_key, None), lambda: self._first_step_fn(sched, None))

      def probe(c):
        c, cache_kv = plain_first(params, c, first_cond)
        return run(c, np.int32(1), np.int32(2), params, {**cond, "kv": cache_kv}, scales)

      cache = cache._replace(prepare=lambda run_one, carry, _p=cache.prepare: _p(probe, carry))
    return chunk_fn, (), cache

  def __call__(
    self,
    prompt: str | Sequence[str] | None = None,
    image: Any = None,
    *,
    images: Sequence[Any] | None = None,
    negative_prompt: str | Sequence[str] | None = None,
    height: int | None = None,
    width: int | None = None,
    num_inference_steps: int = 50,
    guidance_scale: float = 4.0,
    num_images_per_prompt: int = 1,
    seed: int = 0,
    latents: Any = None,
    prompt_embeds: Any = None,
    negative_prompt_embeds: Any = None,
    image_latents: Sequence[Any] | None = None,
    kv_cache: bool | None = None,
    sigmas: Sequence[float] | None = None,
    max_sequence_length: int = md_text.FLUX2_KLEIN_MAX_LENGTH,
    text_encoder_out_layers: Sequence[int] = md_text.FLUX2_KLEIN_LAYERS,
    output_type: str = "np",
    callback: Callable[[int, jax.Array, jax.Array], Any] | None = None,
    cancel: Callable[[], bool] | None = None,
    cache: mdsch.StepCache | None = None,
    chunk: int | str | None = "auto",
    progress: bool = True,
  ) -> jax.Array:
    """Generates images from text, optionally conditioned on up to 4 reference images.

    Args:
      prompt: one prompt or a list (or pass `prompt_embeds`).
      image: one reference image or a list (paths, PIL images, or arrays `[H, W, 3]` uint8 / floats
        in [0, 1]); `images=` is the same. Prepared as the reference does (see
        `prepare_reference_image`) and encoded by the VAE.
      negative_prompt: the unconditional prompt for guidance (default "", what the reference always
        uses; it has no parameter for it).
      height, width: pixels, multiples of 16 (default: the first reference image's prepared size, or
        1024).
      num_inference_steps: denoising steps.
      guidance_scale: classifier-free guidance when > 1 and the model is not distilled.
      num_images_per_prompt: outputs per prompt.
      seed: the noise seed (same seed and inputs → same images).
      latents: initial noise in the reference's layout `[B, 4C, H/16, W/16]` (patchified, NCHW).
      prompt_embeds: `[B, S, joint_attention_dim]` (the reference's stacked Qwen3 hidden states).
      negative_prompt_embeds: for guidance (default: `negative_prompt` encoded).
      image_latents: instead of images, up to 4 reference latents, each normalised and patchified
        channels-last `[1 or B, h_r, w_r, 4C]` (`vae.encode_latents`).
      kv_cache: compute the references' keys/values once at the first step and reuse them
        (diffusers' `Flux2KleinKVPipeline`; no guidance). Default: on for KV checkpoints.
      sigmas: custom sigmas (default `linspace(1, 1/n, n)`).
      max_sequence_length: Qwen3 tokens per prompt (512 in the reference).
      text_encoder_out_layers: the Qwen3 hidden states stacked into the prompt embeddings.
      output_type: "np": images `[B, H, W, 3]` in [0, 1]; "latent": the reference's
        `output_type="latent"` (denormalised, unpatchified latents `[B, H/8, W/8, C]`, channels-last).
      callback: `callback(step, timestep, latents)` after each step (packed latents `[B, S, 4C]`);
        returning False stops like `cancel`.
      cancel: polled at each step boundary; True stops with `md_schedulers.Cancelled`.
      cache: a step cache (md-cache policy) deciding, on device, which steps reuse a prediction (in
        KV-cache mode step 0 always runs: it makes the references' K/V).
      chunk: steps per host dispatch ("auto", the default: about 50 ms of work per dispatch; None: the whole loop in one call, after step 0's own program in
        KV-cache mode; progress, callback and cancel act at chunk boundaries).
      progress: show a progress bar over the steps.

    Returns:
      Images `[B * num_images_per_prompt, height, width, 3]` in [0, 1] (float32), or latents. The
      transformer calls made are in `self.last_calls`.

    Raises:
      md_core.pipeline.SizeError: sizes that do not pack (naming the nearest valid ones).
      ValueError: more than 4 reference images, an image that cannot be read (named) or is too small,
        missing or conflicting prompt inputs, inputs of the wrong shape.
      FileNotFoundError: a reference image path that does not exist.
      md_schedulers.Cancelled: `cancel()` returned True (or `callback` returned False).
    """
    refs_in, cfg_on, kv = self._check_call(
      output_type, image, images, image_latents, height, width, num_inference_steps,
      guidance_scale, kv_cache,
    )  # fmt: skip
    n = int(num_inference_steps)
    reps = int(num_images_per_prompt)
    ctx, batch = self._text_rows(
      prompt, negative_prompt, prompt_embeds, negative_prompt_embeds, reps=reps, cfg_on=cfg_on,
      guidance_scale=guidance_scale, max_sequence_length=max_sequence_length,
      text_encoder_out_layers=text_encoder_out_layers,
    )  # fmt: skip

    ref_size = None
    if refs_in is not None:
      image_latents, ref_size = self._reference_latents(refs_in)
    height = height or (ref_size[0] if ref_size else self.default_size)
    width = width or (ref_size[1] if ref_size else self.default_size)
    check_size(height, width, 2 * self.vae_scale_factor)
    f = self.vae_scale_factor
    rows, cols = height // (2 * f), width // (2 * f)
    x = self._initial_latents(latents, seed, batch, rows, cols, height, width)
    refs, ref_ids = self._references(image_latents, batch)

    sched, st = pc.schedule(
      self.scheduler_config, n, sigmas, mdsch.flux2_empirical_mu(rows * cols, n)
    )
    guide = mdsch.guidance.Guidance(cfg=cfg_on)
    scales = mdsch.guidance.per_step(
      mdsch.num_calls(st), {"guidance": guidance_scale} if cfg_on else {}
    )
    s_img = rows * cols
    img_ids = jnp.asarray(image_ids(rows, cols, axes=4))
    cond = dict(context=self.place(ctx), txt_ids=jnp.asarray(text_ids(ctx.shape[1])))
    kv = kv and refs is not None  # without references the KV mode is plain text-to-image
    mode = "cached" if kv else "plain" if refs is None else "append"
    if mode == "cached":
      cond["img_ids"] = img_ids
    else:
      cond["ids"] = img_ids if refs is None else jnp.concatenate([img_ids, ref_ids])
      cond["refs"] = None if refs is None else self.place(refs)
    sched_key = repr(sorted(sched.config.items()))
    run = self.jit(
      ("loop", sched_key, guide, mode, s_img, cache),
      lambda: pc.run_fn(self._denoiser(mode, s_img), sched, guide, cache),
    )
    params = self._tr.jit_state()
    if kv:
      chunk_fn, args, cache = self._kv_chunks(
        run, sched, sched_key, params, cond, scales, refs, ref_ids, img_ids, cache
      )
    else:
      chunk_fn, args = run, (params, cond, scales)

    carry = pc.run_loop(
      self, chunk_fn, x, st, args=args,
      cache=cache, chunk=chunk, callback=callback, cancel=cancel, progress=progress,
    )  # fmt: skip
    self.last_calls, self.last_cache = int(carry.calls), carry.cache
    z = carry.latents
    if output_type == "latent":
      z = (
        z * jnp.asarray(self.bn_std)[None, None] + jnp.asarray(self.bn_mean)[None, None]
      )  # the VAE's batch-norm, undone
      return unpack_latents(z, 2 * rows, 2 * cols)
    with self.decoding(progress):
      return self.decode(z, rows, cols)


def load_klein(
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
) -> Flux2KleinPipeline:
  """Loads a Flux.2 Klein folder: transformer, VAE, scheduler, and the Qwen3 text encoder and its
  tokenizer where model_index.json lists them (a folder without them runs from prompt embeddings)."""
  kv = index.get("_class_name") == "Flux2KleinKVPipeline"
  folders = {n: mdp.component(root, n, index) for n in ("transformer", "vae", "scheduler")}
  kw = dict(mesh=mesh, rules=rules, progress=progress)
  transformer = load_flux2(folders["transformer"], dtype=dtype, attention=attention, **kw)
  vae = md_vae.load_vae_flux2(folders["vae"], subfolder=None, **kw)
  text_encoder = tokenizer = None
  if mdp.listed(index, "text_encoder") or mdp.listed(index, "tokenizer"):
    te_folder, tok_folder = (
      mdp.component(root, "text_encoder", index),
      mdp.component(root, "tokenizer", index),
    )
    text_encoder = md_text.load_qwen3_encoder(te_folder, subfolder=None, dtype=text_dtype, **kw)
    tokenizer = md_text.load_tokenizer(tok_folder, subfolder=None)
  sched_cfg = mdsch.read_config(folders["scheduler"])
  mdsch.from_config(sched_cfg)  # fail now, not at the first call, on a scheduler md lacks
  return Flux2KleinPipeline(
    transformer=transformer,
    vae=vae,
    text_encoder=text_encoder,
    tokenizer=tokenizer,
    scheduler_config=sched_cfg,
    is_distilled=bool(index.get("is_distilled", kv)),
    use_kv_cache=kv,
    mesh=mesh,
    source=source,
  )
