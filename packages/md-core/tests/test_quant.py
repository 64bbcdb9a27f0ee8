"""md_core.quantize: stored values and scales, the quantized matmuls against closed forms, scanned stacks,
LoRA slots beside int8 kernels, and FSDP placement on 8 devices."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

import md_core
import md_sharding as mds
from md_core import nn, quant


class Block(nnx.Module):
  def __init__(self, rngs):
    self.up = nn.Dense(16, 32, axes=("embed", "mlp"), rngs=rngs)
    self.down = nn.Dense(32, 16, axes=("mlp", "embed"), rngs=rngs)

  def __call__(self, x):
    return x + self.down(jax.nn.silu(self.up(x)))


class Toy(nnx.Module):
  """A Dense in front of a scanned stack of 3 blocks, as md's transformers are built."""

  def __init__(self, rngs):
    self.proj_in = nn.Dense(8, 16, axes=(None, "embed"), rngs=rngs)
    self.blocks = md_core.stack_layers(Block, 3, rngs)

  def __call__(self, x):
    h = self.proj_in(x)
    h, _ = md_core.scan_layers(self.blocks, lambda b, c, _: (b(c), None), h)
    return h


def _x(shape=(2, 5, 8), seed=1):
  return jax.random.normal(jax.random.key(seed), shape)


@jax.jit
def _run(graphdef, state, x):
  return nnx.merge(graphdef, state)(x)


def run(model, x):
  return _run(*nnx.split(model), x)


def test_kernel_values_and_scales():
  w = jax.random.normal(jax.random.key(0), (3, 40, 24)) * jnp.linspace(0.1, 4.0, 24)[None, None]
  w = w.at[1, :, 5].set(0.0)  # an all-zero channel gets scale 1 and zero values
  q, s = quant.quantize_kernel(w, "int8")
  assert q.dtype == jnp.int8 and s.shape == (3, 24) and s.dtype == jnp.float32
  np.testing.assert_allclose(s, np.where(s == 1.0, 1.0, np.abs(w).max(axis=1) / 127), rtol=1e-6)
  assert int(jnp.abs(q).max()) == 127 and float(s[1, 5]) == 1.0 and not np.any(q[1, :, 5])
  err = np.abs(np.asarray(quant.dequantize_kernel(q, s)) - np.asarray(w))
  assert np.all(err <= np.asarray(s)[:, None, :] / 2 + 1e-7)  # round to nearest: half a step
  f, fs = quant.quantize_kernel(w, "fp8")
  assert f.dtype == jnp.float8_e4m3fn
  np.testing.assert_allclose(np.abs(np.asarray(f, np.float32)).max(axis=1).ravel()[:5], 448.0)
  err = np.abs(np.asarray(quant.dequantize_kernel(f, fs)) - np.asarray(w))
  # e4m3 keeps 3 mantissa bits: relative error <= 2^-4, and subnormal steps are 2^-9 of the scale.
  assert np.all(
    err <= np.maximum(np.abs(np.asarray(w)) * 2**-4, np.asarray(fs)[:, None, :] * 2**-9)
  )


@pytest.mark.parametrize("mode", ["int8", "fp8"])
def test_weight_only_matmul_is_x_times_dequantized(mode):
  dense = nn.Dense(8, 6, rngs=nnx.Rngs(0))
  w = np.asarray(dense.kernel[...])
  assert md_core.quantize(dense, mode) == [""]
  deq = np.asarray(quant.dequantize_kernel(dense.kernel[...], dense.kernel_scale[...]))
  assert 0 < np.abs(deq - w).max() < 0.05 * np.abs(w).max()
  x = np.asarray(_x((4, 8)))
  want = x @ deq + np.asarray(dense.bias[...])
  np.testing.assert_allclose(dense(jnp.asarray(x)), want, atol=1e-5, rtol=1e-5)


def test_dynamic_matmul_follows_the_rule():
  dense = nn.Dense(8, 6, use_bias=False, rngs=nnx.Rngs(0))
  md_core.quantize(dense, "int8-dynamic")
  q, s = np.asarray(dense.kernel[...], np.int64), np.asarray(dense.kernel_scale[...], np.float64)
  x = np.asarray(_x((4, 8)), np.float64)
  x_scale = np.abs(x).max(axis=-1, keepdims=True) / 127.0
  xq = np.clip(np.round(x / x_scale), -127, 127).astype(np.int64)
  want = (xq @ q) * x_scale * s[None, :]  # integer product, then both scales
  np.testing.assert_allclose(dense(jnp.asarray(x, jnp.float32)), want, rtol=1e-5, atol=1e-6)


def test_scanned_stack_matches_dequantized_float_model():
  model = Toy(nnx.Rngs(0))
  x = _x()
  ref = run(model, x)
  paths = md_core.quantize(model, "int8")
  assert paths == ["blocks.down", "blocks.up", "proj_in"]
  up = model.blocks.up
  assert up.kernel[...].dtype == jnp.int8 and up.kernel[...].shape == (3, 16, 32)
  assert up.kernel_scale[...].shape == (3, 32)
  assert md_core.logical_axes(up.kernel_scale) == ("layers", "mlp")
  assert md_core.quantize(model, "int8") == []  # already quantized: unchanged
  # Only the scales were added: no float copy of a kernel stays in the state.
  float_leaves = jax.tree.leaves(nnx.state(Toy(nnx.Rngs(0))))
  leaves = jax.tree.leaves(nnx.state(model))
  assert len(leaves) == len(float_leaves) + 3
  assert sum(x.dtype == jnp.int8 for x in leaves) == 3
  # The same model with float kernels equal to the dequantized values gives the same output.
  deq = Toy(nnx.Rngs(0))
  for path, dense in md_core.dense_layers(deq).items():
    qd = md_core.dense_layers(model)[path]
    dense.kernel.set_value(quant.dequantize_kernel(qd.kernel[...], qd.kernel_scale[...]))
  out = run(model, x)
  chex.assert_trees_all_close(out, run(deq, x), atol=1e-5, rtol=1e-5)
  assert 0 < float(jnp.abs(out - ref).max()) < 0.05 * float(jnp.abs(ref).max())


def test_weight_bytes_and_weight_dtype():
  model = nnx.eval_shape(lambda: Toy(nnx.Rngs(0)))
  full = quant.weight_bytes(model)
  kernels = 8 * 16 + 3 * 2 * 16 * 32
  scales = 16 + 3 * (32 + 16)
  for mode, per in (("int8", 1), ("fp8", 1)):
    q = nnx.eval_shape(lambda: Toy(nnx.Rngs(0)))
    md_core.quantize(q, mode)
    assert quant.weight_bytes(q) == full - kernels * (4 - per) + scales * 4
  assert (
    q.proj_in.weight_dtype == jnp.float32
    and q.proj_in.kernel.get_value().dtype == jnp.float8_e4m3fn
  )


def test_bfloat16_model_keeps_its_compute_dtype():
  dense = nn.Dense(8, 6, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
  md_core.quantize(dense, "int8")
  assert dense.weight_dtype == jnp.bfloat16 and dense.quant_from == "bfloat16"
  assert dense(_x((2, 8)).astype(jnp.bfloat16)).dtype == jnp.bfloat16


def test_lora_slots_beside_int8_kernels():
  """Slots stay float32 next to the int8 kernel, in either order, and add exactly x @ a @ (scale * b)."""
  x = _x()
  for slots_first in (False, True):
    model = Toy(nnx.Rngs(0))
    if slots_first:
      md_core.add_lora_slots(model, 4, targets=("up",))
      md_core.quantize(model, "int8")
    else:
      md_core.quantize(model, "int8")
      md_core.add_lora_slots(model, 4, targets=("up",))
    up = model.blocks.up
    assert up.kernel[...].dtype == jnp.int8 and up.lora_a[...].dtype == jnp.float32
    graphdef, state = nnx.split(model)
    base = _run(graphdef, state, x)
    a = jax.random.normal(jax.random.key(2), (3, 16, 2)) * 0.3
    b = jax.random.normal(jax.random.key(3), (3, 2, 32)) * 0.3
    adapted = md_core.set_lora(state, {"blocks.up": md_core.LoRASlotWeight(a, b, scale=0.5)})
    with_lora = _run(graphdef, adapted, x)
    # Reference: the quantized model with the delta folded into a float copy of each layer's kernel.
    ref = Toy(nnx.Rngs(0))
    for path, dense in md_core.dense_layers(ref).items():
      qd = md_core.dense_layers(model)[path]
      w = quant.dequantize_kernel(qd.kernel[...], qd.kernel_scale[...])
      dense.kernel.set_value(w + 0.5 * a @ b if path == "blocks.up" else w)
    chex.assert_trees_all_close(with_lora, run(ref, x), atol=1e-4, rtol=1e-4)
    assert float(jnp.abs(with_lora - base).max()) > 1e-2


def _checkpoint(model):
  """The model's float weights as a flat checkpoint (stacked tensors split per layer) and its key map."""
  ckpt, targets = {}, {}
  for path, var in md_core._loading.flat_variables(model).items():
    value = np.asarray(var.get_value())
    name = ".".join(map(str, path))
    if path[0] == "blocks":
      for i in range(value.shape[0]):
        ckpt[f"{name}.{i}"] = value[i]
        targets[f"{name}.{i}"] = md_core.Target(path, layer=i)
    else:
      ckpt[name], targets[name] = value, md_core.Target(path)
  return ckpt, targets.get


def test_fsdp_shardings_and_output_match_one_device():
  mesh = mds.make_mesh(mds.MeshConfig(ici_fsdp_parallelism=8))
  x = _x((8, 5, 8))
  one = Toy(nnx.Rngs(0))
  ckpt, convert = _checkpoint(one)
  md_core.quantize(one, "int8")
  want = run(one, x)
  sharded = md_core.load_weights(lambda: Toy(nnx.Rngs(0)), ckpt, convert, mesh=mesh, progress=False)
  specs = {p: tuple(d.kernel[...].sharding.spec) for p, d in md_core.dense_layers(sharded).items()}
  assert specs["blocks.up"][:2] == (None, "fsdp") and specs["blocks.down"][2:] == ("fsdp",)
  md_core.quantize(sharded, "int8")
  for path, dense in md_core.dense_layers(sharded).items():
    kernel, scale = dense.kernel[...], dense.kernel_scale[...]
    assert kernel.dtype == jnp.int8 and tuple(kernel.sharding.spec) == specs[path]
    spec = specs[path] + (None,) * (kernel.ndim - len(specs[path]))
    want_scale = spec[:-2] + spec[-1:]
    assert (
      tuple(scale.sharding.spec) + (None,) * (scale.ndim - len(scale.sharding.spec)) == want_scale
    )
    assert len(kernel.addressable_shards) == 8
  down_scale = sharded.blocks.down.kernel_scale[...]
  assert tuple(down_scale.sharding.spec)[-1] == "fsdp"
  assert down_scale.addressable_shards[0].data.shape == (3, 2)  # 16 output channels over 8 devices
  with jax.set_mesh(mesh):
    got = run(sharded, x)
  chex.assert_trees_all_close(got, want, atol=1e-5, rtol=1e-5)


def test_bad_modes_and_targets_name_the_setting():
  model = Toy(nnx.Rngs(0))
  with pytest.raises(ValueError, match=r"mode='int4' is not a quantization mode"):
    md_core.quantize(model, "int4")
  with pytest.raises(ValueError, match=r"mode must be one of"):
    md_core.quantize(model, None)
  with pytest.raises(ValueError, match=r"match no Dense or Conv layer; some are: blocks.down"):
    md_core.quantize(model, "int8", targets=("to_q",))
  with pytest.raises(ValueError, match=r"quantization='bf16'"):
    quant.check_mode("bf16")
  assert quant.check_mode(None) is None
  assert ml_dtypes.finfo(quant.storage_dtype("fp8")).max == 448


@pytest.mark.parametrize("mode", ["int8", "int8-dynamic", "fp8"])
def test_conv_is_weight_only_per_output_channel(mode):
  conv = nn.Conv(6, 5, (3, 3), padding=1, rngs=nnx.Rngs(0))
  x = _x((2, 7, 7, 6))
  ref = conv(x)
  assert md_core.quantize(conv, mode) == [""]
  assert conv.kernel[...].dtype == quant.storage_dtype(mode) and conv.kernel_scale[...].shape == (
    5,
  )
  assert conv.weight_dtype == jnp.float32
  deq = quant.dequantize_kernel(conv.kernel[...], conv.kernel_scale[...])
  float_conv = nn.Conv(6, 5, (3, 3), padding=1, rngs=nnx.Rngs(0))
  float_conv.kernel.set_value(deq)
  out = conv(x)
  chex.assert_trees_all_close(out, float_conv(x), atol=1e-5, rtol=1e-5)
  assert 0 < float(jnp.abs(out - ref).max()) < 0.1 * float(jnp.abs(ref).max())
