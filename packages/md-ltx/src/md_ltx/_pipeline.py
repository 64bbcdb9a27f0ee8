"""LTX-Video pipelines: text-to-video, image-to-video and image / keyframe conditioning.

Three kinds of jitted programs per shape: T5 encoding, the denoising steps (`md_schedulers.run_steps` over
`ltx_token_euler`, driven from the host in chunks; guidance branches `[negative, positive, perturbed]`)
and VAE decoding (plus the VAE encoding of the conditioning images). The family part of sampling is
`_denoiser`: per-token timesteps, the skip-layer mask of the perturbed rows, the transformer call.

Three modes (`mode=`), as diffusers' (0.42) pipelines:
- text-to-video (`LTXPipeline`): the scheduler's shifted schedule (`mu` from the token count), a rotary
  grid scaled by `(vae_temporal_ratio / frame_rate, vae_spatial_ratio, vae_spatial_ratio)`.
- image-to-video (`LTXImageToVideoPipeline`): text-to-video's schedule and rotary grid; the image's
  posterior sample replaces the first latent frame, whose tokens get timestep 0 and are never updated
  (`ltx_token_euler`'s "keep" rule).
- conditioning (`LTXConditionPipeline`, 0.9.5+; used whenever `conditions` are given or the checkpoint is
  a condition pipeline): the linear-quadratic schedule, explicit token coordinates (`video_coords`), images
  at frame 0 blended into the first latent frame with their strength (per-token timesteps
  `min(t, (1 - strength) * 1000)`; tokens whose strength exceeds the noise level are kept: the "per_token"
  rule), images at later frames appended as extra tokens at their frame's coordinates and dropped before
  decoding, optional noise added to the hard-conditioned tokens at each step (`image_cond_noise_scale`,
  the scheduler's conditioning noise).
Decoding of 0.9.1+ VAEs takes `decode_timestep` and blends in noise by `decode_noise_scale` first.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

import md_schedulers as mdsch
import md_text
import md_vae
from md_core import call as mdc
from md_core import pipeline as mdp
from md_lora import LoRAPipeline
from md_ltx._conditioning import (
  LTXCondition,
  check_conditions,
  condition_noise,
  condition_pixels,
  lerp,
)
from md_ltx._guidance import draw_steps, guidance_plan, pad_steps
from md_ltx._recipes import check_ltx_size
from md_ltx._transformer import (
  SKIP_LAYER_STRATEGIES,
  LTXTransformer,
  rope_tables,
  rope_tables_from_coords,
)
from md_ltx._video_tokens import check_video_size, decode_inputs, pack_tokens, unpack_tokens

_CLASSES = ("LTXPipeline", "LTXConditionPipeline", "LTXImageToVideoPipeline")
MODES = ("text_to_video", "image_to_video", "condition")
_MODE_KEYS = {"text_to_video": "t2v", "image_to_video": "i2v", "condition": "condition"}
# The scheduler's token rule per mode: t2v moves every token, i2v keeps the image's, condition moves each
# token from its own noise level.
_RULES = {"t2v": "keep", "i2v": "keep", "condition": "per_token"}
OUTPUT_TYPES = ("np", "frames", "latent")
MAX_SEQUENCE_LENGTH = 128
_F32 = jnp.float32


class _Grid(NamedTuple):
  """A video's latent grid: frames, rows, columns, and its packed token count."""

  f: int
  h: int
  w: int
  tokens: int


class LTXVideoPipeline(LoRAPipeline, mdp.Pipeline):
  """A loaded LTX-Video pipeline (see `load_pipeline`); call it to generate videos.

  Attributes:
    transformer: the LTX-Video transformer; vae: the LTX-Video VAE; text_encoder, tokenizer: T5.
    scheduler_config: the checkpoint's `scheduler_config.json` dict (flow-match Euler).
    condition_pipeline: the checkpoint is an `LTXConditionPipeline` (0.9.5+ conditioning semantics even
      without conditions: linear-quadratic schedule, explicit coordinates; `image=` is a condition).
      Otherwise (`LTXPipeline`, `LTXImageToVideoPipeline`) `image=` runs LTXImageToVideoPipeline's
      semantics. A call's `mode=` overrides either.
  """

  family = "ltx"
  cache_defaults = {"teacache": {"coefficients": "ltx-video"}}  # TeaCache's LTX-Video polynomial
  media = "video"
  lora_components = ("transformer",)  # what pipe.load_lora adapts

  def lora_key_map(self, component: str):
    from md_ltx._weights import convert_key  # noqa: PLC0415

    return convert_key

  def noise_layout(self) -> mdp.NoiseLayout:
    """`[n, F', h, w, C]` from the first of the five keys `__call__` splits the seed into, taken as
    `[n, C, F', h, w]`."""
    return mdp.NoiseLayout(
      "video",
      int(self.size_multiple),
      int(self.vae.config.latent_channels),
      int(self.vae_spatial_compression_ratio),
      int(self.vae_temporal_compression_ratio),
      layout="channels_last",
      split=(5, 0),
    )

  @classmethod
  def size_problems(cls, source, height, width, num_frames=1) -> list[str]:
    """`check_ltx_size`: the checkpoint's VAE and patch multiples and frame steps, from configs."""
    try:
      check_ltx_size(source, height, width, num_frames)
    except (ValueError, FileNotFoundError) as e:
      return [str(e)]
    return []

  def __init__(
    self,
    *,
    transformer: LTXTransformer,
    vae: md_vae.LTXVideoVAE,
    text_encoder: md_text.T5Encoder,
    tokenizer: Any,
    scheduler_config: Mapping[str, Any],
    condition_pipeline: bool = False,
    mesh: jax.sharding.Mesh | None = None,
    source: str = "",
  ):
    if transformer.cfg.in_channels != vae.config.latent_channels * transformer.cfg.patch_size**2 * (
      transformer.cfg.patch_size_t
    ):
      raise ValueError(
        f"the transformer takes in_channels={transformer.cfg.in_channels}; the VAE's "
        f"{vae.config.latent_channels} latent channels packed by patch {transformer.cfg.patch_size} / "
        f"{transformer.cfg.patch_size_t} do not give that"
      )
    self.transformer, self.vae = transformer, vae
    self.text_encoder, self.tokenizer = text_encoder, tokenizer
    self.scheduler_config = dict(scheduler_config)
    self.condition_pipeline = condition_pipeline
    self._init_scaffold(mesh, source)
    self._tr, self._vae = mdp.Split.of(transformer), mdp.Split.of(vae)
    self._te = mdp.Split.of(text_encoder)
    self.last_calls = 0  # denoiser calls of the last call (a step cache skips some)

  # --- facts --------------------------------------------------------------------------------------------
  @property
  def vae_spatial_compression_ratio(self) -> int:
    return self.vae.config.spatial_ratio

  @property
  def vae_temporal_compression_ratio(self) -> int:
    return self.vae.config.temporal_ratio

  @property
  def size_multiple(self) -> int:
    """Pixels per token along height and width (VAE factor × patch)."""
    return self.vae_spatial_compression_ratio * self.transformer.cfg.patch_size

  # --- text ----------------------------------------------------------------------------------------------
  def encode_prompt(
    self, prompts: Sequence[str], max_sequence_length: int = MAX_SEQUENCE_LENGTH
  ) -> tuple[jax.Array, jax.Array]:
    """T5 states `[B, L, D]` and the token mask `[B, L]` (int32, 1 = token), as the reference: the encoder
    sees all `L` positions without a mask; the mask is for the transformer's cross-attention."""
    tokens = md_text.tokenize(self.tokenizer, prompts, max_length=max_sequence_length)  # str: one
    te = self._te

    def encode(state, ids):
      return te.merge(state)(ids)

    fn = self.jit(("encode", max_sequence_length), lambda: jax.jit(encode))
    with self.context():
      states = fn(self._te.jit_state(), jnp.asarray(tokens.ids))
    return states, jnp.asarray(tokens.mask, jnp.int32)

  # --- sizes ---------------------------------------------------------------------------------------------
  def check_size(self, height: int, width: int, num_frames: int) -> None:
    """Raises ValueError (naming the nearest valid values) for sizes the VAE and the packing cannot take:
    height and width multiples of `size_multiple` (32), `num_frames = 1 + 8k`."""
    m, t = (
      self.size_multiple,
      self.vae_temporal_compression_ratio * self.transformer.cfg.patch_size_t,
    )
    check_video_size("LTX-Video VAE", height, width, num_frames, m, t)

  # --- packing ---------------------------------------------------------------------------------------------
  def _pack(self, x):
    cfg = self.transformer.cfg
    return pack_tokens(x, cfg.patch_size, cfg.patch_size_t)

  def _unpack(self, x, f, h, w):
    cfg = self.transformer.cfg
    return unpack_tokens(x, f, h, w, cfg.patch_size, cfg.patch_size_t)

  def _coords(self, f: int, h: int, w: int, frame_index: int) -> np.ndarray:
    """The reference's `video_coords` of a latent grid `[1, 3, S]` (before the frame-rate division): latent
    indices times the VAE factors, the causal first frame at 0, shifted by `frame_index`."""
    p, pt = self.transformer.cfg.patch_size, self.transformer.cfg.patch_size_t
    st, ss = self.vae_temporal_compression_ratio, self.vae_spatial_compression_ratio
    grid = np.meshgrid(np.arange(0, f, pt), np.arange(0, h, p), np.arange(0, w, p), indexing="ij")
    c = np.stack([g.reshape(-1) for g in grid])[None].astype(np.int64)  # [1, 3, S]
    c = c * np.array([st, ss, ss])[None, :, None]
    c[:, 0] = np.maximum(c[:, 0] + 1 - st, 0) + frame_index
    return c

  # --- VAE ---------------------------------------------------------------------------------------------------
  @staticmethod
  def _fit(pic: np.ndarray, height: int, width: int) -> np.ndarray:
    """Frames `[N, H', W', 3]` resized (Lanczos, clipped to [0, 1]) to the video's size when it differs."""
    if pic.shape[1:3] == (height, width):
      return pic
    resized = jax.image.resize(pic, (pic.shape[0], height, width, 3), method="lanczos3")
    return np.asarray(jnp.clip(resized, 0.0, 1.0))

  def _encode_image(self, image: np.ndarray, key, eps: Any = None, what: str = "") -> jax.Array:
    """Frames `[N, H, W, 3]` in [0, 1] → normalized latents `[1, n, h, w, C]`: the posterior sample
    `mean + std * eps`, `eps` given in the reference's layout `[1, C, n, h, w]` or drawn from `key`."""
    vae = self._vae
    if eps is not None:
      ss, st = self.vae_spatial_compression_ratio, self.vae_temporal_compression_ratio
      n, h, w = (image.shape[0] - 1) // st + 1, image.shape[1] // ss, image.shape[2] // ss
      want = (1, self.vae.config.latent_channels, n, h, w)
      eps = jnp.asarray(eps, _F32)
      if eps.shape != want:
        raise ValueError(
          f"{what} must be the posterior's noise [1, C, F, H, W] = {want} (the reference's layout), got "
          f"{eps.shape}"
        )
      eps = jnp.transpose(eps, (0, 2, 3, 4, 1))

    def encode(state, x, key, eps):
      model = vae.merge(state)
      dist = model.encode(x[None] * 2 - 1)
      z = dist.sample(key) if eps is None else dist.mean + dist.std * eps
      mean = model.latents_mean[...].astype(z.dtype).reshape(1, 1, 1, 1, -1)
      std = model.latents_std[...].astype(z.dtype).reshape(1, 1, 1, 1, -1)
      return (z - mean) * 1.0 / std  # the pipelines normalise with scaling factor 1 here

    fn = self.jit(("encode_image", image.shape), lambda: jax.jit(encode))
    with self.context():
      return fn(self._vae.state, jnp.asarray(image), key, eps)

  def _decode_fn(self):
    vae = self._vae
    conditioned = self.vae.config.timestep_conditioning
    inject = any(self.vae.config.decoder_inject_noise)

    def decode(state, latents, timestep, noise_scale, noise, key):
      model = vae.merge(state)
      z = model.denormalize_latents(latents.astype(_F32))
      if not conditioned:
        video = model.decode(z)
      else:
        s = noise_scale[:, None, None, None, None]
        z = (1 - s) * z + s * noise
        video = model.decode(z, timestep, key=key if inject else None)
      return jnp.clip(video / 2 + 0.5, 0.0, 1.0)

    return jax.jit(decode)

  def decode(
    self,
    latents: jax.Array,
    *,
    decode_timestep: float | Sequence[float] = 0.0,
    decode_noise_scale: float | Sequence[float] | None = None,
    decode_noise: Any = None,
    seed: int = 0,
  ) -> jax.Array:
    """Normalized latents `[B, f, h, w, C]` (channels-last) → frames `[B, F, H, W, 3]` in [0, 1].

    For timestep-conditioned VAEs (0.9.1+) the latents are first blended with noise,
    `(1 - decode_noise_scale) * z + decode_noise_scale * noise` (`decode_noise_scale` defaults to
    `decode_timestep`), `noise` being `decode_noise` (`[B, C, f, h, w]`, the reference's layout) or drawn
    from `seed`.
    """
    return self._decode(
      latents, decode_timestep, decode_noise_scale, decode_noise, jax.random.key(int(seed))
    )

  def _decode(self, latents, decode_timestep, decode_noise_scale, decode_noise, key) -> jax.Array:
    timestep, scale, noise, key_vae = decode_inputs(
      latents, decode_timestep, decode_noise_scale, decode_noise, key
    )
    with self.context():
      fn = self.jit("decode", self._decode_fn)
      return fn(self._vae.state, latents, timestep, scale, noise, key_vae)

  # --- sampling ----------------------------------------------------------------------------------------------
  def _denoiser(self, mode: str, branches: int, stg: bool, stg_mode: str):
    """The family part of sampling: the per-token timesteps of the mode, the perturbed rows' block mask,
    the transformer call. `cond` holds the text rows (in the guidance row order), the rotary tables, the
    per-video conditioning mask `[B, S]` (or None) and the per-step block mask `[steps, layers]`."""
    tr = self._tr
    layers = self.transformer.cfg.num_layers

    def denoise(params, x, t, cond, *, step):
      t = t.astype(_F32)  # [rows]
      if cond["cond_mask"] is not None:
        c = jnp.concatenate([cond["cond_mask"]] * branches, axis=0)
        timestep = mdsch.ltx_token_timesteps(t, c, rule=_RULES[mode])  # [rows, S]
      else:
        timestep = t[:, None] if mode == "condition" else t
      skip = None
      if stg:  # the perturbed rows (the last B) skip the step's chosen blocks
        b = x.shape[0] // branches
        keep = cond["keep"][step]  # [layers]
        skip = jnp.concatenate(
          [
            jnp.ones((layers, (branches - 1) * b), _F32),
            jnp.broadcast_to(keep[:, None], (layers, b)),
          ],
          axis=1,
        )
      model = tr.merge(params)
      return model(
        x, cond["context"], timestep, cond["mask"], rope=cond["rope"], skip_layer_mask=skip,
        skip_layer_strategy=stg_mode,
      )  # fmt: skip

    return denoise

  def _run_fn(self, sched, *, mode: str, guide, stg_mode: str, cache):
    """One jitted chunk of steps `[lo, hi)` (traced bounds)."""
    denoise = self._denoiser(mode, guide.num_branches, guide.stg, stg_mode)

    def run(carry, lo, hi, params, cond, scales):
      return mdsch.run_steps(
        denoise,
        sched,
        carry,
        lo,
        hi,
        cond,
        params=params,
        guidance=guide,
        scales=scales,
        cache=cache,
      )

    return jax.jit(run)

  # --- the call's steps ------------------------------------------------------------------------------------
  def _check_call(
    self, *, mode, image, conditions, height, width, num_frames, output_type, denoise_strength,
    timesteps, step_noise, noise, image_cond_noise_scale, image_noise, latents, stg_mode,
  ) -> tuple[str, list[LTXCondition], list[float] | None]:  # fmt: skip
    """Validates a call's settings before any encoding or compiling; returns the loop's mode key, the
    conditioning items and the custom timesteps (floats) or None."""
    self.check_size(height, width, num_frames)
    mdc.check_output_type(output_type, OUTPUT_TYPES)
    if not 0.0 < denoise_strength <= 1.0:
      raise ValueError(f"denoise_strength={denoise_strength} must be in (0, 1]")
    if image is not None and conditions:
      raise ValueError("pass either image= or conditions=, not both")
    mode = self._mode(mode, image, conditions)
    if mode == "i2v":
      for name, value in (
        ("timesteps", timesteps), ("step_noise", step_noise), ("noise", noise),
        ("image_cond_noise_scale", image_cond_noise_scale or None),
      ):  # fmt: skip
        if value is not None:
          raise ValueError(
            f"{name} is not used by mode='image_to_video' (LTXImageToVideoPipeline semantics); pass "
            "mode='condition' for the conditioning pipeline's"
          )
    if image_noise is not None and mode == "t2v":
      raise ValueError("image_noise is the conditioning image's posterior noise: pass image= too")
    conditions = [LTXCondition(image)] if image is not None else list(conditions or [])
    refine = denoise_strength < 1.0
    if timesteps is not None:
      if mode == "t2v":
        raise ValueError(
          "custom timesteps need the conditioning mode (the reference's LTXPipeline passes its own "
          "sigmas): pass mode='condition', load with load_pipeline(..., condition=True) or pass "
          "conditions"
        )
      timesteps = [float(t) for t in timesteps]
      if not timesteps or any(b >= a for a, b in zip(timesteps, timesteps[1:], strict=False)):
        raise ValueError(f"timesteps={timesteps} must be a non-empty descending list")
    if refine and mode != "condition":
      raise ValueError(
        "denoise_strength < 1 needs the conditioning mode (LTXConditionPipeline semantics): pass "
        "mode='condition', load with load_pipeline(..., condition=True) or pass conditions"
      )
    if refine and latents is None:
      raise ValueError("denoise_strength < 1 refines given latents: pass latents= [B, C, F, H, W]")
    cfg = self.transformer.cfg
    with self.context():
      # Heads vs the mesh's tensor degree: fail before any encoding or compiling.
      self.transformer._check(
        jnp.zeros((1, 1, cfg.in_channels)), jnp.zeros((1, 1, cfg.caption_channels)),
        jnp.zeros((1,)), None, 1, 1, 1,
      )  # fmt: skip
    check_conditions(conditions, num_frames)
    if stg_mode not in SKIP_LAYER_STRATEGIES:
      raise ValueError(f"stg_mode={stg_mode!r} must be one of {SKIP_LAYER_STRATEGIES}")
    return mode, conditions, timesteps

  def _text_rows(
    self, prompt, negative_prompt, prompt_embeds, prompt_attention_mask, negative_prompt_embeds,
    negative_prompt_attention_mask, *, per_prompt: int, max_sequence_length: int, cfg_on: bool,
    stg_on: bool,
  ) -> tuple[jax.Array, jax.Array, int]:  # fmt: skip
    """The loop's text rows: T5 states `[rows, L, D]` and masks `[rows, L]` in the guidance row order
    (`[negative;] positive [; positive for STG's perturbed pass]`), and the number of videos."""

    def given(embeds, mask, message):
      if mask is None:
        raise ValueError(message)
      return jnp.asarray(embeds, _F32), jnp.asarray(mask, jnp.int32)

    pos = mdc.resolve_prompt(
      prompt, prompt_embeds, encode=lambda p: self.encode_prompt(p, max_sequence_length),
      given=lambda e: given(e, prompt_attention_mask, "prompt_embeds needs prompt_attention_mask "
                            "(as the reference)"),
    )  # fmt: skip
    neg = None
    if cfg_on:
      neg = mdc.resolve_negative(
        negative_prompt, negative_prompt_embeds, pos,
        encode=lambda p: self.encode_prompt(p, pos[0].shape[1]),
        given=lambda e: given(e, negative_prompt_attention_mask, "negative_prompt_embeds needs "
                              "negative_prompt_attention_mask"),
      )  # fmt: skip
    context, cmask = mdc.guidance_rows(pos, neg, per_prompt)
    batch = pos[0].shape[0] * per_prompt
    if stg_on:  # the perturbed pass reads the positive prompt
      context = jnp.concatenate([context, context[context.shape[0] - batch :]])
      cmask = jnp.concatenate([cmask, cmask[cmask.shape[0] - batch :]])
    return context, cmask, batch

  def _grid(self, num_frames: int, height: int, width: int) -> _Grid:
    st, ss = self.vae_temporal_compression_ratio, self.vae_spatial_compression_ratio
    f, h, w = (num_frames - 1) // st + 1, height // ss, width // ss
    p, pt = self.transformer.cfg.patch_size, self.transformer.cfg.patch_size_t
    return _Grid(f, h, w, (f // pt) * (h // p) * (w // p))

  def _initial_latents(self, latents, mode: str, batch: int, grid: _Grid, key, size) -> jax.Array:
    """The initial latents `[B, f, h, w, C]`: drawn from `key`, or given packed `[B, S, C]` (text- and
    image-to-video) or `[B, C, F, H, W]`."""
    f, h, w = grid.f, grid.h, grid.w
    z = self.vae.config.latent_channels
    if latents is None:
      return jax.random.normal(key, (batch, f, h, w, z), _F32)
    x = jnp.asarray(latents, _F32)
    full, packed = (batch, z, f, h, w), (batch, grid.tokens, self.transformer.cfg.in_channels)
    if mode != "condition" and x.shape == packed:
      return self._unpack(x, f, h, w)
    if x.shape == full:
      return jnp.transpose(x, (0, 2, 3, 4, 1))
    want = f"{full} ([B, C, F, H, W])" + (f" or packed {packed}" if mode != "condition" else "")
    num_frames, height, width = size
    raise ValueError(
      f"latents have shape {x.shape}; expected {want} for {batch} videos of {num_frames} frames at "
      f"{height}x{width}"
    )

  def _schedule(self, mode: str, num_inference_steps: int, timesteps, tokens: int):
    """Flow-match Euler with the mode's token rule, its `init` arguments, and the timesteps and sigmas
    of the whole schedule (host arrays)."""
    sched = mdsch.ltx_token_euler(
      rule=_RULES[mode], **mdsch.from_config(self.scheduler_config).config
    )
    sc = sched.config

    def shift(base, top, lo, hi):
      return mdsch.calculate_shift(tokens, base, top, lo, hi)

    if mode != "condition":
      mu = shift(
        sc.get("base_image_seq_len", 256), sc.get("max_image_seq_len", 4096),
        sc.get("base_shift", 0.5), sc.get("max_shift", 1.15),
      )  # fmt: skip
      sched_kw = dict(sigmas=mdsch.ltx_uniform_sigmas(num_inference_steps), mu=mu)
    else:
      if timesteps is None:
        timesteps = mdsch.linear_quadratic_sigmas(num_inference_steps) * np.float32(1000)
      mu = None
      if sc.get("use_dynamic_shifting"):
        # The reference would stop here (no mu); md shifts by the token count as in text-to-video.
        mu = shift(
          sc["base_image_seq_len"], sc["max_image_seq_len"], sc["base_shift"], sc["max_shift"]
        )
      sched_kw = dict(timesteps=timesteps, mu=mu)
    plain = sched.init(**sched_kw)
    ts = np.asarray(plain.timesteps, np.float32)
    return sched, sched_kw, ts, np.asarray(plain.sigmas, np.float32)

  def _refine_start(self, x, num_inference_steps, denoise_strength, sigmas, noise, key):
    """`(begin, x)`: with `denoise_strength < 1` the reference's get_timesteps keeps the last
    `int(n * strength)` steps and the latents start noised to the first kept level (the scheduler's
    full sigma list still gives each step's next level); else `(0, x)`."""
    if denoise_strength >= 1.0:
      return 0, x
    n = num_inference_steps
    begin = n - min(int(n * denoise_strength), n)
    if begin >= n:
      raise ValueError(f"denoise_strength={denoise_strength} with {n} steps leaves no step")
    if noise is None:
      eps = jax.random.normal(key, x.shape, _F32)
    else:
      eps = jnp.asarray(noise, _F32)
      full = (x.shape[0], x.shape[4], *x.shape[1:4])
      if eps.shape != full:
        raise ValueError(f"noise must be [B, C, F, H, W] = {full}, got {eps.shape}")
      eps = jnp.transpose(eps, (0, 2, 3, 4, 1))
    sigma0 = sigmas[begin]
    return begin, sigma0 * eps + (1 - sigma0) * x

  def _condition(self, mode, conditions, pics, posterior_noise, x, grid, *, frame_rate, size, key):
    """The conditioned packed tokens `[B, S', C]`, their rotary tables, the per-token conditioning
    strengths `[B, S']` (or None) and the tokens the conditioning noise starts from (or None).

    Image to video: the image's latents replace the first latent frame (one posterior sample shared by
    every video), whose tokens the loop keeps. Conditioning mode: images at frame 0 blended into the
    first latent frames with their strength, clips' latent frames after a two-frame prefix at their
    place, other images and prefixes appended as extra tokens at their frame's coordinates."""
    cfg = self.transformer.cfg
    p, pt = cfg.patch_size, cfg.patch_size_t
    st, ss = self.vae_temporal_compression_ratio, self.vae_spatial_compression_ratio
    f, h, w = grid.f, grid.h, grid.w
    height, width = size
    batch = x.shape[0]

    def token_mask(per_frame, extra=()):
      cm = np.concatenate([*extra, per_frame[np.repeat(np.arange(0, f, pt), (h // p) * (w // p))]])
      return jnp.broadcast_to(jnp.asarray(cm), (batch, cm.shape[0]))

    if mode != "condition":
      rope = rope_tables(cfg, f // pt, h // p, w // p, (st / frame_rate, ss, ss))
      cond_mask = None
      if mode == "i2v":
        zc = self._encode_image(
          self._fit(pics[0], height, width), key, posterior_noise[0], "image_noise"
        )  # [1, 1, h, w, C]
        x = x.at[:, :1].set(jnp.broadcast_to(zc, (batch, *zc.shape[1:])))
        first = np.zeros((f,), np.float32)
        first[0] = 1.0
        cond_mask = token_mask(first)
      return self._pack(x), rope, cond_mask, None
    frames_mask = np.zeros((f,), np.float32)
    extra_x, extra_coords, extra_mask = [], [], []
    kcond = jax.random.split(key, 2 * max(len(conditions), 1))
    prefix = 2  # the reference's num_prefix_latent_frames
    for i, c in enumerate(conditions):
      pic = self._fit(pics[i], height, width)
      what = "image_noise" if len(conditions) == 1 else f"image_noise[{i}]"
      zc = self._encode_image(pic, kcond[2 * i], posterior_noise[i], what)  # [1, n, h, w, C]
      n, s, index = zc.shape[1], float(c.strength), int(c.frame_index)
      if index == 0:
        x = x.at[:, :n].set(lerp(x[:, :n], zc, s))
        frames_mask[:n] = s
        continue
      if pic.shape[0] > 1 and n < prefix:
        raise ValueError(
          f"conditions[{i}].video at frame {index} needs at least {prefix} latent frames "
          f"({(prefix - 1) * st + 1} frames), got {pic.shape[0]} frames"
        )
      if pic.shape[0] > 1 and n > prefix:
        # Latent frames after the prefix replace the video's own at their place; the prefix is
        # appended as extra tokens below.
        start = index // st + prefix
        end = start + n - prefix
        if end > f:
          raise ValueError(
            f"conditions[{i}].video at frame {index} reaches latent frame {end}, past the video's {f}"
          )
        x = x.at[:, start:end].set(lerp(x[:, start:end], zc[:, prefix:], s))
        frames_mask[start:end] = s
        zc = zc[:, :prefix]
      zc = lerp(jax.random.normal(kcond[2 * i + 1], zc.shape, _F32), zc, s)
      packed = self._pack(zc)
      extra_x.append(jnp.broadcast_to(packed, (batch, *packed.shape[1:])))
      extra_coords.append(self._coords(zc.shape[1], h, w, index))
      extra_mask.append(np.full((packed.shape[1],), s, np.float32))
    coords = np.concatenate([*extra_coords, self._coords(f, h, w, 0)], axis=2).astype(np.float32)
    coords[:, 0] = coords[:, 0] * np.float32(1.0 / frame_rate)
    x = jnp.concatenate([*extra_x, self._pack(x)], axis=1)
    if not conditions:
      return x, rope_tables_from_coords(cfg, coords), None, None
    return x, rope_tables_from_coords(cfg, coords), token_mask(frames_mask, extra_mask), x

  def _loop_state(self, sched, sched_kw, mode, x, cond_mask, init, *, noise_on, step_noise,
                  noise_scale, total, begin, key):  # fmt: skip
    """The scheduler's state at `begin` (the conditioning mask: the condition mode moves every token
    from its own level, zeros without conditions; the conditioning noise of each step) and the
    latents with the first step's conditioning noise."""
    if step_noise is not None:
      step_noise = jnp.asarray(step_noise, _F32)
      if step_noise.shape != (total, *x.shape):
        raise ValueError(
          f"step_noise must be [steps, B, S, C] = {(total, *x.shape)}, got {step_noise.shape}"
        )
    token_mask = None if cond_mask is None else np.asarray(cond_mask)
    if mode == "condition" and token_mask is None:
      token_mask = np.zeros(x.shape[:2], np.float32)
    noise_kw = {}
    if noise_on:
      if step_noise is None:  # one draw per step run, from the seed's loop key
        draw = self.jit(("step_noise", total, x.shape), lambda: draw_steps(total, x.shape))
        step_noise = draw(key)
      noise_kw = dict(
        cond_latents=init, cond_noise=pad_steps(np.asarray(step_noise), begin),
        cond_noise_scale=noise_scale,
      )  # fmt: skip
    state = sched.init(**sched_kw, conditioning=token_mask, shape=x.shape, **noise_kw)
    state = mdsch.start_at(sched, state, begin)
    if noise_on:  # the first step's conditioning noise (jitted: rounded as in the loop)
      x = self.jit("noised", lambda: jax.jit(mdsch.ltx_token_noised))(state, x)
    return state, x

  # --- the call --------------------------------------------------------------------------------------------
  def _mode(self, mode: str | None, image: Any, conditions: Any) -> str:
    """The loop's mode key ("t2v", "i2v", "condition") for a call's `mode=`, `image=`, `conditions=`."""
    if mode is None:
      if conditions or self.condition_pipeline:
        mode = "condition"
      else:
        mode = "image_to_video" if image is not None else "text_to_video"
    if mode not in MODES:
      raise ValueError(
        f"mode={mode!r} must be one of {MODES} (or None: chosen from the folder's class)"
      )
    if mode == "text_to_video" and (image is not None or conditions):
      raise ValueError(
        "mode='text_to_video' takes no image= or conditions=; pass mode='image_to_video' or 'condition'"
      )
    if mode == "image_to_video":
      if conditions:
        raise ValueError(
          "mode='image_to_video' takes image= (the first frame), not conditions=; pass mode='condition' "
          "for keyframes, clips or strengths"
        )
      if image is None:
        raise ValueError("mode='image_to_video' needs image= (the first frame)")
    return _MODE_KEYS[mode]

  def __call__(
    self,
    prompt: str | Sequence[str] | None = None,
    negative_prompt: str | Sequence[str] | None = None,
    *,
    conditions: Sequence[LTXCondition] | None = None,
    image: Any = None,
    mode: str | None = None,
    height: int = 512,
    width: int = 704,
    num_frames: int = 161,
    frame_rate: float = 25,
    num_inference_steps: int = 50,
    timesteps: Sequence[float] | None = None,
    guidance_scale: float | Sequence[float] = 3.0,
    guidance_rescale: float = 0.0,
    stg_scale: float | Sequence[float] = 0.0,
    stg_blocks: Sequence[int] | Sequence[Sequence[int]] = (),
    stg_mode: str = "attention_values",
    stg_rescale: float | Sequence[float] = 1.0,
    cfg_star: bool = False,
    guidance_timesteps: Sequence[float] | None = None,
    image_cond_noise_scale: float | None = None,
    denoise_strength: float = 1.0,
    num_videos_per_prompt: int = 1,
    seed: int = 0,
    latents: Any = None,
    prompt_embeds: Any = None,
    prompt_attention_mask: Any = None,
    negative_prompt_embeds: Any = None,
    negative_prompt_attention_mask: Any = None,
    decode_timestep: float | Sequence[float] = 0.0,
    decode_noise_scale: float | Sequence[float] | None = None,
    decode_noise: Any = None,
    step_noise: Any = None,
    noise: Any = None,
    image_noise: Any = None,
    max_sequence_length: int = MAX_SEQUENCE_LENGTH,
    output_type: str = "np",
    callback: Callable[[int, jax.Array, jax.Array], Any] | None = None,
    cancel: Callable[[], bool] | None = None,
    cache: mdsch.StepCache | None = None,
    chunk: int | str | None = "auto",
    progress: bool = True,
  ) -> jax.Array:
    """Generates videos.

    Args:
      prompt: one prompt or a list (or pass `prompt_embeds` with `prompt_attention_mask`).
      negative_prompt: for classifier-free guidance (default: the empty prompt, as the reference).
      conditions: `LTXCondition` items (image, frame index, strength); selects the conditioning mode.
      image: the first frame (`[H, W, 3]` uint8 or float in [0, 1], a PIL image or an image file):
        image-to-video, in the mode below.
      mode: "text_to_video" (`LTXPipeline`), "image_to_video" (`LTXImageToVideoPipeline`: the image's
        latents replace the first latent frame, which keeps timestep 0; text-to-video's schedule and
        rotary grid) or "condition" (`LTXConditionPipeline`: `image` is `LTXCondition(image)`). Default:
        "condition" with `conditions`, or for a condition-pipeline folder (`LTXConditionPipeline`, or
        loaded with `condition=True`); otherwise "image_to_video" with `image`, else "text_to_video".
      height, width: pixels, multiples of 32.
      num_frames: `1 + 8k` frames.
      frame_rate: frames per second (scales the rotary time axis).
      num_inference_steps: Euler steps.
      timesteps: custom descending timesteps (conditioning mode, e.g. the distilled checkpoints'
        `[1000, 993, 987, 981, 975, 909, 725, 0.03]`), replacing the linear-quadratic schedule;
        `num_inference_steps` is then their count.
      guidance_scale: classifier-free guidance (off at <= 1); one number, or one per step run (the
        official repository's per-step schedules).
      guidance_rescale: diffusers' std rescale of the CFG prediction towards the conditional one (0: off).
      stg_scale: spatio-temporal guidance (official LTX-Video repository): a third pass of the positive
        prompt with the self-attention of `stg_blocks` skipped (`stg_mode`), and
        `pred + stg_scale * (cond - perturbed)`; one number or one per step (0: off).
      stg_blocks: the blocks skipped in the perturbed pass: a list of block indices, or one list per step.
      stg_mode: "attention_values" (the skipped attention returns its values) or "attention_skip".
      stg_rescale: the official `rescaling_scale` r (one, or one per step): after STG,
        `pred *= r * std(cond) / std(pred) + 1 - r` per video, at steps where r != 1 (1: off).
      cfg_star: the official CFG-star rescale: the unconditional prediction is scaled by
        `<cond, uncond> / |uncond|^2` before guidance.
      guidance_timesteps: the official YAML's window starts (descending, in [0, 1]); list-valued
        `guidance_scale`, `stg_scale`, `stg_rescale` and `stg_blocks` then hold one entry per window, each
        step taking the first window whose start is <= its timestep / 1000 (see `guidance_windows`).
      image_cond_noise_scale: noise added at each step to hard-conditioned tokens (strength 1), scaled by
        `(t / 1000)^2` (conditioning mode; default 0.15 as the reference; image-to-video adds none).
      denoise_strength: below 1 (conditioning mode), `latents` are a video's normalized latents
        `[B, C, F, H, W]` (e.g. a first pass's upsampled `output_type="latent"` result): the last
        `int(num_inference_steps * denoise_strength)` steps run from them noised to that step's level.
      num_videos_per_prompt: videos per prompt.
      seed: draws every noise not given (initial latents, posterior samples, keyframe and step noise,
        decode noise).
      latents: initial noise in the reference's layout: packed `[B, S, C]` (text- and image-to-video;
        `[B, C, F, H, W]` is accepted too) or `[B, C, F, H, W]` (conditioning mode). In image-to-video
        the first latent frame is replaced by the image's (the reference takes given latents as
        already holding it and skips the image).
      prompt_embeds, prompt_attention_mask: precomputed T5 states `[B, L, D]` and mask `[B, L]`.
      negative_prompt_embeds, negative_prompt_attention_mask: the same for the negative prompt.
      decode_timestep, decode_noise_scale: the 0.9.1+ decoder's timestep and noise blend (per video or one).
      decode_noise: the decode noise `[B, C, F, H, W]` (default: drawn from `seed`).
      step_noise: the conditioning mode's per-step noise `[steps, B, S, C]` (default: drawn from `seed`).
      noise: with `denoise_strength < 1`, the noise `[B, C, F, H, W]` mixed into `latents` (default: drawn
        from `seed`).
      image_noise: the VAE posterior's standard-normal noise for the conditioning image(s), in the
        reference's layout `[1, C, n, h, w]` (`n` latent frames of the image or clip): one array for
        `image`, or a list with one per condition (default: drawn from `seed`). The sample is
        `mean + std * image_noise`.
      max_sequence_length: T5 tokens (128 in the reference).
      output_type: "np" for frames ("frames" is the same), or "latent" for the denoised normalized
        latents `[B, C, F, H, W]` (the reference's layout; `decode` takes them channels-last), e.g. for
        a latent upsampler or a second pass.
      callback: `callback(step, timestep, latents)` after each step, `latents` the packed tokens
        `[B, S, C]` after that step (conditioning mode: the appended keyframe tokens first); returning
        False stops like `cancel`.
      cancel: polled at each step boundary; True stops with `md_schedulers.Cancelled`.
      cache: a step cache (md-cache policy) deciding, on device, which steps reuse a prediction.
      chunk: steps per host dispatch ("auto", the default: about 50 ms of work per dispatch; None: the whole loop in one call; progress, callback and cancel
        act at chunk boundaries).
      progress: show a progress bar over the steps.

    Returns:
      Frames `[B, num_frames, height, width, 3]` float32 in [0, 1] (or latents, see `output_type`). The
      denoiser calls made are in `self.last_calls`.

    Raises:
      md_core.pipeline.SizeError: a size the VAE and the packing cannot take (naming the nearest ones).
      md_schedulers.Cancelled: `cancel()` returned True or `callback` returned False.
    """
    mode, conditions, timesteps = self._check_call(
      mode=mode, image=image, conditions=conditions, height=height, width=width,
      num_frames=num_frames, output_type=output_type, denoise_strength=denoise_strength,
      timesteps=timesteps, step_noise=step_noise, noise=noise,
      image_cond_noise_scale=image_cond_noise_scale, image_noise=image_noise, latents=latents,
      stg_mode=stg_mode,
    )  # fmt: skip
    if timesteps is not None:
      num_inference_steps = len(timesteps)
    if image_cond_noise_scale is None:
      image_cond_noise_scale = 0.15 if mode == "condition" else 0.0
    posterior_noise = condition_noise(image_noise, len(conditions))
    pics = condition_pixels(conditions, num_frames, self.vae_temporal_compression_ratio)
    cfg_on = float(np.max(guidance_scale)) > 1.0
    stg_on = float(np.max(stg_scale)) > 0.0
    keys = jax.random.split(jax.random.key(int(seed)), 5)

    context, cmask, batch = self._text_rows(
      prompt, negative_prompt, prompt_embeds, prompt_attention_mask, negative_prompt_embeds,
      negative_prompt_attention_mask, per_prompt=num_videos_per_prompt,
      max_sequence_length=max_sequence_length, cfg_on=cfg_on, stg_on=stg_on,
    )  # fmt: skip
    grid = self._grid(num_frames, height, width)
    x = self._initial_latents(latents, mode, batch, grid, keys[0], (num_frames, height, width))
    sched, sched_kw, ts_host, sigmas_host = self._schedule(
      mode, num_inference_steps, timesteps, grid.tokens
    )
    begin, x = self._refine_start(
      x, num_inference_steps, denoise_strength, sigmas_host, noise, keys[4]
    )
    total = int(ts_host.shape[0]) - begin  # the steps run
    x, rope, cond_mask, init = self._condition(
      mode, conditions, pics, posterior_noise, x, grid, frame_rate=frame_rate,
      size=(height, width), key=keys[1],
    )  # fmt: skip
    guide, scales, keep = guidance_plan(
      total, begin, ts_host[begin:], layers=self.transformer.cfg.num_layers, cfg_on=cfg_on, stg_on=stg_on, guidance_scale=guidance_scale,
      guidance_rescale=guidance_rescale, cfg_star=cfg_star, stg_scale=stg_scale,
      stg_rescale=stg_rescale, stg_blocks=stg_blocks, guidance_timesteps=guidance_timesteps,
    )  # fmt: skip
    state, x = self._loop_state(
      sched, sched_kw, mode, x, cond_mask, init, total=total, begin=begin, key=keys[2],
      noise_on=mode == "condition" and bool(conditions) and image_cond_noise_scale > 0,
      step_noise=step_noise, noise_scale=image_cond_noise_scale,
    )  # fmt: skip

    cond = dict(
      context=self.place(context), mask=self.place(cmask), rope=rope,
      cond_mask=self.place(cond_mask), keep=keep,
    )  # fmt: skip
    carry = mdsch.sample_pipeline(
      self, ("loop", mode, repr(sorted(sched.config.items())), guide, stg_mode),
      lambda cache: self._run_fn(sched, mode=mode, guide=guide, stg_mode=stg_mode, cache=cache),
      x, state, args=(self._tr.jit_state(), cond, scales), begin=begin,
      cache=cache, chunk=chunk, callback=callback, cancel=cancel, progress=progress,
    )  # fmt: skip
    x = carry.latents
    x = self._unpack(x[:, x.shape[1] - grid.tokens :], grid.f, grid.h, grid.w)
    if output_type == "latent":
      return jnp.transpose(x, (0, 4, 1, 2, 3))
    with self.decoding(progress):
      return self._decode(x, decode_timestep, decode_noise_scale, decode_noise, keys[3])
