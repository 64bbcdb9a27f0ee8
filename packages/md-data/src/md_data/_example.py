"""`tf.train.Example` and `tf.io.serialize_tensor` bytes, encoded and decoded without TensorFlow.

Both are protocol buffers with a handful of fields, so a few lines of wire-format code read and write them:
the grain pipeline parses ArrayRecord records with it (no TensorFlow needed there), and the tests check it
byte for byte against TensorFlow's own.

Field numbers (tensorflow/core/example/{example,feature}.proto, core/framework/tensor{,_shape}.proto):
Example.features = 1; Features.feature = 1 (a map entry: key = 1, value = 2); Feature.bytes_list = 1,
float_list = 2, int64_list = 3, each with `value = 1`; TensorProto.dtype = 1, tensor_shape = 2,
tensor_content = 4; TensorShapeProto.dim = 2; Dim.size = 1.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

# TensorFlow's DataType enum values of the dtypes a tensor record may hold.
_DTYPES = {
  1: np.float32,
  2: np.float64,
  3: np.int32,
  4: np.uint8,
  5: np.int16,
  6: np.int8,
  9: np.int64,
  10: np.bool_,
  17: np.uint16,
  19: np.float16,
  22: np.uint32,
  23: np.uint64,
}
_ENUMS = {np.dtype(v): k for k, v in _DTYPES.items()}
_VARINT, _FIXED64, _BYTES, _FIXED32 = 0, 1, 2, 5


def _varint(value: int) -> bytes:
  value &= (1 << 64) - 1  # negative int64s are sent as their 64-bit two's complement
  out = bytearray()
  while True:
    low = value & 0x7F
    value >>= 7
    if value:
      out.append(low | 0x80)
    else:
      out.append(low)
      return bytes(out)


def _read_varint(data: bytes, pos: int) -> tuple[int, int]:
  result = shift = 0
  while True:
    if pos >= len(data):
      raise ValueError("truncated protocol buffer (a varint runs past the end)")
    byte = data[pos]
    pos += 1
    result |= (byte & 0x7F) << shift
    if not byte & 0x80:
      return result, pos
    shift += 7


def _field(number: int, payload: bytes) -> bytes:
  return _varint(number << 3 | _BYTES) + _varint(len(payload)) + payload


def _fields(data: bytes):
  """Yields (field number, wire type, value) of a message: ints for varints, bytes otherwise."""
  pos = 0
  while pos < len(data):
    key, pos = _read_varint(data, pos)
    number, wire = key >> 3, key & 7
    if wire == _VARINT:
      value, pos = _read_varint(data, pos)
    elif wire == _BYTES:
      size, pos = _read_varint(data, pos)
      value = data[pos : pos + size]
      if len(value) != size:
        raise ValueError("truncated protocol buffer (a field runs past the end)")
      pos += size
    elif wire in (_FIXED64, _FIXED32):
      size = 8 if wire == _FIXED64 else 4
      value = data[pos : pos + size]
      pos += size
    else:
      raise ValueError(f"not a protocol buffer: wire type {wire} in field {number}")
    yield number, wire, value


def serialize_tensor(array: Any) -> bytes:
  """The bytes `tf.io.serialize_tensor` writes for `array` (a numeric or bool numpy array)."""
  array = np.asarray(array)
  enum = _ENUMS.get(array.dtype)
  if enum is None:
    names = ", ".join(sorted(np.dtype(d).name for d in _DTYPES.values()))
    raise ValueError(f"serialize_tensor: dtype {array.dtype} is not supported; use one of {names}")
  # proto3 leaves out fields at their default (a dimension of size 0, empty content), as TensorFlow does.
  dims = (_varint(1 << 3 | _VARINT) + _varint(d) if d else b"" for d in array.shape)
  shape = b"".join(_field(2, d) for d in dims)
  content = array.astype(array.dtype.newbyteorder("<"), copy=False).tobytes()
  return (
    _varint(1 << 3 | _VARINT)
    + _varint(enum)
    + _field(2, shape)
    + (_field(4, content) if content else b"")
  )


def parse_tensor(data: bytes) -> np.ndarray:
  """The numpy array of `tf.io.serialize_tensor` bytes (as `tf.io.parse_tensor` reads them)."""
  enum, dims, content = None, [], b""
  for number, _, value in _fields(data):
    if number == 1:
      enum = value
    elif number == 2:
      for n, _, dim in _fields(value):
        if n == 2:
          dims.append(next((v for k, _, v in _fields(dim) if k == 1), 0))
    elif number == 4:
      content = value
  if enum not in _DTYPES:
    raise ValueError(f"parse_tensor: unsupported or missing TensorFlow dtype enum {enum}")
  dtype = np.dtype(_DTYPES[enum]).newbyteorder("<")
  count = int(np.prod(dims, dtype=np.int64))
  if len(content) != count * dtype.itemsize:
    raise ValueError(
      f"parse_tensor: {len(content)} content bytes for shape {tuple(dims)} of {dtype.name} "
      f"(expected {count * dtype.itemsize}); values stored outside tensor_content are not read"
    )
  return np.frombuffer(content, dtype).astype(dtype.newbyteorder("=")).reshape(dims)


def _feature(name: str, value: Any) -> bytes:
  if isinstance(value, bytes | str):
    value = [value]
  if (
    isinstance(value, np.ndarray)
    and value.dtype.kind in "iub"
    or isinstance(value, int | np.integer)
  ):
    ints = np.atleast_1d(np.asarray(value)).ravel()
    body = _field(3, _field(1, b"".join(_varint(int(v)) for v in ints)))
  elif isinstance(value, np.ndarray) and value.dtype.kind == "f" or isinstance(value, float):
    floats = np.atleast_1d(np.asarray(value, "<f4")).ravel()
    body = _field(2, _field(1, floats.tobytes()))
  elif isinstance(value, Sequence) and all(isinstance(v, bytes | str) for v in value):
    items = [v.encode() if isinstance(v, str) else v for v in value]
    body = _field(1, b"".join(_field(1, v) for v in items))
  else:
    raise ValueError(
      f"feature {name!r}: cannot store a {type(value).__name__}; give bytes or str (a bytes "
      "feature), ints (int64) or floats (float)"
    )
  return _field(1, _field(1, name.encode()) + _field(2, body))


def encode_example(features: Mapping[str, Any]) -> bytes:
  """A serialized `tf.train.Example`: bytes / str → a bytes feature, ints → int64, floats → float."""
  return _field(1, b"".join(_feature(k, v) for k, v in features.items()))


def decode_example(data: bytes) -> dict[str, list[bytes] | np.ndarray]:
  """The features of a serialized `tf.train.Example`: a list of bytes, or an int64 / float32 array."""
  out: dict[str, Any] = {}
  for number, _, features in _fields(data):
    if number != 1:
      continue
    for n, _, entry in _fields(features):
      if n != 1:
        continue
      name, feature = "", b""
      for k, _, v in _fields(entry):
        if k == 1:
          name = v.decode()
        elif k == 2:
          feature = v
      out[name] = _decode_feature(feature)
  return out


def _decode_feature(feature: bytes) -> list[bytes] | np.ndarray:
  for kind, _, values in _fields(feature):
    if kind == 1:
      return [v for n, _, v in _fields(values) if n == 1]
    if kind == 2:
      # Packed (one length-delimited field) or one fixed32 field per value: both are little-endian f32s.
      chunks = [np.frombuffer(v, "<f4") for n, _, v in _fields(values) if n == 1]
      return np.concatenate(chunks).astype(np.float32) if chunks else np.zeros(0, np.float32)
    if kind == 3:
      ints = []
      for n, w, v in _fields(values):
        if n != 1:
          continue
        if w == _VARINT:
          ints.append(v)
        else:
          pos = 0
          while pos < len(v):
            x, pos = _read_varint(v, pos)
            ints.append(x)
      return np.array([x - (1 << 64) if x >> 63 else x for x in ints], np.int64)
  return []
