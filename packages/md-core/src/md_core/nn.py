"""Neural-network blocks shared by every family, matching the PyTorch reference's numerics.

Layout conventions: activations are channels-last (`[B, ..., C]`), Dense kernels are `(in, out)`, conv kernels
are `(*window, in, out)`. Every parameter carries logical axis names (`logical_axes=`), which md-sharding maps to
mesh axes. Norms compute in float32 and return the input dtype, as the reference does.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from md_core import quant
from md_core._abstract import param_key

Axes = tuple[str | None, ...]
_F32 = jnp.float32


def _param(rngs: nnx.Rngs | None, init, shape, dtype, axes: Axes) -> nnx.Param:
  # Under nnx.eval_shape this only records shapes; the loader replaces every value.
  key = param_key(rngs)
  return nnx.Param(init(key, shape, dtype), logical_axes=tuple(axes))


def _last(v: jax.Array, ndim: int) -> jax.Array:
  """A per-feature vector `[C]` shaped to broadcast against `[..., C]` of rank `ndim` (explicit, as the
  strict rank-promotion mode requires)."""
  return v.reshape((1,) * (ndim - 1) + (v.shape[-1],))


def matmul(x: jax.Array, w: jax.Array) -> jax.Array:
  """`x @ w` in their dtype. On CPU, bfloat16 / float16 operands are multiplied into a float32 result
  that is then rounded once: the same arithmetic (every backend's low-precision matmul accumulates in
  float32), but XLA's CPU backend runs only that form on the matrix units (AMX / AVX512-BF16: about
  1.5 TFLOP/s against 0.17-0.28 for a bfloat16 result on a 2-core Sapphire Rapids, 2026-12-05)."""
  if x.dtype not in (jnp.bfloat16, jnp.float16) or jax.default_backend() != "cpu":
    return jnp.matmul(x, w)
  if w.ndim == 2 and math.prod(x.shape[:-1]) == 1:
    # One row goes to XLA's Eigen dot, which converts both operands to float32 on every call (12 ms
    # for Wan's 1536 x 9216 time projection); a zero second row keeps it on the matrix units (1.8 ms).
    rows = jnp.concatenate([x.reshape(1, -1), jnp.zeros((1, x.shape[-1]), x.dtype)])
    y = jnp.matmul(rows, w, preferred_element_type=_F32)[:1]
    return y.reshape(*x.shape[:-1], w.shape[-1]).astype(x.dtype)
  return jnp.matmul(x, w, preferred_element_type=_F32).astype(x.dtype)


def _torch_uniform(fan_in: int):
  """PyTorch's default Linear/Conv init (uniform ±1/sqrt(fan_in)), so random models look like the reference."""
  bound = 1.0 / math.sqrt(max(fan_in, 1))

  def init(key, shape, dtype):
    return jax.random.uniform(key, shape, dtype, -bound, bound)

  return init


class Dense(nnx.Module):
  """`y = x @ kernel + bias` with kernel `(in_features, out_features)` (torch `nn.Linear`, transposed)."""

  def __init__(
    self,
    in_features: int,
    out_features: int,
    *,
    use_bias: bool = True,
    axes: Axes = ("embed", "mlp"),
    dtype: Any = None,
    param_dtype: Any = _F32,
    rngs: nnx.Rngs | None = None,
  ):
    self.in_features, self.out_features, self.dtype = in_features, out_features, dtype
    init = _torch_uniform(in_features)
    self.kernel = _param(rngs, init, (in_features, out_features), param_dtype, axes)
    self.bias = _param(rngs, init, (out_features,), param_dtype, axes[-1:]) if use_bias else None

  # Run-time LoRA slots (`md_core.add_lora_slots`): None unless added.
  lora_a: nnx.Variable | None = None
  lora_b: nnx.Variable | None = None
  lora_gain: nnx.Variable | None = None  # DoRA at run time: `[out]` on the base output (gain=True)
  # Quantized weights (`md_core.quantize`): the kernel holds int8 / float8 values and these its
  # per-output-channel scales, the mode and the kernel's dtype before; None unless quantized.
  kernel_scale: nnx.Variable | None = None
  quant_mode: str | None = None
  quant_from: str | None = None

  @property
  def weight_dtype(self) -> Any:
    """The kernel's floating dtype (before quantization for a quantized one): what models that compute
    in their weights' dtype read."""
    if self.quant_from is not None:
      return jnp.dtype(self.quant_from)
    return self.kernel[...].dtype

  def __call__(self, x: jax.Array) -> jax.Array:
    dtype = self.dtype or x.dtype
    x = x.astype(dtype)
    if self.kernel_scale is not None:
      y = quant.quantized_matmul(x, self.kernel[...], self.kernel_scale[...], self.quant_mode)
    else:
      y = matmul(x, self.kernel[...].astype(dtype))
    if self.lora_gain is not None:  # DoRA adapters at run time: the base output's per-output factor
      y = y * _last(self.lora_gain[...].astype(dtype), y.ndim)
    if self.bias is not None:
      y = y + _last(self.bias[...].astype(dtype), y.ndim)
    if self.lora_a is not None:
      y = y + jnp.matmul(
        jnp.matmul(x, self.lora_a[...].astype(dtype)), self.lora_b[...].astype(dtype)
      )
    return y


def _pairs(value, n: int, name: str) -> tuple:
  if isinstance(value, int):
    return (value,) * n
  value = tuple(value)
  if len(value) != n:
    raise ValueError(f"{name}={value} must have {n} entries for a {n}-d convolution")
  return value


def _fold_time(padding: Any, dilation: Sequence[int]) -> bool:
  """Whether a 3-d convolution runs as one 2-d convolution (`_conv3d_folded`): on the CPU backend, where
  XLA's 3-d convolution is several times slower than its 2-d one (fwd + bwd of a 16-channel 3x3x3 conv on
  8x7x32x32: 182 ms against 36 ms on one core), for explicit padding and no dilation."""
  return (
    not isinstance(padding, str) and tuple(dilation) == (1, 1, 1) and jax.default_backend() == "cpu"
  )


def _conv3d_folded(
  x: jax.Array,
  kernel: jax.Array,
  stride: Sequence[int],
  padding: Sequence[tuple[int, int]],
) -> jax.Array:
  """The 3-d convolution `[B, T, H, W, C] * [kt, kh, kw, C, O]` as a 2-d one: the `kt` time taps of each
  output frame are stacked along channels (`[B * T', H, W, kt * C]`) and meet the kernel reshaped to
  `[kh, kw, kt * C, O]`. The same products, summed in another order (float32: ~1e-6 apart)."""
  kt, kh, kw, c, o = kernel.shape
  st = stride[0]
  lo, hi = padding[0]
  if lo or hi:
    x = jnp.pad(x, ((0, 0), (lo, hi), (0, 0), (0, 0), (0, 0)))
  b, t = x.shape[:2]
  frames = (t - kt) // st + 1
  if frames < 1:
    raise ValueError(f"Conv3d: {t} frames (padded) are fewer than the kernel's {kt}")
  last = st * (frames - 1) + 1
  taps = [x[:, d : d + last : st] for d in range(kt)]
  h = taps[0] if kt == 1 else jnp.concatenate(taps, axis=-1)
  h = h.reshape(b * frames, *h.shape[2:])
  k2 = jnp.transpose(kernel, (1, 2, 0, 3, 4)).reshape(kh, kw, kt * c, o)
  y = jax.lax.conv_general_dilated(
    h,
    k2,
    window_strides=tuple(stride[1:]),
    padding=tuple(padding[1:]),
    dimension_numbers=("NHWC", "HWIO", "NHWC"),
  )
  return y.reshape(b, frames, *y.shape[1:])


class Conv(nnx.Module):
  """An N-d convolution over channels-last inputs `[B, *spatial, C]` (torch `nn.Conv1d/2d/3d`).

  `padding` is an int or per-dimension ints (symmetric, as torch), per-dimension `(low, high)` pairs, or
  "SAME"/"VALID".
  """

  def __init__(
    self,
    in_channels: int,
    out_channels: int,
    kernel_size: int | Sequence[int],
    *,
    ndim: int | None = None,
    stride: int | Sequence[int] = 1,
    padding: int | str | Sequence[int] | Sequence[tuple[int, int]] = 0,
    dilation: int | Sequence[int] = 1,
    groups: int = 1,
    use_bias: bool = True,
    axes: Axes = ("conv_in", "conv_out"),
    dtype: Any = None,
    param_dtype: Any = _F32,
    rngs: nnx.Rngs | None = None,
  ):
    if ndim is None:
      if isinstance(kernel_size, int):
        raise ValueError("Conv needs `ndim` when kernel_size is an int")
      ndim = len(kernel_size)
    if in_channels % groups or out_channels % groups:
      raise ValueError(
        f"groups={groups} must divide in_channels={in_channels} and out_channels={out_channels}"
      )
    self.kernel_size = _pairs(kernel_size, ndim, "kernel_size")
    self.stride = _pairs(stride, ndim, "stride")
    self.dilation = _pairs(dilation, ndim, "dilation")
    if isinstance(padding, str):
      self.padding = padding.upper()
    elif isinstance(padding, int):
      self.padding = tuple((padding, padding) for _ in range(ndim))
    else:
      padding = tuple(padding)
      if len(padding) != ndim:
        raise ValueError(f"padding={padding} must have {ndim} entries")
      self.padding = tuple((p, p) if isinstance(p, int) else tuple(p) for p in padding)
    self.groups, self.dtype = groups, dtype
    fan_in = in_channels // groups * math.prod(self.kernel_size)
    init = _torch_uniform(fan_in)
    window_axes = (None,) * ndim
    shape = (*self.kernel_size, in_channels // groups, out_channels)
    self.kernel = _param(rngs, init, shape, param_dtype, window_axes + tuple(axes))
    self.bias = (
      _param(rngs, init, (out_channels,), param_dtype, tuple(axes)[-1:]) if use_bias else None
    )

  # Run-time LoRA slots (`md_core.add_lora_slots`): `lora_a` `[*k, in, R]`, `lora_b` `[R, out]`.
  lora_a: nnx.Variable | None = None
  lora_b: nnx.Variable | None = None
  lora_gain: nnx.Variable | None = None  # DoRA at run time: `[out]` on the base output (gain=True)

  # Quantized weights (`md_core.quantize`; weight-only in every mode): the kernel holds int8 / float8
  # values, `kernel_scale` `[out]` their per-output-channel scales; None unless quantized.
  kernel_scale: nnx.Variable | None = None
  quant_mode: str | None = None
  quant_from: str | None = None

  @property
  def weight_dtype(self) -> Any:
    """The kernel's floating dtype (before quantization for a quantized one)."""
    if self.quant_from is not None:
      return jnp.dtype(self.quant_from)
    return self.kernel[...].dtype

  def _conv(self, x: jax.Array, kernel: jax.Array, groups: int) -> jax.Array:
    ndim = len(self.kernel_size)
    if ndim == 3 and groups == 1 and _fold_time(self.padding, self.dilation):
      return _conv3d_folded(x, kernel, self.stride, self.padding)
    spatial = "DHW"[-ndim:] if ndim <= 3 else None
    dn = (f"N{spatial}C", f"{spatial}IO", f"N{spatial}C")
    return jax.lax.conv_general_dilated(
      x,
      kernel,
      window_strides=self.stride,
      padding=self.padding,
      rhs_dilation=self.dilation,
      dimension_numbers=dn,
      feature_group_count=groups,
    )

  def __call__(self, x: jax.Array) -> jax.Array:
    ndim = len(self.kernel_size)
    if x.ndim != ndim + 2:
      raise ValueError(
        f"Conv{ndim}d expects [B, {ndim} spatial dims, C] input, got shape {x.shape}"
      )
    dtype = self.dtype or x.dtype
    x = x.astype(dtype)
    kernel = self.kernel[...].astype(dtype)
    if self.kernel_scale is not None:
      # Dequantized per output channel as the kernel is converted (one fused elementwise op on the
      # int8 / float8 kernel; the convolution itself runs in the compute dtype).
      kernel = kernel * _last(self.kernel_scale[...].astype(dtype), kernel.ndim)
    y = self._conv(x, kernel, self.groups)
    if self.lora_gain is not None:  # DoRA adapters at run time: the base output's per-output factor
      y = y * _last(self.lora_gain[...].astype(dtype), y.ndim)
    if self.bias is not None:
      y = y + _last(self.bias[...].astype(dtype), y.ndim)
    if self.lora_a is not None:
      # PEFT's conv LoRA: lora_A is a conv like the base one, lora_B a 1x1 conv (a matmul here).
      h = self._conv(x, self.lora_a[...].astype(dtype), 1)
      y = y + jnp.matmul(h, self.lora_b[...].astype(dtype))
    return y


class Embed(nnx.Module):
  """A lookup table `[num_embeddings, features]` (torch `nn.Embedding`)."""

  def __init__(
    self,
    num_embeddings: int,
    features: int,
    *,
    axes: Axes = ("vocab", "embed"),
    param_dtype: Any = _F32,
    rngs: nnx.Rngs | None = None,
  ):
    init = jax.nn.initializers.normal(1.0)
    self.embedding = _param(rngs, init, (num_embeddings, features), param_dtype, axes)

  def __call__(self, ids: jax.Array) -> jax.Array:
    return jnp.take(self.embedding[...], ids, axis=0)


class GroupNorm(nnx.Module):
  """Group normalisation over channels-last inputs `[B, ..., C]`, computed in float32 (torch `nn.GroupNorm`)."""

  def __init__(
    self,
    num_groups: int,
    num_channels: int,
    *,
    eps: float = 1e-5,
    affine: bool = True,
    param_dtype: Any = _F32,
    rngs: nnx.Rngs | None = None,
  ):
    if num_channels % num_groups:
      raise ValueError(f"num_groups={num_groups} must divide num_channels={num_channels}")
    self.num_groups, self.eps = num_groups, eps
    self.scale = (
      _param(rngs, jax.nn.initializers.ones, (num_channels,), param_dtype, ("norm",))
      if affine
      else None
    )
    self.bias = (
      _param(rngs, jax.nn.initializers.zeros, (num_channels,), param_dtype, ("norm",))
      if affine
      else None
    )

  def __call__(self, x: jax.Array) -> jax.Array:
    b, c = x.shape[0], x.shape[-1]
    h = x.astype(_F32).reshape(b, -1, self.num_groups, c // self.num_groups)
    mean = jnp.mean(h, axis=(1, 3), keepdims=True)
    var = jnp.mean(jnp.square(h - mean), axis=(1, 3), keepdims=True)
    h = ((h - mean) * jax.lax.rsqrt(var + self.eps)).reshape(x.shape)
    if self.scale is not None:
      h = h * _last(self.scale[...].astype(_F32), h.ndim) + _last(
        self.bias[...].astype(_F32), h.ndim
      )
    return h.astype(x.dtype)


class LayerNorm(nnx.Module):
  """Layer normalisation over the last axis, computed in float32 (torch `nn.LayerNorm`)."""

  def __init__(
    self,
    dim: int,
    *,
    eps: float = 1e-5,
    elementwise_affine: bool = True,
    use_bias: bool = True,
    param_dtype: Any = _F32,
    rngs: nnx.Rngs | None = None,
  ):
    self.eps = eps
    ones, zeros = jax.nn.initializers.ones, jax.nn.initializers.zeros
    self.scale = _param(rngs, ones, (dim,), param_dtype, ("norm",)) if elementwise_affine else None
    has_bias = elementwise_affine and use_bias
    self.bias = _param(rngs, zeros, (dim,), param_dtype, ("norm",)) if has_bias else None

  def __call__(self, x: jax.Array) -> jax.Array:
    h = x.astype(_F32)
    mean = jnp.mean(h, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(h - mean), axis=-1, keepdims=True)
    h = (h - mean) * jax.lax.rsqrt(var + self.eps)
    if self.scale is not None:
      h = h * _last(self.scale[...].astype(_F32), h.ndim)
    if self.bias is not None:
      h = h + _last(self.bias[...].astype(_F32), h.ndim)
    return h.astype(x.dtype)


class RMSNorm(nnx.Module):
  """Root-mean-square normalisation over the last axis in float32.

  `scale_offset=1.0` gives the `(1 + w)` form some models (Gemma) use.
  """

  def __init__(
    self,
    dim: int,
    *,
    eps: float = 1e-6,
    elementwise_affine: bool = True,
    scale_offset: float = 0.0,
    param_dtype: Any = _F32,
    rngs: nnx.Rngs | None = None,
  ):
    self.eps, self.scale_offset = eps, scale_offset
    init = jax.nn.initializers.zeros if scale_offset else jax.nn.initializers.ones
    self.scale = _param(rngs, init, (dim,), param_dtype, ("norm",)) if elementwise_affine else None

  def __call__(self, x: jax.Array) -> jax.Array:
    h = x.astype(_F32)
    h = h * jax.lax.rsqrt(jnp.mean(jnp.square(h), axis=-1, keepdims=True) + self.eps)
    if self.scale is not None:
      h = h * _last(self.scale[...].astype(_F32) + self.scale_offset, h.ndim)
    return h.astype(x.dtype)


def gelu(x: jax.Array, approximate: bool = False) -> jax.Array:
  """GELU: exact (erf) by default as torch's, or the tanh approximation (`approximate="tanh"` in torch)."""
  return jax.nn.gelu(x, approximate=approximate)


_ACTIVATIONS = {
  "silu": jax.nn.silu,
  "gelu": lambda x: gelu(x, False),
  "gelu-approximate": lambda x: gelu(x, True),
  "gelu_tanh": lambda x: gelu(x, True),
  "relu": jax.nn.relu,
  "mish": lambda x: x * jnp.tanh(jax.nn.softplus(x)),
}


def activation(name: str):
  """An activation function by the reference's name (silu, gelu, gelu-approximate, relu, mish)."""
  try:
    return _ACTIVATIONS[name]
  except KeyError:
    raise ValueError(
      f"unknown activation {name!r}; expected one of {sorted(_ACTIVATIONS)}"
    ) from None


def timestep_embedding(
  timesteps: jax.Array,
  dim: int,
  *,
  flip_sin_to_cos: bool = False,
  downscale_freq_shift: float = 1.0,
  scale: float = 1.0,
  max_period: float = 10000.0,
) -> jax.Array:
  """Sinusoidal embeddings of (possibly fractional) timesteps `[N]` → `[N, dim]` in float32.

  Frequencies are `exp(-log(max_period) * i / (dim/2 - downscale_freq_shift))`; the output is `[sin, cos]`
  (`[cos, sin]` with `flip_sin_to_cos`), zero-padded by one column when `dim` is odd.
  """
  if timesteps.ndim != 1:
    raise ValueError(f"timesteps must be 1-d [N], got shape {timesteps.shape}")
  half = dim // 2
  exponent = -math.log(max_period) * jnp.arange(half, dtype=_F32) / (half - downscale_freq_shift)
  args = timesteps.astype(_F32)[:, None] * jnp.exp(exponent)[None, :]
  args = scale * args
  emb = jnp.concatenate([jnp.sin(args), jnp.cos(args)], axis=-1)
  if flip_sin_to_cos:
    emb = jnp.concatenate([emb[:, half:], emb[:, :half]], axis=-1)
  if dim % 2:
    emb = jnp.pad(emb, ((0, 0), (0, 1)))
  return emb


class TimestepEmbedding(nnx.Module):
  """The MLP over sinusoidal timestep features: `linear_2(act(linear_1(x)))`."""

  def __init__(
    self,
    in_channels: int,
    time_embed_dim: int,
    *,
    out_dim: int | None = None,
    act: str = "silu",
    dtype: Any = None,
    param_dtype: Any = _F32,
    rngs: nnx.Rngs | None = None,
  ):
    self.act = activation(act)
    kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    self.linear_1 = Dense(in_channels, time_embed_dim, axes=(None, "mlp"), **kw)
    self.linear_2 = Dense(time_embed_dim, out_dim or time_embed_dim, axes=("mlp", "embed"), **kw)

  def __call__(self, x: jax.Array) -> jax.Array:
    return self.linear_2(self.act(self.linear_1(x)))


# "geglu-approximate" is, as in the reference, not gated: the sigmoid approximation x·σ(1.702x).
FEED_FORWARD_ACTIVATIONS = (
  "gelu",
  "gelu-approximate",
  "geglu",
  "geglu-approximate",
  "swiglu",
  "linear-silu",
)


class FeedForward(nnx.Module):
  """`proj_out(act(proj_in(x)))`, with gated variants (GEGLU, SwiGLU) where `proj_in` gives value and gate.

  For gated activations `proj_in` produces `2 * inner_dim` features, the first half the value and the second
  half the gate (the order of the reference's fused projection).
  """

  def __init__(
    self,
    dim: int,
    *,
    dim_out: int | None = None,
    mult: float = 4,
    inner_dim: int | None = None,
    activation: str = "geglu",
    use_bias: bool = True,
    dtype: Any = None,
    param_dtype: Any = _F32,
    rngs: nnx.Rngs | None = None,
  ):
    if activation not in FEED_FORWARD_ACTIVATIONS:
      raise ValueError(
        f"unknown feed-forward activation {activation!r}; expected one of {FEED_FORWARD_ACTIVATIONS}"
      )
    inner = inner_dim or int(dim * mult)
    self.activation = activation
    self.gated = activation in ("geglu", "swiglu")
    kw = dict(use_bias=use_bias, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    self.proj_in = Dense(dim, inner * (2 if self.gated else 1), axes=("embed", "mlp"), **kw)
    self.proj_out = Dense(inner, dim_out or dim, axes=("mlp", "embed"), **kw)

  def __call__(self, x: jax.Array) -> jax.Array:
    h = self.proj_in(x)
    a = self.activation
    if self.gated:
      value, gate = jnp.split(h, 2, axis=-1)
      h = value * (jax.nn.silu(gate) if a == "swiglu" else gelu(gate))
    elif a == "geglu-approximate":
      h = h * jax.nn.sigmoid(1.702 * h)
    elif a == "linear-silu":
      h = jax.nn.silu(h)
    else:
      h = gelu(h, approximate=a == "gelu-approximate")
    return self.proj_out(h)


def rope_1d(
  dim: int,
  positions: jax.Array,
  *,
  theta: float = 10000.0,
  linear_factor: float = 1.0,
  ntk_factor: float = 1.0,
) -> tuple[jax.Array, jax.Array]:
  """Rotary tables for one axis: `(cos, sin)`, each `[..., S, dim]` with every frequency repeated twice
  (pairs of adjacent features rotate together). Computed in float64 when x64 is on, else float32."""
  if dim % 2:
    raise ValueError(f"rotary dim must be even, got {dim}")
  theta = theta * ntk_factor
  ftype = jnp.float64 if jax.config.jax_enable_x64 else _F32
  freqs = 1.0 / (theta ** (jnp.arange(0, dim, 2, dtype=ftype) / dim)) / linear_factor
  pos = positions.astype(ftype)[..., None]
  angles = pos * freqs.reshape((1,) * (pos.ndim - 1) + (-1,))
  cos = jnp.repeat(jnp.cos(angles), 2, axis=-1).astype(_F32)
  sin = jnp.repeat(jnp.sin(angles), 2, axis=-1).astype(_F32)
  return cos, sin


def rope_nd(
  ids: jax.Array, axes_dims: Sequence[int], *, theta: float = 10000.0
) -> tuple[jax.Array, jax.Array]:
  """Rotary tables for N position axes: `ids [..., S, N]` → `(cos, sin)` `[..., S, sum(axes_dims)]`, each axis
  contributing `axes_dims[i]` features (as Flux's 3-axis and Flux.2's 4-axis ids)."""
  if ids.shape[-1] != len(axes_dims):
    raise ValueError(
      f"ids have {ids.shape[-1]} position axes but axes_dims={tuple(axes_dims)} has {len(axes_dims)}"
    )
  tables = [rope_1d(d, ids[..., i], theta=theta) for i, d in enumerate(axes_dims)]
  return jnp.concatenate([c for c, _ in tables], -1), jnp.concatenate([s for _, s in tables], -1)


def apply_rope(
  x: jax.Array, cos: jax.Array, sin: jax.Array, *, interleaved: bool = True
) -> jax.Array:
  """Rotates `x [B, S, H, D]` by `(cos, sin)` `[S, D]` or `[B, S, D]`, in float32, returning x's dtype.

  `interleaved=True`: features `(2i, 2i+1)` form a pair (tables from `rope_1d`); False: feature `i` pairs with
  `i + D/2` (tables must then hold each frequency in both halves).
  """
  if cos.shape[-1] != x.shape[-1]:
    raise ValueError(f"rotary tables have {cos.shape[-1]} features, x has head dim {x.shape[-1]}")
  cos = cos.reshape(cos.shape[:-1] + (1, cos.shape[-1]))  # add the heads axis
  sin = sin.reshape(sin.shape[:-1] + (1, sin.shape[-1]))
  if cos.ndim == 3:
    cos, sin = cos[None], sin[None]
  h = x.astype(_F32)
  if interleaved:
    pairs = h.reshape(h.shape[:-1] + (-1, 2))
    rotated = jnp.stack([-pairs[..., 1], pairs[..., 0]], axis=-1).reshape(h.shape)
  else:
    first, second = jnp.split(h, 2, axis=-1)
    rotated = jnp.concatenate([-second, first], axis=-1)
  return (h * cos + rotated * sin).astype(x.dtype)
