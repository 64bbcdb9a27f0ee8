"""Placing one parameter from memory-mapped checkpoint tensors, piece by piece.

A parameter is never assembled as a whole host array. Each reference tensor (one layer of a stacked
parameter) is placed on the devices in its stored dtype and layout, each device reading only its slice of the
memory-mapped file; one jitted program per (layout, dtype, sharding) then permutes and casts it on the
devices. A stacked parameter is allocated once on the devices and filled layer by layer in place (a donated
`dynamic_update_slice`), so host memory beyond the placed weights stays at about one layer.

On a single CPU device (the placed weights live in host memory anyway) a stacked parameter is instead
written straight into one page-aligned host buffer, each layer permuted and cast by NumPy in one pass (the
layers on a thread per core), and handed to jax without a copy: no zero-fill, no second buffer and no
per-layer programs.
"""

from __future__ import annotations

import concurrent.futures
import functools
import mmap
import os
import threading
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from md_core import _keymap
from md_core._keymap import Target

# Sharding of the placed parameter; None: jax's default device.
Sharding = jax.sharding.Sharding | None

# Parameters up to this size are converted on the host and placed in one transfer: the host copy is
# small, and the devices would otherwise compile one conversion program per distinct small shape.
HOST_BYTES = 16 * 2**20
_ALIGN = mmap.PAGESIZE
_BLOCK_BYTES = 256 * 2**10
_MIN_ROWS = 64
_HOST_THREADS = 8


def source_view(array: np.ndarray, target: Target) -> np.ndarray:
  """The part of a reference tensor that `target` takes, as a view (no bytes read): its `split` slice."""
  if target.split is None:
    return array
  index, parts, axis = target.split
  _keymap.target_shape(array.shape, Target(target.path, "identity", target.split))
  size = array.shape[axis] // parts
  where = (slice(None),) * axis + (slice(index * size, (index + 1) * size),)
  return array[where]


def _permutation(target: Target, ndim: int) -> tuple[int, ...]:
  perm = _keymap._PERMUTATIONS[target.layout]
  return tuple(range(ndim)) if perm is None else perm


def _device_dtype(stored: np.dtype, out: np.dtype) -> np.dtype:
  """The dtype a tensor travels in: as stored when jax holds that dtype (the cast then runs on the devices),
  else (int64 / float64 without x64) cast on the host to the parameter's dtype."""
  if jax.dtypes.canonicalize_dtype(stored) == stored:
    return np.dtype(stored)
  return np.dtype(out)


def _source_sharding(sharding: Sharding, perm: tuple[int, ...]) -> Sharding:
  """The sharding of a tensor in reference layout whose permutation `perm` has `sharding`."""
  if sharding is None or not isinstance(sharding, jax.sharding.NamedSharding):
    return sharding
  spec = tuple(sharding.spec) + (None,) * (len(perm) - len(sharding.spec))
  source = [None] * len(perm)
  for out_axis, src_axis in enumerate(perm):
    source[src_axis] = spec[out_axis]
  return jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(*source))


def _layer_sharding(sharding: Sharding, ndim: int) -> Sharding:
  """The sharding of one layer of a stacked parameter (its leading `layers` axis dropped)."""
  if sharding is None or not isinstance(sharding, jax.sharding.NamedSharding):
    return sharding
  spec = tuple(sharding.spec) + (None,) * (ndim - len(sharding.spec))
  return jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(*spec[1:]))


def _on_host_device(sharding: Sharding) -> bool:
  """Whether the parameter lands on one CPU device, whose buffers jax can alias from host memory."""
  if sharding is None:
    device = jax.config.jax_default_device or jax.devices()[0]
    platform = device if isinstance(device, str) else getattr(device, "platform", None)
    return platform == "cpu"
  devices = sharding.device_set
  return len(devices) == 1 and next(iter(devices)).platform == "cpu"


def _aligned_empty(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
  """An uninitialised host array in its own anonymous mapping: page-aligned, so jax's CPU client takes it
  without a copy.

  No `MADV_HUGEPAGE`: with the common THP setting `defrag=madvise` it makes every fault of the mapping
  compact memory for a 2 MiB page synchronously; on a 2-core VM touching 2.8 GB took 1.6-6.8 s with it
  against 0.9-1.3 s without, and the Wan 2.1 1.3B bfloat16 load fell from 6.9-7.8 s to 4.3-4.4 s
  (bench/README.md). Where THP is `always` the kernel still gives huge pages."""
  nbytes = int(np.prod(shape)) * dtype.itemsize
  if nbytes == 0:
    return np.empty(shape, dtype)
  block = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
  return np.frombuffer(block, dtype=dtype).reshape(shape)


def _file_span(src: np.ndarray) -> tuple[str, int] | None:
  """`(path, byte offset)` of a C-contiguous view of a memory-mapped file (`np.memmap`), else None."""
  if not src.flags.c_contiguous or src.ndim == 0:
    return None
  # The root memmap: the one made over the file (views of it are memmaps too, whose `offset` still
  # names the root's start).
  base, node = None, src
  while isinstance(node, np.ndarray):
    if isinstance(node, np.memmap):
      base = node
    node = node.base
  if base is None or getattr(base, "filename", None) is None or not base.flags.c_contiguous:
    return None
  offset = src.ctypes.data - base.ctypes.data
  if offset < 0 or offset + src.nbytes > base.nbytes:
    return None
  return base.filename, int(base.offset) + offset


_reader = threading.local()


def _read_rows(fd: int, offset: int, src: np.ndarray, start: int, stop: int) -> np.ndarray | None:
  """`src[start:stop]` of a file-backed `src` (starting at `offset` in `fd`), read with `preadv` into a
  buffer this thread reuses (the caller may write into it); None where the read comes back short."""
  row = src[0].nbytes
  need = (stop - start) * row
  buf = getattr(_reader, "buf", None)
  if buf is None or buf.nbytes < need:
    buf = _reader.buf = np.empty(max(need, _BLOCK_BYTES), np.uint8)
  out = buf[:need]
  if os.preadv(fd, [memoryview(out)], offset + start * row) != need:
    return None
  return out.view(src.dtype).reshape((stop - start, *src.shape[1:]))


_BFLOAT16 = np.dtype(jnp.bfloat16)


def _scratch(name: str, shape: tuple[int, ...], dtype: type) -> np.ndarray:
  """A per-thread scratch array of `shape` (its buffer kept and grown across calls)."""
  need = int(np.prod(shape)) * np.dtype(dtype).itemsize
  buf = getattr(_reader, name, None)
  if buf is None or buf.nbytes < need:
    buf = np.empty(max(need, _BLOCK_BYTES), np.uint8)
    setattr(_reader, name, buf)
  return buf[:need].view(dtype).reshape(shape)


def _bfloat16_bits(rows: np.ndarray) -> np.ndarray | None:
  """float32 `rows` (a buffer the caller owns; overwritten) rounded to bfloat16, to nearest even, as a
  strided bfloat16 view of their upper halves: the rounding in three vectorised integer passes, where
  NumPy's cast to ml_dtypes' bfloat16 converts one element at a time (0.7-1.2 GB/s against 1.1-2.3 GB/s
  with the transpose after it). None where a NaN is present (adding the rounding bias could carry a NaN's
  payload into the exponent and make it infinite): the caller casts those rows the plain way."""
  # Scratch buffers this thread reuses: fresh temporaries of a block's size (2.3 MB for 64 rows of 8960
  # float32) come from new mappings whose pages fault in on every block.
  flags, lsb = _scratch("flags", rows.shape, np.bool_), _scratch("lsb", rows.shape, np.uint32)
  if np.isnan(rows, out=flags).any():
    return None
  bits = rows.view(np.uint32)
  np.right_shift(bits, 16, out=lsb)
  np.bitwise_and(lsb, 1, out=lsb)
  bits += 0x7FFF
  bits += lsb
  upper = 1 if np.little_endian else 0
  return bits.view(np.uint16)[..., upper::2].view(_BFLOAT16)


def _copy_permuted(dst: np.ndarray, src: np.ndarray, perm: tuple[int, ...]) -> None:
  """`dst[...] = src.transpose(perm)` (cast as needed) in tiles: a block of at least `_MIN_ROWS` of the
  source's leading rows at a time, and within it slices of its second axis of at most `_BLOCK_BYTES`, so
  each tile is transposed in cache and each destination row receives `_MIN_ROWS` or more contiguous
  elements (NumPy's whole-array strided transpose misses the cache on every element of large matrices;
  blocks of 7 rows of a 1536 x 8960 matrix wrote 14-28 bytes per destination row). A source that is a
  contiguous view of a memory-mapped file is read with `preadv` into a reused buffer instead of through the
  mapping (0.72 against 0.49 GB/s per core: the mapping's pages fault in one by one); float32 to
  bfloat16 rounds in that buffer (`_bfloat16_bits`)."""
  if src.size == 0:
    return
  if src.ndim == 0:
    np.copyto(dst, src, casting="unsafe")
    return
  axis = perm.index(0)  # where the source's leading axis lands
  identity = perm == tuple(range(src.ndim))
  block = max(_MIN_ROWS, _BLOCK_BYTES // max(1, src[0].nbytes))
  to_bfloat16 = src.dtype == np.float32 and dst.dtype == _BFLOAT16
  # NaNs and values past bfloat16's range cast quietly, as XLA's cast on the devices does.
  with np.errstate(invalid="ignore", over="ignore"):
    _copy_blocks(dst, src, perm, axis, block, to_bfloat16, identity)


def _copy_blocks(
  dst: np.ndarray,
  src: np.ndarray,
  perm: tuple[int, ...],
  axis: int,
  block: int,
  to_bfloat16: bool,
  identity: bool,
) -> None:
  """`_copy_permuted`'s loop over blocks of `block` leading rows."""
  span = _file_span(src) if hasattr(os, "preadv") else None
  fd = None
  if span is not None:
    try:
      fd = os.open(span[0], os.O_RDONLY)
    except OSError:
      fd = None
  try:
    for start in range(0, src.shape[0], block):
      stop = min(start + block, src.shape[0])
      rows = None if fd is None else _read_rows(fd, span[1], src, start, stop)
      if rows is None:
        rows = src[start:stop]
        if to_bfloat16:
          rows = np.array(rows, order="C")  # the rounding writes into its own copy
      if to_bfloat16 and (bits := _bfloat16_bits(rows)) is not None:
        rows = bits
      where = [slice(None)] * src.ndim
      where[axis] = slice(start, stop)
      if identity or src.ndim == 1:
        np.copyto(dst[tuple(where)], rows, casting="unsafe")
        continue
      inner = rows[:, :1].nbytes  # bytes of one index of the second axis, over the block's rows
      width = max(1, _BLOCK_BYTES // max(1, inner))
      second = perm.index(1)  # where the source's second axis lands
      for lo in range(0, src.shape[1], width):
        where[second] = slice(lo, lo + width)
        np.copyto(dst[tuple(where)], np.transpose(rows[:, lo : lo + width], perm), casting="unsafe")
  finally:
    if fd is not None:
      os.close(fd)


def _copy_permuted_threaded(
  dst: np.ndarray, src: np.ndarray, perm: tuple[int, ...], workers: int
) -> None:
  """`_copy_permuted` with the source's leading rows split into `workers` ranges copied on as many threads
  (NumPy's copies and `preadv` release the GIL; the ranges land in disjoint slices of `dst`)."""
  axis = perm.index(0)
  bounds = np.linspace(0, src.shape[0], workers + 1).astype(int)

  def part(i):
    where = [slice(None)] * src.ndim
    where[axis] = slice(bounds[i], bounds[i + 1])
    _copy_permuted(dst[tuple(where)], src[bounds[i] : bounds[i + 1]], perm)

  with concurrent.futures.ThreadPoolExecutor(workers) as pool:
    list(pool.map(part, range(workers)))


def _put(view: np.ndarray, dtype: np.dtype, sharding: Sharding) -> jax.Array:
  """Places a (memory-mapped) host view; each device reads and copies only its own slice."""

  def piece(index) -> np.ndarray:
    part = view[index]
    if part.dtype == dtype and part.flags.c_contiguous:
      return (
        part  # the transfer copies it (no host copy); the jitted conversion writes a new buffer
      )
    return np.array(part, dtype=dtype, order="C", copy=True)

  if sharding is None:
    return jax.device_put(piece(()))
  return jax.make_array_from_callback(tuple(view.shape), sharding, piece)


def _place_host(value: np.ndarray, sharding: Sharding) -> jax.Array:
  out = jax.device_put(value, sharding, may_alias=True)
  return out.block_until_ready()


@functools.cache
def _converter(perm: tuple[int, ...], dtype: np.dtype, sharding: Sharding):
  def convert(x):
    return jnp.transpose(x, perm).astype(dtype)

  return jax.jit(convert, out_shardings=sharding) if sharding is not None else jax.jit(convert)


@functools.cache
def _allocator(shape: tuple[int, ...], dtype: np.dtype, sharding: Sharding):
  def zeros():
    return jnp.zeros(shape, dtype)

  return jax.jit(zeros, out_shardings=sharding) if sharding is not None else jax.jit(zeros)


@functools.cache
def _layer_writer(perm: tuple[int, ...], dtype: np.dtype, sharding: Sharding):
  def write(stack, layer, index):
    value = jnp.transpose(layer, perm).astype(dtype)
    return jax.lax.dynamic_update_index_in_dim(stack, value, index, 0)

  if sharding is None:
    return jax.jit(write, donate_argnums=0)
  return jax.jit(write, donate_argnums=0, out_shardings=sharding)


def place_tensor(
  array: np.ndarray, target: Target, dtype: np.dtype, sharding: Sharding
) -> jax.Array:
  """One reference tensor → the parameter `target` names: split, permuted, cast to `dtype`, placed."""
  view = source_view(array, target)
  perm = _permutation(target, view.ndim)
  nbytes = view.size * max(view.dtype.itemsize, np.dtype(dtype).itemsize)
  # On one CPU device a large tensor is copied on the host too, its leading rows split over a thread per
  # core (the tiled copy beats XLA's permute and cast there; bench/README.md, 2026-12-07).
  if nbytes <= HOST_BYTES or _on_host_device(sharding):
    shape = tuple(view.shape[i] for i in perm)
    value = _aligned_empty(shape, np.dtype(dtype))
    workers = min(os.cpu_count() or 1, _HOST_THREADS, view.shape[0] if view.ndim else 1)
    if workers > 1 and nbytes > HOST_BYTES:
      _copy_permuted_threaded(value, view, perm, workers)
    else:
      _copy_permuted(value, view, perm)
    return _place_host(value, sharding)
  raw = _put(view, _device_dtype(view.dtype, dtype), _source_sharding(sharding, perm))
  return _converter(perm, np.dtype(dtype), sharding)(raw).block_until_ready()


def place_stacked(
  shape: tuple[int, ...],
  pieces: Sequence[tuple[np.ndarray, Target]],
  dtype: np.dtype,
  sharding: Sharding,
) -> jax.Array:
  """A stacked parameter of `shape` (layers first) from one reference tensor per layer, filled in place."""
  dtype = np.dtype(dtype)
  if int(np.prod(shape)) * dtype.itemsize <= HOST_BYTES or _on_host_device(sharding):
    value = _aligned_empty(tuple(shape), dtype)

    def fill(piece):
      array, target = piece
      view = source_view(array, target)
      _copy_permuted(value[target.layer], view, _permutation(target, view.ndim))

    # NumPy's copies release the GIL: the layers (disjoint slices of `value`) fill on every core.
    workers = min(len(pieces), os.cpu_count() or 1, _HOST_THREADS)
    if workers > 1 and value.nbytes > HOST_BYTES:
      with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        list(pool.map(fill, pieces))
    else:
      for piece in pieces:
        fill(piece)
    return _place_host(value, sharding)
  stack = _allocator(tuple(shape), dtype, sharding)()
  layer_sharding = _layer_sharding(sharding, len(shape))
  for array, target in pieces:
    view = source_view(array, target)
    perm = _permutation(target, view.ndim)
    raw = _put(view, _device_dtype(view.dtype, dtype), _source_sharding(layer_sharding, perm))
    stack = _layer_writer(perm, dtype, sharding)(stack, raw, np.int32(target.layer))
    # Wait for each layer: with asynchronous dispatch the host copies of later layers would pile up.
    stack.block_until_ready()
    del raw
  return stack
