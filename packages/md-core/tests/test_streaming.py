"""md-core streaming loads: per-device pieces from the memory-mapped file, cast on the devices, layers in place."""

import threading
import time

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

import md_core
import md_sharding as mds
from md_core import _stream


class Scanned(nnx.Module):
  """A stacked linear kernel (layers, in, out), a fused qkv split into q and k, an int step table."""

  def __init__(self, layers: int, d_in: int, d_out: int, rngs: nnx.Rngs):
    self.w = nnx.Param(jnp.zeros((layers, d_in, d_out)), logical_axes=("layers", "embed", "mlp"))
    self.q = nnx.Param(jnp.zeros((d_in, d_out)), logical_axes=("embed", "mlp"))
    self.k = nnx.Param(jnp.zeros((d_in, d_out)), logical_axes=("embed", "mlp"))
    self.steps = nnx.Param(jnp.zeros((layers,), jnp.int32), logical_axes=(None,))


def _convert(name):
  if name == "qk.weight":
    return [
      md_core.Target(("q",), "linear", split=(0, 2, 0)),
      md_core.Target(("k",), "linear", split=(1, 2, 0)),
    ]
  if name == "steps":
    return md_core.Target(("steps",))
  return md_core.Target(("w",), "linear", layer=int(name.split(".")[1]))


def _write(tmp_path, layers, d_in, d_out, dtype):
  rng = np.random.default_rng(0)
  tensors = {
    f"blocks.{i}.weight": rng.normal(size=(d_out, d_in)).astype(dtype) for i in range(layers)
  }
  tensors["qk.weight"] = rng.normal(size=(2 * d_out, d_in)).astype(dtype)
  tensors["steps"] = np.arange(layers, dtype=np.int64) * 3
  md_core.save_safetensors(tmp_path / "model.safetensors", tensors)
  return tensors


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16])
@pytest.mark.parametrize(
  "mesh_axes",
  [None, dict(ici_fsdp_parallelism=8), dict(ici_fsdp_parallelism=2, ici_tensor_parallelism=4)],
)
@pytest.mark.parametrize("path", ["devices", "host"])
def test_stacked_split_and_cast_on_meshes(tmp_path, monkeypatch, dtype, mesh_axes, path):
  """Values equal numpy's convert-then-cast on one device and on fsdp / fsdp x tensor meshes; each
  parameter has its logical sharding; a bfloat16 file is upcast to the model's float32. "devices": every
  tensor converted on the devices (layers written in place); "host": small ones converted on the host."""
  if path == "devices":
    monkeypatch.setattr(_stream, "HOST_BYTES", 0)
    monkeypatch.setattr(_stream, "_on_host_device", lambda sharding: False)
  layers, d_in, d_out = 3, 16, 8
  tensors = _write(tmp_path, layers, d_in, d_out, dtype)
  mesh = None if mesh_axes is None else mds.make_mesh(mds.MeshConfig(**mesh_axes))
  model = md_core.load_weights(
    lambda: Scanned(layers, d_in, d_out, nnx.Rngs(0)),
    md_core.open_checkpoint(tmp_path),
    _convert,
    mesh=mesh,
    progress=False,
  )
  want = np.stack([tensors[f"blocks.{i}.weight"].T for i in range(layers)]).astype(np.float32)
  w = model.w[...]
  assert w.dtype == jnp.float32
  np.testing.assert_array_equal(np.asarray(w), want)
  qk = tensors["qk.weight"].astype(np.float32)
  np.testing.assert_array_equal(np.asarray(model.q[...]), qk[:d_out].T)
  np.testing.assert_array_equal(np.asarray(model.k[...]), qk[d_out:].T)
  assert model.steps[...].dtype == jnp.int32
  np.testing.assert_array_equal(np.asarray(model.steps[...]), np.arange(layers) * 3)
  if mesh is not None:
    spec = mds.logical_to_spec(("layers", "embed", "mlp"), mesh=mesh, shape=w.shape)
    assert w.sharding.spec == spec and "fsdp" in tuple(spec)
    assert model.q[...].sharding.spec == mds.logical_to_spec(
      ("embed", "mlp"), mesh=mesh, shape=(d_in, d_out)
    )
    # Every device holds only its own shard.
    sizes = {s.data.size for s in w.addressable_shards}
    assert sizes == {w.size // np.prod([mesh.shape[a] for a in jax.tree.leaves(tuple(spec))])}


def _load_bfloat16(tmp_path, layers):
  """A float32 file of `layers` 16 -> 8 layers written and loaded as bfloat16: (tensors, model)."""
  tensors = _write(tmp_path, layers, 16, 8, np.float32)
  model = md_core.load_weights(
    lambda: Scanned(layers, 16, 8, nnx.Rngs(0)),
    md_core.open_checkpoint(tmp_path),
    _convert,
    dtype=jnp.bfloat16,
    progress=False,
  )
  return tensors, model


@pytest.mark.parametrize("host_bytes", [0, _stream.HOST_BYTES])
def test_cast_to_bfloat16_matches_numpy(tmp_path, monkeypatch, host_bytes):
  """dtype=bfloat16 from a float32 file: the device-side (and the host) cast rounds as ml_dtypes does."""
  monkeypatch.setattr(_stream, "HOST_BYTES", host_bytes)
  if host_bytes == 0:  # every tensor through the device programs, also on one CPU device
    monkeypatch.setattr(_stream, "_on_host_device", lambda sharding: False)
  tensors, model = _load_bfloat16(tmp_path, 2)
  want = np.stack([tensors[f"blocks.{i}.weight"].T for i in range(2)]).astype(ml_dtypes.bfloat16)
  assert model.w[...].dtype == jnp.bfloat16
  np.testing.assert_array_equal(np.asarray(model.w[...]), want)


@pytest.mark.parametrize("host_bytes", [0, _stream.HOST_BYTES])
def test_loaded_weights_do_not_alias_the_file(tmp_path, monkeypatch, host_bytes):
  """The placed parameters are copies: overwriting the memory-mapped file afterwards changes nothing."""
  monkeypatch.setattr(_stream, "HOST_BYTES", host_bytes)
  if host_bytes == 0:  # every tensor through the device programs, also on one CPU device
    monkeypatch.setattr(_stream, "_on_host_device", lambda sharding: False)
  tensors = _write(tmp_path, 2, 16, 8, np.float32)
  path = tmp_path / "model.safetensors"
  model = md_core.load_weights(
    lambda: Scanned(2, 16, 8, nnx.Rngs(0)), md_core.open_checkpoint(path), _convert, progress=False
  )
  size = path.stat().st_size
  with open(path, "r+b") as f:  # same inode, same size: any mapping of it now reads 0xff bytes
    f.seek(4096 if size > 8192 else size // 2)
    f.write(b"\xff" * (size - f.tell()))
  want = np.stack([tensors[f"blocks.{i}.weight"].T for i in range(2)])
  np.testing.assert_array_equal(np.asarray(model.w[...]), want)
  np.testing.assert_array_equal(np.asarray(model.k[...]), tensors["qk.weight"][8:].T)


def test_one_cpu_device_fills_stacks_on_the_host_without_device_programs(tmp_path, monkeypatch):
  """On one CPU device a stacked parameter, however large, is written by NumPy into a page-aligned buffer
  that jax takes without a copy: the zero-fill and per-layer device programs never run, and the values are
  NumPy's (the single tensors, above HOST_BYTES here, still go through the device conversion)."""
  monkeypatch.setattr(_stream, "HOST_BYTES", 0)

  def refuse(*args):
    raise AssertionError("a device program ran on the single-CPU-device path")

  for name in ("_allocator", "_layer_writer"):
    monkeypatch.setattr(_stream, name, refuse)
  tensors, model = _load_bfloat16(tmp_path, 3)
  want = np.stack([tensors[f"blocks.{i}.weight"].T for i in range(3)]).astype(ml_dtypes.bfloat16)
  np.testing.assert_array_equal(np.asarray(model.w[...]), want)
  qk = tensors["qk.weight"].astype(ml_dtypes.bfloat16)
  np.testing.assert_array_equal(np.asarray(model.k[...]), qk[8:].T)
  assert model.w[...].unsafe_buffer_pointer() % _stream._ALIGN == 0


@pytest.mark.parametrize(
  ("shape", "perm"),
  [
    ((37, 11), (1, 0)),
    ((9, 5, 3, 3), (2, 3, 1, 0)),
    ((6, 4, 3, 2, 2), (2, 3, 4, 1, 0)),
    ((7, 5), (0, 1)),
  ],
)
@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16])
def test_blocked_permute_equals_numpy_transpose(monkeypatch, shape, perm, dtype):
  """The host path's blocked copy (blocks of a few source rows, here 2-3) equals NumPy's whole-array
  transpose and cast: linear, conv2d (OIHW -> HWIO) and conv3d layouts, and the identity."""
  src = np.random.default_rng(0).normal(size=shape).astype(np.float32)
  monkeypatch.setattr(_stream, "_BLOCK_BYTES", 2 * src[0].nbytes + 1)
  monkeypatch.setattr(_stream, "_MIN_ROWS", 2)
  dst = _stream._aligned_empty(tuple(shape[i] for i in perm), np.dtype(dtype))
  _stream._copy_permuted(dst, src, perm)
  np.testing.assert_array_equal(dst, np.transpose(src, perm).astype(dtype))
  assert dst.ctypes.data % _stream._ALIGN == 0


def _awkward_float32(shape) -> np.ndarray:
  """Random float32 values with the cases a bfloat16 rounding can get wrong: ties to even (both ways),
  the largest finite values (which round to infinity), infinities, signed zeros, subnormals, NaNs whose
  payload sits only in the low 16 bits (a rounding bias added to them reaches the exponent)."""
  rng = np.random.default_rng(1)
  bits = rng.integers(0, 2**32, size=shape, dtype=np.uint64).astype(np.uint32)
  flat = bits.reshape(-1)
  special = np.array(
    [
      0x3F808000,  # tie, even below: rounds down
      0x3F818000,  # tie, odd below: rounds up
      0x7F7FFFFF,  # float32 max: rounds to inf
      0xFF7FFFFF,
      0x7F800000,  # +inf
      0xFF800000,
      0x00000000,
      0x80000000,
      0x00000001,  # smallest subnormal
      0x807FFFFF,
      0x7F800001,  # NaN, payload in the low bits only
      0xFFC00000,
    ],
    np.uint32,
  )
  flat[: special.size] = special
  return bits.view(np.float32)


@pytest.mark.parametrize(
  ("shape", "perm"), [((37, 11), (1, 0)), ((9, 5, 3, 3), (2, 3, 1, 0)), ((13, 6), (0, 1))]
)
@pytest.mark.parametrize("nan", [True, False])
@pytest.mark.parametrize("file_backed", [True, False])
def test_float32_to_bfloat16_rounding_matches_ml_dtypes_bit_for_bit(
  tmp_path, monkeypatch, shape, perm, nan, file_backed
):
  """The host path's integer rounding of float32 to bfloat16 (to nearest even) gives the bits of NumPy's
  cast to ml_dtypes' bfloat16 for every value, tiles of 2-3 rows included; a block holding a NaN takes
  the plain cast, the other blocks the rounding, and the source is never written (memory-mapped file
  read with `preadv`, or an array in memory)."""
  src = _awkward_float32(shape)
  if not nan:
    src[np.isnan(src)] = 1.5
  if file_backed:
    src.tofile(tmp_path / "w.bin")
    src = np.memmap(tmp_path / "w.bin", np.float32, "r", shape=shape)
  before = np.array(src)
  monkeypatch.setattr(_stream, "_BLOCK_BYTES", 2 * src[0].nbytes + 1)
  monkeypatch.setattr(_stream, "_MIN_ROWS", 2)
  dst = _stream._aligned_empty(tuple(shape[i] for i in perm), np.dtype(ml_dtypes.bfloat16))
  _stream._copy_permuted(dst, src, perm)
  with np.errstate(invalid="ignore", over="ignore"):
    want = np.transpose(before, perm).astype(ml_dtypes.bfloat16)
  np.testing.assert_array_equal(dst.view(np.uint16), want.view(np.uint16))
  np.testing.assert_array_equal(np.asarray(src).view(np.uint32), before.view(np.uint32))
  assert (_stream._bfloat16_bits(np.array(before)) is None) == nan


@pytest.mark.parametrize("workers", [2, 3])
@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16])
def test_threaded_permute_splits_rows_exactly(tmp_path, workers, dtype):
  """A large single tensor on a CPU device is copied by several threads, each a range of its leading rows
  (a conv kernel OIHW -> HWIO here): the result is NumPy's whole transpose and cast."""
  shape, perm = (41, 7, 3, 3), (2, 3, 1, 0)
  src = np.random.default_rng(0).normal(size=shape).astype(np.float32)
  src.tofile(tmp_path / "w.bin")
  mapped = np.memmap(tmp_path / "w.bin", np.float32, "r", shape=shape)
  dst = _stream._aligned_empty(tuple(shape[i] for i in perm), np.dtype(dtype))
  _stream._copy_permuted_threaded(dst, mapped, perm, workers)
  np.testing.assert_array_equal(dst, np.transpose(src, perm).astype(dtype))


def _rss_anon() -> int:
  with open("/proc/self/status") as f:
    for line in f:
      if line.startswith("RssAnon:"):
        return int(line.split()[1]) * 1024
  raise RuntimeError("no RssAnon")


def test_stacked_load_holds_about_one_layer_beyond_the_weights(tmp_path):
  """A 256 MB stacked parameter (32 layers of 8 MB) loads with peak anonymous memory under the weights plus
  128 MB; assembling the stack on the host (as md did before streaming) needs at least the weights twice."""
  layers, d_in, d_out = 32, 1024, 2048
  rng = np.random.default_rng(0)
  layer = rng.normal(size=(d_out, d_in)).astype(np.float32)
  md_core.save_safetensors(
    tmp_path / "model.safetensors",
    {f"blocks.{i}.weight": layer * (i + 1) for i in range(layers)},
  )
  del layer

  class Big(nnx.Module):
    def __init__(self, rngs):
      self.w = nnx.Param(jnp.zeros((layers, d_in, d_out)), logical_axes=("layers", "embed", "mlp"))

  ckpt = md_core.open_checkpoint(tmp_path)
  weights = layers * d_in * d_out * 4
  before, peak, stop = _rss_anon(), [0], threading.Event()

  def sample():
    while not stop.is_set():
      peak[0] = max(peak[0], _rss_anon())
      time.sleep(0.001)

  thread = threading.Thread(target=sample, daemon=True)
  thread.start()
  model = md_core.load_weights(lambda: Big(nnx.Rngs(0)), ckpt, _convert, progress=False)
  jax.block_until_ready(model.w[...])
  stop.set()
  thread.join()
  peak[0] = max(peak[0], _rss_anon())
  grown = peak[0] - before
  assert weights <= grown + 16 * 2**20, (grown, weights)  # the weights are resident (CPU devices)
  assert grown < weights + 128 * 2**20, (
    f"peak grew by {grown / 2**20:.0f} MB for {weights / 2**20:.0f} MB"
  )
  w = model.w[...]
  np.testing.assert_array_equal(np.asarray(w[5]), ckpt["blocks.5.weight"].T)
  np.testing.assert_array_equal(np.asarray(w[31]), ckpt["blocks.31.weight"].T)


def test_host_fill_reads_file_backed_layers_with_pread(tmp_path, monkeypatch):
  """A stacked parameter filled on the host from memory-mapped safetensors views (here a slice that
  starts mid-file) reads them with `os.preadv`, and gives NumPy's permuted values."""
  import os

  from md_core._safetensors import SafetensorsFile

  rng = np.random.default_rng(0)
  layers = {f"l{i}": rng.standard_normal((6, 40)).astype(np.float32) for i in range(3)}
  path = tmp_path / "w.safetensors"
  md_core.save_safetensors(path, layers)
  file = SafetensorsFile(path)
  reads = []
  real = os.preadv
  monkeypatch.setattr(os, "preadv", lambda fd, bufs, off: reads.append(off) or real(fd, bufs, off))
  pieces = [(file[f"l{i}"], md_core.Target(("p",), "linear", layer=i)) for i in range(3)]
  got = _stream.place_stacked((3, 40, 6), pieces, np.float32, None)
  np.testing.assert_array_equal(np.asarray(got), np.stack([layers[f"l{i}"].T for i in range(3)]))
  assert len(reads) == 3 and len(set(reads)) == 3
