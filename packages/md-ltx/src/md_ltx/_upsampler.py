"""LTX latent upsamplers (LTX-Video's `LTXLatentUpsamplerModel`, LTX-2's `LTX2LatentUpsamplerModel`) and the
latent-upsample step of their pipelines (`LTXLatentUpsamplePipeline`, `LTX2LatentUpsamplePipeline`).

The upsampler is a small conv net over VAE latents: an initial conv + GroupNorm + SiLU, `num_blocks_per_stage`
residual blocks, one upsampling layer (sub-pixel conv ×2 in space, in time, or both; or LTX-2's rational
resampler: sub-pixel conv by `num` then an anti-aliasing binomial blur with stride `den`), as many residual
blocks again and a final conv. Activations are channels-last `[B, F, H, W, C]`; the residual blocks of each
stage are stacked and scanned.

The pipeline step (`upsample_latents`) takes the first pass's latents, undoes the VAE's per-channel
normalisation, upsamples, optionally matches the per-channel statistics of the input (AdaIN, blended by a
factor) and tone-maps, then (LTX-Video) normalises again for the second denoising pass.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

import md_core
from md_core import nn, stack_layers

_F32 = jnp.float32

# LTX-2's rational resampler: scale → (upsample factor, blur-downsample stride).
RATIONAL_SCALES = {0.75: (3, 4), 1.5: (3, 2), 2.0: (2, 1), 4.0: (4, 1)}

_IGNORED_KEYS = {"_class_name", "_diffusers_version", "_name_or_path", "_use_default_values"}
# The names the original (LTX-Video / ltx-core) single files use in their `config` metadata.
_ORIGINAL_KEYS = {
  "spatial_scale": "rational_spatial_scale",
  "rational_resampler": "use_rational_resampler",
}
_GROUPS = 32  # every GroupNorm of the reference has 32 groups


@dataclasses.dataclass(frozen=True)
class LatentUpsamplerConfig:
  """Settings of an LTX latent upsampler (diffusers' config keys).

  Attributes:
    in_channels: latent channels (128 for the LTX-Video and LTX-2 VAEs).
    mid_channels: width of the conv net (a multiple of 32: its GroupNorms have 32 groups).
    num_blocks_per_stage: residual blocks before and after the upsampling layer.
    dims: 3 (3-d convs over frames, height, width) or 2 (2-d convs applied frame by frame).
    spatial_upsample: double height and width.
    temporal_upsample: double the frames (the first output frame is dropped: `F → 2F - 1`).
    rational_spatial_scale: LTX-2's resampler scale, one of `RATIONAL_SCALES` (0.75, 1.5, 2, 4).
    use_rational_resampler: spatial upsampling by LTX-2's rational resampler (conv + shuffle by `num`, blur
      with stride `den`) instead of a plain ×2 sub-pixel conv. LTX-Video's model never uses it.
  """

  in_channels: int = 128
  mid_channels: int = 512
  num_blocks_per_stage: int = 4
  dims: int = 3
  spatial_upsample: bool = True
  temporal_upsample: bool = False
  rational_spatial_scale: float = 2.0
  use_rational_resampler: bool = False

  def __post_init__(self):
    if self.dims not in (2, 3):
      raise ValueError(f"dims={self.dims} must be 2 or 3")
    if self.mid_channels % _GROUPS:
      raise ValueError(f"mid_channels={self.mid_channels} must be a multiple of {_GROUPS}")
    if not (self.spatial_upsample or self.temporal_upsample):
      raise ValueError("spatial_upsample or temporal_upsample must be True")
    if self.temporal_upsample and self.dims == 2:
      raise ValueError("temporal_upsample needs dims=3 (2-d convs see one frame at a time)")
    if self.kind == "rational" and float(self.rational_spatial_scale) not in RATIONAL_SCALES:
      raise ValueError(
        f"rational_spatial_scale={self.rational_spatial_scale} is not supported; "
        f"expected one of {sorted(RATIONAL_SCALES)}"
      )

  @property
  def kind(self) -> str:
    """The upsampling layer: "spatial", "rational", "temporal" or "spatiotemporal"."""
    if self.spatial_upsample and self.temporal_upsample:
      return "spatiotemporal"
    if self.temporal_upsample:
      return "temporal"
    return "rational" if self.use_rational_resampler else "spatial"

  @property
  def factors(self) -> tuple[int, int, int]:
    """`(frame, height, width)` scaling as integer ratios' numerators (height/width: `num / den`)."""
    if self.kind == "spatiotemporal":
      return (2, 2, 2)
    if self.kind == "temporal":
      return (2, 1, 1)
    return (1, 2, 2)

  @classmethod
  def from_dict(cls, config: Mapping[str, Any], **overrides) -> LatentUpsamplerConfig:
    """From a diffusers `config.json` dict (`LTXLatentUpsamplerModel` or `LTX2LatentUpsamplerModel`), or
    the `config` metadata of an original single file (`spatial_scale`, `rational_resampler`)."""
    config = {_ORIGINAL_KEYS.get(k, k): v for k, v in config.items()}
    name = str(config.get("_class_name", ""))
    fields = {f.name for f in dataclasses.fields(cls)}
    values = {}
    if name.startswith("LTX2"):
      # LTX-2's class defaults (diffusers): width 1024, rational resampler on.
      values.update(mid_channels=1024, use_rational_resampler=True)
    for key, value in config.items():
      if key in fields:
        values[key] = value
      elif key not in _IGNORED_KEYS and not key.startswith("_"):
        raise ValueError(f"unknown latent upsampler config key {key!r}; known: {sorted(fields)}")
    if name == "LTXLatentUpsamplerModel":
      values["use_rational_resampler"] = False  # LTX-Video's class has no rational resampler
    values.update(overrides)
    values["rational_spatial_scale"] = float(values.get("rational_spatial_scale", 2.0))
    return cls(**values)

  @classmethod
  def from_json(cls, path: str | os.PathLike, **overrides) -> LatentUpsamplerConfig:
    return cls.from_dict(md_core.read_json(path), **overrides)


# Real configs (diffusers' conversion scripts) and a tiny one for tests.
VARIANTS: dict[str, LatentUpsamplerConfig] = {
  # Lightricks/ltxv-spatial-upscaler-0.9.7 and -0.9.8 (LTXLatentUpsamplerModel).
  "ltx-video-0.9.7": LatentUpsamplerConfig(),
  "ltx-video-0.9.8": LatentUpsamplerConfig(),
  # Lightricks/LTX-2 latent_upsampler (LTX2LatentUpsamplerModel, rational resampler at scale 2).
  "ltx-2": LatentUpsamplerConfig(mid_channels=1024, use_rational_resampler=True),
  "tiny": LatentUpsamplerConfig(in_channels=8, mid_channels=32, num_blocks_per_stage=1),
}


class Buffer(nnx.Variable):
  """A fixed tensor stored in the checkpoint (the rational resampler's blur kernel), not trained."""


class ResBlock(nnx.Module):
  """conv → GroupNorm → SiLU → conv → GroupNorm → (+ input) → SiLU, channels unchanged."""

  def __init__(self, channels: int, dims: int, *, rngs: nnx.Rngs):
    self.conv1 = nn.Conv(channels, channels, 3, ndim=dims, padding=1, rngs=rngs)
    self.norm1 = nn.GroupNorm(_GROUPS, channels, rngs=rngs)
    self.conv2 = nn.Conv(channels, channels, 3, ndim=dims, padding=1, rngs=rngs)
    self.norm2 = nn.GroupNorm(_GROUPS, channels, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    h = jax.nn.silu(self.norm1(self.conv1(x)))
    h = self.norm2(self.conv2(h))
    return jax.nn.silu(h + x)


def pixel_shuffle(x: jax.Array, factors: tuple[int, ...]) -> jax.Array:
  """Sub-pixel rearrangement over the last `len(factors)` spatial axes of a channels-last array.

  The channel axis holds `(c, p_1, …, p_n)` with `c` slowest (the reference's `PixelShuffleND`):
  `[B, *S, C * prod(p)] → [B, *(S_i * p_i), C]`.
  """
  n = len(factors)
  lead, spatial, c = x.shape[: x.ndim - 1 - n], x.shape[x.ndim - 1 - n : -1], x.shape[-1]
  p = math.prod(factors)
  if c % p:
    raise ValueError(f"channels {c} are not divisible by the shuffle factors {factors}")
  x = x.reshape(*lead, *spatial, c // p, *factors)
  k = len(lead)
  # [*lead, s_1..s_n, c, p_1..p_n] → [*lead, s_1, p_1, …, s_n, p_n, c]
  order = list(range(k))
  for i in range(n):
    order += [k + i, k + n + 1 + i]
  order.append(k + n)
  x = x.transpose(order)
  return x.reshape(*lead, *(s * f for s, f in zip(spatial, factors)), c // p)


def binomial_kernel(size: int = 5) -> jax.Array:
  """The normalised 2-d binomial (Pascal row `size - 1`) kernel of the rational resampler, `[size, size]`."""
  row = jnp.asarray([math.comb(size - 1, i) for i in range(size)], _F32)
  k2 = row[:, None] * row[None, :]
  return k2 / jnp.sum(k2)


def blur_downsample(x: jax.Array, kernel: jax.Array, stride: int) -> jax.Array:
  """Depthwise blur with a `[k, k]` kernel and `stride` over H, W of `[N, H, W, C]` (zero padding k // 2)."""
  if stride == 1:
    return x
  k, c = kernel.shape[-1], x.shape[-1]
  w = jnp.broadcast_to(kernel.reshape(k, k, 1, 1).astype(x.dtype), (k, k, 1, c))
  return jax.lax.conv_general_dilated(
    x,
    w,
    window_strides=(stride, stride),
    padding=((k // 2, k // 2), (k // 2, k // 2)),
    dimension_numbers=("NHWC", "HWIO", "NHWC"),
    feature_group_count=c,
  )


class Upsample(nnx.Module):
  """The upsampling layer: a conv to `factor × mid_channels` channels, then a pixel shuffle (and, for the
  rational resampler, a strided blur)."""

  def __init__(self, cfg: LatentUpsamplerConfig, *, rngs: nnx.Rngs):
    self.kind = cfg.kind
    mid = cfg.mid_channels
    self.num, self.den = 2, 1
    if self.kind == "rational":
      self.num, self.den = RATIONAL_SCALES[float(cfg.rational_spatial_scale)]
      self.blur_kernel = Buffer(binomial_kernel(5).reshape(1, 1, 5, 5))
    out, ndim = {
      "spatial": (4, 2),
      "rational": (self.num**2, 2),
      "temporal": (2, 3),
      "spatiotemporal": (8, 3),
    }[self.kind]
    self.conv = nn.Conv(mid, out * mid, 3, ndim=ndim, padding=1, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    """`[B, F, H, W, C]` → upsampled `[B, F', H', W', C]`."""
    b, f = x.shape[:2]
    if self.kind in ("spatial", "rational"):
      # 2-d conv frame by frame.
      h = self.conv(x.reshape(b * f, *x.shape[2:]))
      h = pixel_shuffle(h, (self.num, self.num))
      if self.kind == "rational":
        h = blur_downsample(h, self.blur_kernel[...][0, 0], self.den)
      return h.reshape(b, f, *h.shape[1:])
    h = self.conv(x)
    h = pixel_shuffle(h, (2, 2, 2)) if self.kind == "spatiotemporal" else _temporal_shuffle(h)
    return h[:, 1:]  # the reference drops the first output frame (causal first latent frame)


def _temporal_shuffle(x: jax.Array) -> jax.Array:
  """`[B, F, H, W, 2C] → [B, 2F, H, W, C]` with the channel axis as `(c, p)` (the reference's 1-d shuffle)."""
  b, f, hh, ww, c2 = x.shape
  x = x.reshape(b, f, hh, ww, c2 // 2, 2).transpose(0, 1, 5, 2, 3, 4)
  return x.reshape(b, 2 * f, hh, ww, c2 // 2)


class LatentUpsampler(nnx.Module):
  """An LTX latent upsampler (LTX-Video's or LTX-2's), channels-last.

  `__call__(latents)` maps unnormalised VAE latents `[B, F, H, W, in_channels]` to `[B, F', H', W',
  in_channels]`: `H' = H * num / den` (×2 for the real models), `F' = 2F - 1` with temporal upsampling.
  """

  def __init__(self, cfg: LatentUpsamplerConfig, *, rngs: nnx.Rngs):
    self.config = cfg
    mid, dims = cfg.mid_channels, cfg.dims
    self.initial_conv = nn.Conv(cfg.in_channels, mid, 3, ndim=dims, padding=1, rngs=rngs)
    self.initial_norm = nn.GroupNorm(_GROUPS, mid, rngs=rngs)
    n = cfg.num_blocks_per_stage
    self.res_blocks = stack_layers(lambda r: ResBlock(mid, dims, rngs=r), n, rngs) if n else None
    self.upsampler = Upsample(cfg, rngs=rngs)
    self.post_upsample_res_blocks = (
      stack_layers(lambda r: ResBlock(mid, dims, rngs=r), n, rngs) if n else None
    )
    self.final_conv = nn.Conv(mid, cfg.in_channels, 3, ndim=dims, padding=1, rngs=rngs)

  @staticmethod
  def _blocks(stack: nnx.Module | None, x: jax.Array) -> jax.Array:
    if stack is None:
      return x

    def body(block, h, _):
      return block(h), None

    return md_core.scan_layers(stack, body, x, hookable=False)[0]

  def __call__(self, latents: jax.Array) -> jax.Array:
    cfg = self.config
    if latents.ndim != 5 or latents.shape[-1] != cfg.in_channels:
      raise ValueError(
        f"latents must be [B, F, H, W, in_channels={cfg.in_channels}], got shape {latents.shape}"
      )
    b, f = latents.shape[:2]
    x = latents
    if cfg.dims == 2:
      x = x.reshape(b * f, *x.shape[2:])  # frames are independent images
    x = jax.nn.silu(self.initial_norm(self.initial_conv(x)))
    x = self._blocks(self.res_blocks, x)
    if cfg.dims == 2:
      x = self.upsampler(x.reshape(b, f, *x.shape[1:]))
      x = x.reshape(b * f, *x.shape[2:])
    else:
      x = self.upsampler(x)
    x = self._blocks(self.post_upsample_res_blocks, x)
    x = self.final_conv(x)
    if cfg.dims == 2:
      x = x.reshape(b, f, *x.shape[1:])
    return x


# ---------------------------------------------------------------------------------------------------------
# The pipelines' upsample step.

_LAYOUTS = ("BFHWC", "BCFHW")


def _channel_stats(like: jax.Array, mean: Any, std: Any, channel_axis: int):
  c = like.shape[channel_axis]
  mean, std = jnp.asarray(mean, like.dtype).reshape(-1), jnp.asarray(std, like.dtype).reshape(-1)
  if mean.shape != (c,) or std.shape != (c,):
    raise ValueError(
      f"latents_mean {mean.shape} and latents_std {std.shape} must have one value per channel ({c})"
    )
  shape = [1] * like.ndim
  shape[channel_axis] = c
  return mean.reshape(shape), std.reshape(shape)


def normalize_latents(
  latents: jax.Array,
  latents_mean: Any,
  latents_std: Any,
  scaling_factor: float = 1.0,
  *,
  channel_axis: int = -1,
) -> jax.Array:
  """`(z - mean) * scaling_factor / std` per channel (the LTX pipelines' normalisation)."""
  mean, std = _channel_stats(latents, latents_mean, latents_std, channel_axis)
  return (latents - mean) * scaling_factor / std


def denormalize_latents(
  latents: jax.Array,
  latents_mean: Any,
  latents_std: Any,
  scaling_factor: float = 1.0,
  *,
  channel_axis: int = -1,
) -> jax.Array:
  """`z * std / scaling_factor + mean` per channel: undoes `normalize_latents`."""
  mean, std = _channel_stats(latents, latents_mean, latents_std, channel_axis)
  return latents * std / scaling_factor + mean


def adain_filter_latent(
  latents: jax.Array, reference_latents: jax.Array, factor: float = 1.0, *, channel_axis: int = -1
) -> jax.Array:
  """Adaptive instance normalisation: gives each (sample, channel) of `latents` the mean and standard
  deviation of the same (sample, channel) of `reference_latents`, then blends `latents + factor * (matched -
  latents)` (`factor` 1: fully matched; the reference allows -10…10).

  Statistics are over every axis except batch (0) and `channel_axis`, with the unbiased (n - 1) standard
  deviation, as `torch.std_mean`. Shapes may differ outside those two axes (the reference is the smaller,
  pre-upsampling latent).
  """
  channel_axis = channel_axis % latents.ndim
  if reference_latents.ndim != latents.ndim or (
    reference_latents.shape[0],
    reference_latents.shape[channel_axis],
  ) != (latents.shape[0], latents.shape[channel_axis]):
    raise ValueError(
      f"reference_latents {reference_latents.shape} must match latents {latents.shape} in batch and "
      f"channels (axis {channel_axis})"
    )
  axes = tuple(a for a in range(latents.ndim) if a not in (0, channel_axis))

  def std_mean(x):
    x = x.astype(_F32)
    n = math.prod(x.shape[a] for a in axes)
    mean = jnp.mean(x, axis=axes, keepdims=True)
    var = jnp.sum(jnp.square(x - mean), axis=axes, keepdims=True) / max(n - 1, 1)
    return jnp.sqrt(var), mean

  r_sd, r_mean = std_mean(reference_latents)
  i_sd, i_mean = std_mean(latents)
  x = latents.astype(_F32)
  matched = (x - i_mean) / i_sd * r_sd + r_mean
  return (x + factor * (matched - x)).astype(latents.dtype)


def tone_map_latents(latents: jax.Array, compression: float) -> jax.Array:
  """Sigmoid tone mapping of latent values (the LTX pipelines'): `z * (1 - 0.8 s sigmoid(4 s (|z| - 1)))`
  with `s = 0.75 * compression`; `compression` 0 is the identity, 1 the strongest compression."""
  s = 0.75 * compression
  return latents * (1.0 - 0.8 * s * jax.nn.sigmoid(4.0 * s * (jnp.abs(latents) - 1.0)))


@functools.partial(
  jax.jit, static_argnames=("graphdef", "denormalize", "normalize", "adain", "tone")
)
def _upsample_step(
  graphdef, state, latents, mean, std, scales, *, denormalize, normalize, adain, tone
):
  # scales: [scaling_factor, adain_factor, tone_map_compression_ratio] (traced: changing them does not
  # recompile); the flags say which steps run, as the reference's `> 0` tests do.
  scaling_factor, adain_factor, compression = scales[0], scales[1], scales[2]
  upsampler = nnx.merge(graphdef, state)
  if denormalize:
    latents = denormalize_latents(latents, mean, std, scaling_factor)
  up = upsampler(latents.astype(upsampler.initial_conv.kernel[...].dtype))
  if adain:
    up = adain_filter_latent(up, latents.astype(up.dtype), adain_factor)
  if tone:
    up = tone_map_latents(up, compression)
  if normalize:
    up = normalize_latents(up, mean, std, scaling_factor)
  return up


def upsample_latents(
  upsampler: LatentUpsampler,
  latents: jax.Array,
  latents_mean: Any = None,
  latents_std: Any = None,
  *,
  scaling_factor: float = 1.0,
  adain_factor: float = 0.0,
  tone_map_compression_ratio: float = 0.0,
  latents_normalized: bool = True,
  normalize_output: bool = True,
  layout: str = "BFHWC",
) -> jax.Array:
  """The upsample step of `LTXLatentUpsamplePipeline` (`output_type="latent"`), as one jitted program.

  Defaults follow LTX-Video: the input latents are normalised (a first pass's output), so they are
  denormalised with the VAE's statistics, upsampled, AdaIN-filtered against the denormalised input when
  `adain_factor > 0`, tone-mapped when `tone_map_compression_ratio > 0`, and normalised again for the second
  denoising pass. For LTX-2 (`LTX2LatentUpsamplePipeline`) see `upsample_latents_ltx2`.

  Args:
    upsampler: the `LatentUpsampler` (`load_latent_upsampler`).
    latents: `[B, F, H, W, C]` (`layout="BFHWC"`) or the reference's `[B, C, F, H, W]` (`layout="BCFHW"`).
    latents_mean: the VAE's per-channel latent mean `[C]` (e.g. md-vae `LTXVideoVAE.latents_mean[...]`);
      needed when `latents_normalized` or `normalize_output`.
    latents_std: the VAE's per-channel latent standard deviation `[C]`.
    scaling_factor: the VAE config's `scaling_factor` (1.0 for every LTX VAE).
    adain_factor: AdaIN blend (0: off; the reference's multi-scale recipe uses 1.0).
    tone_map_compression_ratio: tone-mapping strength in [0, 1] (0: off).
    latents_normalized: the input is normalised (undo it before upsampling).
    normalize_output: normalise the result with the same statistics.
    layout: "BFHWC" (md, channels-last) or "BCFHW" (the reference's); the result has the same layout.

  Returns:
    The upsampled latents, `[B, F', 2H, 2W, C]` for the real models, in `layout`.

  Raises:
    ValueError: a bad layout, latent shape, statistics shape or tone-map ratio.
  """
  if layout not in _LAYOUTS:
    raise ValueError(f"layout={layout!r} must be one of {_LAYOUTS}")
  if not 0.0 <= tone_map_compression_ratio <= 1.0:
    raise ValueError(
      f"tone_map_compression_ratio={tone_map_compression_ratio} must be in the range [0, 1]"
    )
  latents = jnp.asarray(latents)
  if latents.ndim != 5:
    raise ValueError(f"latents must be 5-d [B, F, H, W, C] or [B, C, F, H, W], got {latents.shape}")
  if layout == "BCFHW":
    latents = jnp.moveaxis(latents, 1, -1)
  c = upsampler.config.in_channels
  if latents.shape[-1] != c:
    raise ValueError(
      f"latents {latents.shape} (layout {layout}) have {latents.shape[-1]} channels; the upsampler "
      f"takes {c}"
    )
  needs_stats = latents_normalized or normalize_output
  if needs_stats and (latents_mean is None or latents_std is None):
    raise ValueError(
      "latents_mean and latents_std (the VAE's latent statistics) are needed to "
      + ("denormalise the input" if latents_normalized else "normalise the output")
      + "; pass them, or latents_normalized=False / normalize_output=False"
    )
  if needs_stats:
    mean = jnp.asarray(latents_mean, _F32).reshape(-1)
    std = jnp.asarray(latents_std, _F32).reshape(-1)
    _channel_stats(latents, mean, std, -1)
  else:
    mean = std = jnp.zeros((c,), _F32)
  graphdef, state = nnx.split(upsampler)
  out = _upsample_step(
    graphdef,
    state,
    latents,
    mean,
    std,
    jnp.asarray([scaling_factor, adain_factor, tone_map_compression_ratio], _F32),
    denormalize=bool(latents_normalized),
    normalize=bool(normalize_output),
    adain=adain_factor > 0.0,
    tone=tone_map_compression_ratio > 0.0,
  )
  return jnp.moveaxis(out, -1, 1) if layout == "BCFHW" else out


def unpack_latents(
  latents: jax.Array,
  num_frames: int,
  height: int,
  width: int,
  patch_size: int = 1,
  patch_size_t: int = 1,
) -> jax.Array:
  """LTX-2 token sequences `[B, F*H*W, C*pt*p*p]` → channels-last latents `[B, F*pt, H*p, W*p, C]`
  (`num_frames`, `height`, `width` in latent tokens; the inverse of the pipelines' packing)."""
  b, s, d = latents.shape
  if s != num_frames * height * width or d % (patch_size_t * patch_size**2):
    raise ValueError(
      f"packed latents {latents.shape} do not hold {num_frames}x{height}x{width} tokens of patch "
      f"({patch_size_t}, {patch_size}, {patch_size})"
    )
  p, pt = patch_size, patch_size_t
  x = latents.reshape(b, num_frames, height, width, -1, pt, p, p)
  x = x.transpose(0, 1, 5, 2, 6, 3, 7, 4)
  return x.reshape(b, num_frames * pt, height * p, width * p, x.shape[-1])


def upsample_latents_ltx2(
  upsampler: LatentUpsampler,
  latents: jax.Array,
  latents_mean: Any = None,
  latents_std: Any = None,
  *,
  latents_normalized: bool = False,
  scaling_factor: float = 1.0,
  adain_factor: float = 0.0,
  tone_map_compression_ratio: float = 0.0,
  num_frames: int | None = None,
  height: int | None = None,
  width: int | None = None,
  spatial_patch_size: int = 1,
  temporal_patch_size: int = 1,
  vae_temporal_compression: int = 8,
  vae_spatial_compression: int = 32,
  layout: str = "BFHWC",
) -> jax.Array:
  """The upsample step of `LTX2LatentUpsamplePipeline` (`output_type="latent"`).

  LTX-2's upsampler works on unnormalised latents: the input is denormalised only when
  `latents_normalized` (then `latents_mean`/`latents_std` are needed), and the result is returned
  unnormalised. AdaIN and tone mapping as in `upsample_latents`.

  Args:
    upsampler: the LTX-2 `LatentUpsampler`.
    latents: `[B, F, H, W, C]` / `[B, C, F, H, W]` (per `layout`), or packed tokens `[B, S, D]` with
      `num_frames`, `height`, `width` given in pixels (as the reference takes them); packed input comes
      back channels-last (or `[B, C, F, H, W]` with `layout="BCFHW"`).
    latents_normalized: the input is normalised with the VAE's statistics.
    num_frames, height, width: the video size in pixels, for packed input only.
    spatial_patch_size, temporal_patch_size: the packing's patch sizes (packed input only).
    vae_temporal_compression, vae_spatial_compression: the VAE's compression (8 and 32 for LTX-2).
    Other arguments: as `upsample_latents`.

  Returns:
    The upsampled, unnormalised latents in `layout`.
  """
  latents = jnp.asarray(latents)
  if latents.ndim == 3:
    if None in (num_frames, height, width):
      raise ValueError("packed latents [B, S, D] need num_frames, height and width (in pixels)")
    latents = unpack_latents(
      latents,
      (num_frames - 1) // vae_temporal_compression + 1,
      height // vae_spatial_compression,
      width // vae_spatial_compression,
      spatial_patch_size,
      temporal_patch_size,
    )
    if layout == "BCFHW":
      latents = jnp.moveaxis(latents, -1, 1)
  return upsample_latents(
    upsampler,
    latents,
    latents_mean,
    latents_std,
    scaling_factor=scaling_factor,
    adain_factor=adain_factor,
    tone_map_compression_ratio=tone_map_compression_ratio,
    latents_normalized=latents_normalized,
    normalize_output=False,
    layout=layout,
  )
