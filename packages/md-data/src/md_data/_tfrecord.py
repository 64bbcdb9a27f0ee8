"""TFRecord files in MaxDiffusion's layouts: written here, read with tf.data (extra: `md-data[tfrecord]`).

Cached latents (what MaxDiffusion's training reads when `cache_latents_text_encoder_outputs` is set): each
record is a `tf.train.Example` whose `latents` and `encoder_hidden_states` features hold one
`tf.io.serialize_tensor` float tensor each (bytes features), plus an int64 `timesteps` on held-out eval
records. Raw images: an `image` bytes feature (an encoded PNG or JPEG) and a `text` caption (`caption` is
read too). md writes latents in its own channels-last layout (`[h, w, c]`, video `[f, h, w, c]`); MaxDiffusion
writes channels first. Writing and the checks before reading need no TensorFlow (framing, examples and
tensors are encoded in md-data); the batched reader is a tf.data pipeline.
"""

from __future__ import annotations

import glob
import io
import os
import pathlib
import struct
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from md_data._example import decode_example, encode_example, serialize_tensor

LATENT_FEATURES = ("latents", "encoder_hidden_states")
IMAGE_FEATURE = "image"
CAPTION_FEATURES = ("text", "caption")
TIMESTEPS_FEATURE = "timesteps"
# Files a folder of records may hold: anything but hidden files and the writer's unfinished ones.
_TMP_SUFFIX = ".tmp"


def import_tensorflow():
  """TensorFlow, with its GPUs hidden (JAX owns the accelerators); an error names the extra to install."""
  try:
    import tensorflow as tf
  except ImportError as err:
    raise ImportError(
      "md-data's TFRecord pipeline needs TensorFlow: pip install 'md-data[tfrecord]' "
      f"(tensorflow-cpu); importing it failed: {err}"
    ) from err
  try:
    tf.config.set_visible_devices([], "GPU")
  except RuntimeError:  # already initialised by the caller: leave its choice alone
    pass
  return tf


def latent_example(
  latents: Any, encoder_hidden_states: Any, *, timesteps: int | None = None
) -> bytes:
  """One cached-latent record: `latents` and `encoder_hidden_states` as serialized float32 tensors.

  Args:
    latents: one example's latents, e.g. `[h, w, c]` or `[f, h, w, c]`.
    encoder_hidden_states: its text states `[S, D]`.
    timesteps: the fixed timestep of a held-out eval record (MaxDiffusion's eval layout), or None.

  Returns:
    A serialized `tf.train.Example`.
  """
  features: dict[str, Any] = {
    "latents": serialize_tensor(np.asarray(latents, np.float32)),
    "encoder_hidden_states": serialize_tensor(np.asarray(encoder_hidden_states, np.float32)),
  }
  if timesteps is not None:
    features[TIMESTEPS_FEATURE] = int(timesteps)
  return encode_example(features)


def image_example(image: Any, caption: str, *, format: str = "png") -> bytes:
  """One raw-image record: `image` (encoded bytes) and its `text` caption.

  Args:
    image: encoded image bytes (kept as they are), or pixels `[H, W, 3]` (uint8, or float in [0, 1])
      that are encoded as `format`.
    caption: the image's caption.
    format: "png" or "jpeg", for pixels.
  """
  if not isinstance(image, bytes):
    from PIL import Image

    from md_core import media

    if format not in ("png", "jpeg"):
      raise ValueError(f"image_example: format must be 'png' or 'jpeg', got {format!r}")
    buffer = io.BytesIO()
    Image.fromarray(media.to_uint8(np.asarray(image))).save(buffer, format=format.upper())
    image = buffer.getvalue()
  return encode_example({IMAGE_FEATURE: image, CAPTION_FEATURES[0]: caption})


def _masked_crc(data: bytes) -> int:
  """TFRecord's checksum: CRC-32C, rotated right by 15 bits plus a constant (tensorflow/core/lib/hash/crc32c.h)."""
  import google_crc32c

  crc = google_crc32c.value(data)
  return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def _frame(record: bytes) -> bytes:
  header = struct.pack("<Q", len(record))
  return (
    header
    + struct.pack("<I", _masked_crc(header))
    + record
    + struct.pack("<I", _masked_crc(record))
  )


def write_tfrecord(path: str | os.PathLike, examples: Iterable[bytes]) -> int:
  """Writes serialized examples to one TFRecord file, atomically: a temporary name, renamed when complete.

  A file at `path` therefore always holds every record it was meant to (an interrupted writer leaves only
  `<path>.tmp`, which readers skip). The framing (length, masked CRC-32C of it, data, masked CRC-32C of
  the data) is written here, without TensorFlow; the tests read the files back with tf.data.

  Returns:
    The number of records written.
  """
  path = pathlib.Path(path)
  path.parent.mkdir(parents=True, exist_ok=True)
  tmp = path.with_name(path.name + _TMP_SUFFIX)
  count = 0
  with tmp.open("wb") as f:
    for example in examples:
      f.write(_frame(bytes(example)))
      count += 1
  os.replace(tmp, path)
  return count


def iter_tfrecord(path: str | os.PathLike) -> Iterator[bytes]:
  """The records of one TFRecord file, checksums verified, without TensorFlow.

  Raises:
    ValueError: a truncated file or a checksum that does not match (the file and offset named).
  """
  path = pathlib.Path(path)
  with path.open("rb") as f:
    offset = 0
    while True:
      header = f.read(12)
      if not header:
        return
      if len(header) < 12:
        raise ValueError(f"{path}: truncated record header at byte {offset}")
      (length,), (crc,) = struct.unpack("<Q", header[:8]), struct.unpack("<I", header[8:])
      if crc != _masked_crc(header[:8]):
        raise ValueError(f"{path}: not a TFRecord file (bad length checksum at byte {offset})")
      data, footer = f.read(length), f.read(4)
      if len(data) < length or len(footer) < 4:
        raise ValueError(f"{path}: truncated record at byte {offset}")
      if struct.unpack("<I", footer)[0] != _masked_crc(data):
        raise ValueError(f"{path}: corrupt record at byte {offset} (data checksum)")
      offset += 16 + length
      yield data


def record_files(source: str | os.PathLike | Sequence[str | os.PathLike], what: str) -> list[str]:
  """The sorted files of a folder (hidden and unfinished `.tmp` files left out), a glob, or a list.

  Raises:
    FileNotFoundError: a folder or file that does not exist.
    ValueError: a folder or glob with no files.
  """
  if isinstance(source, str | os.PathLike):
    text = os.fspath(source)
    if any(c in text for c in "*?["):
      files = sorted(f for f in glob.glob(text) if os.path.isfile(f))
      if not files:
        raise ValueError(f"{what}: the pattern {text!r} matches no files")
      return files
    path = pathlib.Path(text)
    if not path.exists():
      raise FileNotFoundError(f"{what}: {path} does not exist")
    if path.is_file():
      return [str(path)]
    files = sorted(
      str(p)
      for p in path.iterdir()
      if p.is_file() and not p.name.startswith(".") and not p.name.endswith(_TMP_SUFFIX)
    )
    if not files:
      raise ValueError(f"{what}: the folder {path} holds no record files")
    return files
  files = [os.fspath(f) for f in source]
  if not files:
    raise ValueError(f"{what}: an empty list of files")
  for f in files:
    if not os.path.isfile(f):
      raise FileNotFoundError(f"{what}: {f} does not exist")
  return files


def shard_files(
  files: Sequence[str], process_index: int | None, process_count: int | None, what: str
) -> list[str]:
  """This process's files: every `process_count`-th, from `process_index` (jax's by default)."""
  if process_index is None or process_count is None:
    import jax

    process_index = jax.process_index() if process_index is None else process_index
    process_count = jax.process_count() if process_count is None else process_count
  if not 0 <= process_index < process_count:
    raise ValueError(f"{what}: process_index={process_index} must lie in [0, {process_count})")
  if len(files) < process_count:
    raise ValueError(
      f"{what}: {len(files)} files cannot be split over {process_count} processes; write at least "
      f"{process_count} shards (one file per process or more)"
    )
  return list(files[process_index::process_count])


class TFRecordIterator:
  """Batches of numpy arrays (dicts) from TFRecord files, through tf.data; resumable by batch count.

  `state()` is the number of batches served (JSON-able); `restore(state)` rebuilds the pipeline and skips
  that many batches, so with a fixed `seed` the next batch equals the uninterrupted run's. Files are split
  between processes (every `process_count`-th file), so each process loads its own part of the global
  batch.
  """

  def __init__(
    self,
    source: str | os.PathLike | Sequence[str | os.PathLike],
    *,
    kind: str,
    batch_size: int,
    seed: int | None = 0,
    shuffle_buffer: int = 1024,
    drop_remainder: bool = True,
    repeat: bool = True,
    image_size: int | tuple[int, int] | None = None,
    timesteps: bool | None = None,
    process_index: int | None = None,
    process_count: int | None = None,
  ):
    if kind not in ("latents", "images"):
      raise ValueError(f"TFRecordIterator: kind must be 'latents' or 'images', got {kind!r}")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
      raise ValueError(f"TFRecordIterator: batch_size must be a positive int, got {batch_size!r}")
    what = f"TFRecords ({kind})"
    self._files = shard_files(record_files(source, what), process_index, process_count, what)
    self._kind, self._batch_size, self._seed = kind, batch_size, seed
    self._shuffle_buffer, self._drop_remainder, self._repeat = (
      shuffle_buffer,
      drop_remainder,
      repeat,
    )
    if isinstance(image_size, int):
      image_size = (image_size, image_size)
    self._image_size = image_size
    self._features = self._check_features(timesteps)
    self._served = 0
    self._it = iter(self._dataset())

  @property
  def files(self) -> list[str]:
    """This process's files."""
    return list(self._files)

  def _check_features(self, timesteps: bool | None) -> tuple[str, ...]:
    """The features to read, checked on each file's first record (the file and feature named)."""
    wanted: list[str] | None = None
    for f in self._files:
      first = next(iter_tfrecord(f), None)
      if first is None:
        raise ValueError(f"{f}: the file holds no records")
      have = decode_example(first)
      if self._kind == "latents":
        need = list(LATENT_FEATURES)
        if timesteps or (timesteps is None and wanted is None and TIMESTEPS_FEATURE in have):
          need.append(TIMESTEPS_FEATURE)
        need = wanted or need
      else:
        caption = next((c for c in CAPTION_FEATURES if c in have), CAPTION_FEATURES[0])
        need = wanted or [IMAGE_FEATURE, caption]
      for name in need:
        if name not in have:
          raise ValueError(
            f"{f}: a record has no feature {name!r} (it has {', '.join(sorted(have)) or 'none'}); "
            f"{self._kind} records need {', '.join(need)}"
          )
      wanted = need
    return tuple(wanted)

  def _dataset(self):
    tf = import_tensorflow()
    spec = {
      name: tf.io.FixedLenFeature([], tf.int64 if name == TIMESTEPS_FEATURE else tf.string)
      for name in self._features
    }
    files = tf.data.Dataset.from_tensor_slices(self._files)
    if self._seed is not None:
      files = files.shuffle(len(self._files), seed=self._seed)
    ds = files.interleave(
      tf.data.TFRecordDataset,
      cycle_length=min(4, len(self._files)),
      num_parallel_calls=tf.data.AUTOTUNE,
      deterministic=True,
    )
    if self._seed is not None:
      ds = ds.shuffle(self._shuffle_buffer, seed=self._seed + 1)
    ds = ds.map(self._parser(tf, spec), num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
    ds = ds.batch(self._batch_size, drop_remainder=self._drop_remainder)
    if self._repeat:
      ds = ds.repeat()
    return ds.prefetch(2)

  def _parser(self, tf, spec):
    names, size = self._features, self._image_size

    def parse(record):
      raw = tf.io.parse_single_example(record, spec)
      if self._kind == "latents":
        out = {n: tf.io.parse_tensor(raw[n], tf.float32) for n in LATENT_FEATURES}
        if TIMESTEPS_FEATURE in names:
          out[TIMESTEPS_FEATURE] = raw[TIMESTEPS_FEATURE]
        return out
      image = tf.io.decode_image(raw[IMAGE_FEATURE], channels=3, expand_animations=False)
      image = tf.cast(image, tf.float32) / 255.0
      if size is not None:
        # The shorter side to the target, then a centre crop (diffusers' train_text_to_image.py).
        h, w = tf.cast(tf.shape(image)[0], tf.float32), tf.cast(tf.shape(image)[1], tf.float32)
        scale = tf.maximum(size[0] / h, size[1] / w)
        new = tf.cast(tf.math.ceil(tf.stack([h * scale, w * scale])), tf.int32)
        image = tf.image.resize(image, new, method="bicubic", antialias=True)
        image = tf.image.resize_with_crop_or_pad(image, size[0], size[1])
        image = tf.clip_by_value(image, 0.0, 1.0)
      return {"pixels": image, "captions": raw[names[1]]}

    return parse

  def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
    return self

  def __next__(self) -> dict[str, np.ndarray]:
    tf = import_tensorflow()
    try:
      batch = next(self._it)
    except tf.errors.InvalidArgumentError as err:
      raise ValueError(
        f"a record of {', '.join(self._files)} could not be read as {self._kind} records with "
        f"features {', '.join(self._features)}: {err.message.splitlines()[0]}"
      ) from None
    self._served += 1
    out = {k: v.numpy() for k, v in batch.items()}
    if "captions" in out:
      out["captions"] = [c.decode() for c in out["captions"]]
    return out

  def state(self) -> dict[str, Any]:
    """The position: batches served so far (JSON-able)."""
    return {"batches": self._served}

  def restore(self, state: Mapping[str, Any]) -> None:
    """Continues after `state["batches"]` batches, as the run that saved `state` did."""
    served = int(state["batches"])
    if served < 0:
      raise ValueError(f"TFRecordIterator.restore: batches must be >= 0, got {served}")
    self._it = iter(self._dataset().skip(served))
    self._served = served


def read_latent_records(source, *, batch_size: int, **options: Any) -> TFRecordIterator:
  """Cached-latent batches `{"latents": [B, ...], "encoder_hidden_states": [B, S, D]}` (+ `"timesteps"`
  `[B]` int64 on eval records) from TFRecords; `options` as `TFRecordIterator`."""
  return TFRecordIterator(source, kind="latents", batch_size=batch_size, **options)


def read_image_records(source, *, batch_size: int, **options: Any) -> TFRecordIterator:
  """Raw-image batches `{"pixels": [B, H, W, 3] float32 in [0, 1], "captions": [str]}` from TFRecords;
  pass `image_size` unless every image has one size; `options` as `TFRecordIterator`."""
  return TFRecordIterator(source, kind="images", batch_size=batch_size, **options)
