"""The LTX-Video causal 3D VAE (diffusers' `AutoencoderKLLTXVideo`), channels-last `[B, F, H, W, C]`.

128 latent channels, 8x in time and 32x in space (a 4x4 pixel patch, then three 2x stages; 0.9.5+ adds a
fourth, space-to-depth, stage). The encoder is causal in time (the first frame is repeated in front); the
decoder pads with the first and last frames. Decoders from 0.9.1 on take a timestep (`decode_timestep`) that
modulates their norms, double their widths through depth-to-space upsamplers with residuals, and (0.9.1)
inject per-channel-scaled spatial noise. The file also holds per-channel latent statistics
(`latents_mean`, `latents_std`) that the pipelines normalise latents with.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import os
import pathlib
from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

import md_core
from md_core import nn

_F32 = jnp.float32
_IGNORED_KEYS = {"_class_name", "_diffusers_version", "_name_or_path", "_use_default_values"}
_DOWN_TYPES = ("LTXVideoDownBlock3D", "LTXVideo095DownBlock3D")
_DOWNSAMPLE_STRIDES = {"spatial": (1, 2, 2), "temporal": (2, 1, 1), "spatiotemporal": (2, 2, 2)}
_PADDING_MODES = ("zeros", "reflect")


@dataclasses.dataclass(frozen=True)
class LTXVideoVAEConfig:
  """diffusers' `AutoencoderKLLTXVideo` config keys (see `LTX_VAE_VARIANTS` for the released ones)."""

  in_channels: int = 3
  out_channels: int = 3
  latent_channels: int = 128
  block_out_channels: tuple[int, ...] = (128, 256, 512, 512)
  down_block_types: tuple[str, ...] = ("LTXVideoDownBlock3D",) * 4
  decoder_block_out_channels: tuple[int, ...] = (128, 256, 512, 512)
  layers_per_block: tuple[int, ...] = (4, 3, 3, 3, 4)
  decoder_layers_per_block: tuple[int, ...] = (4, 3, 3, 3, 4)
  spatio_temporal_scaling: tuple[bool, ...] = (True, True, True, False)
  decoder_spatio_temporal_scaling: tuple[bool, ...] = (True, True, True, False)
  decoder_inject_noise: tuple[bool, ...] = (False, False, False, False, False)
  downsample_type: tuple[str, ...] = ("conv", "conv", "conv", "conv")
  upsample_residual: tuple[bool, ...] = (False, False, False, False)
  upsample_factor: tuple[int, ...] = (1, 1, 1, 1)
  timestep_conditioning: bool = False
  patch_size: int = 4
  patch_size_t: int = 1
  resnet_norm_eps: float = 1e-6
  scaling_factor: float = 1.0
  encoder_causal: bool = True
  decoder_causal: bool = False
  spatial_compression_ratio: int | None = None
  temporal_compression_ratio: int | None = None
  # LTX-2 (`AutoencoderKLLTX2Video`, see md_vae._ltx2_vae) parametrises these; LTX-Video's are the defaults:
  # zero spatial padding and 2x2x2 upsamplers.
  upsample_type: tuple[str, ...] | None = None
  encoder_spatial_padding_mode: str = "zeros"
  decoder_spatial_padding_mode: str = "zeros"

  def __post_init__(self):
    for f in dataclasses.fields(self):
      v = getattr(self, f.name)
      if isinstance(v, list):
        object.__setattr__(self, f.name, tuple(v))
    bad = [t for t in self.down_block_types if t not in _DOWN_TYPES]
    if bad:
      raise ValueError(f"down_block_types {bad} are not supported; expected {_DOWN_TYPES}")
    bad = [t for t in self.downsample_type if t not in ("conv",) + tuple(_DOWNSAMPLE_STRIDES)]
    if bad:
      raise ValueError(
        f"downsample_type {bad} not supported; expected conv, {', '.join(_DOWNSAMPLE_STRIDES)}"
      )
    for name in ("encoder_spatial_padding_mode", "decoder_spatial_padding_mode"):
      if getattr(self, name) not in _PADDING_MODES:
        raise ValueError(
          f"{name}={getattr(self, name)!r} not supported; expected one of {_PADDING_MODES}"
        )
    n = len(self.decoder_block_out_channels)
    if self.upsample_type is not None and (
      len(self.upsample_type) != n or any(t not in _DOWNSAMPLE_STRIDES for t in self.upsample_type)
    ):
      raise ValueError(
        f"upsample_type={self.upsample_type} needs {n} entries out of {', '.join(_DOWNSAMPLE_STRIDES)}"
      )
    if len(self.decoder_layers_per_block) != n + 1 or len(self.decoder_inject_noise) != n + 1:
      raise ValueError(
        f"decoder_layers_per_block={self.decoder_layers_per_block} and decoder_inject_noise="
        f"{self.decoder_inject_noise} need {n + 1} entries (mid block + {n} up blocks)"
      )

  @property
  def spatial_ratio(self) -> int:
    if self.spatial_compression_ratio is not None:
      return self.spatial_compression_ratio
    return self.patch_size * 2 ** sum(self.spatio_temporal_scaling)

  @property
  def temporal_ratio(self) -> int:
    if self.temporal_compression_ratio is not None:
      return self.temporal_compression_ratio
    return self.patch_size_t * 2 ** sum(self.spatio_temporal_scaling)

  @classmethod
  def from_dict(cls, d: Mapping[str, Any], **overrides) -> LTXVideoVAEConfig:
    """Reads `vae/config.json` of an LTX-Video checkpoint.

    Raises:
      ValueError: another class, or keys md does not implement (named, with the supported ones).
    """
    d = dict(d)
    name = d.get("_class_name")
    if name not in (None, "AutoencoderKLLTXVideo"):
      raise ValueError(f"config is for {name!r}; LTXVideoVAEConfig reads AutoencoderKLLTXVideo")
    fields = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(k for k in d if k not in fields and k not in _IGNORED_KEYS)
    if unknown:
      raise ValueError(
        f"LTX-Video VAE config keys {unknown} are not supported; supported keys: {sorted(fields)}"
      )
    kwargs = {k: tuple(v) if isinstance(v, list) else v for k, v in d.items() if k in fields}
    kwargs.update(overrides)
    return cls(**kwargs)

  @classmethod
  def from_json(cls, path: str | os.PathLike, **overrides) -> LTXVideoVAEConfig:
    path = pathlib.Path(path)
    if path.is_dir():
      path = path / "config.json"
    return cls.from_dict(md_core.read_json(path), **overrides)


# Sizes from diffusers' scripts/convert_ltx_to_diffusers.py (get_vae_config) and the hub configs
# (tools/configs/ltx/).
LTX_VAE_VARIANTS: dict[str, LTXVideoVAEConfig] = {
  "0.9.0": LTXVideoVAEConfig(),
  "0.9.1": LTXVideoVAEConfig(
    decoder_block_out_channels=(256, 512, 1024), decoder_layers_per_block=(5, 6, 7, 8),
    decoder_spatio_temporal_scaling=(True, True, True), decoder_inject_noise=(True, True, True, False),
    upsample_residual=(True, True, True), upsample_factor=(2, 2, 2), timestep_conditioning=True,
  ),
  "0.9.5": LTXVideoVAEConfig(
    block_out_channels=(128, 256, 512, 1024, 2048), down_block_types=("LTXVideo095DownBlock3D",) * 4,
    decoder_block_out_channels=(256, 512, 1024), layers_per_block=(4, 6, 6, 2, 2),
    decoder_layers_per_block=(5, 5, 5, 5), spatio_temporal_scaling=(True, True, True, True),
    decoder_spatio_temporal_scaling=(True, True, True), decoder_inject_noise=(False,) * 4,
    downsample_type=("spatial", "temporal", "spatiotemporal", "spatiotemporal"),
    upsample_residual=(True, True, True), upsample_factor=(2, 2, 2), timestep_conditioning=True,
    spatial_compression_ratio=32, temporal_compression_ratio=8,
  ),
}  # fmt: skip


# Set (at trace time) by `causal_override`: forces every CausalConv3d called meanwhile causal or not.
_CAUSAL_OVERRIDE: contextvars.ContextVar[bool | None] = contextvars.ContextVar(
  "md_vae_ltx_causal", default=None
)


@contextlib.contextmanager
def causal_override(causal: bool | None):
  """Within the block, every `CausalConv3d` pads causally (True) or symmetrically (False) whatever it was
  built with (None: as built). LTX-2's runtime `causal=` argument; mutates no module, so it works on modules
  closed over by a jitted function."""
  token = _CAUSAL_OVERRIDE.set(causal)
  try:
    yield
  finally:
    _CAUSAL_OVERRIDE.reset(token)


class CausalConv3d(nnx.Module):
  """A 3D convolution padded in time by repeating edge frames (causal: the first frame, `k - 1` times in
  front; else `(k - 1) / 2` first frames in front and last frames behind), padded in space with zeros or
  (`padding_mode="reflect"`, LTX-2's decoder) by reflection."""

  def __init__(self, cin, cout, kernel_size=3, *, stride=1, causal=True, padding_mode="zeros",
               rngs=None):  # fmt: skip
    k = kernel_size
    self.kernel_t, self.causal = k, causal
    self.reflect = k // 2 if padding_mode == "reflect" else 0
    pad = 0 if self.reflect else k // 2
    self.conv = nn.Conv(
      cin, cout, (k, k, k), stride=stride, padding=((0, 0), (pad, pad), (pad, pad)),
      axes=("conv_in", "conv_out"), rngs=rngs,
    )  # fmt: skip

  def __call__(self, x: jax.Array) -> jax.Array:  # [B, F, H, W, C]
    k = self.kernel_t
    override = _CAUSAL_OVERRIDE.get()
    if self.causal if override is None else override:
      x = jnp.concatenate([jnp.repeat(x[:, :1], k - 1, axis=1), x], axis=1)
    else:
      p = (k - 1) // 2
      x = jnp.concatenate([jnp.repeat(x[:, :1], p, axis=1), x, jnp.repeat(x[:, -1:], p, axis=1)], 1)
    if self.reflect:
      r = self.reflect
      x = jnp.pad(x, ((0, 0), (0, 0), (r, r), (r, r), (0, 0)), mode="reflect")
    return self.conv(x)


class TimeEmbedder(nnx.Module):
  """PixArt-alpha's timestep embedder without size conditions: sinusoids (256) → MLP."""

  def __init__(self, dim: int, *, rngs=None):
    self.timestep_embedder = nn.TimestepEmbedding(256, dim, rngs=rngs)

  def __call__(self, t: jax.Array, dtype) -> jax.Array:  # [B] → [B, dim]
    feats = nn.timestep_embedding(t, 256, flip_sin_to_cos=True, downscale_freq_shift=0)
    return self.timestep_embedder(feats.astype(dtype))


class ResnetBlock(nnx.Module):
  """RMS norm (no affine) → [modulation] → SiLU → conv → [noise], twice, plus a (normed, 1x1) shortcut."""

  def __init__(self, cin, cout, *, eps, causal, inject_noise=False, conditioned=False,
               padding_mode="zeros", rngs=None):  # fmt: skip
    self.norm1 = nn.RMSNorm(cin, eps=1e-8, elementwise_affine=False)
    self.conv1 = CausalConv3d(cin, cout, causal=causal, padding_mode=padding_mode, rngs=rngs)
    self.norm2 = nn.RMSNorm(cout, eps=1e-8, elementwise_affine=False)
    self.conv2 = CausalConv3d(cout, cout, causal=causal, padding_mode=padding_mode, rngs=rngs)
    shortcut = cin != cout
    self.norm3 = nn.LayerNorm(cin, eps=eps, rngs=rngs) if shortcut else None
    self.conv_shortcut = CausalConv3d(cin, cout, 1, causal=causal, rngs=rngs) if shortcut else None
    zeros = jnp.zeros((cin, 1, 1), _F32)  # the reference's shape
    noise = (lambda: nnx.Param(zeros, logical_axes=("norm", None, None))) if inject_noise else None
    self.per_channel_scale1 = noise() if noise else None
    self.per_channel_scale2 = noise() if noise else None
    table = None
    if conditioned:
      table = jax.random.normal(md_core.param_key(rngs), (4, cin), _F32)
      table = nnx.Param(table / cin**0.5, logical_axes=(None, "norm"))
    self.scale_shift_table = table

  def _noise(self, x, scale, key):
    # One [H, W] draw shared by the batch, frames and channels, scaled per channel (as the reference).
    noise = jax.random.normal(key, x.shape[2:4], _F32)
    return x + (noise[None, None, :, :, None] * scale[...].reshape(1, 1, 1, 1, -1)).astype(x.dtype)

  def __call__(self, x, temb=None, key=None):
    h = self.norm1(x)
    if self.scale_shift_table is not None:
      ada = temb.reshape(temb.shape[0], 4, -1) + self.scale_shift_table[...][None]  # [B, 4, C]
      shift1, scale1, shift2, scale2 = (
        ada[:, i].reshape(-1, 1, 1, 1, ada.shape[-1]) for i in range(4)
      )
      h = h * (1 + scale1) + shift1
    h = self.conv1(jax.nn.silu(h))
    if self.per_channel_scale1 is not None:
      k1, k2 = jax.random.split(key)
      h = self._noise(h, self.per_channel_scale1, k1)
    h = self.norm2(h)
    if self.scale_shift_table is not None:
      h = h * (1 + scale2) + shift2
    h = self.conv2(jax.nn.silu(h))
    if self.per_channel_scale2 is not None:
      h = self._noise(h, self.per_channel_scale2, k2)
    if self.norm3 is not None:
      x = self.conv_shortcut(self.norm3(x))
    return h + x


def _space_to_depth(x, stride):
  """`[B, F, H, W, C]` → `[B, F/st, H/sh, W/sw, C * st * sh * sw]`, channel-major as the reference."""
  b, f, h, w, c = x.shape
  st, sh, sw = stride
  x = x.reshape(b, f // st, st, h // sh, sh, w // sw, sw, c)
  x = x.transpose(0, 1, 3, 5, 7, 2, 4, 6)
  return x.reshape(b, f // st, h // sh, w // sw, c * st * sh * sw)


def _depth_to_space(x, stride):
  """`[B, F, H, W, C * st * sh * sw]` → `[B, F * st, H * sh, W * sw, C]` (the inverse of the above)."""
  b, f, h, w, c = x.shape
  st, sh, sw = stride
  c //= st * sh * sw
  x = x.reshape(b, f, h, w, c, st, sh, sw).transpose(0, 1, 5, 2, 6, 3, 7, 4)
  return x.reshape(b, f * st, h * sh, w * sw, c)


class Downsampler(nnx.Module):
  """0.9.5+: space-to-depth of a conv plus the group mean of the space-to-depth input (a residual)."""

  def __init__(self, cin, cout, stride, *, causal, padding_mode="zeros", rngs=None):
    self.stride = stride
    self.group_size = cin * stride[0] * stride[1] * stride[2] // cout
    self.conv = CausalConv3d(
      cin, cout // (stride[0] * stride[1] * stride[2]), causal=causal, padding_mode=padding_mode,
      rngs=rngs,
    )  # fmt: skip

  def __call__(self, x):
    x = jnp.concatenate([x[:, : self.stride[0] - 1], x], axis=1)
    residual = _space_to_depth(x, self.stride)
    residual = residual.reshape(residual.shape[:-1] + (-1, self.group_size)).mean(-1)
    return _space_to_depth(self.conv(x), self.stride) + residual


class Upsampler(nnx.Module):
  """Depth-to-space of a conv (2x in time and space, or LTX-2's `stride`), dropping the first new frames
  (`stride[0] - 1`); optional residual."""

  def __init__(self, cin, *, residual, factor, causal, stride=(2, 2, 2), padding_mode="zeros",
               rngs=None):  # fmt: skip
    self.residual, self.factor, self.stride = residual, factor, tuple(stride)
    n = stride[0] * stride[1] * stride[2]
    self.conv = CausalConv3d(
      cin, cin * n // factor, causal=causal, padding_mode=padding_mode, rngs=rngs
    )

  def __call__(self, x):
    stride = self.stride
    drop = stride[0] - 1
    h = _depth_to_space(self.conv(x), stride)[:, drop:]
    if self.residual:
      r = _depth_to_space(x, stride)[:, drop:]
      h = h + jnp.tile(r, (1, 1, 1, 1, stride[0] * stride[1] * stride[2] // self.factor))
    return h


class DownBlock(nnx.Module):
  def __init__(self, cfg, i, cin, cout, *, rngs=None):
    pad = cfg.encoder_spatial_padding_mode
    kw = dict(eps=cfg.resnet_norm_eps, causal=cfg.encoder_causal, padding_mode=pad, rngs=rngs)
    self.resnets = nnx.List([ResnetBlock(cin, cin, **kw) for _ in range(cfg.layers_per_block[i])])
    is_095 = cfg.down_block_types[i] == "LTXVideo095DownBlock3D"
    downsamplers = None
    if cfg.spatio_temporal_scaling[i]:
      kind = cfg.downsample_type[i] if is_095 else "conv"
      if kind == "conv":
        down = CausalConv3d(
          cin, cin, stride=2, causal=cfg.encoder_causal, padding_mode=pad, rngs=rngs
        )
      else:
        down = Downsampler(
          cin, cout, _DOWNSAMPLE_STRIDES[kind], causal=cfg.encoder_causal, padding_mode=pad,
          rngs=rngs,
        )  # fmt: skip
      downsamplers = nnx.List([down])
    self.downsamplers = downsamplers
    self.conv_out = ResnetBlock(cin, cout, **kw) if not is_095 and cin != cout else None

  def __call__(self, x):
    for r in self.resnets:
      x = r(x)
    if self.downsamplers is not None:
      x = self.downsamplers[0](x)
    if self.conv_out is not None:
      x = self.conv_out(x)
    return x


class MidBlock(nnx.Module):
  def __init__(self, c, layers, *, eps, causal, inject_noise=False, conditioned=False,
               padding_mode="zeros", rngs=None):  # fmt: skip
    self.time_embedder = TimeEmbedder(4 * c, rngs=rngs) if conditioned else None
    kw = dict(eps=eps, causal=causal, inject_noise=inject_noise, conditioned=conditioned,
              padding_mode=padding_mode, rngs=rngs)  # fmt: skip
    self.resnets = nnx.List([ResnetBlock(c, c, **kw) for _ in range(layers)])

  def __call__(self, x, t=None, key=None):
    temb = None if self.time_embedder is None else self.time_embedder(t, x.dtype)
    keys = (
      [None] * len(self.resnets) if key is None else list(jax.random.split(key, len(self.resnets)))
    )
    for r, k in zip(self.resnets, keys, strict=True):
      x = r(x, temb, k)
    return x


class UpBlock(nnx.Module):
  def __init__(self, cin, cout, layers, *, eps, causal, inject_noise, conditioned, scale, residual,
               factor, stride=(2, 2, 2), padding_mode="zeros", rngs=None):  # fmt: skip
    kw = dict(eps=eps, causal=causal, inject_noise=inject_noise, conditioned=conditioned,
              padding_mode=padding_mode, rngs=rngs)  # fmt: skip
    self.time_embedder = TimeEmbedder(4 * cin, rngs=rngs) if conditioned else None
    self.conv_in = ResnetBlock(cin, cout, **kw) if cin != cout else None
    if self.conv_in is not None and conditioned:
      raise ValueError(
        "a timestep-conditioned LTX decoder up block whose width changes is not supported (the reference "
        "feeds it the raw timestep); no released checkpoint has one"
      )
    up = Upsampler(
      cout * factor, residual=residual, factor=factor, causal=causal, stride=stride,
      padding_mode=padding_mode, rngs=rngs,
    )  # fmt: skip
    self.upsamplers = nnx.List([up]) if scale else None
    self.resnets = nnx.List([ResnetBlock(cout, cout, **kw) for _ in range(layers)])

  def __call__(self, x, t=None, key=None):
    n = len(self.resnets) + 1
    keys = [None] * n if key is None else list(jax.random.split(key, n))
    if self.conv_in is not None:
      x = self.conv_in(x, None, keys[-1])
    temb = None if self.time_embedder is None else self.time_embedder(t, x.dtype)
    if self.upsamplers is not None:
      x = self.upsamplers[0](x)
    for r, k in zip(self.resnets, keys[:-1], strict=True):
      x = r(x, temb, k)
    return x


class Encoder(nnx.Module):
  def __init__(self, cfg: LTXVideoVAEConfig, *, rngs=None):
    self.cfg = cfg
    bo = cfg.block_out_channels
    p = cfg.patch_size
    c = bo[0]
    pad = cfg.encoder_spatial_padding_mode
    self.conv_in = CausalConv3d(
      cfg.in_channels * p * p, c, causal=cfg.encoder_causal, padding_mode=pad, rngs=rngs
    )
    is_095 = cfg.down_block_types[-1] == "LTXVideo095DownBlock3D"
    n = len(bo) - (1 if is_095 else 0)
    blocks = []
    for i in range(n):
      cin = c
      c = bo[i + 1] if is_095 or i + 1 < n else bo[i]
      blocks.append(DownBlock(cfg, i, cin, c, rngs=rngs))
    self.down_blocks = nnx.List(blocks)
    self.mid_block = MidBlock(
      c, cfg.layers_per_block[-1], eps=cfg.resnet_norm_eps, causal=cfg.encoder_causal,
      padding_mode=pad, rngs=rngs,
    )  # fmt: skip
    self.norm_out = nn.RMSNorm(c, eps=1e-8, elementwise_affine=False)
    self.conv_out = CausalConv3d(
      c, cfg.latent_channels + 1, causal=cfg.encoder_causal, padding_mode=pad, rngs=rngs
    )

  def __call__(self, x):  # [B, F, H, W, 3] → [B, F', H', W', latent + 1]
    cfg = self.cfg
    b, f, h, w, c = x.shape
    p, pt = cfg.patch_size, cfg.patch_size_t
    x = x.reshape(b, f // pt, pt, h // p, p, w // p, p, c).transpose(0, 1, 3, 5, 7, 2, 6, 4)
    x = self.conv_in(x.reshape(b, f // pt, h // p, w // p, c * pt * p * p))
    for block in self.down_blocks:
      x = block(x)
    x = self.mid_block(x)
    return self.conv_out(jax.nn.silu(self.norm_out(x)))


class Decoder(nnx.Module):
  def __init__(self, cfg: LTXVideoVAEConfig, *, rngs=None):
    self.cfg = cfg
    bo = tuple(reversed(cfg.decoder_block_out_channels))
    scaling = tuple(reversed(cfg.decoder_spatio_temporal_scaling))
    layers = tuple(reversed(cfg.decoder_layers_per_block))
    noise = tuple(reversed(cfg.decoder_inject_noise))
    residual = tuple(reversed(cfg.upsample_residual))
    factor = tuple(reversed(cfg.upsample_factor))
    # Unlike the other per-block options, the reference does not reverse upsample_type.
    kinds = cfg.upsample_type or ("spatiotemporal",) * len(bo)
    cond, causal, eps = cfg.timestep_conditioning, cfg.decoder_causal, cfg.resnet_norm_eps
    pad = cfg.decoder_spatial_padding_mode
    c = bo[0]
    self.conv_in = CausalConv3d(cfg.latent_channels, c, causal=causal, padding_mode=pad, rngs=rngs)
    self.mid_block = MidBlock(
      c, layers[0], eps=eps, causal=causal, inject_noise=noise[0], conditioned=cond,
      padding_mode=pad, rngs=rngs,
    )  # fmt: skip
    blocks = []
    for i in range(len(bo)):
      cin, c = c // factor[i], bo[i] // factor[i]
      blocks.append(
        UpBlock(
          cin,
          c,
          layers[i + 1],
          eps=eps,
          causal=causal,
          inject_noise=noise[i + 1],
          conditioned=cond,
          scale=scaling[i],
          residual=residual[i],
          factor=factor[i],
          stride=_DOWNSAMPLE_STRIDES[kinds[i]],
          padding_mode=pad,
          rngs=rngs,
        )  # fmt: skip
      )
    self.up_blocks = nnx.List(blocks)
    self.norm_out = nn.RMSNorm(c, eps=1e-8, elementwise_affine=False)
    p = cfg.patch_size
    self.conv_out = CausalConv3d(
      c, cfg.out_channels * p * p * cfg.patch_size_t, causal=causal, padding_mode=pad, rngs=rngs
    )
    multiplier = embedder = table = None
    if cond:
      multiplier = nnx.Param(jnp.asarray(1000.0, _F32), logical_axes=())
      embedder = TimeEmbedder(2 * c, rngs=rngs)
      table = jax.random.normal(md_core.param_key(rngs), (2, c), _F32)
      table = nnx.Param(table / c**0.5, logical_axes=(None, "norm"))
    self.timestep_scale_multiplier, self.time_embedder, self.scale_shift_table = (
      multiplier,
      embedder,
      table,
    )

  def __call__(self, z, t=None, key=None):  # [B, F, H, W, latent] → [B, F', H', W', 3]
    cfg = self.cfg
    x = self.conv_in(z)
    if t is not None:
      t = t * self.timestep_scale_multiplier[...]
    keys = [None] * (len(self.up_blocks) + 1)
    if key is not None:
      keys = list(jax.random.split(key, len(keys)))
    x = self.mid_block(x, t, keys[0])
    for block, k in zip(self.up_blocks, keys[1:], strict=True):
      x = block(x, t, k)
    x = self.norm_out(x)
    if self.time_embedder is not None:
      temb = (
        self.time_embedder(t, x.dtype).reshape(x.shape[0], 2, -1)
        + self.scale_shift_table[...][None]
      )
      shift, scale = (temb[:, i].reshape(-1, 1, 1, 1, temb.shape[-1]) for i in range(2))
      x = x * (1 + scale) + shift
    x = self.conv_out(jax.nn.silu(x))
    b, f, h, w, _ = x.shape
    p, pt = cfg.patch_size, cfg.patch_size_t
    # Channels are (c, t, pw, ph) from slowest: the innermost offset is the row's.
    x = x.reshape(b, f, h, w, -1, pt, p, p).transpose(0, 1, 5, 2, 7, 3, 6, 4)
    return x.reshape(b, f * pt, h * p, w * p, cfg.out_channels)


class LTXLatentDist(NamedTuple):
  """The encoder's posterior: `mean` and `logvar` `[B, F, H, W, C]` (one log-variance shared by all
  channels, clamped to [-30, 20] as the reference)."""

  mean: jax.Array
  logvar: jax.Array

  @property
  def std(self) -> jax.Array:
    return jnp.exp(0.5 * self.logvar)

  def mode(self) -> jax.Array:
    return self.mean

  def sample(self, key: jax.Array) -> jax.Array:
    return self.mean + self.std * jax.random.normal(key, self.mean.shape, self.mean.dtype)


def _nearest(n: int, step: int, offset: int) -> str:
  below = max(offset, offset + step * ((n - offset) // step))
  return f"{below} or {below + step}" if below != n else str(n)


class LTXVideoVAE(nnx.Module):
  """`AutoencoderKLLTXVideo`: `encode(video) -> LTXLatentDist`, `decode(latents, timestep) -> video`.

  Video is `[B, F, H, W, 3]` in [-1, 1] with `F = 1 + 8k` and H, W multiples of 32; latents are
  `[B, 1 + k, H/32, W/32, 128]`.
  """

  def __init__(self, config: LTXVideoVAEConfig, *, rngs: nnx.Rngs | None = None):
    self.config = config
    self.encoder = Encoder(config, rngs=rngs)
    self.decoder = Decoder(config, rngs=rngs)
    c = config.latent_channels
    # Buffers in the file (DESIGN.md §6): per-channel latent statistics.
    self.latents_mean = nnx.Param(jnp.zeros((c,), _F32), logical_axes=("norm",))
    self.latents_std = nnx.Param(jnp.ones((c,), _F32), logical_axes=("norm",))

  _NAME = "LTX-Video VAE"  # in error messages (LTX2VideoVAE overrides it)

  def check_video(self, video) -> None:
    cfg = self.config
    if video.ndim != 5 or video.shape[-1] != cfg.in_channels:
      raise ValueError(f"video must be [B, F, H, W, {cfg.in_channels}], got {video.shape}")
    _, f, h, w, _ = video.shape
    t, s = cfg.temporal_ratio, cfg.spatial_ratio
    problems = []
    if (f - 1) % t:
      problems.append(f"frames={f} is not 1 + {t}k (nearest: {_nearest(f, t, 1)})")
    for name, n in (("height", h), ("width", w)):
      if n % s or n == 0:
        problems.append(f"{name}={n} is not a multiple of {s} (nearest: {_nearest(n, s, s)})")
    if problems:
      raise ValueError(
        f"the {self._NAME} cannot encode video {video.shape}: " + "; ".join(problems)
      )

  def encode(self, video: jax.Array) -> LTXLatentDist:
    """`[B, F, H, W, 3]` (F = 1 + 8k, H and W multiples of 32) → the latent posterior."""
    self.check_video(video)
    moments = self.encoder(video)
    c = self.config.latent_channels
    logvar = jnp.broadcast_to(moments[..., c:], moments[..., :c].shape)
    return LTXLatentDist(moments[..., :c], jnp.clip(logvar, -30.0, 20.0))

  def decode(
    self,
    latents: jax.Array,
    timestep: jax.Array | float | None = None,
    *,
    key: jax.Array | None = None,
  ) -> jax.Array:
    """`[B, F, H, W, 128]` latents → `[B, 1 + 8 (F - 1), 32 H, 32 W, 3]` video.

    Args:
      latents: unnormalised latents (see `denormalize_latents`).
      timestep: `[B]` or a number: the decode timestep (pipelines pass 0.0 … 0.05), required exactly when
        the decoder is timestep-conditioned (0.9.1+).
      key: random key for the noise the 0.9.1 decoder injects (required when it has noise injection).
    """
    t, key = self._decoder_inputs(latents, timestep, key)
    return self.decoder(latents, t, key)

  def _decoder_inputs(self, latents, timestep, key):
    """Checks `decode`'s arguments; → (the `[B]` float32 timestep or None, the noise key or None)."""
    cfg = self.config
    if latents.ndim != 5 or latents.shape[-1] != cfg.latent_channels:
      raise ValueError(
        f"latents must be [B, F, H, W, latent_channels={cfg.latent_channels}], got {latents.shape}"
      )
    if cfg.timestep_conditioning:
      if timestep is None:
        raise ValueError(
          f"this {self._NAME} decoder is timestep-conditioned: pass timestep= (the pipeline's "
          "decode_timestep, e.g. 0.05)"
        )
      t = jnp.broadcast_to(jnp.asarray(timestep, _F32).reshape(-1), (latents.shape[0],))
    elif timestep is not None:
      raise ValueError(f"this {self._NAME} decoder is not timestep-conditioned: pass no timestep")
    else:
      t = None
    if any(cfg.decoder_inject_noise) and key is None:
      raise ValueError(f"this {self._NAME} decoder injects noise: pass key=jax.random.key(...)")
    return t, key if any(cfg.decoder_inject_noise) else None

  def _stats(self, like: jax.Array) -> tuple[jax.Array, jax.Array]:
    shape = (1,) * (like.ndim - 1) + (-1,)
    return (
      self.latents_mean[...].astype(like.dtype).reshape(shape),
      self.latents_std[...].astype(like.dtype).reshape(shape),
    )

  def normalize_latents(self, latents: jax.Array) -> jax.Array:
    """`(z - mean) * scaling_factor / std` with the file's per-channel statistics (the pipelines' form)."""
    mean, std = self._stats(latents)
    return (latents - mean) * self.config.scaling_factor / std

  def denormalize_latents(self, latents: jax.Array) -> jax.Array:
    mean, std = self._stats(latents)
    return latents * std / self.config.scaling_factor + mean
