"""Quantized weights for `md_core.nn.Dense` and `md_core.nn.Conv`: int8 weight-only, int8 dynamic (weights and activations) and
fp8 (e4m3) weight-only.

`quantize(model, mode)` replaces the kernel of each chosen Dense (and Conv) layer, in place, by its quantized values
(int8 or float8_e4m3fn, same shape and logical axes, so the same sharding) and adds a `kernel_scale`
variable `[..., out]` (float32, one scale per output channel and layer of a scanned stack, sharded like the
kernel's output axis). The scales are symmetric absmax ones: `scale = max|W[:, j]| / qmax` with qmax 127
(int8) or 448 (the largest float8_e4m3fn). A quantized Dense computes

  weight-only ("int8", "fp8"):  y = (x @ q.astype(x.dtype)) * scale + b
  "int8-dynamic":               y = (q(x) @ q) * scale(x) * scale + b, the product in int32,

where `q(x)` quantizes each row (token) of the activations to int8 with its own absmax scale, computed at
run time. The float kernel is gone (no dequantized copy is kept); XLA fuses the conversion into the matmul.
Biases, norms, LoRA slots (`md_core.add_lora_slots`) and every other parameter keep their dtypes.

Why not qwix's model-level PTQ (`qwix.quantize_model` with a `PtqProvider`): it finds weights by the
identity of the module's `nnx.Param` arrays while the model runs on sample inputs, so it cannot see the
per-layer slices of md's scanned stacks (`md_core.scan_layers` runs the blocks from sliced state) nor
kernels behind `jnp.matmul`, and it needs real-size sample inputs for each family. The numerics here are
qwix's default scheme (symmetric, per-channel absmax over the contracting axis).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

MODES = ("int8", "int8-dynamic", "fp8")
_F32 = jnp.float32
_QMAX = {"int8": 127.0, "int8-dynamic": 127.0, "fp8": 448.0}


class QuantScale(nnx.Variable):
  """Per-output-channel scales of a quantized kernel (a state filter type; never in a checkpoint)."""


def check_mode(mode: Any, name: str = "quantization") -> str | None:
  """`mode` if it is one of `MODES` (or None: no quantization).

  Raises:
    ValueError: any other value, naming the setting `name` and the modes.
  """
  if mode is None or mode in MODES:
    return mode
  raise ValueError(f"{name}={mode!r} is not a quantization mode; expected one of {MODES} or None")


def storage_dtype(mode: str) -> jnp.dtype:
  """The dtype quantized kernels are stored in: int8, or float8_e4m3fn for "fp8"."""
  return jnp.dtype(jnp.float8_e4m3fn if check_mode(mode) == "fp8" else jnp.int8)


def quantize_kernel(
  kernel: jax.Array, mode: str, reduce: tuple[int, ...] = (-2,)
) -> tuple[jax.Array, jax.Array]:
  """Quantizes a kernel per output channel: a Dense kernel `[..., in, out]` over `in` (`reduce=(-2,)`),
  a convolution's `[*window, in, out]` over the window and `in` (`reduce=(0, ..., -2)`).

  Returns:
    `(values` shaped like the kernel in `storage_dtype(mode)`, `scales` float32, the kernel's shape
    without the `reduce` axes)`; `values * scales` (broadcast over them) approximates the kernel.
  """
  qmax = _QMAX[check_mode(mode)]
  w = kernel.astype(_F32)
  amax = jnp.max(jnp.abs(w), axis=reduce)
  scale = jnp.where(amax > 0, amax / qmax, 1.0)
  q = jnp.clip(w / jnp.expand_dims(scale, reduce), -qmax, qmax)
  if mode == "fp8":
    return q.astype(jnp.float8_e4m3fn), scale
  return jnp.round(q).astype(jnp.int8), scale


def dequantize_kernel(values: jax.Array, scale: jax.Array) -> jax.Array:
  """The float32 kernel `values * scale` (for checks; quantized layers never build it)."""
  # Scales `[out]`: every axis but the last was reduced; `[layers, out]`: a stacked Dense's `in` axis.
  reduce = tuple(range(values.ndim - 1)) if scale.ndim == 1 else (-2,)
  return values.astype(_F32) * jnp.expand_dims(scale.astype(_F32), reduce)


def quantized_matmul(x: jax.Array, values: jax.Array, scale: jax.Array, mode: str) -> jax.Array:
  """`x [..., in] @ kernel [in, out]` for a quantized kernel, in x's dtype (see the module docstring)."""
  lead = (1,) * (x.ndim - 1)
  if mode == "int8-dynamic":
    h = x.astype(_F32)
    x_scale = jnp.max(jnp.abs(h), axis=-1, keepdims=True) / 127.0  # [..., 1]
    x_scale = jnp.where(x_scale > 0, x_scale, 1.0)
    xq = jnp.clip(jnp.round(h / x_scale), -127, 127).astype(jnp.int8)
    acc = jax.lax.dot_general(
      xq, values, (((x.ndim - 1,), (0,)), ((), ())), preferred_element_type=jnp.int32
    )
    y = acc.astype(_F32) * x_scale * scale.astype(_F32).reshape(lead + scale.shape)
    return y.astype(x.dtype)
  y = jnp.matmul(x, values.astype(x.dtype))
  return y * scale.astype(x.dtype).reshape(lead + scale.shape)


def _kept(items: tuple, reduce: tuple[int, ...]) -> tuple:
  drop = {r % len(items) for r in reduce}
  return tuple(x for i, x in enumerate(items) if i not in drop)


def _quantize_placed(
  kernel: jax.Array, mode: str, reduce: tuple[int, ...]
) -> tuple[jax.Array, jax.Array]:
  """`quantize_kernel` with the values placed like the kernel and the scales like its kept axes (the
  output axis, and a stack's `layers` axis)."""
  if isinstance(kernel, jax.ShapeDtypeStruct):  # an abstract model (nnx.eval_shape): shapes only
    return jax.eval_shape(functools.partial(quantize_kernel, mode=mode, reduce=reduce), kernel)
  if isinstance(kernel, jax.core.Tracer):  # traced: no placement
    return quantize_kernel(kernel, mode, reduce)
  # One compiled program per kernel shape and mode (layers of the same shape share it).
  values, scale = _quantize_jit(kernel, mode=mode, reduce=reduce)
  sharding = kernel.sharding
  if isinstance(sharding, jax.sharding.NamedSharding):
    spec = tuple(sharding.spec) + (None,) * (kernel.ndim - len(sharding.spec))
    scale_sharding = jax.sharding.NamedSharding(
      sharding.mesh, jax.sharding.PartitionSpec(*_kept(spec, reduce))
    )
    return jax.device_put(values, sharding), jax.device_put(scale, scale_sharding)
  return jax.device_put(values, sharding), jax.device_put(scale, sharding)


_quantize_jit = jax.jit(quantize_kernel, static_argnames=("mode", "reduce"))


def quantizable_layers(model: nnx.Module) -> dict[str, nnx.Module]:
  """Every `md_core.nn.Dense` and `md_core.nn.Conv` of `model` by its dotted path."""
  from md_core._lora import _path_str  # noqa: PLC0415 - nn imports this module
  from md_core.nn import Conv, Dense  # noqa: PLC0415

  return {_path_str(p): node for p, node in nnx.iter_graph(model) if isinstance(node, Dense | Conv)}


def _reduce_axes(layer: nnx.Module, ndim: int) -> tuple[int, ...]:
  kernel_size = getattr(layer, "kernel_size", None)
  if kernel_size is None:  # Dense
    return (-2,)
  return tuple(range(ndim - len(kernel_size) - 2, ndim - 1))  # a conv's window and input axes


def quantize(
  model: nnx.Module,
  mode: str,
  *,
  targets: Callable[[str], bool] | Iterable[str] | None = None,
) -> list[str]:
  """Quantizes the Dense and Conv layers of `model` that `targets` selects, in place.

  Convolutions are quantized weight-only in every mode ("int8-dynamic" gives them int8 weights and
  float activations).

  Args:
    model: any md module (loaded, on a mesh or not, or abstract under `nnx.eval_shape`).
    mode: "int8" (weight-only), "int8-dynamic" (weights and per-token activations) or "fp8" (e4m3,
      weight-only).
    targets: a predicate on the dotted layer path, or a collection of paths / path suffixes; None: every
      Dense and Conv layer.

  Returns:
    The paths quantized, sorted (layers already quantized are left as they are).

  Raises:
    ValueError: an unknown mode, or targets that select no layer.
  """
  if check_mode(mode, "mode") is None:
    raise ValueError(f"quantize: mode must be one of {MODES}, got None")
  layers = quantizable_layers(model)
  if targets is None:
    chosen = sorted(layers)
  elif callable(targets):
    chosen = sorted(p for p in layers if targets(p))
  else:
    names = tuple(targets)
    chosen = sorted(p for p in layers if any(p == n or p.endswith("." + n) for n in names))
  if not chosen:
    sample = ", ".join(sorted(layers)[:6])
    raise ValueError(
      f"quantize: targets {targets!r} match no Dense or Conv layer; some are: {sample}"
    )
  done = []
  for path in chosen:
    layer = layers[path]
    if layer.kernel_scale is not None:
      continue
    kernel = layer.kernel
    value = kernel.get_value()
    reduce = _reduce_axes(layer, value.ndim)
    axes = getattr(kernel, "logical_axes", None) or (None,) * value.ndim
    values, scale = _quantize_placed(value, mode, reduce)
    kernel.set_value(values)
    layer.kernel_scale = QuantScale(scale, logical_axes=_kept(tuple(axes), reduce))
    layer.quant_mode, layer.quant_from = mode, jnp.dtype(value.dtype).name
    done.append(path)
  return done


def quantized_paths(model: nnx.Module) -> dict[str, str]:
  """`{layer path: mode}` of the quantized Dense and Conv layers of `model`."""
  return {
    p: d.quant_mode for p, d in quantizable_layers(model).items() if d.kernel_scale is not None
  }


def weight_bytes(state_or_model: Any) -> int:
  """Bytes of every array of a module or state (abstract ones too): what its weights take on device."""
  state = state_or_model if isinstance(state_or_model, nnx.State) else nnx.state(state_or_model)
  return sum(int(x.size) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(state))
