"""Wan 2.1 / 2.2 video pipelines: text-to-video, image-to-video, two experts, TI2V.

Three kinds of jitted programs per shape: text (and CLIP image) encoding, the denoising loop and VAE
decoding (plus the VAE encode of the conditioning video for image-to-video). The loop is one
`fori_loop` per expert over UniPC steps, with classifier-free guidance as a batch of 2
(`[negative, positive]`) inside, so a pipeline compiles once per shape and setting.

Behaviour follows diffusers' `WanPipeline` and `WanImageToVideoPipeline` (0.42): prompt cleaning, UMT5
states trimmed at each prompt's length and zero-padded to 512, `num_frames` rounded down to `4k + 1`,
latents normalised by the VAE's `latents_mean` / `latents_std`, the I2V mask (first / last frame) and
image latents concatenated on channels, CLIP `hidden_states[-2]` image tokens (Wan 2.1 I2V), the expert
switch at `boundary_ratio * num_train_timesteps` with `guidance_scale_2` (Wan 2.2 A14B) and the per-token
timesteps of `expand_timesteps` (Wan 2.2 TI2V-5B).
"""

from __future__ import annotations

import html
import os
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import md_core
import md_schedulers as mdsch
import md_text
import md_vae
import md_wan
from md_core import call as mdc
from md_core import pipeline as mdp
from md_lora import LoRAPipeline
from md_wan._sizes import check_wan_size
from md_wan._transformer import WanTransformer
from md_wan._weights import load_transformer

_CLASSES = ("WanPipeline", "WanImageToVideoPipeline")
MAX_SEQUENCE_LENGTH = 512

# The negative prompt the Wan authors recommend (diffusers' examples and the Wan repo use it).
DEFAULT_NEGATIVE_PROMPT = (
  "Bright tones, overexposed, static, blurred details, subtitles, style, works, paintings, images, "
  "static, overall gray, worst quality, low quality, JPEG compression residue, ugly, incomplete, extra "
  "fingers, poorly drawn hands, poorly drawn faces, deformed, disfigured, misshapen limbs, fused "
  "fingers, still picture, messy background, three legs, many people in the background, walking "
  "backwards"
)


def clean_prompt(text: str) -> str:
  """The reference's `prompt_clean`: ftfy (when installed), HTML unescaping twice, whitespace runs → one
  space, stripped."""
  try:
    import ftfy  # noqa: PLC0415 - optional, as in the reference

    text = ftfy.fix_text(text)
  except ImportError:
    pass
  text = html.unescape(html.unescape(text)).strip()
  return re.sub(r"\s+", " ", text).strip()


def _f32(x: Any) -> jax.Array:
  return jnp.asarray(x, jnp.float32)


def _nearest(value: int, factor: int) -> str:
  low = max(factor, value // factor * factor)
  return str(low) if low == value else f"{low} or {low + factor}" if low < value else str(low)


def _image_array(image: Any, what: str) -> np.ndarray:
  """One image as float32 `[1, H, W, 3]` in [0, 1], read by `md_core.images.image_batch` (the forms and
  the uint8 scaling every family's image input takes)."""
  x = md_core.images.image_batch(image, what=what)
  if x.shape[0] != 1:
    raise ValueError(
      f"{what}: expected one image per call; got a batch of {x.shape[0]} ({x.shape})"
    )
  return x


class WanVideoPipeline(LoRAPipeline, mdp.Pipeline):
  """A loaded Wan pipeline (see `load_pipeline`); call it to generate videos.

  Attributes:
    transformer: the (high-noise) expert; `transformer_2` the low-noise expert of Wan 2.2 A14B or None.
    vae: the Wan VAE; text_encoder, tokenizer: UMT5 and its tokenizer.
    image_encoder: CLIP vision encoder of Wan 2.1 I2V (None otherwise); `image_size` its input size.
    image_to_video: whether the checkpoint is an image-to-video one (needs `image=`).
    boundary_ratio: Wan 2.2 expert switch (`transformer` while t >= ratio * num_train_timesteps).
    expand_timesteps: Wan 2.2 TI2V per-token timesteps (the image's latents replace the first frame).
    scheduler_config: the checkpoint's `scheduler_config.json` dict.
  """

  family = "wan"
  media = "video"
  lora_components = ("transformer", "transformer_2")  # what pipe.load_lora adapts

  def lora_key_map(self, component: str):
    from md_wan._weights import convert_key  # noqa: PLC0415

    return convert_key

  def noise_layout(self) -> mdp.NoiseLayout:
    """Noise drawn and taken as `[n, C, (F-1)/t + 1, H/f, W/f]`."""
    return mdp.NoiseLayout(
      "video",
      int(max(self.size_multiple)),
      int(self.vae.config.z_dim),
      int(self.vae_scale_factor_spatial),
      int(self.vae_scale_factor_temporal),
    )

  @classmethod
  def size_problems(cls, source, height, width, num_frames=1) -> list[str]:
    """`check_wan_size`: the checkpoint's VAE and patch multiples and `4k + 1` frames, from configs."""
    return check_wan_size(source, height, width, num_frames)

  def __init__(
    self,
    *,
    transformer: WanTransformer,
    vae: md_vae.WanVAE,
    text_encoder: md_text.T5Encoder,
    tokenizer: Any,
    scheduler_config: Mapping[str, Any],
    transformer_2: WanTransformer | None = None,
    image_encoder: md_text.CLIPVisionModel | None = None,
    image_size: int | None = None,
    image_to_video: bool = False,
    boundary_ratio: float | None = None,
    expand_timesteps: bool = False,
    mesh: jax.sharding.Mesh | None = None,
    source: str = "",
  ):
    if transformer_2 is not None and boundary_ratio is None:
      raise ValueError("a pipeline with transformer_2 needs boundary_ratio (Wan 2.2: 0.875 or 0.9)")
    if boundary_ratio is not None and transformer_2 is None:
      raise ValueError(
        f"boundary_ratio={boundary_ratio} needs transformer_2 (the low-noise expert)"
      )
    if (transformer.cfg.image_dim is not None) and image_encoder is None:
      raise ValueError(
        "the transformer has the Wan 2.1 I2V image branch (image_dim set): the pipeline needs its CLIP "
        "image_encoder"
      )
    self.transformer, self.transformer_2, self.vae = transformer, transformer_2, vae
    self.text_encoder, self.tokenizer, self.image_encoder = text_encoder, tokenizer, image_encoder
    self.image_size = image_size
    self.scheduler_config = dict(scheduler_config)
    self.image_to_video = image_to_video
    self.boundary_ratio, self.expand_timesteps = boundary_ratio, expand_timesteps
    self._init_scaffold(mesh, source)
    self._t1, self._t2 = mdp.Split.of(transformer), mdp.Split.of(transformer_2)
    self._vae, self._te, self._ie = (
      mdp.Split.of(vae),
      mdp.Split.of(text_encoder),
      mdp.Split.of(image_encoder),
    )

  # --- facts --------------------------------------------------------------------------------------------
  @property
  def vae_scale_factor_spatial(self) -> int:
    return self.vae.config.spatial_factor

  @property
  def vae_scale_factor_temporal(self) -> int:
    return self.vae.config.temporal_factor

  @property
  def size_multiple(self) -> tuple[int, int]:
    """Pixels per token along height and width (VAE factor × patch)."""
    _, ph, pw = self.transformer.cfg.patch_size
    s = self.vae_scale_factor_spatial
    return s * ph, s * pw

  def make_scheduler(self, **options: Any) -> mdsch.Scheduler:
    """The checkpoint's scheduler with `options` overridden (e.g. `flow_shift=5.0` for 720p)."""
    return mdsch.from_config(self.scheduler_config, **options)

  # --- encoders ------------------------------------------------------------------------------------------
  def encode_prompt(
    self, prompts: Sequence[str], max_sequence_length: int = MAX_SEQUENCE_LENGTH
  ) -> jax.Array:
    """UMT5 states `[B, max_sequence_length, D]`, zero after each prompt's last token (as the reference
    trims and pads them)."""
    tokens = md_text.tokenize(
      self.tokenizer,
      [clean_prompt(p) for p in mdp.as_prompts(prompts)],
      max_length=max_sequence_length,
    )
    te = self._te

    def encode(state, ids, mask):
      h = te.merge(state)(ids, mask)
      return (h.astype(jnp.float32) * mask[..., None]).astype(h.dtype)

    fn = self.jit(("encode", max_sequence_length), lambda: jax.jit(encode))
    with self.context():
      return fn(self._te.jit_state(), jnp.asarray(tokens.ids), jnp.asarray(tokens.mask))

  def encode_image(self, images: Any) -> jax.Array:
    """CLIP image tokens (`hidden_states[-2]`, `[N, tokens, D]`) of images: `[N, H, W, 3]` (uint8, or
    floats in [0, 1]), or PIL images / `[H, W, 3]` arrays in a list.

    The images are resized and cropped on the host as the reference's CLIP image processor does
    (`md_text.clip_image_preprocess`, PIL bicubic), then encoded in one jitted call.
    """
    if self.image_encoder is None:
      raise ValueError(
        "this pipeline has no image_encoder (only Wan 2.1 I2V uses CLIP image tokens)"
      )
    size = self.image_size or self.image_encoder.config.image_size
    pixels = md_text.clip_image_preprocess(images, size=size)
    ie = self._ie

    def encode(state, pixels):
      return ie.merge(state)(pixels, output_hidden_states=True).hidden_states[-2]

    with self.context():
      return self.jit("image", lambda: jax.jit(encode))(self._ie.state, jnp.asarray(pixels))

  def _condition_fn(self, num_frames: int, has_last: bool):
    vae = self._vae
    expand = self.expand_timesteps

    def condition(state, first, last):  # first, last: [1, H, W, 3] in [0, 1]
      model = vae.merge(state)
      x = first[:, None] * 2 - 1  # [1, 1, H, W, 3]
      if not expand:
        _, _, h, w, c = x.shape
        tail = [jnp.zeros((1, num_frames - (2 if has_last else 1), h, w, c), x.dtype)]
        if has_last:
          tail.append(last[:, None] * 2 - 1)
        x = jnp.concatenate([x, *tail], axis=1)
      z = model.normalize_latents(model.encode(x).mode())  # [1, f, h, w, z]
      return z

    return jax.jit(condition)

  def _i2v_mask(self, num_frames: int, latent_shape, has_last: bool) -> np.ndarray:
    """The reference's `mask_lat_size`: `[1, f, h, w, 4]` channels-last, 1 on given frames."""
    t = self.vae_scale_factor_temporal
    _, f, h, w = latent_shape
    frames = np.zeros((num_frames,), np.float32)
    frames[0] = 1.0
    if has_last:
      frames[-1] = 1.0
    # The first frame stands for `t` frames (the causal VAE's first latent frame covers one).
    extended = np.concatenate([np.repeat(frames[:1], t), frames[1:]])  # [t * f]
    mask = extended.reshape(f, t)  # [f, t]: latent frame × channel
    return np.broadcast_to(mask[None, :, None, None, :], (1, f, h, w, t)).copy()

  # --- the loop ---------------------------------------------------------------------------------------------
  def _denoiser(self, expert: int, mode: str, branches: int):
    """The family part of sampling: model inputs for every guidance row, then the transformer."""
    split = self._t1 if expert == 0 else self._t2
    patch = self.transformer.cfg.patch_size

    def denoise(params, x, t, cond, *, step):
      del step
      # The branches in `x`: fewer than `branches` when a CFG cache runs without the negative rows
      # (the image condition has one row per video).
      reps = branches if cond["condition"] is None else x.shape[0] // cond["condition"].shape[0]

      def rows(a):  # per-video inputs, repeated for each guidance branch
        return None if a is None else jnp.concatenate([a] * reps, axis=0)

      # Looked up on the package at trace time: the one model-input function training uses too.
      inputs = md_wan.model_inputs(
        x, t, cond["context"], condition=rows(cond["condition"]),
        frame_mask=cond["frame_mask"] if mode == "expand" else None,
        image_tokens=rows(cond["image_tokens"]), patch_size=patch,
      )  # fmt: skip
      return split.merge(params)(*inputs, layout="BFHWC")

    return denoise

  def _run_fn(self, sched, *, switch: int, total: int, guide, mode: str, cache):
    """One jitted chunk of steps `[lo, hi)` (traced bounds) over both experts."""
    d1 = self._denoiser(0, mode, guide.num_branches)
    d2 = self._denoiser(1, mode, guide.num_branches) if switch < total else None

    def run(carry, lo, hi, s1, s2, cond, g1, g2):
      experts = [mdsch.Expert(d1, s1, switch, g1)]
      if d2 is not None:
        experts.append(mdsch.Expert(d2, s2, total, g2))
      return mdsch.run_steps(
        None, sched, carry, lo, hi, cond, guidance=guide, experts=experts, cache=cache
      )

    return jax.jit(run)

  def _decode_fn(self):
    vae = self._vae

    def decode(state, latents):  # [B, f, h, w, z] → [B, F, H, W, 3] in [0, 1]
      model = vae.merge(state)
      video = model.decode(model.denormalize_latents(latents.astype(jnp.float32)))
      return jnp.clip(video / 2 + 0.5, 0.0, 1.0)

    return jax.jit(decode)

  def decode(self, latents: jax.Array) -> jax.Array:
    """The denoiser's latents `[B, f, h, w, z]` (channels-last) → frames `[B, F, H, W, 3]` in [0, 1]."""
    with self.context():
      return self.jit("decode", self._decode_fn)(self._vae.state, latents)

  # --- the call --------------------------------------------------------------------------------------------
  def check_size(self, height: int, width: int, num_frames: int) -> int:
    """Validates the video size and returns `num_frames`.

    Raises:
      md_core.pipeline.SizeError: a height or width that the VAE and the patching cannot take, or a
        frame count that is not `4k + 1`, naming the nearest valid values. (The reference rounds such a
        count down with a warning; md refuses it, so a run never makes another length than asked.)
    """
    mh, mw = self.size_multiple
    for name, value, m in (("height", height, mh), ("width", width, mw)):
      try:
        mdp.check_multiple(name, value, m)
      except mdp.SizeError as e:
        raise mdp.SizeError(
          f"{e} (VAE factor {self.vae_scale_factor_spatial} x patch "
          f"{self.transformer.cfg.patch_size[1:]})"
        ) from None
    t = self.vae_scale_factor_temporal
    if isinstance(num_frames, bool) or not isinstance(num_frames, int | np.integer):
      raise mdp.SizeError(f"num_frames must be an int, got {num_frames!r}")
    if num_frames < 1:
      raise mdp.SizeError(
        f"num_frames={num_frames} must be >= 1 (valid counts are {t}k + 1: 1, {t + 1}, {2 * t + 1}, ...)"
      )
    if num_frames % t != 1:
      below = (num_frames - 1) // t * t + 1
      raise mdp.SizeError(
        f"num_frames={num_frames} is not {t}k + 1; the nearest valid: {below} or {below + t}"
      )
    return int(num_frames)

  # --- the call's steps ------------------------------------------------------------------------------------
  def _check_call(self, output_type, height, width, num_frames, image, last_image) -> int:
    """Validates a call's settings and images before any work; returns `num_frames`."""
    mdc.check_output_type(output_type)
    num_frames = self.check_size(height, width, num_frames)
    with self.context():
      # Heads vs tensor / Ulysses degrees: fail before any encoding or compiling.
      for model in (self.transformer, self.transformer_2):
        if model is not None:
          model._check_mesh()
    if self.image_to_video and image is None and not self.expand_timesteps:
      raise ValueError(
        f"{self.source or 'this pipeline'} is an image-to-video checkpoint: pass image= (the first frame, "
        "[H, W, 3]); use a text-to-video checkpoint for video from text alone"
      )
    if image is None and last_image is not None:
      raise ValueError("last_image needs image (the first frame) too")
    if image is not None and not (self.image_to_video or self.expand_timesteps):
      raise ValueError(
        "image= was given to a text-to-video checkpoint; load an I2V one (Wan2.1-I2V, Wan2.2-I2V-A14B) "
        "or TI2V-5B"
      )
    cfg = self.transformer.cfg
    if last_image is not None and cfg.image_dim is not None and cfg.pos_embed_seq_len is None:
      raise ValueError(
        "last_image with a Wan 2.1 I2V transformer: its image branch takes one image's CLIP tokens; use a "
        "first/last-frame checkpoint (Wan2.1-FLF2V-14B, pos_embed_seq_len set) or Wan2.2-I2V-A14B"
      )
    if image is not None and last_image is None and cfg.pos_embed_seq_len is not None:
      raise ValueError(
        f"{self.source or 'this pipeline'} is a first/last-frame checkpoint (Wan2.1-FLF2V, "
        f"pos_embed_seq_len={cfg.pos_embed_seq_len}): its image branch takes the CLIP tokens of two "
        "images; pass last_image= (the last frame) as well as image="
      )
    if last_image is not None and self.expand_timesteps:
      raise ValueError(
        "last_image is not supported with expand_timesteps (TI2V-5B takes one image)"
      )
    return num_frames

  def _initial_latents(self, latents, seed, batch, num_frames, height, width) -> jax.Array:
    """The initial noise `[B, f, h, w, z]`: drawn from `seed`, or given `[B, C, F, H, W]`."""
    t, s = self.vae_scale_factor_temporal, self.vae_scale_factor_spatial
    f, h, w = (num_frames - 1) // t + 1, height // s, width // s
    z = self.vae.config.z_dim
    shape = (batch, f, h, w, z)
    if latents is None:
      x = jax.random.normal(jax.random.key(int(seed)), shape, jnp.float32)
    else:
      x = jnp.asarray(latents, jnp.float32)
      want = (batch, z, f, h, w)
      if x.shape != want:
        raise ValueError(
          f"latents have shape {x.shape}; expected [B, C, F, H, W] = {want} for {batch} videos of "
          f"{num_frames} frames at {height}x{width}"
        )
      x = jnp.transpose(x, (0, 2, 3, 4, 1))
    return x

  def _image_condition(
    self, image, last_image, image_embeds, mode, shape, num_frames, height, width
  ):
    """`(condition, image_tokens)`: the image's latent condition (I2V: frame mask and latents
    `[B, f, h, w, 4 + z]`; TI2V: the image's latent frame `[B, 1, h, w, z]`) and Wan 2.1 I2V's CLIP
    tokens, None each without an image."""
    batch, f, h, w, z = shape
    condition = image_tokens = None
    if image is not None:
      given = [image] if last_image is None else [image, last_image]
      pixels = [_image_array(x, name) for x, name in zip(given, ("image", "last_image"))]
      first = self._fit_image(pixels[0], height, width)
      last = None if last_image is None else self._fit_image(pixels[1], height, width)
      fn = self.jit(
        ("condition", num_frames, last is not None),
        lambda: self._condition_fn(num_frames, last is not None),
      )
      with self.context():
        cond = fn(self._vae.state, first, last)  # [1, f or 1, h, w, z]
      cond = jnp.repeat(cond, batch, axis=0)
      if mode == "concat":
        mask = jnp.asarray(self._i2v_mask(num_frames, (1, f, h, w), last is not None))
        condition = jnp.concatenate([jnp.repeat(mask, batch, axis=0), cond], axis=-1)
      else:
        condition = cond
      if self.transformer.cfg.image_dim is not None:
        if image_embeds is None:
          # As the reference: CLIP sees the images as given (its processor resizes them itself).
          # PIL images go as given: CLIP's processor composites transparency onto white.
          image_embeds = self.encode_image(
            [x if hasattr(x, "convert") else p[0] for x, p in zip(given, pixels)]
          )
        image_tokens = self._video_image_tokens(image_embeds, batch)
    channels = z + (0 if mode != "concat" else condition.shape[-1])
    if channels != self.transformer.cfg.in_channels:
      raise ValueError(
        f"the transformer takes in_channels={self.transformer.cfg.in_channels}, the pipeline makes {channels} "
        f"(latents {z} + condition); is the checkpoint's model_index.json class right?"
      )
    return condition, image_tokens

  def __call__(
    self,
    prompt: str | Sequence[str] | None = None,
    negative_prompt: str | Sequence[str] | None = None,
    *,
    image: Any = None,
    last_image: Any = None,
    height: int = 480,
    width: int = 832,
    num_frames: int = 81,
    num_inference_steps: int = 50,
    guidance_scale: float = 5.0,
    guidance_scale_2: float | None = None,
    num_videos_per_prompt: int = 1,
    seed: int = 0,
    latents: Any = None,
    prompt_embeds: Any = None,
    negative_prompt_embeds: Any = None,
    image_embeds: Any = None,
    max_sequence_length: int = MAX_SEQUENCE_LENGTH,
    scheduler_options: Mapping[str, Any] | None = None,
    output_type: str = "np",
    callback: Callable[[int, jax.Array, jax.Array], Any] | None = None,
    cancel: Callable[[], bool] | None = None,
    cache: mdsch.StepCache | None = None,
    chunk: int | str | None = "auto",
    progress: bool = True,
  ) -> jax.Array:
    """Generates videos.

    Args:
      prompt: one prompt or a list (or pass `prompt_embeds`).
      negative_prompt: for classifier-free guidance (default: the empty prompt, as the reference).
      image: the first frame for image-to-video (`[H, W, 3]` uint8 or floats in [0, 1], or a PIL image),
        at `height` x `width` (resized otherwise); required by I2V checkpoints, optional for TI2V.
      last_image: the last frame (first/last-frame-to-video), same format.
      height, width: pixels; multiples of the VAE factor times the patch (16 for 2.1, 32 for TI2V).
      num_frames: frames; other counts than 4k + 1 become `num_frames // 4 * 4 + 1`, as in the
        reference (with a warning).
      num_inference_steps: UniPC steps.
      guidance_scale: classifier-free guidance (off at <= 1); for Wan 2.2 A14B the high-noise expert's.
      guidance_scale_2: the low-noise expert's (default: `guidance_scale`).
      num_videos_per_prompt: videos per prompt.
      seed: draws the initial noise when `latents` is None.
      latents: initial noise `[B, C, F, H, W]` (the reference's layout; latent frames and pixels / factor).
      prompt_embeds, negative_prompt_embeds: precomputed UMT5 states `[B, S, D]`.
      image_embeds: precomputed CLIP image tokens (Wan 2.1 I2V `[1, tokens, D]`; FLF2V `[2, tokens, D]`,
        the first then the last frame's), the same for every video.
      max_sequence_length: text tokens (512 in the reference).
      scheduler_options: overrides of the scheduler config (e.g. `{"flow_shift": 5.0}`).
      output_type: "np" for frames, "latent" for the final latents `[B, C, F, H, W]` (the reference's
        layout, before the VAE).
      callback: `callback(step, timestep, latents)` after each step (latents channels-last
        `[B, f, h, w, C]`); returning False stops like `cancel`.
      cancel: polled at each step boundary; True stops with `md_schedulers.Cancelled`.
      cache: a step cache (md-cache policy) deciding, on device, which steps reuse a prediction.
      chunk: steps per host dispatch ("auto", the default: about 50 ms of work per dispatch; None: the whole loop in one call; progress, callback and cancel
        act at chunk boundaries).
      progress: show a progress bar over the steps.

    Returns:
      Frames `[B, F, H, W, 3]` float32 in [0, 1], or latents with `output_type="latent"`. The denoiser
      calls made are in `self.last_calls`.
    """
    num_frames = self._check_call(output_type, height, width, num_frames, image, last_image)
    cfg_on = guidance_scale > 1.0
    if guidance_scale_2 is None:
      guidance_scale_2 = guidance_scale

    # Text.
    embeds = mdc.resolve_prompt(
      prompt, prompt_embeds, encode=lambda p: self.encode_prompt(p, max_sequence_length), given=_f32
    )
    b = embeds.shape[0]
    neg = None
    if cfg_on:
      neg = mdc.resolve_negative(
        negative_prompt, negative_prompt_embeds, embeds,
        encode=lambda p: self.encode_prompt(p, embeds.shape[1]), given=_f32,
      )  # fmt: skip
    context = mdc.guidance_rows(embeds, neg, num_videos_per_prompt)
    batch = b * num_videos_per_prompt

    # Latents (channels-last inside md) and the image conditioning.
    x = self._initial_latents(latents, seed, batch, num_frames, height, width)
    shape = x.shape
    mode = "expand" if self.expand_timesteps else "concat" if self.image_to_video else "plain"
    condition, image_tokens = self._image_condition(
      image, last_image, image_embeds, mode, shape, num_frames, height, width
    )

    # Schedule and the expert switch (static: the timesteps are known on the host).
    sched = self.make_scheduler(**dict(scheduler_options or {}))
    state = sched.init(num_inference_steps, shape=shape)
    total = mdsch.num_calls(state)
    switch = total
    if self.boundary_ratio is not None:
      boundary = self.boundary_ratio * float(sched.config["num_train_timesteps"])
      switch = int(np.sum(np.asarray(state.timesteps) >= boundary))
    guide = mdsch.guidance.Guidance(cfg=cfg_on)
    scales = [mdsch.guidance.per_step(total, {"guidance": g} if cfg_on else {})
              for g in (guidance_scale, guidance_scale_2)]  # fmt: skip
    frame_mask = None
    if mode == "expand":
      # 0 on the image's first latent frame, 1 elsewhere (all ones without an image).
      frame_mask = jnp.asarray(md_wan.first_frame_mask(shape, clean_first=condition is not None))
    cond = dict(
      context=context, image_tokens=image_tokens, condition=condition, frame_mask=frame_mask
    )
    key = ("loop", repr(sorted(sched.config.items())), total, switch, guide, mode,
           condition is not None, image_tokens is not None)  # fmt: skip
    s1, s2 = self._t1.jit_state(), None if self._t2 is None else self._t2.jit_state()
    carry = mdsch.sample_pipeline(
      self, key,
      lambda cache: self._run_fn(sched, switch=switch, total=total, guide=guide, mode=mode, cache=cache),
      x, state, args=(s1, s2, self.place(cond), *[jax.tree.map(jnp.asarray, g) for g in scales]),
      cache=cache, chunk=chunk, callback=callback, cancel=cancel, progress=progress,
    )  # fmt: skip
    x = carry.latents
    if mode == "expand":
      x = md_wan.blend_first_frame(x, condition, frame_mask)
    if output_type == "latent":
      return jnp.transpose(x, (0, 4, 1, 2, 3))
    with self.decoding(progress):
      return self.decode(x)

  def _video_image_tokens(self, image_embeds: Any, batch: int) -> jax.Array:
    """CLIP tokens of one video (`[1, T, D]`; FLF2V: first and last frame, `[2, T, D]`) repeated for
    `batch` videos, keeping each video's images together (`[first, last, first, last, ...]`)."""
    tokens = jnp.asarray(image_embeds, jnp.float32)
    per_video = 1 if self.transformer.cfg.pos_embed_seq_len is None else 2
    if tokens.ndim != 3 or tokens.shape[0] != per_video:
      what = "first and last frame" if per_video == 2 else "image"
      raise ValueError(
        f"image_embeds has shape {tuple(tokens.shape)}; this transformer takes the CLIP tokens of "
        f"{per_video} image(s) per video ({what}): [{per_video}, tokens, {self.transformer.cfg.image_dim}]"
      )
    return jnp.tile(tokens, (batch, 1, 1))

  def _fit_image(self, image: np.ndarray, height: int, width: int) -> jax.Array:
    x = jnp.asarray(image)  # [1, H, W, 3]
    if x.shape[1:3] != (height, width):
      # The reference resizes with PIL (lanczos); a resize here gives close but not identical pixels.
      x = jax.image.resize(x, (1, height, width, 3), method="lanczos3")
      x = jnp.clip(x, 0.0, 1.0)
    return x


# --- loading ----------------------------------------------------------------------------------------------------


@mdp.with_quantization
def load_pipeline(
  source: str | os.PathLike,
  *,
  mesh: jax.sharding.Mesh | None = None,
  dtype: Any = None,
  rules: Any = None,
  attention: str | None = None,
  attention_config: Any = None,
  remat: str | None = None,
  revision: str | None = None,
  progress: bool = False,
) -> WanVideoPipeline:
  """Loads a Wan 2.1 / 2.2 diffusers pipeline (`WanPipeline` or `WanImageToVideoPipeline`) as md modules.

  Args:
    source: a local diffusers folder with `model_index.json`, or a hub id
      (`"Wan-AI/Wan2.1-T2V-1.3B-Diffusers"`, `"Wan-AI/Wan2.2-I2V-A14B-Diffusers"`, ...).
    mesh: place parameters on this mesh by their logical axes (FSDP over `fsdp`, heads over `tensor`);
      the token sequence is split over `context` when `attention` is a context-parallel scheme.
    dtype: parameter dtype of the transformers and the text encoder (default float32: bfloat16 files are
      upcast); the VAE and the CLIP encoder stay float32 as the reference runs them.
    rules: md-sharding logical axis rules.
    attention: md-attention implementation of the transformers ("auto", "blockwise", "ring",
      "ulysses", "ulysses_ring", ...).
    attention_config: an `md_attention.AttentionConfig` (block sizes, Ulysses degree...).
    remat: rematerialisation policy of the transformer blocks.
    revision: hub revision.
    progress: progress bars while loading tensors.
    quantization: quantize the denoiser(s) after loading: "int8" (weight-only), "int8-dynamic"
      (weights and activations) or "fp8" (e4m3 weight-only); None keeps the loaded dtype
      (`md_core.quantize`).

  Returns:
    A `WanVideoPipeline`.

  Raises:
    FileNotFoundError: no folder / hub id, or a component missing (named).
    ValueError: a pipeline class md does not implement.
  """
  root = md_core.resolve_source(source, revision=revision)
  index, cls = mdp.read_index(
    root, _CLASSES, "Wan pipeline (transformer/, vae/, text_encoder/, tokenizer/, scheduler/)"
  )
  overrides = mdp.model_overrides(
    attention=attention, attention_config=attention_config, remat=remat
  )
  kw = dict(mesh=mesh, rules=rules, progress=progress)
  transformer = load_transformer(
    mdp.component(root, "transformer", index), subfolder=None, dtype=dtype, **kw, **overrides
  )
  transformer_2 = None
  if mdp.listed(index, "transformer_2"):
    transformer_2 = load_transformer(
      mdp.component(root, "transformer_2", index), subfolder=None, dtype=dtype, **kw, **overrides
    )
  vae = md_vae.load_vae_wan(mdp.component(root, "vae", index), subfolder=None, **kw)
  te = md_text.load_t5_encoder(mdp.component(root, "text_encoder", index), dtype=dtype, **kw)
  tok = md_text.load_tokenizer(mdp.component(root, "tokenizer", index), subfolder=None)
  image_encoder, image_size = None, None
  if mdp.listed(index, "image_encoder"):
    image_encoder = md_text.load_clip_vision(
      mdp.component(root, "image_encoder", index), subfolder=None, with_projection=False, **kw
    )
    image_size = image_encoder.config.image_size
    proc = root / "image_processor" / "preprocessor_config.json"
    if proc.is_file():
      crop = md_core.read_json(proc).get("crop_size", {})
      image_size = int(crop.get("height", image_size)) if isinstance(crop, dict) else int(crop)
  sched_cfg = mdsch.read_config(mdp.component(root, "scheduler", index))
  mdsch.from_config(sched_cfg)  # fail now, not at the first call
  ratio = index.get("boundary_ratio")
  return WanVideoPipeline(
    transformer=transformer,
    transformer_2=transformer_2,
    vae=vae,
    text_encoder=te,
    tokenizer=tok,
    image_encoder=image_encoder,
    image_size=image_size,
    scheduler_config=sched_cfg,
    image_to_video=cls == "WanImageToVideoPipeline",
    boundary_ratio=None if ratio is None else float(ratio),
    expand_timesteps=bool(index.get("expand_timesteps", False)),
    mesh=mesh,
    source=str(source),
  )
