"""The LTX-2 vocoders (diffusers' `LTX2Vocoder`, `LTX2VocoderWithBWE`): mel spectrogram → waveform.

`LTX2Vocoder` (LTX-2.0) is a HiFi-GAN generator: a conv, then per stage a transposed-conv upsampler and the
mean of several dilated residual blocks (leaky ReLU, or snake-beta activations run at twice the rate between
Kaiser-sinc low-pass filters), a final conv and tanh; 240 samples per mel frame (24 kHz from 100 frames/s).
`LTX2VocoderWithBWE` (LTX-2.3) runs such a generator at 16 kHz, takes a causal STFT log-mel spectrogram of its
waveform, and adds a second generator's output (bandwidth extension) to a Hann-sinc resampling of it: 48 kHz.

Layouts are channels-last: mel `[B, T, mel_bins, channels]` (the audio VAE's output), waveforms
`[B, samples, channels]` (`.transpose(0, 2, 1)` gives the reference's `[B, channels, samples]`). The whole
chain is local in time, so `__call__(mel, chunk_frames=n)` runs `n` mel frames at a time with enough context
on both sides to equal one pass (bounded memory for long audio).
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
import numpy as np
from flax import nnx

import md_core
from md_core import nn

_F32 = jnp.float32
_IGNORED_KEYS = {"_class_name", "_diffusers_version", "_name_or_path", "_use_default_values"}
_ACTS = ("leaky_relu", "snake", "snakebeta")
_FINAL = (None, "tanh", "clamp")


def _tuples(obj) -> None:
  for f in dataclasses.fields(obj):
    v = getattr(obj, f.name)
    if isinstance(v, list):
      v = tuple(tuple(x) if isinstance(x, list) else x for x in v)
      object.__setattr__(obj, f.name, v)


def _read(cls, d: Mapping[str, Any], class_name: str, overrides):
  d = dict(d)
  name = d.get("_class_name")
  if name not in (None, class_name):
    raise ValueError(f"config is for {name!r}; {cls.__name__} reads {class_name}")
  fields = {f.name for f in dataclasses.fields(cls)}
  unknown = sorted(k for k in d if k not in fields and k not in _IGNORED_KEYS)
  if unknown:
    raise ValueError(
      f"{class_name} config keys {unknown} are not supported; supported: {sorted(fields)}"
    )
  kwargs = {k: v for k, v in d.items() if k in fields}
  kwargs.update(overrides)
  return cls(**kwargs)


@dataclasses.dataclass(frozen=True)
class LTX2VocoderConfig:
  """diffusers' `LTX2Vocoder` config keys (`LTX2_VOCODER_VARIANTS["ltx-2"]` is the LTX-2.0 release)."""

  in_channels: int = 128
  hidden_channels: int = 1024
  out_channels: int = 2
  upsample_kernel_sizes: tuple[int, ...] = (16, 15, 8, 4, 4)
  upsample_factors: tuple[int, ...] = (6, 5, 2, 2, 2)
  resnet_kernel_sizes: tuple[int, ...] = (3, 7, 11)
  resnet_dilations: tuple[tuple[int, ...], ...] = ((1, 3, 5), (1, 3, 5), (1, 3, 5))
  act_fn: str = "leaky_relu"
  leaky_relu_negative_slope: float = 0.1
  antialias: bool = False
  antialias_ratio: int = 2
  antialias_kernel_size: int = 12
  final_act_fn: str | None = "tanh"
  final_bias: bool = True
  output_sampling_rate: int = 24000

  def __post_init__(self):
    _tuples(self)
    if len(self.upsample_kernel_sizes) != len(self.upsample_factors):
      raise ValueError(
        f"upsample_kernel_sizes={self.upsample_kernel_sizes} and upsample_factors="
        f"{self.upsample_factors} must have the same length"
      )
    if len(self.resnet_kernel_sizes) != len(self.resnet_dilations):
      raise ValueError(
        f"resnet_kernel_sizes={self.resnet_kernel_sizes} and resnet_dilations="
        f"{self.resnet_dilations} must have the same length"
      )
    if self.act_fn not in _ACTS:
      raise ValueError(f"act_fn={self.act_fn!r} is not one of {_ACTS}")
    if self.act_fn == "leaky_relu" and self.antialias:
      raise ValueError(
        "act_fn='leaky_relu' with antialias=True is not supported (the reference nests its "
        "anti-aliasing wrappers there; no released vocoder uses it)"
      )
    if self.final_act_fn not in _FINAL:
      raise ValueError(f"final_act_fn={self.final_act_fn!r} is not one of {_FINAL}")
    if self.hidden_channels % 2 ** len(self.upsample_factors):
      raise ValueError(
        f"hidden_channels={self.hidden_channels} must halve {len(self.upsample_factors)} times"
      )

  @property
  def hop(self) -> int:
    """Output samples per input frame."""
    return math.prod(self.upsample_factors)

  @classmethod
  def from_dict(cls, d: Mapping[str, Any], **overrides) -> LTX2VocoderConfig:
    """Reads `vocoder/config.json` of an LTX-2.0 checkpoint (ValueError on unknown keys)."""
    return _read(cls, d, "LTX2Vocoder", overrides)


@dataclasses.dataclass(frozen=True)
class LTX2VocoderBWEConfig:
  """diffusers' `LTX2VocoderWithBWE` config keys (`LTX2_VOCODER_VARIANTS["ltx-2.3"]` is the release)."""

  in_channels: int = 128
  hidden_channels: int = 1536
  out_channels: int = 2
  upsample_kernel_sizes: tuple[int, ...] = (11, 4, 4, 4, 4, 4)
  upsample_factors: tuple[int, ...] = (5, 2, 2, 2, 2, 2)
  resnet_kernel_sizes: tuple[int, ...] = (3, 7, 11)
  resnet_dilations: tuple[tuple[int, ...], ...] = ((1, 3, 5), (1, 3, 5), (1, 3, 5))
  act_fn: str = "snakebeta"
  leaky_relu_negative_slope: float = 0.1
  antialias: bool = True
  antialias_ratio: int = 2
  antialias_kernel_size: int = 12
  final_act_fn: str | None = None
  final_bias: bool = False
  bwe_in_channels: int = 128
  bwe_hidden_channels: int = 512
  bwe_out_channels: int = 2
  bwe_upsample_kernel_sizes: tuple[int, ...] = (12, 11, 4, 4, 4)
  bwe_upsample_factors: tuple[int, ...] = (6, 5, 2, 2, 2)
  bwe_resnet_kernel_sizes: tuple[int, ...] = (3, 7, 11)
  bwe_resnet_dilations: tuple[tuple[int, ...], ...] = ((1, 3, 5), (1, 3, 5), (1, 3, 5))
  bwe_act_fn: str = "snakebeta"
  bwe_leaky_relu_negative_slope: float = 0.1
  bwe_antialias: bool = True
  bwe_antialias_ratio: int = 2
  bwe_antialias_kernel_size: int = 12
  bwe_final_act_fn: str | None = None
  bwe_final_bias: bool = False
  filter_length: int = 512
  hop_length: int = 80
  window_length: int = 512
  num_mel_channels: int = 64
  input_sampling_rate: int = 16000
  output_sampling_rate: int = 48000

  def __post_init__(self):
    _tuples(self)
    self.vocoder, self.bwe  # noqa: B018 - validates both generators
    ratio = self.output_sampling_rate // self.input_sampling_rate
    if ratio * self.input_sampling_rate != self.output_sampling_rate:
      raise ValueError(
        f"output_sampling_rate={self.output_sampling_rate} must be a multiple of "
        f"input_sampling_rate={self.input_sampling_rate}"
      )
    if self.bwe_in_channels != self.out_channels * self.num_mel_channels:
      raise ValueError(
        f"bwe_in_channels={self.bwe_in_channels} must be out_channels x num_mel_channels = "
        f"{self.out_channels} x {self.num_mel_channels}"
      )
    if self.bwe.hop != ratio * self.hop_length:
      raise ValueError(
        f"the bandwidth extender makes {self.bwe.hop} samples per STFT frame; it must make "
        f"{ratio} x hop_length = {ratio * self.hop_length}"
      )

  @property
  def vocoder(self) -> LTX2VocoderConfig:
    """The first stage (at `input_sampling_rate`)."""
    names = [f.name for f in dataclasses.fields(LTX2VocoderConfig)]
    kw = {n: getattr(self, n) for n in names if n != "output_sampling_rate"}
    return LTX2VocoderConfig(**kw, output_sampling_rate=self.input_sampling_rate)

  @property
  def bwe(self) -> LTX2VocoderConfig:
    """The bandwidth-extension generator."""
    names = [f.name for f in dataclasses.fields(LTX2VocoderConfig)]
    kw = {n: getattr(self, "bwe_" + n) for n in names if n != "output_sampling_rate"}
    return LTX2VocoderConfig(**kw, output_sampling_rate=self.output_sampling_rate)

  @classmethod
  def from_dict(cls, d: Mapping[str, Any], **overrides) -> LTX2VocoderBWEConfig:
    """Reads `vocoder/config.json` of an LTX-2.3 checkpoint (ValueError on unknown keys)."""
    return _read(cls, d, "LTX2VocoderWithBWE", overrides)


def vocoder_config_from_json(
  path: str | os.PathLike,
) -> LTX2VocoderConfig | LTX2VocoderBWEConfig:
  """Reads a `vocoder/config.json`, choosing the class from its `_class_name` (default `LTX2Vocoder`)."""
  path = pathlib.Path(path)
  if path.is_dir():
    path = path / "config.json"
  d = md_core.read_json(path)
  name = d.get("_class_name", "LTX2Vocoder")
  if name == "LTX2VocoderWithBWE":
    return LTX2VocoderBWEConfig.from_dict(d)
  if name == "LTX2Vocoder":
    return LTX2VocoderConfig.from_dict(d)
  raise ValueError(f"{path}: _class_name {name!r} is not LTX2Vocoder or LTX2VocoderWithBWE")


# From diffusers' scripts/convert_ltx2_to_diffusers.py (get_ltx2_vocoder_config, 2.0 and 2.3).
LTX2_VOCODER_VARIANTS: dict[str, LTX2VocoderConfig | LTX2VocoderBWEConfig] = {
  "ltx-2": LTX2VocoderConfig(),
  "ltx-2.3": LTX2VocoderBWEConfig(),
}


# --------------------------------------------------------------------------------------------------
# Layers


def _conv1d(cin, cout, k, *, dilation=1, use_bias=True, rngs=None):
  total = dilation * (k - 1)  # torch's padding="same" (odd kernels: symmetric)
  pad = ((total // 2, total - total // 2),)
  return nn.Conv(cin, cout, (k,), padding=pad, dilation=dilation, use_bias=use_bias, rngs=rngs)


def _depthwise(x, taps, *, stride=1, dilate=1, padding=(0, 0)):
  """A per-channel 1-D filter `taps` [K] over `[B, T, C]` (lhs dilation = transposed conv)."""
  c = x.shape[-1]
  kernel = jnp.broadcast_to(taps.astype(x.dtype)[:, None, None], (taps.shape[0], 1, c))
  return jax.lax.conv_general_dilated(
    x, kernel, (stride,), (padding,), lhs_dilation=(dilate,),
    dimension_numbers=("NWC", "WIO", "NWC"), feature_group_count=c,
  )  # fmt: skip


def _replicate(x, left, right):
  return jnp.pad(x, ((0, 0), (left, right), (0, 0)), mode="edge")


class ConvTranspose1d(nnx.Module):
  """torch `nn.ConvTranspose1d` with padding `(k - stride) // 2`: `[B, T, Cin]` → `[B, stride T, Cout]`.

  The kernel keeps torch's `(in, out, k)` axes reversed, `(k, out, in)` (the conv1d layout)."""

  def __init__(self, cin, cout, k, stride, *, rngs=None):
    self.k, self.stride, self.pad = k, stride, (k - stride) // 2
    init = jax.nn.initializers.uniform(1.0 / math.sqrt(cout * k))
    key = md_core.param_key(rngs)
    self.kernel = nnx.Param(
      init(key, (k, cout, cin), _F32), logical_axes=(None, "conv_out", "conv_in")
    )
    self.bias = nnx.Param(jnp.zeros((cout,), _F32), logical_axes=("conv_out",))

  def __call__(self, x):
    w = self.kernel[...].astype(x.dtype)[::-1].transpose(0, 2, 1)  # (k, in, out), flipped
    p = self.k - 1 - self.pad
    y = jax.lax.conv_general_dilated(
      x, w, (1,), ((p, p),), lhs_dilation=(self.stride,), dimension_numbers=("NWC", "WIO", "NWC")
    )
    return y + self.bias[...].astype(x.dtype).reshape(1, 1, -1)


class LeakyReLU(nnx.Module):
  def __init__(self, slope: float):
    self.slope = slope

  def __call__(self, x):
    return jax.nn.leaky_relu(x, self.slope)


class SnakeBeta(nnx.Module):
  """`x + sin(a x)^2 / (b + 1e-9)` with per-channel log-scale `a = exp(alpha)`, `b = exp(beta)` (or a)."""

  def __init__(self, c: int, *, use_beta: bool = True):
    self.alpha = nnx.Param(jnp.zeros((c,), _F32), logical_axes=("norm",))
    self.beta = nnx.Param(jnp.zeros((c,), _F32), logical_axes=("norm",)) if use_beta else None

  def __call__(self, x):
    alpha = jnp.exp(self.alpha[...].astype(x.dtype)).reshape(1, 1, -1)
    amp = alpha if self.beta is None else jnp.exp(self.beta[...].astype(x.dtype)).reshape(1, 1, -1)
    return x + (1.0 / (amp + 1e-9)) * jnp.square(jnp.sin(x * alpha))


def kaiser_sinc_filter(cutoff: float, half_width: float, kernel_size: int) -> np.ndarray:
  """A Kaiser-windowed sinc low-pass filter `[kernel_size]` normalised to sum 1 (BigVGAN's)."""
  delta_f = 4 * half_width
  half = kernel_size // 2
  amplitude = 2.285 * (half - 1) * math.pi * delta_f + 7.95
  if amplitude > 50.0:
    beta = 0.1102 * (amplitude - 8.7)
  elif amplitude >= 21.0:
    beta = 0.5842 * (amplitude - 21) ** 0.4 + 0.07886 * (amplitude - 21.0)
  else:
    beta = 0.0
  window = np.kaiser(kernel_size, beta)
  even = kernel_size % 2 == 0
  t = np.arange(-half, half) + 0.5 if even else np.arange(kernel_size) - half
  if cutoff == 0.0:
    return np.zeros(kernel_size, np.float32)
  taps = 2 * cutoff * window * np.sinc(2 * cutoff * t)
  return (taps / taps.sum()).astype(np.float32)


class _Filter(nnx.Module):
  """Holds a file's low-pass `filter` buffer `[1, 1, K]`."""

  def __init__(self, kernel_size: int, ratio: int):
    taps = kaiser_sinc_filter(0.5 / ratio, 0.6 / ratio, kernel_size)
    self.filter = nnx.Param(jnp.asarray(taps).reshape(1, 1, -1), logical_axes=(None, None, None))


class UpSample1d(_Filter):
  """Kaiser-sinc interpolation by `ratio` (replicate-padded transposed depthwise conv)."""

  def __init__(self, ratio: int, kernel_size: int):
    super().__init__(kernel_size, ratio)
    self.ratio, self.k = ratio, kernel_size

  def __call__(self, x):
    r, k = self.ratio, self.k
    pad = k // r - 1
    left, right = pad * r + (k - r) // 2, pad * r + (k - r + 1) // 2
    taps = self.filter[...][0, 0][::-1]
    y = r * _depthwise(_replicate(x, pad, pad), taps, dilate=r, padding=(k - 1, k - 1))
    return y[:, left : y.shape[1] - right]


class DownSample1d(_Filter):
  def __init__(self, ratio: int, kernel_size: int):
    super().__init__(kernel_size, ratio)
    self.ratio, self.k = ratio, kernel_size

  def __call__(self, x):
    k = self.k
    x = _replicate(x, k // 2 + k % 2 - 1, k // 2)
    return _depthwise(x, self.filter[...][0, 0], stride=self.ratio)


class AntiAliasAct(nnx.Module):
  """Upsample 2x, activation, low-pass and downsample 2x (less aliasing from the nonlinearity)."""

  def __init__(self, act, ratio: int, kernel_size: int):
    self.upsample = UpSample1d(ratio, kernel_size)
    self.act = act
    self.downsample = DownSample1d(ratio, kernel_size)

  def __call__(self, x):
    return self.downsample(self.act(self.upsample(x)))


def _act(cfg: LTX2VocoderConfig, c: int, *, use_beta: bool):
  if cfg.act_fn == "leaky_relu":
    return LeakyReLU(cfg.leaky_relu_negative_slope)
  act = SnakeBeta(c, use_beta=use_beta)
  if cfg.antialias:
    act = AntiAliasAct(act, cfg.antialias_ratio, cfg.antialias_kernel_size)
  return act


class ResBlock(nnx.Module):
  """HiFi-GAN residual block: per dilation, act → dilated conv → act → conv, added to the input."""

  def __init__(self, c, k, dilations, cfg: LTX2VocoderConfig, *, rngs=None):
    use_beta = cfg.act_fn == "snakebeta"
    self.convs1 = nnx.List([_conv1d(c, c, k, dilation=d, rngs=rngs) for d in dilations])
    self.convs2 = nnx.List([_conv1d(c, c, k, rngs=rngs) for _ in dilations])
    self.acts1 = nnx.List([_act(cfg, c, use_beta=use_beta) for _ in dilations])
    self.acts2 = nnx.List([_act(cfg, c, use_beta=use_beta) for _ in dilations])

  def __call__(self, x):
    for a1, c1, a2, c2 in zip(self.acts1, self.convs1, self.acts2, self.convs2, strict=True):
      x = x + c2(a2(c1(a1(x))))
    return x


def _halo(cfg: LTX2VocoderConfig) -> float:
  """An upper bound on how many input frames either side one output sample depends on."""
  reach = (7 - 1) / 2  # conv_in
  rate = 1
  aa = 0
  if cfg.act_fn != "leaky_relu" and cfg.antialias:
    aa = cfg.antialias_kernel_size  # up and down filters, in samples at the stage rate (bound)
  for s, k in zip(cfg.upsample_factors, cfg.upsample_kernel_sizes, strict=True):
    reach += math.ceil(k / s) / rate
    rate *= s
    block = max(
      sum((k - 1) // 2 * d + (k - 1) // 2 + 2 * aa for d in ds)
      for k, ds in zip(cfg.resnet_kernel_sizes, cfg.resnet_dilations, strict=True)
    )
    reach += block / rate
  final_aa = cfg.antialias_kernel_size if cfg.act_fn != "leaky_relu" else 0
  return reach + (3 + final_aa) / rate


class Generator(nnx.Module):
  """One HiFi-GAN generator over flattened features: `[B, T, in_channels]` → `[B, T * hop, out]`."""

  def __init__(self, cfg: LTX2VocoderConfig, *, rngs=None):
    self.cfg = cfg
    self.conv_in = _conv1d(cfg.in_channels, cfg.hidden_channels, 7, rngs=rngs)
    ups, resnets = [], []
    c = cfg.hidden_channels
    for s, k in zip(cfg.upsample_factors, cfg.upsample_kernel_sizes, strict=True):
      ups.append(ConvTranspose1d(c, c // 2, k, s, rngs=rngs))
      c //= 2
      for rk, ds in zip(cfg.resnet_kernel_sizes, cfg.resnet_dilations, strict=True):
        resnets.append(ResBlock(c, rk, ds, cfg, rngs=rngs))
    self.upsamplers = nnx.List(ups)
    self.resnets = nnx.List(resnets)
    if cfg.act_fn == "leaky_relu":
      self.act_out = LeakyReLU(0.01)  # torch's default slope here, as the reference
    else:
      snake = SnakeBeta(c, use_beta=True)
      self.act_out = AntiAliasAct(snake, cfg.antialias_ratio, cfg.antialias_kernel_size)
    self.conv_out = _conv1d(c, cfg.out_channels, 7, use_bias=cfg.final_bias, rngs=rngs)

  def generate(self, x):
    cfg = self.cfg
    if x.shape[-1] != cfg.in_channels:
      raise ValueError(
        f"vocoder input has {x.shape[-1]} features per frame (shape {x.shape}), expected "
        f"in_channels={cfg.in_channels}"
      )
    x = self.conv_in(x)
    n = len(cfg.resnet_kernel_sizes)
    for i, up in enumerate(self.upsamplers):
      if cfg.act_fn == "leaky_relu":
        x = jax.nn.leaky_relu(x, cfg.leaky_relu_negative_slope)
      x = up(x)
      outs = [self.resnets[i * n + j](x) for j in range(n)]
      x = sum(outs[1:], outs[0]) / n
    x = self.conv_out(self.act_out(x))
    if cfg.final_act_fn == "tanh":
      x = jnp.tanh(x)
    elif cfg.final_act_fn == "clamp":
      x = jnp.clip(x, -1.0, 1.0)
    return x


def mel_features(mel: jax.Array) -> jax.Array:
  """`[B, T, M, C]` → `[B, T, C * M]` (channel-major, as the reference flattens `[B, C, M, T]`)."""
  b, t, m, c = mel.shape
  return mel.transpose(0, 1, 3, 2).reshape(b, t, c * m)


def _check_mel(mel, in_channels):
  if mel.ndim != 4 or mel.shape[2] * mel.shape[3] != in_channels:
    raise ValueError(
      f"mel must be [B, T, mel_bins, channels] with mel_bins x channels = in_channels={in_channels}, "
      f"got shape {mel.shape}"
    )


def _chunked(run, mel, chunk_frames, context, align, samples_per_frame):
  """Runs `run` over windows of `mel` frames with `context` on both sides and keeps the middles."""
  frames = mel.shape[1]
  if chunk_frames < 1:
    raise ValueError(f"chunk_frames must be >= 1, got {chunk_frames}")
  pieces = []
  for a in range(0, frames, chunk_frames):
    b = min(a + chunk_frames, frames)
    c0 = max(0, a - context) // align * align
    c1 = min(frames, b + context)
    y = run(mel[:, c0:c1])
    pieces.append(y[:, samples_per_frame * (a - c0) : samples_per_frame * (b - c0)])
  return jnp.concatenate(pieces, axis=1)


class LTX2Vocoder(Generator):
  """`LTX2Vocoder`: mel `[B, T, mel_bins, channels]` → waveform `[B, T * hop, out_channels]` at
  `sample_rate` (LTX-2.0: 240 samples per frame, 24 kHz)."""

  def __init__(self, config: LTX2VocoderConfig, *, rngs: nnx.Rngs | None = None):
    super().__init__(config, rngs=rngs)
    self.config = config

  @property
  def sample_rate(self) -> int:
    return self.config.output_sampling_rate

  def context_frames(self) -> int:
    """Mel frames of context on each side that make a chunked run equal one pass."""
    return math.ceil(_halo(self.config)) + 1

  def __call__(self, mel: jax.Array, *, chunk_frames: int | None = None) -> jax.Array:
    """Args: mel `[B, T, M, C]`; chunk_frames: run this many frames at a time (same result)."""
    _check_mel(mel, self.config.in_channels)
    run = lambda m: self.generate(mel_features(m))  # noqa: E731
    if chunk_frames is None or chunk_frames >= mel.shape[1]:
      return run(mel)
    return _chunked(run, mel, chunk_frames, self.context_frames(), 1, self.config.hop)


class CausalSTFT(nnx.Module):
  """The file's windowed DFT bases `[2 F, 1, N]` (held as a conv kernel `[N, 1, 2 F]`)."""

  def __init__(self, filter_length: int, hop_length: int, window_length: int):
    f = filter_length // 2 + 1
    self.hop_length, self.window_length = hop_length, window_length
    axes = (None, None, None)
    self.forward_basis = nnx.Param(jnp.zeros((filter_length, 1, 2 * f), _F32), logical_axes=axes)
    # Stored in the file and unused by the forward pass (kept so every tensor is accounted for).
    self.inverse_basis = nnx.Param(jnp.zeros((2 * f, 1, filter_length), _F32), logical_axes=axes)

  def magnitude(self, x):  # [N, S, 1] → [N, frames, F]
    x = jnp.pad(x, ((0, 0), (max(0, self.window_length - self.hop_length), 0), (0, 0)))
    spec = jax.lax.conv_general_dilated(
      x, self.forward_basis[...].astype(x.dtype), (self.hop_length,), ((0, 0),),
      dimension_numbers=("NWC", "WIO", "NWC"),
    )  # fmt: skip
    re, im = jnp.split(spec, 2, axis=-1)
    return jnp.sqrt(jnp.square(re) + jnp.square(im))


class MelSTFT(nnx.Module):
  def __init__(self, filter_length, hop_length, window_length, num_mel_channels):
    self.stft_fn = CausalSTFT(filter_length, hop_length, window_length)
    f = filter_length // 2 + 1
    self.mel_basis = nnx.Param(jnp.zeros((num_mel_channels, f), _F32), logical_axes=(None, None))

  def __call__(self, x):  # [N, S, 1] → log-mel [N, frames, num_mel]
    mag = self.stft_fn.magnitude(x)
    mel = jnp.einsum("ntf,mf->ntm", mag, self.mel_basis[...].astype(mag.dtype))
    return jnp.log(jnp.maximum(mel, 1e-5))


def hann_sinc_filter(ratio: int, rolloff: float = 0.99, width_zeros: int = 6) -> np.ndarray:
  """The resampler's Hann-windowed sinc `[2 w ratio + 1]` (w = ceil(width_zeros / rolloff))."""
  width = math.ceil(width_zeros / rolloff)
  k = 2 * width * ratio + 1
  t = (np.arange(k) / ratio - width) * rolloff
  window = np.cos(np.clip(t, -width_zeros, width_zeros) * math.pi / width_zeros / 2) ** 2
  return (np.sinc(t) * window * rolloff / ratio).astype(np.float32)


class LTX2VocoderWithBWE(nnx.Module):
  """`LTX2VocoderWithBWE`: mel `[B, T, mel_bins, channels]` → waveform at `output_sampling_rate`
  (LTX-2.3: 16 kHz stage, then bandwidth extension to 48 kHz; `[B, T * 480, out_channels]`)."""

  def __init__(self, config: LTX2VocoderBWEConfig, *, rngs: nnx.Rngs | None = None):
    self.config = config
    self.vocoder = Generator(config.vocoder, rngs=rngs)
    self.bwe_generator = Generator(config.bwe, rngs=rngs)
    self.mel_stft = MelSTFT(
      config.filter_length, config.hop_length, config.window_length, config.num_mel_channels
    )
    self.ratio = config.output_sampling_rate // config.input_sampling_rate

  @property
  def sample_rate(self) -> int:
    return self.config.output_sampling_rate

  def _resample(self, x):
    # The resampler's filter is computed, not stored in the file.
    r, taps = self.ratio, jnp.asarray(hann_sinc_filter(self.ratio)[::-1].copy())
    width = (taps.shape[0] - 1) // (2 * r)
    k = taps.shape[0]
    y = r * _depthwise(_replicate(x, width, width), taps, dilate=r, padding=(k - 1, k - 1))
    return y[:, 2 * width * r : y.shape[1] - (k - r)]

  def _run(self, mel):
    cfg = self.config
    x = self.vocoder.generate(mel_features(mel))  # [B, S, C] at input_sampling_rate
    b, s, c = x.shape
    rem = s % cfg.hop_length
    if rem:
      x = jnp.pad(x, ((0, 0), (0, cfg.hop_length - rem), (0, 0)))
    logmel = self.mel_stft(x.transpose(0, 2, 1).reshape(b * c, -1, 1))  # [B C, frames, M]
    frames = logmel.shape[1]
    feats = logmel.reshape(b, c, frames, -1).transpose(0, 2, 1, 3).reshape(b, frames, -1)
    y = jnp.clip(self.bwe_generator.generate(feats) + self._resample(x), -1.0, 1.0)
    return y[:, : s * self.ratio]

  def context_frames(self) -> int:
    """Mel frames of context on each side that make a chunked run equal one pass."""
    cfg = self.config
    hop1 = cfg.vocoder.hop
    stft = cfg.window_length / hop1
    bwe = _halo(cfg.bwe) * cfg.hop_length / hop1
    resample = (hann_sinc_filter(self.ratio).shape[0] / self.ratio) / hop1
    return math.ceil(_halo(cfg.vocoder) + stft + bwe + resample) + 1

  def __call__(self, mel: jax.Array, *, chunk_frames: int | None = None) -> jax.Array:
    """Args: mel `[B, T, M, C]`; chunk_frames: run this many frames at a time (same result)."""
    cfg = self.config
    _check_mel(mel, cfg.in_channels)
    if chunk_frames is None or chunk_frames >= mel.shape[1]:
      return self._run(mel)
    hop1 = cfg.vocoder.hop
    align = cfg.hop_length // math.gcd(hop1, cfg.hop_length)  # windows start on the STFT grid
    per_frame = hop1 * self.ratio
    return _chunked(self._run, mel, chunk_frames, self.context_frames(), align, per_frame)
