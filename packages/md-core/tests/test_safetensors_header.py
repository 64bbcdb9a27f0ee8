"""md-core's safetensors reader refuses every header inconsistency, naming the file and the tensor: hand-made
headers (negative or fractional dimensions, reversed or negative offsets, overlapping tensors, sizes that
disagree with dtype x shape, offsets past the file, wrong types)."""

import json
import struct

import numpy as np
import pytest

import md_core


def _write(path, header: dict, data: bytes) -> None:
  text = json.dumps(header).encode()
  path.write_bytes(struct.pack("<Q", len(text)) + text + data)


def _f32(shape, begin):
  count = int(np.prod(shape))
  return {"dtype": "F32", "shape": list(shape), "data_offsets": [begin, begin + 4 * count]}


@pytest.mark.parametrize(
  "header, data_bytes, words",
  [
    ({"w": {"dtype": "F32", "shape": [-2, 2], "data_offsets": [16, 0]}}, 16, "shape [-2, 2]"),
    ({"w": {"dtype": "F32", "shape": [2, 2], "data_offsets": [-8, 8]}}, 16, "data_offsets [-8, 8]"),
    ({"w": {"dtype": "F32", "shape": [0], "data_offsets": [8, 0]}}, 16, "end is before the begin"),
    ({"w": {"dtype": "F32", "shape": [2.5], "data_offsets": [0, 8]}}, 16, "shape [2.5]"),
    ({"w": {"dtype": "F32", "shape": [True], "data_offsets": [0, 4]}}, 16, "shape [True]"),
    ({"w": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, 16, "needs 12 bytes"),
    ({"w": {"dtype": "F32", "shape": [8], "data_offsets": [0, 32]}}, 16, "ends at byte 32"),
    ({"w": {"dtype": "X9", "shape": [1], "data_offsets": [0, 4]}}, 16, "unsupported dtype 'X9'"),
    ({"w": {"dtype": "F32", "shape": [1], "data_offsets": [0]}}, 16, "expected [begin, end]"),
    ({"w": {"dtype": "F32", "shape": [1]}}, 16, "unsupported entry"),
    ({"w": [1, 2]}, 16, "unsupported entry"),
    (
      {"a": _f32([4], 0), "b": _f32([2], 8)},
      16,
      "tensor 'b' starts at data byte 8, inside tensor 'a'",
    ),
    (
      {"a": _f32([2], 8), "b": _f32([4], 0)},
      16,
      "tensor 'a' starts at data byte 8, inside tensor 'b'",
    ),
    ({"w": {"dtype": "F32", "shape": [2**40, 2**40], "data_offsets": [0, 16]}}, 16, "needs"),
  ],
)
def test_inconsistent_headers_name_file_and_tensor(tmp_path, header, data_bytes, words):
  path = tmp_path / "bad.safetensors"
  _write(path, header, bytes(data_bytes))
  with pytest.raises(md_core.SafetensorsError) as e:
    md_core.SafetensorsFile(path)
  assert str(path) in str(e.value) and words in str(e.value), str(e.value)


def test_header_not_an_object_and_bad_metadata(tmp_path):
  path = tmp_path / "bad.safetensors"
  _write(path, [1, 2], b"")  # type: ignore[arg-type]
  with pytest.raises(md_core.SafetensorsError, match="not a JSON object"):
    md_core.SafetensorsFile(path)
  _write(path, {"__metadata__": [1]}, b"")
  with pytest.raises(md_core.SafetensorsError, match="__metadata__"):
    md_core.SafetensorsFile(path)


def test_consistent_headers_still_read(tmp_path):
  path = tmp_path / "ok.safetensors"
  a, b = np.arange(4, dtype=np.float32), np.arange(2, dtype=np.float32) + 10
  _write(
    path, {"a": _f32([4], 0), "b": _f32([2], 16), "e": _f32([0], 24)}, a.tobytes() + b.tobytes()
  )
  f = md_core.SafetensorsFile(path)
  np.testing.assert_array_equal(f["a"], a)
  np.testing.assert_array_equal(f["b"], b)
  assert f["e"].shape == (0,)
