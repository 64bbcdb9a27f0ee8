"""Memory-mapped safetensors files: reading (single and sharded), writing.

The format is an 8-byte little-endian header length, a JSON header mapping tensor names to dtype, shape and
byte offsets, then the raw bytes. Reading maps the file and returns numpy views into it, so a tensor is copied
only when it is converted (layout, dtype) and placed on a device.
"""

from __future__ import annotations

import json
import os
import pathlib
import struct
from collections.abc import Iterator, Mapping

import ml_dtypes
import numpy as np

_DTYPES: dict[str, np.dtype] = {
  "F64": np.dtype(np.float64),
  "F32": np.dtype(np.float32),
  "F16": np.dtype(np.float16),
  "BF16": np.dtype(ml_dtypes.bfloat16),
  "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
  "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
  "I64": np.dtype(np.int64),
  "I32": np.dtype(np.int32),
  "I16": np.dtype(np.int16),
  "I8": np.dtype(np.int8),
  "U64": np.dtype(np.uint64),
  "U32": np.dtype(np.uint32),
  "U16": np.dtype(np.uint16),
  "U8": np.dtype(np.uint8),
  "BOOL": np.dtype(np.bool_),
}
_NAMES = {v: k for k, v in _DTYPES.items()}
_MAX_HEADER = 100 * 1024 * 1024


class SafetensorsError(ValueError):
  """A safetensors file that cannot be read as one (truncated, corrupt, unknown dtype)."""


def _index(value) -> bool:
  return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _entry(path: pathlib.Path, key: str, info, data_size: int) -> tuple:
  """One header entry, checked: (dtype, shape, begin, end) or a `SafetensorsError` naming the tensor."""
  where = f"{path}: tensor {key!r}"
  if not isinstance(info, dict) or set(info) != {"dtype", "shape", "data_offsets"}:
    raise SafetensorsError(
      f"{where} has an unsupported entry {str(info)[:200]} (expected dtype, shape and data_offsets)"
    )
  name, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
  if not isinstance(name, str) or name not in _DTYPES:
    raise SafetensorsError(f"{where} has an unsupported dtype {name!r}; known: {sorted(_DTYPES)}")
  if not isinstance(shape, list) or not all(_index(d) for d in shape):
    raise SafetensorsError(f"{where} has shape {shape!r}: expected a list of integers >= 0")
  if not isinstance(offsets, list) or len(offsets) != 2 or not all(_index(o) for o in offsets):
    raise SafetensorsError(
      f"{where} has data_offsets {offsets!r}: expected [begin, end], integers >= 0"
    )
  begin, end = offsets
  if end < begin:
    raise SafetensorsError(
      f"{where} has data_offsets [{begin}, {end}]: the end is before the begin"
    )
  dtype = _DTYPES[name]
  want = int(np.prod(shape, dtype=object)) * dtype.itemsize
  if end - begin != want:
    raise SafetensorsError(
      f"{where} of shape {tuple(shape)} {name} needs {want} bytes, header gives {end - begin}"
    )
  if end > data_size:
    raise SafetensorsError(
      f"{where} ends at byte {end} of the data section but the file holds only {data_size} data "
      "bytes (truncated file?)"
    )
  return dtype, tuple(shape), begin, end


class SafetensorsFile(Mapping[str, np.ndarray]):
  """One `.safetensors` file, memory-mapped. A read-only mapping from tensor name to numpy array."""

  def __init__(self, path: str | os.PathLike):
    self.path = pathlib.Path(path)
    if not self.path.is_file():
      raise FileNotFoundError(f"{self.path}: no such safetensors file")
    size = self.path.stat().st_size
    with open(self.path, "rb") as f:
      head = f.read(8)
      if len(head) < 8:
        raise SafetensorsError(f"{self.path}: {size} bytes is too short for a safetensors file")
      (n,) = struct.unpack("<Q", head)
      if n > _MAX_HEADER or 8 + n > size:
        raise SafetensorsError(
          f"{self.path}: header claims {n} bytes but the file holds {size} bytes "
          "(truncated download, or not a safetensors file)"
        )
      try:
        header = json.loads(f.read(n))
      except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise SafetensorsError(f"{self.path}: unreadable header ({e})") from None
    if not isinstance(header, dict):
      raise SafetensorsError(f"{self.path}: the header is not a JSON object")
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict):
      raise SafetensorsError(f"{self.path}: __metadata__ is not an object of strings")
    self.metadata: dict[str, str] = metadata
    self._data_start = 8 + n
    data_size = size - self._data_start
    self._entries: dict[str, tuple[np.dtype, tuple[int, ...], int, int]] = {}
    for key, info in header.items():
      dtype, shape, begin, end = _entry(self.path, key, info, data_size)
      self._entries[key] = (dtype, shape, begin, end)
    # No two tensors may share bytes (a crafted header could alias one onto another).
    spans = sorted((b, e, k) for k, (_, _, b, e) in self._entries.items() if e > b)
    for (_, e0, k0), (b1, _, k1) in zip(spans, spans[1:]):
      if b1 < e0:
        raise SafetensorsError(
          f"{self.path}: tensor {k1!r} starts at data byte {b1}, inside tensor {k0!r} (which ends at "
          f"{e0}): overlapping tensors"
        )
    self._map: np.memmap | None = None

  def _buffer(self) -> np.ndarray:
    if self._map is None:
      self._map = np.memmap(self.path, dtype=np.uint8, mode="r")
    return self._map

  def __getitem__(self, key: str) -> np.ndarray:
    try:
      dtype, shape, begin, end = self._entries[key]
    except KeyError:
      raise KeyError(f"{self.path}: no tensor {key!r}") from None
    if begin == end:
      return np.zeros(shape, dtype)
    raw = self._buffer()[self._data_start + begin : self._data_start + end]
    return raw.view(dtype).reshape(shape)

  def __iter__(self) -> Iterator[str]:
    return iter(self._entries)

  def __len__(self) -> int:
    return len(self._entries)

  def shape(self, key: str) -> tuple[int, ...]:
    return self._entries[key][1]

  def dtype(self, key: str) -> np.dtype:
    return self._entries[key][0]

  def __repr__(self) -> str:
    return f"SafetensorsFile({str(self.path)!r}, {len(self)} tensors)"


class Checkpoint(Mapping[str, np.ndarray]):
  """Tensors spread over one or more safetensors files, read lazily. `file_of(key)` names a tensor's file."""

  def __init__(self, files: list[SafetensorsFile], *, name: str | None = None):
    self.files = files
    self.name = name or (str(files[0].path) if len(files) == 1 else str(files[0].path.parent))
    self._where: dict[str, SafetensorsFile] = {}
    for f in files:
      for key in f:
        if key in self._where:
          raise SafetensorsError(
            f"tensor {key!r} appears in both {self._where[key].path} and {f.path}"
          )
        self._where[key] = f

  def __getitem__(self, key: str) -> np.ndarray:
    try:
      return self._where[key][key]
    except KeyError:
      raise KeyError(f"{self.name}: no tensor {key!r}") from None

  def __iter__(self) -> Iterator[str]:
    return iter(self._where)

  def __len__(self) -> int:
    return len(self._where)

  def shape(self, key: str) -> tuple[int, ...]:
    return self._where[key].shape(key)

  def dtype(self, key: str) -> np.dtype:
    return self._where[key].dtype(key)

  def file_of(self, key: str) -> pathlib.Path:
    return self._where[key].path

  def __repr__(self) -> str:
    return f"Checkpoint({self.name!r}, {len(self.files)} files, {len(self)} tensors)"


def open_checkpoint(path: str | os.PathLike, *, variant: str | None = None) -> Checkpoint:
  """Opens safetensors weights: a file, a sharded `*.safetensors.index.json`, or a folder holding either.

  In a folder, an index file wins; otherwise every `*.safetensors` file is read. `variant` (e.g. "fp16") picks
  files named `<stem>.<variant>.safetensors`, as diffusers names them; without it such files are ignored when
  files without a variant exist.

  Raises:
    FileNotFoundError: nothing to read at `path` (the message lists what the folder holds).
    SafetensorsError: a truncated or corrupt file, or a shard listed in the index that is missing.
  """
  path = pathlib.Path(path)
  if path.is_file():
    if path.name.endswith(".index.json"):
      return _open_index(path)
    return Checkpoint([SafetensorsFile(path)])
  if not path.is_dir():
    raise FileNotFoundError(f"{path}: no such file or folder")
  suffix = f".{variant}.safetensors" if variant else ".safetensors"
  indexes = sorted(path.glob(f"*{suffix}.index.json"))
  files = sorted(path.glob(f"*{suffix}"))
  if not variant:
    # Skip variant files (model.fp16.safetensors) when plain ones exist.
    plain = [f for f in files if "." not in f.name.removesuffix(".safetensors")]
    files = plain or files
    indexes = [
      i for i in indexes if "." not in i.name.removesuffix(".safetensors.index.json")
    ] or indexes
  if indexes:
    if len(indexes) > 1:
      raise FileNotFoundError(f"{path}: several index files {[i.name for i in indexes]}; name one")
    return _open_index(indexes[0])
  if not files:
    held = sorted(p.name for p in path.iterdir())[:20]
    raise FileNotFoundError(f"{path}: no *{suffix} weights here (the folder holds {held})")
  return Checkpoint([SafetensorsFile(f) for f in files], name=str(path))


def _open_index(index: pathlib.Path) -> Checkpoint:
  try:
    weight_map = json.loads(index.read_text())["weight_map"]
  except (json.JSONDecodeError, KeyError) as e:
    raise SafetensorsError(
      f"{index}: not a safetensors index (expected a 'weight_map'): {e}"
    ) from None
  names = sorted(set(weight_map.values()))
  missing = [n for n in names if not (index.parent / n).is_file()]
  if missing:
    raise SafetensorsError(f"{index}: shard files {missing} listed in the index are missing")
  ckpt = Checkpoint([SafetensorsFile(index.parent / n) for n in names], name=str(index))
  wrong = [k for k, n in weight_map.items() if k not in ckpt or ckpt.file_of(k).name != n]
  if wrong:
    raise SafetensorsError(f"{index}: tensors {wrong[:10]} are not in the shard the index names")
  return ckpt


def save_safetensors(
  path: str | os.PathLike,
  tensors: Mapping[str, np.ndarray],
  *,
  metadata: Mapping[str, str] | None = None,
) -> None:
  """Writes numpy arrays (any dtype above, incl. bfloat16) as one safetensors file."""
  header: dict[str, object] = {}
  if metadata:
    header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
  arrays = []
  offset = 0
  for key in sorted(tensors):
    a = np.asarray(tensors[key])
    if not a.flags.c_contiguous:  # (np.ascontiguousarray would turn a 0-d array into 1-d)
      a = np.ascontiguousarray(a)
    if a.dtype not in _NAMES:
      raise TypeError(f"tensor {key!r}: dtype {a.dtype} cannot be stored in safetensors")
    header[key] = {
      "dtype": _NAMES[a.dtype],
      "shape": list(a.shape),
      "data_offsets": [offset, offset + a.nbytes],
    }
    offset += a.nbytes
    arrays.append(a)
  blob = json.dumps(header, separators=(",", ":")).encode()
  blob += b" " * (-len(blob) % 8)  # keep the data section 8-byte aligned
  path = pathlib.Path(path)
  path.parent.mkdir(parents=True, exist_ok=True)
  with open(path, "wb") as f:
    f.write(struct.pack("<Q", len(blob)))
    f.write(blob)
    for a in arrays:
      f.write(a.tobytes())
