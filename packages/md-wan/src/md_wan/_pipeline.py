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

import contextlib
import dataclasses
import html
import os
import re
import warnings
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


@dataclasses.dataclass
class _Split:
  """A module split once into its static graph definition and its state (a jit argument)."""

  graphdef: Any
  state: Any

  @classmethod
  def of(cls, module: nnx.Module | None) -> _Split | None:
    if module is None:
      return None
    return cls(*nnx.split(module))

  def merge(self, state: Any) -> nnx.Module:
    return nnx.merge(self.graphdef, state)


def _as_list(prompt: str | Sequence[str] | None) -> list[str] | None:
  if prompt is None:
    return None
  return [prompt] if isinstance(prompt, str) else list(prompt)


def _nearest(value: int, factor: int) -> str:
  low = max(factor, value // factor * factor)
  return str(low) if low == value else f"{low} or {low + factor}" if low < value else str(low)


def _image_array(image: Any, what: str) -> jax.Array:
  """An image as float32 `[1, H, W, 3]` in [0, 1] (uint8 input is divided by 255)."""
  if hasattr(image, "convert"):  # PIL
    image = np.asarray(image.convert("RGB"))
  x = jnp.asarray(image)
  if x.ndim == 3:
    x = x[None]
  if x.ndim != 4 or x.shape[-1] != 3 or x.shape[0] != 1:
    raise ValueError(
      f"{what} must be one RGB image [H, W, 3] (uint8, or float in [0, 1]); got shape {x.shape}"
    )
  return x.astype(jnp.float32) / 255.0 if x.dtype == jnp.uint8 else x.astype(jnp.float32)


class WanVideoPipeline:
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
    self.mesh, self.source = mesh, source
    self._t1, self._t2 = _Split.of(transformer), _Split.of(transformer_2)
    self._vae, self._te, self._ie = (
      _Split.of(vae),
      _Split.of(text_encoder),
      _Split.of(image_encoder),
    )
    self._compiled: dict[Any, Any] = {}

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

  def _context(self):
    return jax.set_mesh(self.mesh) if self.mesh is not None else contextlib.nullcontext()

  def _jit(self, key, make):
    fn = self._compiled.get(key)
    if fn is None:
      fn = self._compiled[key] = make()
    return fn

  # --- encoders ------------------------------------------------------------------------------------------
  def encode_prompt(
    self, prompts: Sequence[str], max_sequence_length: int = MAX_SEQUENCE_LENGTH
  ) -> jax.Array:
    """UMT5 states `[B, max_sequence_length, D]`, zero after each prompt's last token (as the reference
    trims and pads them)."""
    tokens = md_text.tokenize(
      self.tokenizer, [clean_prompt(p) for p in _as_list(prompts)], max_length=max_sequence_length
    )
    te = self._te

    def encode(state, ids, mask):
      h = te.merge(state)(ids, mask)
      return (h.astype(jnp.float32) * mask[..., None]).astype(h.dtype)

    fn = self._jit(("encode", max_sequence_length), lambda: jax.jit(encode))
    with self._context():
      return fn(self._te.state, jnp.asarray(tokens.ids), jnp.asarray(tokens.mask))

  def encode_image(self, images: jax.Array) -> jax.Array:
    """CLIP image tokens (`hidden_states[-2]`, `[N, tokens, D]`) of images `[N, H, W, 3]` in [0, 1]."""
    if self.image_encoder is None:
      raise ValueError(
        "this pipeline has no image_encoder (only Wan 2.1 I2V uses CLIP image tokens)"
      )
    ie, size = self._ie, self.image_size

    def encode(state, x):
      pixels = md_text.clip_image_preprocess(x, size=size)
      return ie.merge(state)(pixels, output_hidden_states=True).hidden_states[-2]

    with self._context():
      return self._jit("image", lambda: jax.jit(encode))(self._ie.state, images)

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
  def _loop_fn(self, sched, *, switch: int, total: int, cfg_on: bool, mode: str, show: bool):
    t1, t2 = self._t1, self._t2
    patch = self.transformer.cfg.patch_size

    def loop(s1, s2, latents, sched_state, context, image_tokens, condition, g1, g2):
      models = [t1.merge(s1), None if t2 is None else t2.merge(s2)]
      tick = md_progress.make_step_callback(total, desc="denoising") if show else None
      b = latents.shape[0]
      if mode == "expand":
        _, f, h, w, _ = latents.shape
        # 0 on the image's first latent frame, 1 elsewhere (all ones without an image).
        frame_mask = jnp.ones((1, f, h, w, 1), jnp.float32)
        if condition is not None:
          frame_mask = frame_mask.at[:, 0].set(0.0)

      def body(expert: int, guidance):
        model = models[expert]

        def step(i, carry):
          x, st = carry
          t = mdsch.current_timestep(st).astype(jnp.float32)
          if mode == "concat":
            xin = jnp.concatenate([x, condition], axis=-1)
            timestep = jnp.broadcast_to(t, (b,))
          elif mode == "expand":
            xin = x if condition is None else (1 - frame_mask) * condition + frame_mask * x
            per_token = frame_mask[0, :, :: patch[1], :: patch[2], 0].reshape(-1) * t
            timestep = jnp.broadcast_to(per_token, (b, per_token.shape[0]))
          else:
            xin = x
            timestep = jnp.broadcast_to(t, (b,))
          img = image_tokens
          if cfg_on:
            xin = jnp.concatenate([xin, xin], axis=0)
            timestep = jnp.concatenate([timestep, timestep], axis=0)
            img = None if img is None else jnp.concatenate([img, img], axis=0)
          out = model(xin, timestep, context, img, layout="BFHWC").astype(jnp.float32)
          if cfg_on:
            uncond, cond = jnp.split(out, 2, axis=0)
            out = uncond + guidance * (cond - uncond)
          x, st = sched.step(st, out, x)
          if tick is not None:
            tick(i)
          return x, st

        return step

      carry = (latents, sched_state)
      carry = jax.lax.fori_loop(0, switch, body(0, g1), carry)
      if switch < total:
        carry = jax.lax.fori_loop(switch, total, body(1, g2), carry)
      x = carry[0]
      if mode == "expand" and condition is not None:
        x = (1 - frame_mask) * condition + frame_mask * x
      return x

    return jax.jit(loop)

  def _decode_fn(self):
    vae = self._vae

    def decode(state, latents):  # [B, f, h, w, z] → [B, F, H, W, 3] in [0, 1]
      model = vae.merge(state)
      video = model.decode(model.denormalize_latents(latents.astype(jnp.float32)))
      return jnp.clip(video / 2 + 0.5, 0.0, 1.0)

    return jax.jit(decode)

  def decode(self, latents: jax.Array) -> jax.Array:
    """The denoiser's latents `[B, f, h, w, z]` (channels-last) → frames `[B, F, H, W, 3]` in [0, 1]."""
    with self._context():
      return self._jit("decode", self._decode_fn)(self._vae.state, latents)

  # --- the call --------------------------------------------------------------------------------------------
  def check_size(self, height: int, width: int, num_frames: int) -> int:
    """Validates the video size; returns `num_frames` rounded to `4k + 1` as the reference does
    (`num_frames // 4 * 4 + 1`).

    Raises:
      ValueError: a height or width that the VAE and the patching cannot take (naming the nearest valid
        sizes), or fewer than one frame.
    """
    mh, mw = self.size_multiple
    bad = [
      f"{name}={v} → {_nearest(v, m)}"
      for name, v, m in (("height", height, mh), ("width", width, mw))
      if v <= 0 or v % m
    ]
    if bad:
      raise ValueError(
        f"height must be a multiple of {mh} and width of {mw} (VAE factor {self.vae_scale_factor_spatial} "
        f"x patch {self.transformer.cfg.patch_size[1:]}); got {height}x{width}; nearest valid: "
        f"{', '.join(bad)}"
      )
    t = self.vae_scale_factor_temporal
    if num_frames < 1:
      raise ValueError(
        f"num_frames={num_frames} must be >= 1 (valid counts are 4k + 1: 1, 5, 9, ...)"
      )
    if num_frames % t != 1:
      rounded = num_frames // t * t + 1
      below = (num_frames - 1) // t * t + 1
      warnings.warn(
        f"num_frames={num_frames} is not {t}k + 1 (nearest valid: {below} or {below + t}); using "
        f"{rounded} (num_frames // {t} * {t} + 1) as the reference does",
        stacklevel=3,
      )
      num_frames = rounded
    return num_frames

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
      progress: show a progress bar over the steps.

    Returns:
      Frames `[B, F, H, W, 3]` float32 in [0, 1].
    """
    num_frames = self.check_size(height, width, num_frames)
    with self._context():
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
    cfg_on = guidance_scale > 1.0
    if guidance_scale_2 is None:
      guidance_scale_2 = guidance_scale

    # Text.
    prompts = _as_list(prompt)
    if prompt_embeds is None:
      if not prompts:
        raise ValueError("pass prompt (a string or a list) or prompt_embeds")
      embeds = self.encode_prompt(prompts, max_sequence_length)
    else:
      if prompts:
        raise ValueError("pass either prompt or prompt_embeds, not both")
      embeds = jnp.asarray(prompt_embeds, jnp.float32)
    b = embeds.shape[0]
    context = jnp.repeat(embeds, num_videos_per_prompt, axis=0)
    if cfg_on:
      if negative_prompt_embeds is not None:
        neg = jnp.asarray(negative_prompt_embeds, jnp.float32)
      else:
        negs = _as_list(negative_prompt) or [""]
        if len(negs) == 1 and b > 1:
          negs = negs * b
        if len(negs) != b:
          raise ValueError(
            f"negative_prompt has {len(negs)} entries for {b} prompts; give 1 or {b}"
          )
        neg = self.encode_prompt(negs, embeds.shape[1])
      if neg.shape != embeds.shape:
        raise ValueError(
          f"negative_prompt_embeds {neg.shape} and prompt_embeds {embeds.shape} must have one shape"
        )
      context = jnp.concatenate([jnp.repeat(neg, num_videos_per_prompt, axis=0), context], axis=0)
    batch = b * num_videos_per_prompt

    # Latents (channels-last inside md).
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

    # Image conditioning.
    condition = image_tokens = None
    mode = "expand" if self.expand_timesteps else "concat" if self.image_to_video else "plain"
    if image is not None:
      first = self._fit_image(image, height, width, "image")
      last = (
        None if last_image is None else self._fit_image(last_image, height, width, "last_image")
      )
      fn = self._jit(
        ("condition", num_frames, last is not None),
        lambda: self._condition_fn(num_frames, last is not None),
      )
      with self._context():
        cond = fn(self._vae.state, first, last)  # [1, f or 1, h, w, z]
      cond = jnp.repeat(cond, batch, axis=0)
      if mode == "concat":
        mask = jnp.asarray(self._i2v_mask(num_frames, (1, f, h, w), last is not None))
        condition = jnp.concatenate([jnp.repeat(mask, batch, axis=0), cond], axis=-1)
      else:
        condition = cond
      if self.transformer.cfg.image_dim is not None:
        if image_embeds is None:
          pics = first if last is None else jnp.concatenate([first, last], axis=0)
          image_embeds = self.encode_image(pics)
        image_tokens = self._video_image_tokens(image_embeds, batch)
    channels = x.shape[-1] + (0 if mode != "concat" else condition.shape[-1])
    if channels != self.transformer.cfg.in_channels:
      raise ValueError(
        f"the transformer takes in_channels={self.transformer.cfg.in_channels}, the pipeline makes {channels} "
        f"(latents {z} + condition); is the checkpoint's model_index.json class right?"
      )

    # Schedule and the expert switch (static: the timesteps are known on the host).
    sched = self.make_scheduler(**dict(scheduler_options or {}))
    state = sched.init(num_inference_steps, shape=shape)
    total = mdsch.num_calls(state)
    switch = total
    if self.boundary_ratio is not None:
      boundary = self.boundary_ratio * float(sched.config["num_train_timesteps"])
      switch = int(np.sum(np.asarray(state.timesteps) >= boundary))
    show = bool(progress) and md_progress.progress_enabled()
    key = (
      "loop",
      repr(sorted(sched.config.items())),
      total,
      switch,
      cfg_on,
      mode,
      condition is not None,
      image_tokens is not None,
      show,
    )
    loop = self._jit(
      key,
      lambda: self._loop_fn(sched, switch=switch, total=total, cfg_on=cfg_on, mode=mode, show=show),
    )
    with self._context():
      x = loop(
        self._t1.state,
        None if self._t2 is None else self._t2.state,
        x,
        state,
        context,
        image_tokens,
        condition,
        jnp.float32(guidance_scale),
        jnp.float32(guidance_scale_2),
      )
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

  def _fit_image(self, image: Any, height: int, width: int, what: str) -> jax.Array:
    x = _image_array(image, what)
    if x.shape[1:3] != (height, width):
      # The reference resizes with PIL (lanczos); a resize here gives close but not identical pixels.
      x = jax.image.resize(x, (1, height, width, 3), method="lanczos3")
      x = jnp.clip(x, 0.0, 1.0)
    return x


# --- loading ----------------------------------------------------------------------------------------------------


def _folder(root, name: str, index: Mapping[str, Any]):
  folder = root / name
  if not folder.is_dir():
    have = sorted(k for k, v in index.items() if isinstance(v, list) and v and v[0])
    raise FileNotFoundError(
      f"{root}: pipeline component {name!r} is missing (no folder {folder}); model_index.json lists "
      f"{have}. Download the whole pipeline, or pass a complete diffusers folder"
    )
  return folder


def _listed(index: Mapping[str, Any], name: str) -> bool:
  entry = index.get(name)
  return isinstance(entry, list) and bool(entry) and entry[0] is not None


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
    dtype: parameter dtype of the transformers and the text encoder (default: as stored); the VAE and
      the CLIP encoder stay float32 as the reference runs them.
    rules: md-sharding logical axis rules.
    attention: md-attention implementation of the transformers ("auto", "blockwise", "ring",
      "ulysses", "ulysses_ring", ...).
    attention_config: an `md_attention.AttentionConfig` (block sizes, Ulysses degree...).
    remat: rematerialisation policy of the transformer blocks.
    revision: hub revision.
    progress: progress bars while loading tensors.

  Returns:
    A `WanVideoPipeline`.

  Raises:
    FileNotFoundError: no folder / hub id, or a component missing (named).
    ValueError: a pipeline class md does not implement.
  """
  root = md_core.resolve_source(source, revision=revision)
  index_file = root / "model_index.json"
  if not index_file.is_file():
    raise FileNotFoundError(
      f"{root}: no model_index.json; pass a diffusers Wan pipeline folder (transformer/, vae/, "
      "text_encoder/, tokenizer/, scheduler/) or its hub id"
    )
  index = md_core.read_json(index_file)
  cls = index.get("_class_name", "")
  if cls not in _CLASSES:
    raise ValueError(
      f"{index_file}: pipeline class {cls!r} is not one md-wan loads; known: {_CLASSES}"
    )
  overrides = {}
  if attention is not None:
    overrides["attention"] = attention
  if attention_config is not None:
    overrides["attention_config"] = attention_config
  if remat is not None:
    overrides["remat"] = remat
  kw = dict(mesh=mesh, rules=rules, progress=progress)
  transformer = load_transformer(
    _folder(root, "transformer", index), subfolder=None, dtype=dtype, **kw, **overrides
  )
  transformer_2 = None
  if _listed(index, "transformer_2"):
    transformer_2 = load_transformer(
      _folder(root, "transformer_2", index), subfolder=None, dtype=dtype, **kw, **overrides
    )
  vae = md_vae.load_vae_wan(_folder(root, "vae", index), subfolder=None, **kw)
  te = md_text.load_t5_encoder(_folder(root, "text_encoder", index), dtype=dtype, **kw)
  tok = md_text.load_tokenizer(_folder(root, "tokenizer", index), subfolder=None)
  image_encoder, image_size = None, None
  if _listed(index, "image_encoder"):
    image_encoder = md_text.load_clip_vision(
      _folder(root, "image_encoder", index), subfolder=None, with_projection=False, **kw
    )
    image_size = image_encoder.config.image_size
    proc = root / "image_processor" / "preprocessor_config.json"
    if proc.is_file():
      crop = md_core.read_json(proc).get("crop_size", {})
      image_size = int(crop.get("height", image_size)) if isinstance(crop, dict) else int(crop)
  sched_cfg = mdsch.read_config(_folder(root, "scheduler", index))
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
