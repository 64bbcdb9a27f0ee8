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

Programs per shape: the prompt encoding, one denoising loop (`fori_loop`; the negative / positive /
perturbed predictions are one batch, the modality-isolated one a second call) and the decodings.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import pathlib
import tempfile
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import md_core
import md_schedulers as mdsch
import md_text
from md_core import progress as md_progress
from md_ltx._ltx2_transformer import LTX2Transformer, ltx2_audio_coords, ltx2_video_coords
from md_ltx._ltx2_weights import load_ltx2_transformer
from md_ltx._video_tokens import check_video_size, pack_tokens, unpack_tokens
from md_vae._ltx2_audio import LTX2AudioVAE, pack_audio_latents, unpack_audio_latents
from md_vae._ltx2_audio_weights import load_vae_ltx2_audio
from md_vae._ltx2_vae import LTX2VideoVAE
from md_vae._ltx2_vae_weights import load_vae_ltx2
from md_vae._ltx2_vocoder_weights import load_vocoder_ltx2

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


@dataclasses.dataclass
class _Split:
  graphdef: Any
  state: Any

  @classmethod
  def of(cls, module: nnx.Module) -> _Split:
    return cls(*nnx.split(module))

  def merge(self, state: Any) -> nnx.Module:
    return nnx.merge(self.graphdef, state)


@dataclasses.dataclass(frozen=True)
class _Guide:
  """Which predictions and terms the loop computes (static: part of the compiled program's key)."""

  cfg: bool
  stg: bool
  modality: bool
  rescale: bool
  audio_rescale: bool
  stg_blocks: tuple[int, ...]
  cross_timestep: bool
  i2v: bool


def _as_list(prompt: str | Sequence[str] | None) -> list[str] | None:
  if prompt is None:
    return None
  return [prompt] if isinstance(prompt, str) else list(prompt)


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


def _rescale(guided, cond, phi):
  """Guidance rescale (Lin et al. 2023, 3.4): blend in the guided prediction scaled to the conditional
  one's std (over everything but the batch, unbiased)."""
  axes = tuple(range(1, guided.ndim))
  std_cond = jnp.std(cond, axis=axes, keepdims=True, ddof=1)
  std_guided = jnp.std(guided, axis=axes, keepdims=True, ddof=1)
  return phi * (guided * (std_cond / std_guided)) + (1 - phi) * guided


class LTX2VideoPipeline:
  """A loaded LTX-2 pipeline (see `load_ltx2_pipeline`); call it to generate videos with sound.

  Attributes:
    transformer, vae, audio_vae, vocoder, text_encoder (Gemma 3), connectors, tokenizer: the components.
    scheduler_config: the checkpoint's `scheduler_config.json` dict (flow-match Euler).
    image_to_video: the folder is an `LTX2ImageToVideoPipeline` (an `image` is then required).
  """

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
    self.mesh, self.source = mesh, source
    self._tr, self._vae = _Split.of(transformer), _Split.of(vae)
    self._audio = _Split.of(nnx.Dict(vae=audio_vae, vocoder=vocoder))
    self._text = _Split.of(nnx.Dict(encoder=text_encoder, connectors=connectors))
    self._compiled: dict[Any, Any] = {}

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

  def _context(self):
    return jax.set_mesh(self.mesh) if self.mesh is not None else contextlib.nullcontext()

  def _jit(self, key, make):
    fn = self._compiled.get(key)
    if fn is None:
      fn = self._compiled[key] = make()
    return fn

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

    fn = self._jit(("gemma", max_sequence_length), lambda: jax.jit(encode))
    mask = jnp.asarray(tokens.mask, jnp.int32)
    with self._context():
      return fn(self._text.state, jnp.asarray(tokens.ids), mask), mask

  def connect(self, embeds: jax.Array, mask: jax.Array) -> md_text.LTX2TextEmbeds:
    """The feature extractor and connectors on packed Gemma states: video / audio text states + mask."""
    split = self._text
    side = getattr(self.tokenizer, "padding_side", "left") or "left"

    def run(state, e, m):
      return split.merge(state)["connectors"](e, m, padding_side=side)

    fn = self._jit(("connectors", side), lambda: jax.jit(run))
    with self._context():
      return fn(self._text.state, jnp.asarray(embeds, _F32), jnp.asarray(mask, jnp.int32))

  # --- sizes ---------------------------------------------------------------------------------------------
  def check_size(self, height: int, width: int, num_frames: int) -> None:
    """Raises ValueError (naming the nearest valid values) for sizes the VAE and the packing cannot take:
    height and width multiples of 32 (and of the VAE's factor × patch), `num_frames = 1 + 8k`."""
    tc = self.transformer.cfg
    m = int(np.lcm(32, self.vae_spatial_compression_ratio * tc.patch_size))
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

    fn = self._jit(("encode_image", pixels.shape), lambda: jax.jit(encode))
    with self._context():
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
    b = latents.shape[0]

    def per_video(v, what):
      v = [float(v)] * b if np.isscalar(v) else [float(x) for x in v]
      if len(v) != b:
        raise ValueError(f"{what} has {len(v)} entries for {b} videos")
      return jnp.asarray(v, _F32)

    timestep = per_video(decode_timestep, "decode_timestep")
    scale = (
      timestep
      if decode_noise_scale is None
      else per_video(decode_noise_scale, "decode_noise_scale")
    )
    key_noise, key_vae = jax.random.split(jax.random.key(int(seed)))
    if decode_noise is None:
      noise = jax.random.normal(key_noise, latents.shape, _F32)
    else:
      noise = jnp.asarray(decode_noise, _F32)
      want = (b, latents.shape[-1], *latents.shape[1:4])
      if noise.shape != want:
        raise ValueError(f"decode_noise must be [B, C, F, H, W] = {want}, got {noise.shape}")
      noise = jnp.transpose(noise, (0, 2, 3, 4, 1))
    fn = self._jit("decode_video", self._decode_video_fn)
    with self._context():
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

    fn = self._jit("decode_audio", lambda: jax.jit(decode))
    with self._context():
      return fn(self._audio.state, packed)

  # --- the loop ----------------------------------------------------------------------------------------------
  def _loop_fn(self, *, total: int, guide: _Guide, show: bool):
    tr = self._tr

    def loop(state, x, a, sigmas, ts, text, audio_text, mask, vcoords, acoords, cond, scales):
      model = tr.merge(state)
      tick = md_progress.make_step_callback(total, desc="denoising") if show else None
      b = x.shape[0]
      pos = slice(b, 2 * b) if guide.cfg else slice(0, b)
      n = (2 if guide.cfg else 1) + guide.stg
      # Text rows: [negative, positive] with CFG; the perturbed pass reuses the positive rows.
      txt = jnp.concatenate([text] + [text[pos]] * guide.stg, axis=0)
      atxt = jnp.concatenate([audio_text] + [audio_text[pos]] * guide.stg, axis=0)
      msk = jnp.concatenate([mask] + [mask[pos]] * guide.stg, axis=0)
      perturb = None
      if guide.stg:
        perturb = jnp.concatenate([jnp.ones(((n - 1) * b,), _F32), jnp.zeros((b,), _F32)])

      def run(xv, xa, t, t_video, tx, atx, m, **kw):
        v, va = model(
          xv, xa, tx, atx, t_video, audio_timestep=t, sigma=t, encoder_attention_mask=m,
          audio_encoder_attention_mask=m, video_coords=vcoords, audio_coords=acoords,
          use_cross_timestep=guide.cross_timestep, **kw,
        )  # fmt: skip
        return v.astype(_F32), va.astype(_F32)

      def step(i, carry):
        x, a = carry
        sigma, sigma_next, t = sigmas[i], sigmas[i + 1], ts[i]
        tb = jnp.full((b,), t, _F32)
        tv = tb if not guide.i2v else t * (1 - cond)  # per-token: the image's tokens at 0
        v, va = run(
          jnp.concatenate([x] * n), jnp.concatenate([a] * n), jnp.concatenate([tb] * n),
          jnp.concatenate([tv] * n), txt, atxt, msk,
          spatio_temporal_guidance_blocks=guide.stg_blocks if guide.stg else (),
          perturbation_mask=perturb,
        )  # fmt: skip
        vs, vas = jnp.split(v, n), jnp.split(va, n)
        x0 = lambda s, out: s - out * sigma  # noqa: E731
        vpos, apos = x0(x, vs[n - 1 - guide.stg]), x0(a, vas[n - 1 - guide.stg])
        gv, ga = vpos, apos
        if guide.cfg:
          gv = gv + (scales["g"] - 1) * (vpos - x0(x, vs[0]))
          ga = ga + (scales["ag"] - 1) * (apos - x0(a, vas[0]))
        if guide.stg:
          gv = gv + scales["stg"] * (vpos - x0(x, vs[-1]))
          ga = ga + scales["astg"] * (apos - x0(a, vas[-1]))
        if guide.modality:
          mv, ma = run(x, a, tb, tv, text[pos], audio_text[pos], mask[pos], isolate_modalities=True)
          gv = gv + (scales["mod"] - 1) * (vpos - x0(x, mv))
          ga = ga + (scales["amod"] - 1) * (apos - x0(a, ma))
        if guide.rescale:
          gv = _rescale(gv, vpos, scales["phi"])
        if guide.audio_rescale:
          ga = _rescale(ga, apos, scales["aphi"])
        vel, avel = (x - gv) / sigma, (a - ga) / sigma
        moved = x + (sigma_next - sigma) * vel
        if guide.i2v:
          moved = jnp.where(cond[..., None] > 0.5, x, moved)
        a = a + (sigma_next - sigma) * avel
        if tick is not None:
          tick(i)
        return moved, a

      return jax.lax.fori_loop(0, total, step, (x.astype(_F32), a.astype(_F32)))

    return jax.jit(loop)

  # --- call ----------------------------------------------------------------------------------------------------
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
      output_type: "np" (frames and waveform) or "latent" (denormalised latents in the reference layouts).
      progress: a progress bar over the steps.

    Returns:
      `LTX2Output(frames, audio, sample_rate, frame_rate)`.

    Raises:
      ValueError: sizes the VAE cannot take (with the nearest valid ones), an unreadable image, latents
        or embeddings of the wrong shape, an image-to-video call without image or latents.
    """
    if output_type not in ("np", "latent"):
      raise ValueError(f"output_type must be 'np' or 'latent', got {output_type!r}")
    if motion_speed <= 0:
      raise ValueError(f"motion_speed must be positive, got {motion_speed}")
    audio_guidance_scale = audio_guidance_scale or guidance_scale
    audio_stg_scale = audio_stg_scale or stg_scale
    audio_modality_scale = audio_modality_scale or modality_scale
    audio_guidance_rescale = audio_guidance_rescale or guidance_rescale
    tc, vc = self.transformer.cfg, self.vae.config
    i2v = self.image_to_video or image is not None
    if i2v and latents is None:
      if image is None:
        raise ValueError(
          "image-to-video needs an image (or latents whose first frame is the condition)"
        )
      self.check_size(height, width, num_frames)
      images = image if isinstance(image, list | tuple) else [image]
      crf = LTX2_IMAGE_CRF if image_crf is None else int(image_crf)
      image = [_image_array(im, height, width, crf) for im in images]  # read, check before any work
    do_cfg = guidance_scale > 1.0 or audio_guidance_scale > 1.0
    blocks = tuple(int(i) for i in (spatio_temporal_guidance_blocks or ()))
    want_stg = stg_scale > 0.0 or audio_stg_scale > 0.0
    if want_stg and not blocks:
      raise ValueError("stg_scale > 0 needs spatio_temporal_guidance_blocks")
    for i in blocks if want_stg else ():
      if not 0 <= i < tc.num_layers:
        raise ValueError(
          f"spatio_temporal_guidance_blocks has block {i}; the transformer has {tc.num_layers} blocks"
        )

    # Latent grid.
    s, r = self.vae_spatial_compression_ratio, self.vae_temporal_compression_ratio
    if latents is not None:
      latents = jnp.asarray(latents, _F32)
      if latents.ndim == 5:
        _, _, f, h, w = latents.shape
      elif latents.ndim == 3:
        self.check_size(height, width, num_frames)
        f, h, w = (num_frames - 1) // r + 1, height // s, width // s
      else:
        raise ValueError(
          f"latents must be [B, C, F, H, W] or packed [B, S, C], got shape {latents.shape}"
        )
    else:
      self.check_size(height, width, num_frames)
      f, h, w = (num_frames - 1) // r + 1, height // s, width // s
    tokens = (f // tc.patch_size_t) * (h // tc.patch_size) * (w // tc.patch_size)

    # Text.
    prompts = _as_list(prompt)
    if (prompts is None) == (prompt_embeds is None):
      raise ValueError("pass exactly one of prompt and prompt_embeds")
    if prompts is not None:
      embeds, emask = self.prompt_embeds(prompts, max_sequence_length)
    else:
      if prompt_attention_mask is None:
        raise ValueError("prompt_embeds needs prompt_attention_mask")
      embeds, emask = (
        jnp.asarray(prompt_embeds, _F32),
        jnp.asarray(prompt_attention_mask, jnp.int32),
      )
    batch = embeds.shape[0]
    if do_cfg:
      if negative_prompt_embeds is not None:
        if negative_prompt_attention_mask is None:
          raise ValueError("negative_prompt_embeds needs negative_prompt_attention_mask")
        nembeds = jnp.asarray(negative_prompt_embeds, _F32)
        nmask = jnp.asarray(negative_prompt_attention_mask, jnp.int32)
      else:
        neg = _as_list(negative_prompt or "")
        neg = neg * batch if len(neg) == 1 else neg
        if len(neg) != batch:
          raise ValueError(f"{len(neg)} negative prompts for {batch} prompts")
        nembeds, nmask = self.prompt_embeds(neg, embeds.shape[1])
      if nembeds.shape != embeds.shape or nmask.shape != emask.shape:
        raise ValueError(
          f"negative prompt embeddings {nembeds.shape} / mask {nmask.shape} differ from the prompt's "
          f"{embeds.shape} / {emask.shape}"
        )
    rep = num_videos_per_prompt
    embeds, emask = jnp.repeat(embeds, rep, axis=0), jnp.repeat(emask, rep, axis=0)
    if do_cfg:
      nembeds, nmask = jnp.repeat(nembeds, rep, axis=0), jnp.repeat(nmask, rep, axis=0)
      embeds, emask = jnp.concatenate([nembeds, embeds]), jnp.concatenate([nmask, emask])
    text = self.connect(embeds, emask)
    b = batch * rep

    keys = jax.random.split(jax.random.key(int(seed)), 5)
    c = vc.latent_channels
    # Video latents (normalised, packed) and the conditioning mask.
    cond = None
    if latents is not None:
      if latents.shape[0] != b:
        raise ValueError(f"latents have batch {latents.shape[0]}; the call makes {b} videos")
      if latents.ndim == 5:
        if latents.shape[1] != c:
          raise ValueError(f"latents [B, C, F, H, W] must have C={c}, got shape {latents.shape}")
        z = self.vae.normalize_latents(jnp.transpose(latents, (0, 2, 3, 4, 1)))
      if i2v:
        cond = self._pack(jnp.zeros((b, f, h, w, 1), _F32).at[:, 0].set(1.0))[..., 0]
      if latents.ndim == 5:
        if noise_scale:
          eps = jax.random.normal(keys[0], z.shape, _F32)
          ns = (
            noise_scale
            if cond is None
            else noise_scale * (1 - self._unpack(cond[..., None], f, h, w))
          )
          z = ns * eps + (1 - ns) * z
        x = self._pack(z)
      else:
        x = latents
        if x.shape[1:] != (tokens, tc.in_channels):
          raise ValueError(
            f"packed latents must be [B, S={tokens}, {tc.in_channels}] for {height}x{width}, "
            f"{num_frames} frames; got {latents.shape}"
          )
        if noise_scale and cond is None:
          eps = jax.random.normal(keys[0], x.shape, _F32)
          x = noise_scale * eps + (1 - noise_scale) * x
    elif i2v:
      noise = jax.random.normal(keys[0], (b, c, f, h, w), _F32)
      x, cond = self._image_latents(image, noise)
    else:
      x = self._pack(jax.random.normal(keys[0], (b, c, f, h, w), _F32).transpose(0, 2, 3, 4, 1))

    # Audio latents (normalised, packed).
    ac = self.audio_vae.config
    mel = ac.latent_mel_bins
    if audio_latents is not None:
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
      fa = audio_latents.shape[1]
      a = self.audio_vae.normalize_latents(audio_latents)
      if noise_scale:
        eps = jax.random.normal(keys[1], a.shape, _F32)
        a = noise_scale * eps + (1 - noise_scale) * a
    else:
      fa = round(num_frames / frame_rate * ac.latents_per_second)
      eps = jax.random.normal(keys[1], (b, ac.latent_channels, fa, mel), _F32)
      a = pack_audio_latents(jnp.transpose(eps, (0, 2, 3, 1)))

    # Schedule (the audio stream uses the same one).
    sched = mdsch.from_config(self.scheduler_config)
    mu = mdsch.ltx_mu(tokens, self.scheduler_config)
    given = mdsch.ltx_uniform_sigmas(num_inference_steps) if sigmas is None else list(sigmas)
    st = sched.init(sigmas=given, mu=mu)
    ts = jnp.asarray(np.asarray(st.timesteps, np.float32))
    sig = jnp.asarray(np.asarray(st.sigmas, np.float32))
    total = int(ts.shape[0])

    fps = float(frame_rate) / float(motion_speed)
    vcoords = jnp.asarray(ltx2_video_coords(tc, f, h, w, fps))
    acoords = jnp.asarray(ltx2_audio_coords(tc, fa))
    guide = _Guide(
      cfg=do_cfg,
      stg=want_stg and tc.perturbed_attn,
      modality=modality_scale > 1.0 or audio_modality_scale > 1.0,
      rescale=guidance_rescale > 0,
      audio_rescale=audio_guidance_rescale > 0,
      stg_blocks=blocks,
      cross_timestep=bool(use_cross_timestep),
      i2v=cond is not None,
    )
    scales = {
      k: jnp.float32(v)
      for k, v in dict(
        g=guidance_scale, ag=audio_guidance_scale, stg=stg_scale, astg=audio_stg_scale,
        mod=modality_scale, amod=audio_modality_scale, phi=guidance_rescale,
        aphi=audio_guidance_rescale,
      ).items()
    }  # fmt: skip
    show = bool(progress) and md_progress.progress_enabled()
    loop = self._jit(
      ("loop", total, guide, show), lambda: self._loop_fn(total=total, guide=guide, show=show)
    )
    with self._context():
      x, a = loop(
        self._tr.state, x, a, sig, ts, text.video, text.audio, text.mask, vcoords, acoords,
        cond if cond is not None else jnp.zeros((b, tokens), _F32), scales,
      )  # fmt: skip
    z = self._unpack(x, f, h, w)
    if output_type == "latent":
      video = jnp.transpose(self.vae.denormalize_latents(z), (0, 4, 1, 2, 3))
      za = unpack_audio_latents(self.audio_vae.denormalize_latents(a), mel)
      return LTX2Output(video, jnp.transpose(za, (0, 3, 1, 2)), self.sample_rate, float(frame_rate))
    frames = self.decode_video(
      z, decode_timestep=decode_timestep, decode_noise_scale=decode_noise_scale,
      decode_noise=decode_noise, seed=int(jax.random.randint(keys[2], (), 0, 2**31 - 1)),
    )  # fmt: skip
    return LTX2Output(frames, self.decode_audio(a), self.sample_rate, float(frame_rate))


# --- saving ------------------------------------------------------------------------------------------------------


def save_ltx2_video(
  path: str | os.PathLike,
  result: LTX2Output,
  fps: float | None = None,
  *,
  index: int = 0,
  crf: int = 18,
) -> pathlib.Path:
  """Writes video `index` of an `LTX2Output` as MP4 (H.264) with its audio track muxed in (AAC).

  Args:
    path: the `.mp4` to write.
    result: what the pipeline returned (`output_type="np"`).
    fps: frames per second (default: the result's frame rate).
    index: which video of the batch.
    crf: H.264 quality.
  """
  frames, audio = np.asarray(result.frames), np.asarray(result.audio)
  if frames.ndim != 5 or frames.shape[-1] != 3:
    raise ValueError(f"result.frames must be [B, F, H, W, 3] frames, got shape {frames.shape}")
  if audio.ndim != 3:
    raise ValueError(f"result.audio must be [B, channels, samples], got shape {audio.shape}")
  return md_core.media.save_video(
    path,
    frames[index],
    result.frame_rate if fps is None else fps,
    audio=np.clip(audio[index], -1.0, 1.0),
    sample_rate=result.sample_rate,
    crf=crf,
  )


# --- loading ---------------------------------------------------------------------------------------------------


def _folder(root, name: str, index: Mapping[str, Any]):
  folder = root / name
  if not folder.is_dir():
    have = sorted(k for k, v in index.items() if isinstance(v, list) and v and v[0])
    raise FileNotFoundError(
      f"{root}: pipeline component {name!r} is missing (no folder {folder}); model_index.json lists "
      f"{have}. Download the whole pipeline, or pass a complete diffusers folder"
    )
  return folder


def load_ltx2_pipeline(
  source: str | os.PathLike,
  *,
  transformer: str | os.PathLike | LTX2Transformer | None = None,
  image_to_video: bool | None = None,
  mesh: jax.sharding.Mesh | None = None,
  dtype: Any = None,
  rules: Any = None,
  attention: str | None = None,
  attention_config: Any = None,
  remat: str | None = None,
  revision: str | None = None,
  progress: bool = False,
) -> LTX2VideoPipeline:
  """Loads an LTX-2 diffusers pipeline (`LTX2Pipeline`, `LTX2ImageToVideoPipeline`) as md modules.

  Args:
    source: a local diffusers folder with `model_index.json`, or a hub id (`"Lightricks/LTX-2"`).
    transformer: another transformer: a loaded `LTX2Transformer`, a diffusers transformer folder or an
      original single file (`ltx-2-19b-dev.safetensors`).
    image_to_video: require an image (default: when the folder is an `LTX2ImageToVideoPipeline`); any
      pipeline conditions on `image=` when one is given.
    mesh: place parameters on this mesh by their logical axes.
    dtype: parameter dtype of the transformer, Gemma 3 and the connectors (default: as stored); the VAEs
      and the vocoder stay float32.
    rules: md-sharding logical axis rules.
    attention, attention_config, remat: the transformer's md-attention implementation, its settings and
      the rematerialisation policy.
    revision: hub revision.
    progress: progress bars while loading tensors.

  Raises:
    FileNotFoundError: no folder / hub id, or a component missing (named).
    ValueError: a pipeline class this loader does not implement.
  """
  root = md_core.resolve_source(source, revision=revision)
  index_file = root / "model_index.json"
  if not index_file.is_file():
    raise FileNotFoundError(
      f"{root}: no model_index.json; pass a diffusers LTX-2 pipeline folder (transformer/, vae/, "
      "audio_vae/, vocoder/, text_encoder/, connectors/, tokenizer/, scheduler/) or its hub id"
    )
  index = md_core.read_json(index_file)
  cls = index.get("_class_name", "")
  if cls not in LTX2_PIPELINE_CLASSES:
    raise ValueError(
      f"{index_file}: pipeline class {cls!r} is not one load_ltx2_pipeline loads; known: "
      f"{LTX2_PIPELINE_CLASSES}"
    )
  overrides = {}
  if attention is not None:
    overrides["attention"] = attention
  if attention_config is not None:
    overrides["attention_config"] = attention_config
  if remat is not None:
    overrides["remat"] = remat
  kw = dict(mesh=mesh, rules=rules, progress=progress)
  if isinstance(transformer, LTX2Transformer):
    model = transformer
  else:
    where = _folder(root, "transformer", index) if transformer is None else transformer
    model = load_ltx2_transformer(where, subfolder=None, dtype=dtype, **kw, **overrides)
  vae = load_vae_ltx2(_folder(root, "vae", index), subfolder=None, **kw)
  audio_vae = load_vae_ltx2_audio(_folder(root, "audio_vae", index), subfolder=None, **kw)
  vocoder = load_vocoder_ltx2(_folder(root, "vocoder", index), subfolder=None, **kw)
  te = md_text.load_gemma3_encoder(
    _folder(root, "text_encoder", index), subfolder=None, dtype=dtype, **kw
  )
  connectors = md_text.load_ltx2_connectors(
    _folder(root, "connectors", index), subfolder=None, dtype=dtype, **kw
  )
  tok = md_text.load_tokenizer(_folder(root, "tokenizer", index), subfolder=None)
  sched_cfg = mdsch.read_config(_folder(root, "scheduler", index))
  mdsch.from_config(sched_cfg)  # fail now, not at the first call
  return LTX2VideoPipeline(
    transformer=model,
    vae=vae,
    audio_vae=audio_vae,
    vocoder=vocoder,
    text_encoder=te,
    connectors=connectors,
    tokenizer=tok,
    scheduler_config=sched_cfg,
    image_to_video=cls == "LTX2ImageToVideoPipeline" if image_to_video is None else image_to_video,
    mesh=mesh,
    source=str(source),
  )
