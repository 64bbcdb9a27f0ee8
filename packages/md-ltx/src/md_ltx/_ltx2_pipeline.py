"""LTX-2 pipelines: text-to-video with audio (`LTX2Pipeline`) and image-to-video (`LTX2ImageToVideoPipeline`).

As diffusers' (0.42) pipelines, in JAX: prompts → Gemma 3 (every hidden state) → the feature extractor and
the video / audio text connectors; packed video and audio latent tokens; the flow-match Euler schedule
(`linspace(1, 1/n, n)` shifted by the token count's `mu`, stretched to `shift_terminal`), shared by both
streams; guidance in x0 space as a sum of deltas, per stream:

  x0 = x - v * sigma for each prediction, then
  guided = x0_pos + (g - 1)(x0_pos - x0_neg) + stg (x0_pos - x0_perturbed) + (m - 1)(x0_pos - x0_isolated)

(classifier-free guidance with the negative prompt; spatio-temporal guidance with the self-attentions of
`spatio_temporal_guidance_blocks` replaced by their values; modality guidance with the audio<->video
cross-attentions switched off), optionally rescaled toward the positive prediction's std
(`guidance_rescale`), turned back into a velocity and stepped. Image-to-video encodes the image as the
first latent frame, keeps it fixed (its tokens get timestep 0 and are not stepped) and noises the rest.
The video is decoded by the LTX-2 video VAE (a timestep-conditioned one blends in `decode_noise_scale` of
noise first), the audio by the audio VAE to a mel spectrogram and the vocoder to a waveform.

Sampling runs on md-schedulers' shared loop (`run_steps`, host-driven chunks): the sample is the pair
`(video, audio)`, the video as its token grid `[B, f', h', w', C']` (the packed tokens, reshaped) so the
image-to-video mask of `md_schedulers.ltx_token_euler` fits it alone; the family part is `_denoiser`
(the negative / positive / perturbed rows in one transformer call, the modality-isolated rows in a second).

Programs per shape: the prompt encoding, one jitted chunk of denoising steps and the decodings.
"""

from __future__ import annotations

import dataclasses
import math
import os
import pathlib
import tempfile
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import md_core
import md_schedulers as mdsch
import md_text
from md_core import call as mdc
from md_core import pipeline as mdp
from md_lora import LoRAPipeline
from md_ltx._ltx2_transformer import LTX2Transformer, ltx2_audio_coords, ltx2_video_coords
from md_ltx._recipes import check_ltx2_size
from md_ltx._video_tokens import check_video_size, decode_inputs, pack_tokens, unpack_tokens
from md_vae._ltx2_audio import LTX2AudioVAE, pack_audio_latents, unpack_audio_latents
from md_vae._ltx2_vae import LTX2VideoVAE

LTX2_PIPELINE_CLASSES = ("LTX2Pipeline", "LTX2ImageToVideoPipeline")
_F32 = jnp.float32


@dataclasses.dataclass
class LTX2Output:
  """What an LTX-2 pipeline returns.

  Attributes:
    frames: `[B, F, H, W, 3]` float32 in [0, 1] (with `output_type="latent"`: the denormalised video
      latents `[B, C, f, h, w]`, the reference's layout).
    audio: `[B, channels, samples]` float32 waveform (latent: the audio latents `[B, C, L, M]`).
    sample_rate: the waveform's samples per second (the vocoder's output rate).
    frame_rate: the frame rate the video was generated for (the MP4's).
  """

  frames: jax.Array
  audio: jax.Array
  sample_rate: int
  frame_rate: float

  def __iter__(self):  # frames, audio = pipe(...), as the reference's return_dict=False
    return iter((self.frames, self.audio))


# H.264 quality the LTX-2 / 2.3 (Gemma 3) checkpoints were trained with for conditioning images.
LTX2_IMAGE_CRF = 33


def _recompress(image: np.ndarray, crf: int) -> np.ndarray:
  """One uint8 `[H, W, 3]` image through H.264 at `crf` (one frame, yuv420p) and back, cropped to even
  sizes, as the reference re-compresses conditioning images (it encodes with PyAV's libx264 "veryfast";
  md with the bundled ffmpeg's libx264, so the result is close to, not bit-identical with, the reference's)."""
  h, w = image.shape[0] // 2 * 2, image.shape[1] // 2 * 2
  with tempfile.TemporaryDirectory(prefix="md_ltx2_crf_") as tmp:
    path = md_core.media.save_video(
      pathlib.Path(tmp) / "image.mp4", image[None, :h, :w], 1.0, crf=crf
    )
    frame = md_core.media.load_video(path, max_frames=1)[0]
  return np.round(frame * 255.0).astype(np.uint8)


def _image_array(image: Any, height: int, width: int, crf: int = 0) -> np.ndarray:
  """An image (file path, PIL image, `[H, W, 3]` uint8 or float in [0, 1]) → float32 `[height, width, 3]`
  in [-1, 1]: re-compressed with H.264 at `crf` (0: not), resized bilinearly (PIL) when its size differs,
  as the reference's pipeline and video processor do."""
  import PIL.Image  # noqa: PLC0415 - only for image conditioning

  if isinstance(image, str | os.PathLike):
    try:
      with PIL.Image.open(image) as im:
        image = im.convert("RGB")
    except (OSError, ValueError) as e:
      raise ValueError(f"image: cannot read the image file {os.fspath(image)!r}: {e}") from e
  if isinstance(image, PIL.Image.Image):
    image = image.convert("RGB")
    if crf:
      image = PIL.Image.fromarray(_recompress(np.asarray(image), crf))
  else:
    x = np.asarray(image)
    if x.ndim != 3 or x.shape[-1] != 3:
      raise ValueError(
        f"image must be one RGB image [H, W, 3] (uint8, or float in [0, 1]), a PIL image or a file; "
        f"got shape {x.shape}"
      )
    if crf:
      if x.dtype != np.uint8:
        x = np.round(np.clip(x, 0.0, 1.0) * 255.0).astype(np.uint8)
      x = _recompress(x, crf)
    if x.shape[:2] == (height, width):
      x = x.astype(np.float32) / 255.0 if x.dtype == np.uint8 else x.astype(np.float32)
      return x * 2.0 - 1.0
    if x.dtype != np.uint8:
      x = np.round(np.clip(x, 0.0, 1.0) * 255.0).astype(np.uint8)
    image = PIL.Image.fromarray(x)
  if image.size != (width, height):
    image = image.resize((width, height), resample=PIL.Image.BILINEAR)
  return np.asarray(image, np.float32) / 255.0 * 2.0 - 1.0


class LTX2VideoPipeline(LoRAPipeline, mdp.Pipeline):
  """A loaded LTX-2 pipeline (see `load_ltx2_pipeline`); call it to generate videos with sound.

  Attributes:
    transformer, vae, audio_vae, vocoder, text_encoder (Gemma 3), connectors, tokenizer: the components.
    scheduler_config: the checkpoint's `scheduler_config.json` dict (flow-match Euler).
    image_to_video: the folder is an `LTX2ImageToVideoPipeline` (an `image` is then required).
  """

  family = "ltx2"
  media = "video"
  lora_components = ("transformer",)  # what pipe.load_lora adapts

  def lora_key_map(self, component: str):
    from md_ltx._ltx2_weights import ltx2_convert_key  # noqa: PLC0415

    return ltx2_convert_key

  @classmethod
  def size_problems(cls, source, height, width, num_frames=1) -> list[str]:
    """`check_ltx2_size`: the checkpoint's VAE and patch multiples and frame steps, from configs."""
    try:
      check_ltx2_size(source, height, width, num_frames)
    except (ValueError, FileNotFoundError) as e:
      return [str(e)]
    return []

  def __init__(
    self,
    *,
    transformer: LTX2Transformer,
    vae: LTX2VideoVAE,
    audio_vae: LTX2AudioVAE,
    vocoder: Any,
    text_encoder: md_text.Gemma3Encoder,
    connectors: md_text.LTX2TextConnectors,
    tokenizer: Any,
    scheduler_config: Mapping[str, Any],
    image_to_video: bool = False,
    mesh: jax.sharding.Mesh | None = None,
    source: str = "",
  ):
    tc = transformer.cfg
    p, pt = tc.patch_size, tc.patch_size_t
    if tc.in_channels != vae.config.latent_channels * p * p * pt:
      raise ValueError(
        f"the transformer takes in_channels={tc.in_channels}; the VAE's {vae.config.latent_channels} "
        f"latent channels packed by patch {p} / {pt} do not give that"
      )
    ac = audio_vae.config
    if tc.audio_in_channels != ac.latent_channels * ac.latent_mel_bins:
      raise ValueError(
        f"the transformer takes audio_in_channels={tc.audio_in_channels}; the audio VAE's "
        f"{ac.latent_channels} channels x {ac.latent_mel_bins} latent mel bins do not give that"
      )
    self.transformer, self.vae, self.audio_vae, self.vocoder = transformer, vae, audio_vae, vocoder
    self.text_encoder, self.connectors, self.tokenizer = text_encoder, connectors, tokenizer
    self.scheduler_config = dict(scheduler_config)
    self.image_to_video = image_to_video
    self._init_scaffold(mesh, source)
    self._tr, self._vae = mdp.Split.of(transformer), mdp.Split.of(vae)
    self._audio = mdp.Split.of(nnx.Dict(vae=audio_vae, vocoder=vocoder))
    self._text = mdp.Split.of(nnx.Dict(encoder=text_encoder, connectors=connectors))
    self.last_calls = 0

  # --- facts --------------------------------------------------------------------------------------------
  @property
  def vae_spatial_compression_ratio(self) -> int:
    return self.vae.config.spatial_ratio

  @property
  def vae_temporal_compression_ratio(self) -> int:
    return self.vae.config.temporal_ratio

  @property
  def sample_rate(self) -> int:
    """The waveform's samples per second."""
    return int(self.vocoder.sample_rate)

  # --- text ----------------------------------------------------------------------------------------------
  def prompt_embeds(
    self, prompts: str | Sequence[str], max_sequence_length: int = 1024
  ) -> tuple[jax.Array, jax.Array]:
    """Gemma 3's packed hidden states `[B, L, C * (layers + 1)]` and the token mask `[B, L]` (int32),
    as the reference's `encode_prompt` returns them (left padding, prompts stripped)."""
    tokens = md_text.gemma3_tokenize(self.tokenizer, prompts, max_length=max_sequence_length)
    split = self._text

    def encode(state, ids, mask):
      return md_text.ltx2_prompt_embeds(split.merge(state)["encoder"], ids, mask)

    fn = self.jit(("gemma", max_sequence_length), lambda: jax.jit(encode))
    mask = jnp.asarray(tokens.mask, jnp.int32)
    with self.context():
      return fn(self._text.jit_state(), jnp.asarray(tokens.ids), mask), mask

  def connect(self, embeds: jax.Array, mask: jax.Array) -> md_text.LTX2TextEmbeds:
    """The feature extractor and connectors on packed Gemma states: video / audio text states + mask."""
    split = self._text
    side = getattr(self.tokenizer, "padding_side", "left") or "left"

    def run(state, e, m):
      return split.merge(state)["connectors"](e, m, padding_side=side)

    fn = self.jit(("connectors", side), lambda: jax.jit(run))
    with self.context():
      return fn(self._text.jit_state(), jnp.asarray(embeds, _F32), jnp.asarray(mask, jnp.int32))

  # --- sizes ---------------------------------------------------------------------------------------------
  def check_size(self, height: int, width: int, num_frames: int) -> None:
    """Raises `md_core.pipeline.SizeError` (a ValueError naming the nearest valid values) for sizes the
    VAE and the packing cannot take: height and width multiples of 32 (and of the VAE's factor × patch),
    `num_frames = 1 + 8k`."""
    tc = self.transformer.cfg
    m = math.lcm(32, self.vae_spatial_compression_ratio * tc.patch_size)
    t = self.vae_temporal_compression_ratio * tc.patch_size_t
    check_video_size("LTX-2 VAE", height, width, num_frames, m, t)

  # --- packing ---------------------------------------------------------------------------------------------
  def _pack(self, x):
    cfg = self.transformer.cfg
    return pack_tokens(x, cfg.patch_size, cfg.patch_size_t)

  def _unpack(self, x, f, h, w):
    cfg = self.transformer.cfg
    return unpack_tokens(x, f, h, w, cfg.patch_size, cfg.patch_size_t)

  # --- image conditioning ----------------------------------------------------------------------------------
  def _encode_image(self, pixels: jax.Array) -> jax.Array:
    """`[B, H, W, 3]` in [-1, 1] → normalised latents `[B, 1, h, w, C]` (the posterior's mode)."""
    vae = self._vae

    def encode(state, x):
      model = vae.merge(state)
      z = model.encode(x[:, None]).mode()
      mean = model.latents_mean[...].astype(z.dtype).reshape(1, 1, 1, 1, -1)
      std = model.latents_std[...].astype(z.dtype).reshape(1, 1, 1, 1, -1)
      return (z - mean) * 1.0 / std  # the i2v pipeline normalises the image with scaling factor 1

    fn = self.jit(("encode_image", pixels.shape), lambda: jax.jit(encode))
    with self.context():
      return fn(self._vae.state, pixels)

  def prepare_image_latents(
    self, image: Any, *, height: int, width: int, noise: Any, image_crf: int = 0
  ) -> tuple[jax.Array, jax.Array]:
    """The image-to-video start: packed latents `[B, S, C]` (the encoded image at the first latent frame,
    `noise` elsewhere) and the conditioning mask `[B, S]` (1 on the image's tokens), as the reference's
    `prepare_latents` builds them without given latents.

    Args:
      image: one image (path, PIL, `[H, W, 3]`) or a list of one per video.
      noise: `[B, C, f, h, w]` in the reference's layout.
      image_crf: H.264 re-compression of the image first (0: none; the pipeline call's default is 33).
    """
    images = image if isinstance(image, list | tuple) else [image]
    pixels = [_image_array(im, height, width, image_crf) for im in images]
    return self._image_latents(pixels, noise)

  def _image_latents(self, pixels: list[np.ndarray], noise: Any) -> tuple[jax.Array, jax.Array]:
    """`prepare_image_latents` on images already read (`_image_array`)."""
    noise = jnp.transpose(jnp.asarray(noise, _F32), (0, 2, 3, 4, 1))
    b = noise.shape[0]
    if len(pixels) == 1 and b > 1:
      pixels = pixels * b
    if len(pixels) != b:
      raise ValueError(f"{len(pixels)} images for {b} videos")
    pixels = jnp.asarray(np.stack(pixels))
    init = self._encode_image(pixels)  # [B, 1, h, w, C]
    if init.shape[2:] != noise.shape[2:] or noise.shape[1] < 1:
      raise ValueError(
        f"noise [B, C, f, h, w] has latent size {noise.shape[2:4]} and {noise.shape[-1]} channels; "
        f"the image encodes to {init.shape[2:4]} with {init.shape[-1]}"
      )
    mask = jnp.zeros(noise.shape[:4] + (1,), _F32).at[:, 0].set(1.0)
    latents = init * mask + noise * (1 - mask)
    return self._pack(latents), self._pack(mask)[..., 0]

  # --- decoding ----------------------------------------------------------------------------------------------
  def _decode_video_fn(self):
    vae = self._vae
    conditioned = self.vae.config.timestep_conditioning
    inject = any(self.vae.config.decoder_inject_noise)

    def decode(state, latents, timestep, noise_scale, noise, key):
      model = vae.merge(state)
      z = latents.astype(_F32)
      if conditioned:
        s = noise_scale[:, None, None, None, None]
        z = (1 - s) * z + s * noise
      z = model.denormalize_latents(z)
      if conditioned:
        video = model.decode(z, timestep, key=key if inject else None)
      else:
        video = model.decode(z)
      return jnp.clip(video / 2 + 0.5, 0.0, 1.0)

    return jax.jit(decode)

  def decode_video(
    self,
    latents: jax.Array,
    *,
    decode_timestep: float | Sequence[float] = 0.0,
    decode_noise_scale: float | Sequence[float] | None = None,
    decode_noise: Any = None,
    seed: int = 0,
  ) -> jax.Array:
    """Normalised latents `[B, f, h, w, C]` (channels last) → frames `[B, F, H, W, 3]` in [0, 1].

    A timestep-conditioned VAE first blends in noise, `(1 - decode_noise_scale) * z + decode_noise_scale *
    noise` (`decode_noise_scale` defaults to `decode_timestep`), `noise` being `decode_noise`
    (`[B, C, f, h, w]`, the reference's layout) or drawn from `seed`.
    """
    timestep, scale, noise, key_vae = decode_inputs(
      latents, decode_timestep, decode_noise_scale, decode_noise, jax.random.key(int(seed))
    )
    fn = self.jit("decode_video", self._decode_video_fn)
    with self.context():
      return fn(self._vae.state, latents, timestep, scale, noise, key_vae)

  def decode_audio(self, packed: jax.Array) -> jax.Array:
    """Normalised packed audio latents `[B, L, C * M]` → waveform `[B, channels, samples]`."""
    split = self._audio
    mel_bins = self.audio_vae.config.latent_mel_bins

    def decode(state, x):
      parts = split.merge(state)
      z = unpack_audio_latents(parts["vae"].denormalize_latents(x.astype(_F32)), mel_bins)
      wave = parts["vocoder"](parts["vae"].decode(z))  # [B, samples, channels]
      return jnp.transpose(wave, (0, 2, 1))

    fn = self.jit("decode_audio", lambda: jax.jit(decode))
    with self.context():
      return fn(self._audio.state, packed)

  # --- the loop ----------------------------------------------------------------------------------------------
  def _denoiser(self, spec: mdsch.guidance.Guidance, stg_blocks: tuple[int, ...], cross: bool):
    """The family part of sampling: the transformer on every guidance row (`[negative, positive,
    perturbed]` in one call, the `isolated` rows in a second one without audio<->video attention)."""
    tr, n = self._tr, spec.num_branches
    joint = n - spec.modality  # rows of the first call, in branches

    def denoise(params, x, t, cond, *, step):
      del step
      model = tr.merge(params)
      video, audio = x
      rows = video.shape[0]
      b = rows // n
      tokens = video.reshape(rows, -1, video.shape[-1])  # the token grid → packed tokens
      t = t.astype(_F32)
      mask = cond["conditioning"]
      tv = t if mask is None else mdsch.ltx_token_timesteps(t, jnp.concatenate([mask] * n))

      def call(rs, **kw):
        v, a = model(
          tokens[rs], audio[rs], cond["text"][rs], cond["audio_text"][rs], tv[rs],
          audio_timestep=t[rs], sigma=t[rs], encoder_attention_mask=cond["mask"][rs],
          audio_encoder_attention_mask=cond["mask"][rs], video_coords=cond["video_coords"],
          audio_coords=cond["audio_coords"], use_cross_timestep=cross, **kw,
        )  # fmt: skip
        return v.astype(_F32), a.astype(_F32)

      kw = {}
      if spec.stg:  # the last row block of the first call skips the STG blocks' self-attention
        perturb = jnp.concatenate([jnp.ones(((joint - 1) * b,), _F32), jnp.zeros((b,), _F32)])
        kw = dict(spatio_temporal_guidance_blocks=stg_blocks, perturbation_mask=perturb)
      outs = [call(slice(0, joint * b), **kw)]
      if spec.modality:
        outs.append(call(slice(joint * b, rows), isolate_modalities=True))
      v = jnp.concatenate([o[0] for o in outs], axis=0)
      return v.reshape(video.shape), jnp.concatenate([o[1] for o in outs], axis=0)

    return denoise

  def _run_fn(self, sched, *, spec, stg_blocks, cross, cache):
    """One jitted chunk of steps `[lo, hi)` (traced bounds)."""
    denoise = self._denoiser(spec, stg_blocks, cross)

    def run(carry, lo, hi, params, cond, scales):
      return mdsch.run_steps(
        denoise, sched, carry, lo, hi, cond, params=params, guidance=spec, scales=scales,
        cache=cache,
      )  # fmt: skip

    return jax.jit(run)

  # --- call ----------------------------------------------------------------------------------------------------
  # --- the call's steps ------------------------------------------------------------------------------------
  def _read_images(self, image, latents, height, width, num_frames, image_crf):
    """`(i2v, pixels)`: whether the call is image to video, and the images read and checked before any
    work (None when the latents carry the condition or there is no image)."""
    i2v = self.image_to_video or image is not None
    if not i2v or latents is not None:
      return i2v, image
    if image is None:
      raise ValueError(
        "image-to-video needs an image (or latents whose first frame is the condition)"
      )
    self.check_size(height, width, num_frames)
    images = image if isinstance(image, list | tuple) else [image]
    crf = LTX2_IMAGE_CRF if image_crf is None else int(image_crf)
    return i2v, [_image_array(im, height, width, crf) for im in images]

  def _stg_blocks(
    self, blocks, stg_scale: float, audio_stg_scale: float
  ) -> tuple[bool, tuple[int, ...]]:
    """`(want_stg, blocks)`: whether spatio-temporal guidance runs, and its blocks (checked)."""
    layers = self.transformer.cfg.num_layers
    blocks = tuple(int(i) for i in (blocks or ()))
    want_stg = stg_scale > 0.0 or audio_stg_scale > 0.0
    if want_stg and not blocks:
      raise ValueError("stg_scale > 0 needs spatio_temporal_guidance_blocks")
    for i in blocks if want_stg else ():
      if not 0 <= i < layers:
        raise ValueError(
          f"spatio_temporal_guidance_blocks has block {i}; the transformer has {layers} blocks"
        )
    return want_stg, blocks

  def _latent_grid(self, latents, height: int, width: int, num_frames: int):
    """`(latents, (f, h, w), tokens)`: the given latents as float32 (or None) and the latent grid, from
    `[B, C, F, H, W]` latents or the size."""
    tc = self.transformer.cfg
    s, r = self.vae_spatial_compression_ratio, self.vae_temporal_compression_ratio
    if latents is not None:
      latents = jnp.asarray(latents, _F32)
      if latents.ndim not in (3, 5):
        raise ValueError(
          f"latents must be [B, C, F, H, W] or packed [B, S, C], got shape {latents.shape}"
        )
    if latents is not None and latents.ndim == 5:
      _, _, f, h, w = latents.shape
    else:
      self.check_size(height, width, num_frames)
      f, h, w = (num_frames - 1) // r + 1, height // s, width // s
    tokens = (f // tc.patch_size_t) * (h // tc.patch_size) * (w // tc.patch_size)
    return latents, (f, h, w), tokens

  def _text_rows(
    self, prompt, negative_prompt, prompt_embeds, prompt_attention_mask, negative_prompt_embeds,
    negative_prompt_attention_mask, *, per_prompt: int, max_sequence_length: int, cfg_on: bool,
  ) -> tuple[md_text.LTX2TextEmbeds, int]:  # fmt: skip
    """The connectors' text states of the guidance rows (`[negative;] positive`) and the number of
    videos."""

    def given(embeds, mask, message):
      if mask is None:
        raise ValueError(message)
      embeds, mask = jnp.asarray(embeds, _F32), jnp.asarray(mask, jnp.int32)
      if mask.shape != embeds.shape[:2]:
        raise ValueError(
          f"attention mask {mask.shape} does not match the embeddings {embeds.shape}"
        )
      return embeds, mask

    pos = mdc.resolve_prompt(
      prompt, prompt_embeds, encode=lambda p: self.prompt_embeds(p, max_sequence_length),
      given=lambda e: given(e, prompt_attention_mask, "prompt_embeds needs prompt_attention_mask"),
    )  # fmt: skip
    neg = None
    if cfg_on:
      neg = mdc.resolve_negative(
        negative_prompt, negative_prompt_embeds, pos,
        encode=lambda p: self.prompt_embeds(p, pos[0].shape[1]),
        given=lambda e: given(e, negative_prompt_attention_mask, "negative_prompt_embeds needs "
                              "negative_prompt_attention_mask"),
      )  # fmt: skip
    embeds, mask = mdc.guidance_rows(pos, neg, per_prompt)
    return self.connect(embeds, mask), pos[0].shape[0] * per_prompt

  def _video_latents(self, latents, image, i2v, b, grid, tokens, noise_scale, key, size):
    """`(x, cond)`: the packed, normalised video latents `[B, S, C]` and the image-to-video
    conditioning mask `[B, S]` (1 on the first frame's tokens; None for text to video)."""
    tc, c = self.transformer.cfg, self.vae.config.latent_channels
    f, h, w = grid
    if latents is None:
      if i2v:
        return self._image_latents(image, jax.random.normal(key, (b, c, f, h, w), _F32))
      noise = jax.random.normal(key, (b, c, f, h, w), _F32)
      return self._pack(noise.transpose(0, 2, 3, 4, 1)), None
    if latents.shape[0] != b:
      raise ValueError(f"latents have batch {latents.shape[0]}; the call makes {b} videos")
    cond = None
    if i2v:
      cond = self._pack(jnp.zeros((b, f, h, w, 1), _F32).at[:, 0].set(1.0))[..., 0]
    if latents.ndim == 5:
      if latents.shape[1] != c:
        raise ValueError(f"latents [B, C, F, H, W] must have C={c}, got shape {latents.shape}")
      z = self.vae.normalize_latents(jnp.transpose(latents, (0, 2, 3, 4, 1)))
      if noise_scale:
        eps = jax.random.normal(key, z.shape, _F32)
        ns = (
          noise_scale
          if cond is None
          else noise_scale * (1 - self._unpack(cond[..., None], f, h, w))
        )
        z = ns * eps + (1 - ns) * z
      return self._pack(z), cond
    x = latents
    if x.shape[1:] != (tokens, tc.in_channels):
      height, width, num_frames = size
      raise ValueError(
        f"packed latents must be [B, S={tokens}, {tc.in_channels}] for {height}x{width}, "
        f"{num_frames} frames; got {latents.shape}"
      )
    if noise_scale and cond is None:
      eps = jax.random.normal(key, x.shape, _F32)
      x = noise_scale * eps + (1 - noise_scale) * x
    return x, cond

  def _audio_latents(self, audio_latents, b, num_frames, frame_rate, noise_scale, key):
    """`(a, frames)`: the packed, normalised audio latents `[B, L, C * M]` and their length L."""
    ac = self.audio_vae.config
    mel = ac.latent_mel_bins
    if audio_latents is None:
      fa = round(num_frames / frame_rate * ac.latents_per_second)
      eps = jax.random.normal(key, (b, ac.latent_channels, fa, mel), _F32)
      return pack_audio_latents(jnp.transpose(eps, (0, 2, 3, 1))), fa
    audio_latents = jnp.asarray(audio_latents, _F32)
    if audio_latents.ndim == 4:
      if audio_latents.shape[1] != ac.latent_channels or audio_latents.shape[3] != mel:
        raise ValueError(
          f"audio_latents [B, C, L, M] must have C={ac.latent_channels}, M={mel}; got "
          f"{audio_latents.shape}"
        )
      audio_latents = pack_audio_latents(jnp.transpose(audio_latents, (0, 2, 3, 1)))
    if audio_latents.ndim != 3 or audio_latents.shape[0] != b:
      raise ValueError(
        f"audio_latents must be [B={b}, C, L, M] or packed [B, L, C * M], got {audio_latents.shape}"
      )
    a = self.audio_vae.normalize_latents(audio_latents)
    if noise_scale:
      eps = jax.random.normal(key, a.shape, _F32)
      a = noise_scale * eps + (1 - noise_scale) * a
    return a, audio_latents.shape[1]

  def _schedule(self, tokens, grid_shape, cond, shapes, num_inference_steps, sigmas):
    """`(base, sched, state)`: flow-match Euler over the video token grid and the audio (one schedule),
    the image's tokens kept."""
    base = mdsch.from_config(self.scheduler_config)
    if base.name != "FlowMatchEulerDiscreteScheduler":
      raise ValueError(
        f"LTX-2 samples with flow-match Euler; the folder's scheduler is {base.name}"
      )
    sched = mdsch.ltx_token_euler(**base.config)
    mu = mdsch.ltx_mu(tokens, self.scheduler_config)
    given = mdsch.ltx_uniform_sigmas(num_inference_steps) if sigmas is None else list(sigmas)
    st = sched.init(
      sigmas=given, mu=mu, conditioning=None if cond is None else np.asarray(cond).reshape(grid_shape),
      shape=shapes,
    )  # fmt: skip
    return base, sched, st

  def _guidance(self, total, b, *, do_cfg, want_stg, guidance_scale, audio_guidance_scale, stg_scale,
                audio_stg_scale, modality_scale, audio_modality_scale, guidance_rescale,
                audio_guidance_rescale):  # fmt: skip
    """`(spec, scales, extra)`: the guidance rows `[negative, positive, perturbed, isolated]` of the
    enabled branches, combined on x0 = x - sigma * v with one scale per modality, the rescale after
    every term (as the reference); `extra` the positive rows the perturbed and isolated rows repeat."""
    rescale = (guidance_rescale > 0, audio_guidance_rescale > 0)
    spec = mdsch.guidance.Guidance(
      cfg=do_cfg, stg=want_stg and self.transformer.cfg.perturbed_attn,
      modality=modality_scale > 1.0 or audio_modality_scale > 1.0, rescale=any(rescale),
      rescale_last=any(rescale), space="x0",
    )  # fmt: skip
    values = dict(
      guidance=(guidance_scale, audio_guidance_scale),
      stg=(stg_scale, audio_stg_scale),
      modality=(modality_scale, audio_modality_scale),
      # phi = 0 leaves a modality's prediction exactly as it is.
      rescale=tuple(float(phi) if on else 0.0
                    for phi, on in zip((guidance_rescale, audio_guidance_rescale), rescale)),
    )  # fmt: skip
    scales = jax.tree.map(
      jnp.asarray, mdsch.guidance.per_step(total, {k: values[k] for k in spec.scale_names})
    )
    pos = slice(b, 2 * b) if spec.cfg else slice(0, b)
    return spec, scales, (pos,) * (spec.stg + spec.modality)

  def __call__(
    self,
    prompt: str | Sequence[str] | None = None,
    negative_prompt: str | Sequence[str] | None = None,
    *,
    image: Any = None,
    image_crf: int | None = None,
    height: int = 512,
    width: int = 768,
    num_frames: int = 121,
    frame_rate: float = 24.0,
    motion_speed: float = 1.0,
    num_inference_steps: int = 30,
    sigmas: Sequence[float] | None = None,
    guidance_scale: float = 3.0,
    stg_scale: float = 1.0,
    modality_scale: float = 3.0,
    guidance_rescale: float = 0.7,
    audio_guidance_scale: float | None = 7.0,
    audio_stg_scale: float | None = 1.0,
    audio_modality_scale: float | None = 3.0,
    audio_guidance_rescale: float | None = 0.7,
    spatio_temporal_guidance_blocks: Sequence[int] | None = (28,),
    noise_scale: float = 0.0,
    num_videos_per_prompt: int = 1,
    seed: int = 0,
    latents: Any = None,
    audio_latents: Any = None,
    prompt_embeds: Any = None,
    prompt_attention_mask: Any = None,
    negative_prompt_embeds: Any = None,
    negative_prompt_attention_mask: Any = None,
    decode_timestep: float | Sequence[float] = 0.0,
    decode_noise_scale: float | Sequence[float] | None = None,
    decode_noise: Any = None,
    use_cross_timestep: bool = True,
    max_sequence_length: int = 1024,
    output_type: str = "np",
    callback: Callable[[int, jax.Array, Any], Any] | None = None,
    cancel: Callable[[], bool] | None = None,
    cache: mdsch.StepCache | None = None,
    chunk: int | str | None = "auto",
    progress: bool = True,
  ) -> LTX2Output:
    """Generates videos with sound (diffusers' LTX2Pipeline / LTX2ImageToVideoPipeline call, same names
    and defaults).

    Args:
      prompt: one prompt or a list (or pass `prompt_embeds`).
      negative_prompt: for classifier-free guidance (default "").
      image: image-to-video: the first frame (path, PIL, `[H, W, 3]` uint8 / float in [0, 1], or a list of
        one per video); resized to `height x width` if needed. Required for an image-to-video folder; with
        given `latents` it is unused (as in the reference: the latents' first frame is the condition).
      image_crf: H.264 re-compression of the image before encoding, as the model was trained (None: 33,
        the LTX-2 / 2.3 value; 0: none). md's encoder settings differ slightly from the reference's, so
        the compressed image is close to, not bit-identical with, the reference's.
      height, width: multiples of 32. num_frames: `1 + 8k`.
      frame_rate: the video's frame rate (positions and audio length follow it); `motion_speed` divides it
        for the positions only.
      num_inference_steps, sigmas: the schedule (`sigmas`: custom, e.g. `md_schedulers.LTX2_DISTILLED_SIGMAS`).
      guidance_scale, stg_scale, modality_scale, guidance_rescale: the video's guidance terms;
        `audio_*` the audio's (None or 0: the video's value, as the reference).
      spatio_temporal_guidance_blocks: the blocks whose self-attention the perturbed pass skips (STG runs
        only for transformers built with perturbed attention; for others the term is zero, as there).
      noise_scale: noise blended into given latents (`noise_scale * eps + (1 - noise_scale) * z`).
      num_videos_per_prompt: videos per prompt.
      seed: random seed for latents / audio latents / decode noise not given.
      latents: video latents, unnormalised `[B, C, f, h, w]` (as the VAE gives them; they are normalised
        here as the reference does) or normalised packed `[B, S, C]`.
      audio_latents: unnormalised `[B, C, L, M]` or packed unnormalised `[B, L, C * M]`.
      prompt_embeds, prompt_attention_mask, negative_*: precomputed packed Gemma states `[B, L, D]`.
      decode_timestep, decode_noise_scale, decode_noise: the decoder's timestep and noise blend
        (timestep-conditioned VAEs only); `decode_noise` `[B, C, f, h, w]`, else drawn from `seed`.
      use_cross_timestep: the audio<->video modulation follows the other stream's timestep (the reference
        default, True).
      max_sequence_length: Gemma's token count (1024).
      output_type: "np" (frames and waveform) or "latent" (the final latents before the VAEs,
        denormalised, in the reference's layouts: video `[B, C, f, h, w]`, audio `[B, C, L, M]`).
      callback: `callback(step, timestep, latents)` after each step, `latents` the normalised packed
        `(video [B, S, C], audio [B, L, C * M])` (the reference's callback layout); returning False
        stops like `cancel`.
      cancel: polled at each step boundary; True stops with `md_schedulers.Cancelled`.
      cache: a step cache (md-cache policy) deciding, on device, which steps reuse a prediction.
      chunk: steps per host dispatch ("auto", the default: about 50 ms of work per dispatch; None: the whole loop in one call; progress, callback and cancel
        act at chunk boundaries).
      progress: a progress bar over the steps.

    Returns:
      `LTX2Output(frames, audio, sample_rate, frame_rate)`. The denoiser calls made are in
      `self.last_calls`.

    Raises:
      ValueError: sizes the VAE cannot take (`md_core.pipeline.SizeError`, with the nearest valid ones),
        an unreadable image, latents or embeddings of the wrong shape, an image-to-video call without
        image or latents, an unknown `output_type`.
      md_schedulers.Cancelled: `cancel()` returned True (or `callback` returned False).
    """
    mdc.check_output_type(output_type)
    if motion_speed <= 0:
      raise ValueError(f"motion_speed must be positive, got {motion_speed}")
    audio_guidance_scale = audio_guidance_scale or guidance_scale
    audio_stg_scale = audio_stg_scale or stg_scale
    audio_modality_scale = audio_modality_scale or modality_scale
    audio_guidance_rescale = audio_guidance_rescale or guidance_rescale
    tc = self.transformer.cfg
    i2v, image = self._read_images(image, latents, height, width, num_frames, image_crf)
    do_cfg = guidance_scale > 1.0 or audio_guidance_scale > 1.0
    want_stg, blocks = self._stg_blocks(spatio_temporal_guidance_blocks, stg_scale, audio_stg_scale)
    latents, (f, h, w), tokens = self._latent_grid(latents, height, width, num_frames)

    text, b = self._text_rows(
      prompt, negative_prompt, prompt_embeds, prompt_attention_mask, negative_prompt_embeds,
      negative_prompt_attention_mask, per_prompt=num_videos_per_prompt,
      max_sequence_length=max_sequence_length, cfg_on=do_cfg,
    )  # fmt: skip
    keys = jax.random.split(jax.random.key(int(seed)), 5)
    x, cond = self._video_latents(
      latents, image, i2v, b, (f, h, w), tokens, noise_scale, keys[0], (height, width, num_frames)
    )
    a, fa = self._audio_latents(audio_latents, b, num_frames, frame_rate, noise_scale, keys[1])
    grid = (b, f // tc.patch_size_t, h // tc.patch_size, w // tc.patch_size)
    xg = x.reshape(grid + (x.shape[-1],))  # the token grid: only the video fits the mask
    base, sched, st = self._schedule(
      tokens, grid, cond, (xg.shape, a.shape), num_inference_steps, sigmas
    )
    total = mdsch.num_calls(st)
    spec, scales, extra = self._guidance(
      total, b, do_cfg=do_cfg, want_stg=want_stg, guidance_scale=guidance_scale,
      audio_guidance_scale=audio_guidance_scale, stg_scale=stg_scale,
      audio_stg_scale=audio_stg_scale, modality_scale=modality_scale,
      audio_modality_scale=audio_modality_scale, guidance_rescale=guidance_rescale,
      audio_guidance_rescale=audio_guidance_rescale,
    )  # fmt: skip
    fps = float(frame_rate) / float(motion_speed)
    cond_in = dict(
      text=jnp.concatenate([text.video] + [text.video[r] for r in extra]),
      audio_text=jnp.concatenate([text.audio] + [text.audio[r] for r in extra]),
      mask=jnp.concatenate([text.mask] + [text.mask[r] for r in extra]),
      video_coords=jnp.asarray(ltx2_video_coords(tc, f, h, w, fps)),
      audio_coords=jnp.asarray(ltx2_audio_coords(tc, fa)),
      conditioning=cond,
    )
    blocks = blocks if spec.stg else ()
    cross = bool(use_cross_timestep)
    report = None
    if callback is not None:

      def report(i, t, latents):
        v, au = latents
        return callback(i, t, (v.reshape(b, tokens, -1), au))

    carry = mdsch.sample_pipeline(
      self, ("loop", repr(sorted(base.config.items())), total, spec, blocks, cross, cond is not None),
      lambda cache: self._run_fn(sched, spec=spec, stg_blocks=blocks, cross=cross, cache=cache),
      (xg, a), st, args=(self._tr.jit_state(), self.place(cond_in), scales),
      cache=cache, chunk=chunk, callback=report, cancel=cancel, progress=progress,
    )  # fmt: skip
    xg, a = carry.latents
    return self._outputs(xg.reshape(b, tokens, -1), a, (f, h, w), output_type, frame_rate, keys[2],
                         decode_timestep, decode_noise_scale, decode_noise, progress)  # fmt: skip

  def _outputs(self, x, a, grid, output_type, frame_rate, key, decode_timestep, decode_noise_scale,
               decode_noise, progress) -> LTX2Output:  # fmt: skip
    """The denormalised latents (`output_type="latent"`) or the decoded frames and audio."""
    z = self._unpack(x, *grid)
    if output_type == "latent":
      video = jnp.transpose(self.vae.denormalize_latents(z), (0, 4, 1, 2, 3))
      za = unpack_audio_latents(
        self.audio_vae.denormalize_latents(a), self.audio_vae.config.latent_mel_bins
      )
      return LTX2Output(video, jnp.transpose(za, (0, 3, 1, 2)), self.sample_rate, float(frame_rate))
    with self.decoding(progress):
      frames = self.decode_video(
        z, decode_timestep=decode_timestep, decode_noise_scale=decode_noise_scale,
        decode_noise=decode_noise, seed=int(jax.random.randint(key, (), 0, 2**31 - 1)),
      )  # fmt: skip
      audio = self.decode_audio(a)
    return LTX2Output(frames, audio, self.sample_rate, float(frame_rate))
