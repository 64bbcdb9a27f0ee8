"""Random-access sources for the grain pipeline: image / video folders with captions, ArrayRecord files.

A folder's captions come from `metadata.jsonl` or `metadata.csv` when it has one (Hugging Face's imagefolder
convention: a `file_name` column, paths relative to the folder, and a `text` column), else from a sidecar
text file per picture (`cat.png` + `cat.txt`). Each item is `{"pixels": float32 [H, W, 3] or [F, H, W, 3] in
[0, 1], "captions": str}`.
"""

from __future__ import annotations

import bisect
import csv
import io
import json
import os
import pathlib
from collections.abc import Sequence
from typing import Any

import numpy as np
from PIL import Image

from md_data._example import decode_example, parse_tensor
from md_data._shapes import ShapesConfig, shapes_sample
from md_data._tfrecord import (
  CAPTION_FEATURES,
  IMAGE_FEATURE,
  LATENT_FEATURES,
  TIMESTEPS_FEATURE,
  iter_tfrecord,
  record_files,
)

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".bmp")
VIDEO_SUFFIXES = (".gif", ".mp4", ".webm", ".mov", ".mkv", ".avi")
METADATA_FILES = ("metadata.jsonl", "metadata.csv")


def import_grain():
  """grain; an error names the extra to install."""
  try:
    import grain
  except ImportError as err:
    raise ImportError(
      "md-data's grain pipeline needs grain: pip install 'md-data[grain]' (grain, array-record); "
      f"importing it failed: {err}"
    ) from err
  return grain


def _fit(image: Image.Image, size: tuple[int, int] | None) -> np.ndarray:
  """RGB float32 pixels; with `size`, the shorter side resized to it and then centre-cropped."""
  image = image.convert("RGB")
  if size is not None:
    h, w = size
    scale = max(h / image.height, w / image.width)
    new = (max(w, round(image.width * scale)), max(h, round(image.height * scale)))
    image = image.resize(new, resample=Image.Resampling.BICUBIC)
    left, top = (image.width - w) // 2, (image.height - h) // 2
    image = image.crop((left, top, left + w, top + h))
  return np.asarray(image, np.float32) / 255.0


def _decode_image(data: bytes | pathlib.Path, size, what: str) -> np.ndarray:
  try:
    with Image.open(io.BytesIO(data) if isinstance(data, bytes) else data) as image:
      return _fit(image, size)
  except (OSError, SyntaxError, ValueError) as err:
    raise ValueError(f"{what}: cannot decode the image: {err}") from err


def _load_video(path: pathlib.Path, size, frames: int | None) -> np.ndarray:
  if path.suffix.lower() == ".gif":  # Pillow reads GIFs; other containers go through ffmpeg
    try:
      with Image.open(path) as gif:
        clip = []
        for k in range(getattr(gif, "n_frames", 1)):
          if frames is not None and k >= frames:
            break
          gif.seek(k)
          clip.append(_fit(gif, size))
    except (OSError, SyntaxError, ValueError) as err:
      raise ValueError(f"{path}: cannot decode the video: {err}") from err
    clip = np.stack(clip)
  else:
    from md_core import media

    clip = media.load_video(path, max_frames=frames)
    if size is not None:
      clip = np.stack([_fit(Image.fromarray(media.to_uint8(f)), size) for f in clip])
  if frames is not None and len(clip) < frames:
    raise ValueError(f"{path}: the video has {len(clip)} frames, fewer than frames={frames}")
  return clip


def _metadata_captions(path: pathlib.Path, column: str) -> list[tuple[str, str]]:
  if path.suffix == ".jsonl":
    rows = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
      if line.strip():
        try:
          rows.append(json.loads(line))
        except json.JSONDecodeError as err:
          raise ValueError(f"{path}:{n}: not a JSON object: {err}") from None
  else:
    with path.open(newline="") as f:
      rows = list(csv.DictReader(f))
  out = []
  for n, row in enumerate(rows, 1):
    missing = [k for k in ("file_name", column) if k not in row]
    if missing:
      raise ValueError(
        f"{path}: row {n} has no {' or '.join(repr(k) for k in missing)} column (it has "
        f"{', '.join(row)}); the metadata needs file_name and {column}"
      )
    out.append((str(row["file_name"]), str(row[column])))
  return out


class FolderSource:
  """The pictures (images or videos) of a folder and their captions, as a grain random-access source."""

  def __init__(
    self,
    folder: str | os.PathLike,
    *,
    image_size: int | tuple[int, int] | None = None,
    frames: int | None = None,
    caption_column: str = "text",
  ):
    """Lists the folder's pictures and reads their captions.

    Args:
      folder: the folder; sub-folders are searched too (sidecar captions).
      image_size: `(height, width)` or one int: resize the shorter side, then centre-crop. None keeps each
        picture's size (then a batch needs pictures of one size).
      frames: a video's first `frames` frames (None: all); ignored for images.
      caption_column: the metadata's caption column.

    Raises:
      FileNotFoundError: the folder does not exist (or is a file).
      ValueError: no pictures, a picture without a caption, or a metadata row naming a missing file.
    """
    root = pathlib.Path(folder)
    if not root.is_dir():
      raise FileNotFoundError(
        f"FolderSource: {root} {'is not a folder' if root.exists() else 'does not exist'}"
      )
    self._size = (image_size, image_size) if isinstance(image_size, int) else image_size
    self._frames = frames
    suffixes = IMAGE_SUFFIXES + VIDEO_SUFFIXES
    meta = next((root / m for m in METADATA_FILES if (root / m).is_file()), None)
    if meta is not None:
      items = []
      for name, text in _metadata_captions(meta, caption_column):
        path = root / name
        if not path.is_file():
          raise ValueError(f"{meta}: file_name {name!r} does not exist in {root}")
        items.append((path, text))
    else:
      try:
        found = sorted(p for p in root.rglob("*") if p.suffix.lower() in suffixes and p.is_file())
      except OSError as err:
        raise ValueError(f"FolderSource: cannot list {root}: {err}") from err
      items = []
      for path in found:
        sidecar = path.with_suffix(".txt")
        if not sidecar.is_file():
          raise ValueError(
            f"{path} has no caption: add {sidecar.name} beside it, or a metadata.jsonl / "
            f"metadata.csv (file_name, {caption_column}) in {root}"
          )
        items.append((path, sidecar.read_text().strip()))
    if not items:
      raise ValueError(
        f"FolderSource: {root} holds no images or videos ({', '.join(suffixes)})"
        + (f"; {meta.name} lists none" if meta is not None else "")
      )
    self._items = items
    self.root = root

  @property
  def files(self) -> list[pathlib.Path]:
    return [p for p, _ in self._items]

  def __len__(self) -> int:
    return len(self._items)

  def __getitem__(self, index: int) -> dict[str, Any]:
    path, text = self._items[index]
    if path.suffix.lower() in VIDEO_SUFFIXES:
      pixels = _load_video(path, self._size, self._frames)
    else:
      pixels = _decode_image(path, self._size, str(path))
    return {"pixels": pixels, "captions": text}

  def __repr__(self) -> str:
    return f"FolderSource({str(self.root)!r}, {len(self)} items)"


class ShapesSource:
  """`count` samples of the procedural shapes dataset as a random-access source (`{"pixels", "captions"}`)."""

  def __init__(self, config: ShapesConfig | None = None, *, seed: int = 0, count: int = 64):
    if count < 1:
      raise ValueError(f"ShapesSource: count must be positive, got {count}")
    self.config, self.seed, self.count = config or ShapesConfig(), int(seed), int(count)

  def __len__(self) -> int:
    return self.count

  def __getitem__(self, index: int) -> dict[str, Any]:
    if not 0 <= index < self.count:
      raise IndexError(f"ShapesSource: index {index} out of range [0, {self.count})")
    sample = shapes_sample(self.config, self.seed, int(index))
    return {"pixels": sample.pixels, "captions": sample.caption}

  def __repr__(self) -> str:
    return f"ShapesSource({self.config}, seed={self.seed}, count={self.count})"


class ArrayRecordSource:
  """Records of ArrayRecord files, each a serialized `tf.train.Example` in the TFRecord layouts.

  `kind="latents"` decodes `latents`, `encoder_hidden_states` (and `timesteps` when present) to arrays;
  `kind="images"` decodes `image` to float pixels and the caption to `"captions"`; `kind=None` returns
  the raw features (`decode_example`).
  """

  def __init__(
    self,
    source: str | os.PathLike | Sequence[str | os.PathLike],
    *,
    kind: str | None = "latents",
    image_size: int | tuple[int, int] | None = None,
  ):
    if kind not in ("latents", "images", None):
      raise ValueError(f"ArrayRecordSource: kind must be 'latents', 'images' or None, got {kind!r}")
    grain = import_grain()
    self._files = record_files(source, "ArrayRecordSource")
    self._readers = []
    for f in self._files:
      try:
        self._readers.append(grain.sources.ArrayRecordDataSource([f]))
      except Exception as err:  # noqa: BLE001 -- array_record raises plain RuntimeError/ValueError
        raise ValueError(f"{f}: cannot open as an ArrayRecord file: {err}") from err
    self._ends = np.cumsum([len(r) for r in self._readers]).tolist()
    if not self._ends or self._ends[-1] == 0:
      raise ValueError(f"ArrayRecordSource: {', '.join(self._files)} hold no records")
    self._kind = kind
    self._size = (image_size, image_size) if isinstance(image_size, int) else image_size

  def __len__(self) -> int:
    return self._ends[-1]

  def __getitem__(self, index: int) -> dict[str, Any]:
    index = int(index)
    k = bisect.bisect_right(self._ends, index)
    start = self._ends[k - 1] if k else 0
    name = self._files[k]
    features = decode_example(self._readers[k][index - start])
    if self._kind is None:
      return features
    if self._kind == "latents":
      need = LATENT_FEATURES
    else:
      caption = next((c for c in CAPTION_FEATURES if c in features), CAPTION_FEATURES[0])
      need = (IMAGE_FEATURE, caption)
    for n in need:
      if n not in features:
        raise ValueError(
          f"{name}: record {index - start} has no feature {n!r} (it has "
          f"{', '.join(sorted(features)) or 'none'}); {self._kind} records need {', '.join(need)}"
        )
    if self._kind == "latents":
      out = {n: parse_tensor(features[n][0]) for n in LATENT_FEATURES}
      if TIMESTEPS_FEATURE in features:
        out[TIMESTEPS_FEATURE] = features[TIMESTEPS_FEATURE][0]
      return out
    pixels = _decode_image(
      features[IMAGE_FEATURE][0], self._size, f"{name}: record {index - start}"
    )
    return {"pixels": pixels, "captions": features[need[1]][0].decode()}

  def __repr__(self) -> str:
    return f"ArrayRecordSource({len(self._files)} files, {len(self)} records)"


class TFRecordImageSource:
  """Raw-image TFRecords (`image` + `text` / `caption`) as a random-access source (no TensorFlow needed).

  The encoded images and captions are read into memory once (decoded on access), which suits preparing a
  dataset of compressed images; stream large ones with `read_image_records` instead.
  """

  def __init__(
    self,
    source: str | os.PathLike | Sequence[str | os.PathLike],
    *,
    image_size: int | tuple[int, int] | None = None,
  ):
    self._size = (image_size, image_size) if isinstance(image_size, int) else image_size
    self._items: list[tuple[bytes, str, str]] = []
    for f in record_files(source, "TFRecordImageSource"):
      for n, record in enumerate(iter_tfrecord(f)):
        features = decode_example(record)
        caption = next((c for c in CAPTION_FEATURES if c in features), None)
        for name in (IMAGE_FEATURE, caption or CAPTION_FEATURES[0]):
          if name not in features:
            raise ValueError(
              f"{f}: record {n} has no feature {name!r} (it has "
              f"{', '.join(sorted(features)) or 'none'}); image records need image and text"
            )
        self._items.append(
          (features[IMAGE_FEATURE][0], features[caption][0].decode(), f"{f}: record {n}")
        )
    if not self._items:
      raise ValueError(f"TFRecordImageSource: {source} holds no records")

  def __len__(self) -> int:
    return len(self._items)

  def __getitem__(self, index: int) -> dict[str, Any]:
    data, text, where = self._items[index]
    return {"pixels": _decode_image(data, self._size, where), "captions": text}


def write_array_record(path: str | os.PathLike, examples) -> int:
  """Writes serialized examples to one ArrayRecord file (temporary name, renamed when complete)."""
  import_grain()
  from array_record.python import array_record_module

  path = pathlib.Path(path)
  path.parent.mkdir(parents=True, exist_ok=True)
  tmp = path.with_name(path.name + ".tmp")
  writer = array_record_module.ArrayRecordWriter(str(tmp), "group_size:1")
  count = 0
  try:
    for example in examples:
      writer.write(example)
      count += 1
  finally:
    writer.close()
  os.replace(tmp, path)
  return count
