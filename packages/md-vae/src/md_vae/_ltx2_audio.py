"""The LTX-2 audio VAE (diffusers' `AutoencoderKLLTX2Audio`), channels-last `[B, T, M, C]`.

It compresses a stereo log-mel spectrogram (`[B, T, 64, 2]`, 100 frames a second at 16 kHz / hop 160) 4x in
time and in mel bins into 8 latent channels: `[B, L, 16, 8]` with `T = 4 L - 3`. Convolutions are causal
along one axis (`causality_axis`: "height" = time for the released model, zero-padded in front only);
norms are per-position RMS ("pixel") norms or GroupNorm(32). The LTX-2 pipeline packs latents to
`[B, L, C * M]` (channel-major) and normalises them there with the file's statistics (`latents_mean`,
`latents_std`, one entry per packed feature).

Because the released decoder (pixel norm, no attention, causal in time) only looks back a bounded number
of frames, `decode(..., chunk_frames=n)` decodes `n` latent frames at a time with enough left context to
give the same result as one pass, so memory stays bounded for long audio.
"""

from __future__ import annotations

import dataclasses
import math
import os
import pathlib
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

import md_core
from md_core import nn
from md_vae._kl import DiagonalGaussian

_F32 = jnp.float32
_IGNORED_KEYS = {"_class_name", "_diffusers_version", "_name_or_path", "_use_default_values"}
_AXES = ("none", "width", "height", "width-compatibility")
# The reference hard-codes the time and mel compression (LATENT_DOWNSAMPLE_FACTOR).
LTX2_AUDIO_DOWNSAMPLE = 4


@dataclasses.dataclass(frozen=True)
class LTX2AudioVAEConfig:
  """diffusers' `AutoencoderKLLTX2Audio` config keys (`LTX2_AUDIO_VAE_VARIANTS["ltx-2"]` is the release)."""

  base_channels: int = 128
  output_channels: int = 2
  ch_mult: tuple[int, ...] = (1, 2, 4)
  num_res_blocks: int = 2
  attn_resolutions: tuple[int, ...] | None = None
  in_channels: int = 2
  resolution: int = 256
  latent_channels: int = 8
  norm_type: str = "pixel"
  causality_axis: str = "height"
  dropout: float = 0.0
  mid_block_add_attention: bool = False
  sample_rate: int = 16000
  mel_hop_length: int = 160
  is_causal: bool = True
  mel_bins: int | None = 64
  double_z: bool = True

  def __post_init__(self):
    for f in dataclasses.fields(self):
      v = getattr(self, f.name)
      if isinstance(v, list):
        object.__setattr__(self, f.name, tuple(v))
    if self.causality_axis not in _AXES:
      raise ValueError(f"causality_axis={self.causality_axis!r} is not one of {_AXES}")
    if self.norm_type not in ("pixel", "group"):
      raise ValueError(f"norm_type={self.norm_type!r} is not 'pixel' or 'group'")
    if self.norm_type == "group" and self.causality_axis != "none":
      raise ValueError("GroupNorm resnets need causality_axis='none' (as the reference requires)")

  @property
  def latent_mel_bins(self) -> int:
    return (self.mel_bins or 64) // LTX2_AUDIO_DOWNSAMPLE

  @property
  def latents_per_second(self) -> float:
    """Latent frames per second of audio (25 for the release)."""
    return self.sample_rate / self.mel_hop_length / LTX2_AUDIO_DOWNSAMPLE

  @classmethod
  def from_dict(cls, d: Mapping[str, Any], **overrides) -> LTX2AudioVAEConfig:
    """Reads `audio_vae/config.json` of an LTX-2 checkpoint.

    Raises:
      ValueError: another class, or keys md does not implement (named, with the supported ones).
    """
    d = dict(d)
    name = d.get("_class_name")
    if name not in (None, "AutoencoderKLLTX2Audio"):
      raise ValueError(f"config is for {name!r}; LTX2AudioVAEConfig reads AutoencoderKLLTX2Audio")
    fields = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(k for k in d if k not in fields and k not in _IGNORED_KEYS)
    if unknown:
      raise ValueError(
        f"LTX-2 audio VAE config keys {unknown} are not supported; supported keys: {sorted(fields)}"
      )
    kwargs = {k: tuple(v) if isinstance(v, list) else v for k, v in d.items() if k in fields}
    kwargs.update(overrides)
    return cls(**kwargs)

  @classmethod
  def from_json(cls, path: str | os.PathLike, **overrides) -> LTX2AudioVAEConfig:
    path = pathlib.Path(path)
    if path.is_dir():
      path = path / "config.json"
    return cls.from_dict(md_core.read_json(path), **overrides)


# From diffusers' scripts/convert_ltx2_to_diffusers.py (LTX-2.0; LTX-2.3 uses the same audio VAE).
LTX2_AUDIO_VAE_VARIANTS: dict[str, LTX2AudioVAEConfig] = {"ltx-2": LTX2AudioVAEConfig()}


def _causal_padding(axis: str, kh: int, kw: int) -> tuple[tuple[int, int], tuple[int, int]]:
  """((top, bottom), (left, right)) zero padding of a stride-1 causal conv with a (kh, kw) kernel."""
  ph, pw = kh - 1, kw - 1
  sym_h, sym_w = (ph // 2, ph - ph // 2), (pw // 2, pw - pw // 2)
  if axis == "height":
    return (ph, 0), sym_w
  if axis in ("width", "width-compatibility"):
    return sym_h, (pw, 0)
  return sym_h, sym_w


class CausalConv2d(nnx.Module):
  """A stride-1 conv over `[B, T, M, C]` zero-padded on one side of the causal axis (`.conv` in the file)."""

  def __init__(self, cin, cout, kernel_size=3, *, axis, rngs=None):
    self.padding = _causal_padding(axis, kernel_size, kernel_size)
    self.conv = nn.Conv(cin, cout, (kernel_size, kernel_size), rngs=rngs)

  def __call__(self, x):
    return self.conv(jnp.pad(x, ((0, 0), *self.padding, (0, 0))))


class PixelNorm(nnx.Module):
  """RMS over the channels of each position (no affine), in float32."""

  def __init__(self, eps: float = 1e-6):
    self.eps = eps

  def __call__(self, x):
    h = x.astype(_F32)
    h = h * jax.lax.rsqrt(jnp.mean(jnp.square(h), axis=-1, keepdims=True) + self.eps)
    return h.astype(x.dtype)


def _norm(kind: str, c: int, rngs):
  if kind == "group":
    return nn.GroupNorm(32, c, eps=1e-6, rngs=rngs)
  return PixelNorm(1e-6)


class AttnBlock(nnx.Module):
  """Single-head self-attention over all positions with 1x1-conv projections, plus the input."""

  def __init__(self, c, norm_type, *, rngs=None):
    self.norm = _norm(norm_type, c, rngs)
    self.q, self.k, self.v, self.proj_out = (nn.Conv(c, c, (1, 1), rngs=rngs) for _ in range(4))

  def __call__(self, x):
    b, t, m, c = x.shape
    h = self.norm(x)
    q, k, v = (f(h).reshape(b, t * m, c) for f in (self.q, self.k, self.v))
    w = jax.nn.softmax(jnp.einsum("bqc,bkc->bqk", q, k) * c**-0.5, axis=-1)
    return x + self.proj_out(jnp.einsum("bqk,bkc->bqc", w, v).reshape(b, t, m, c))


class ResnetBlock(nnx.Module):
  def __init__(self, cin, cout, cfg: LTX2AudioVAEConfig, *, rngs=None):
    axis = cfg.causality_axis
    self.norm1 = _norm(cfg.norm_type, cin, rngs)
    self.conv1 = CausalConv2d(cin, cout, axis=axis, rngs=rngs)
    self.norm2 = _norm(cfg.norm_type, cout, rngs)
    self.conv2 = CausalConv2d(cout, cout, axis=axis, rngs=rngs)
    # The reference's 1x1 shortcut (`nin_shortcut`) when the width changes.
    self.nin_shortcut = CausalConv2d(cin, cout, 1, axis=axis, rngs=rngs) if cin != cout else None

  def __call__(self, x):
    h = self.conv1(jax.nn.silu(self.norm1(x)))
    h = self.conv2(jax.nn.silu(self.norm2(h)))
    if self.nin_shortcut is not None:
      x = self.nin_shortcut(x)
    return x + h


# Zero padding ((top, bottom), (left, right)) in front of the stride-2 downsampling conv.
_DOWN_PADDING = {
  "none": ((0, 1), (0, 1)),
  "width": ((0, 1), (2, 0)),
  "height": ((2, 0), (0, 1)),
  "width-compatibility": ((0, 1), (1, 0)),
}


class Downsample(nnx.Module):
  def __init__(self, c, axis, *, rngs=None):
    self.padding = _DOWN_PADDING[axis]
    self.conv = nn.Conv(c, c, (3, 3), stride=2, rngs=rngs)

  def __call__(self, x):
    return self.conv(jnp.pad(x, ((0, 0), *self.padding, (0, 0))))


class Upsample(nnx.Module):
  """Nearest 2x, a causal conv, then the first row (time-causal) or column (mel-causal) dropped."""

  def __init__(self, c, axis, *, rngs=None):
    self.axis = axis
    self.conv = CausalConv2d(c, c, axis=axis, rngs=rngs)

  def __call__(self, x):
    x = jnp.repeat(jnp.repeat(x, 2, axis=1), 2, axis=2)
    x = self.conv(x)
    if self.axis == "height":
      x = x[:, 1:]
    elif self.axis == "width":
      x = x[:, :, 1:]
    return x


class Stage(nnx.Module):
  """One resolution level: resnets (each followed by attention where configured), then a resampler."""

  def __init__(self, blocks, attn, *, downsample=None, upsample=None):
    self.block = nnx.List(blocks)
    self.attn = nnx.List(attn) if attn else None
    self.downsample, self.upsample = downsample, upsample

  def __call__(self, x):
    for i, block in enumerate(self.block):
      x = block(x)
      if self.attn is not None:
        x = self.attn[i](x)
    return x


class Mid(nnx.Module):
  def __init__(self, c, cfg, *, rngs=None):
    self.block_1 = ResnetBlock(c, c, cfg, rngs=rngs)
    add = cfg.mid_block_add_attention
    self.attn_1 = AttnBlock(c, cfg.norm_type, rngs=rngs) if add else None
    self.block_2 = ResnetBlock(c, c, cfg, rngs=rngs)

  def __call__(self, x):
    x = self.block_1(x)
    if self.attn_1 is not None:
      x = self.attn_1(x)
    return self.block_2(x)


class Encoder(nnx.Module):
  def __init__(self, cfg: LTX2AudioVAEConfig, *, rngs=None):
    axis, attn_res = cfg.causality_axis, set(cfg.attn_resolutions or ())
    c = cfg.base_channels
    self.conv_in = CausalConv2d(cfg.in_channels, c, axis=axis, rngs=rngs)
    res, stages = cfg.resolution, []
    for level, mult in enumerate(cfg.ch_mult):
      cout = cfg.base_channels * mult
      blocks, attn = [], []
      for _ in range(cfg.num_res_blocks):
        blocks.append(ResnetBlock(c, cout, cfg, rngs=rngs))
        c = cout
        if res in attn_res:
          attn.append(AttnBlock(c, cfg.norm_type, rngs=rngs))
      down = None
      if level != len(cfg.ch_mult) - 1:
        down = Downsample(c, axis, rngs=rngs)
        res //= 2
      stages.append(Stage(blocks, attn, downsample=down))
    self.down = nnx.List(stages)
    self.mid = Mid(c, cfg, rngs=rngs)
    self.norm_out = _norm(cfg.norm_type, c, rngs)
    z = 2 * cfg.latent_channels if cfg.double_z else cfg.latent_channels
    self.conv_out = CausalConv2d(c, z, axis=axis, rngs=rngs)

  def __call__(self, x):
    x = self.conv_in(x)
    for stage in self.down:
      x = stage(x)
      if stage.downsample is not None:
        x = stage.downsample(x)
    x = self.mid(x)
    return self.conv_out(jax.nn.silu(self.norm_out(x)))


class Decoder(nnx.Module):
  def __init__(self, cfg: LTX2AudioVAEConfig, *, rngs=None):
    self.cfg = cfg
    axis, attn_res = cfg.causality_axis, set(cfg.attn_resolutions or ())
    n = len(cfg.ch_mult)
    c = cfg.base_channels * cfg.ch_mult[-1]
    self.conv_in = CausalConv2d(cfg.latent_channels, c, axis=axis, rngs=rngs)
    self.mid = Mid(c, cfg, rngs=rngs)
    res = cfg.resolution // 2 ** (n - 1)
    stages: list[Stage | None] = [None] * n
    for level in reversed(range(n)):
      cout = cfg.base_channels * cfg.ch_mult[level]
      blocks, attn = [], []
      for _ in range(cfg.num_res_blocks + 1):
        blocks.append(ResnetBlock(c, cout, cfg, rngs=rngs))
        c = cout
        if res in attn_res:
          attn.append(AttnBlock(c, cfg.norm_type, rngs=rngs))
      up = None
      if level != 0:
        up = Upsample(c, axis, rngs=rngs)
        res *= 2
      stages[level] = Stage(blocks, attn, upsample=up)
    self.up = nnx.List(stages)
    self.norm_out = _norm(cfg.norm_type, c, rngs)
    self.conv_out = CausalConv2d(c, cfg.output_channels, axis=axis, rngs=rngs)

  def __call__(self, z):  # [B, L, M', C] → [B, 4 L - 3, mel_bins, out]
    cfg = self.cfg
    frames, mel = z.shape[1], z.shape[2]
    x = self.mid(self.conv_in(z))
    for stage in reversed(self.up):
      x = stage(x)
      if stage.upsample is not None:
        x = stage.upsample(x)
    x = self.conv_out(jax.nn.silu(self.norm_out(x)))
    # The reference crops or zero-pads to its nominal size (4 L - 3 frames, `mel_bins`).
    t = max(frames * LTX2_AUDIO_DOWNSAMPLE - (LTX2_AUDIO_DOWNSAMPLE - 1), 1)
    m = cfg.mel_bins if cfg.mel_bins is not None else mel
    x = x[:, :t, :m]
    return jnp.pad(x, ((0, 0), (0, t - x.shape[1]), (0, m - x.shape[2]), (0, 0)))


def pack_audio_latents(latents: jax.Array) -> jax.Array:
  """`[B, L, M, C]` → the transformer's `[B, L, C * M]` (channel-major features, as the reference)."""
  b, t, m, c = latents.shape
  return latents.transpose(0, 1, 3, 2).reshape(b, t, c * m)


def unpack_audio_latents(packed: jax.Array, latent_mel_bins: int) -> jax.Array:
  """`[B, L, C * M]` → `[B, L, M, C]` (the inverse of `pack_audio_latents`)."""
  b, t, d = packed.shape
  if d % latent_mel_bins:
    raise ValueError(
      f"packed audio latents {packed.shape}: {d} features are not C x {latent_mel_bins}"
    )
  return packed.reshape(b, t, d // latent_mel_bins, latent_mel_bins).transpose(0, 1, 3, 2)


class LTX2AudioVAE(nnx.Module):
  """`AutoencoderKLLTX2Audio`: `encode(mel) -> DiagonalGaussian`, `decode(latents) -> mel`.

  Mel spectrograms are `[B, T, mel_bins, in_channels]` (time, mel, stereo channel last); latents are
  `[B, L, mel_bins / 4, latent_channels]`.
  """

  def __init__(self, config: LTX2AudioVAEConfig, *, rngs: nnx.Rngs | None = None):
    self.config = config
    self.encoder = Encoder(config, rngs=rngs)
    self.decoder = Decoder(config, rngs=rngs)
    # Buffers in the file: statistics of the packed latents (base_channels entries, = C * M released).
    c = config.base_channels
    self.latents_mean = nnx.Param(jnp.zeros((c,), _F32), logical_axes=("norm",))
    self.latents_std = nnx.Param(jnp.ones((c,), _F32), logical_axes=("norm",))

  def encode(self, mel: jax.Array) -> DiagonalGaussian:
    """`[B, T, mel_bins, in_channels]` → the posterior over `[B, ceil(T / 4), mel_bins / 4, C]`."""
    cfg = self.config
    if mel.ndim != 4 or mel.shape[-1] != cfg.in_channels:
      raise ValueError(
        f"mel must be [B, T, mel_bins, in_channels={cfg.in_channels}], got shape {mel.shape}"
      )
    if cfg.mel_bins is not None and mel.shape[2] != cfg.mel_bins:
      raise ValueError(
        f"mel has {mel.shape[2]} mel bins (shape {mel.shape}); this VAE takes mel_bins={cfg.mel_bins}"
      )
    moments = self.encoder(mel)
    mean, logvar = jnp.split(moments, 2, axis=-1)
    return DiagonalGaussian(mean, jnp.clip(logvar, -30.0, 20.0))

  def decode(self, latents: jax.Array, *, chunk_frames: int | None = None) -> jax.Array:
    """`[B, L, M, latent_channels]` (unnormalised) → mel `[B, 4 L - 3, mel_bins, output_channels]`.

    Args:
      latents: unnormalised latents (see `denormalize_latents`, `unpack_audio_latents`).
      chunk_frames: decode this many latent frames at a time (plus `context_frames` of left context
        each), for a bounded peak memory; the result equals one pass. Needs the released kind of
        decoder (causal in time, pixel norm, no attention). Called outside jit, it compiles at most
        three window shapes.
    """
    cfg = self.config
    if latents.ndim != 4 or latents.shape[-1] != cfg.latent_channels:
      raise ValueError(
        f"latents must be [B, L, M, latent_channels={cfg.latent_channels}], got shape "
        f"{latents.shape}"
      )
    frames = latents.shape[1]
    if chunk_frames is None or chunk_frames >= frames:
      return self.decoder(latents)
    if chunk_frames < 1:
      raise ValueError(f"chunk_frames must be >= 1, got {chunk_frames}")
    ctx = self.context_frames()
    f = LTX2_AUDIO_DOWNSAMPLE
    pieces = []
    for a in range(0, frames, chunk_frames):
      b = min(a + chunk_frames, frames)
      c = max(0, a - ctx)
      mel = self.decoder(latents[:, c:b])
      start = 0 if a == 0 else f * (a - c) - (f - 1)
      pieces.append(mel[:, start : f * (b - c) - (f - 1)])
    return jnp.concatenate(pieces, axis=1)

  def context_frames(self) -> int:
    """Latent frames of left context that make a chunked decode equal one pass.

    Raises:
      ValueError: the decoder mixes frames beyond a causal window (attention, GroupNorm, or
        convolutions that are not causal in time).
    """
    cfg = self.config
    if (
      cfg.causality_axis != "height"
      or cfg.norm_type != "pixel"
      or cfg.mid_block_add_attention
      or cfg.attn_resolutions
    ):
      raise ValueError(
        "chunked decoding needs a decoder that is causal in time with pixel norms and no attention "
        f"(causality_axis='height', norm_type='pixel'); this one has causality_axis="
        f"{cfg.causality_axis!r}, norm_type={cfg.norm_type!r}, attention="
        f"{bool(cfg.mid_block_add_attention or cfg.attn_resolutions)}"
      )
    # Every 3x3 conv reaches 2 rows back at its rate; level i of n runs at 2^(n-1-i) rows per frame.
    n = len(cfg.ch_mult)
    per_level = 2 * (cfg.num_res_blocks + 1)
    reach = 2 * (1 + 4 + per_level)  # conv_in, mid, the last level (latent rate)
    for level in range(n - 2, -1, -1):
      rows = 2 * (1 + per_level + (1 if level == 0 else 0))  # upsample conv, resnets, conv_out
      reach += rows / 2 ** (n - 1 - level)
    return math.ceil(reach) + 1

  def _stats(self, like: jax.Array) -> tuple[jax.Array, jax.Array]:
    n = self.latents_mean.shape[0]
    if like.shape[-1] != n:
      raise ValueError(
        f"packed audio latents must be [B, L, {n}] (latent_channels x latent mel bins), got shape "
        f"{like.shape}; pack [B, L, M, C] latents with pack_audio_latents first"
      )
    shape = (1,) * (like.ndim - 1) + (n,)
    return (
      self.latents_mean[...].astype(like.dtype).reshape(shape),
      self.latents_std[...].astype(like.dtype).reshape(shape),
    )

  def normalize_latents(self, packed: jax.Array) -> jax.Array:
    """`(z - mean) / std` over packed `[B, L, C * M]` latents (the LTX-2 pipeline's form)."""
    mean, std = self._stats(packed)
    return (packed - mean) / std

  def denormalize_latents(self, packed: jax.Array) -> jax.Array:
    """`z * std + mean` over packed `[B, L, C * M]` latents."""
    mean, std = self._stats(packed)
    return packed * std + mean
