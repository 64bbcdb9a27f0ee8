"""Media I/O: images, videos (MP4 with optional AAC audio, GIF) and 16-bit WAV audio.

Pipelines return arrays; this module turns them into files and reads files back into arrays.

Conventions:
  * Pixels are float in [0, 1] (any float dtype, numpy or jax, bf16 included) or uint8. Readers
    always return float32 in [0, 1].
  * Images are `[H, W, C]` with C = 3 (RGB), 4 (RGBA) or 1 / no channel axis (grey); videos are
    `[F, H, W, 3]`; audio is `[channels, samples]` float in [-1, 1].
  * Video goes through the ffmpeg binary that imageio-ffmpeg ships
    (`imageio_ffmpeg.get_ffmpeg_exe()`), so no system ffmpeg or ffprobe is needed.

Errors name the file and say what was expected and what came: a missing file raises
`FileNotFoundError`, a file the decoder rejects or a wrong shape, dtype or suffix raises
`ValueError`.
"""

from __future__ import annotations

import math
import os
import pathlib
import re
import subprocess
import tempfile
import wave
from collections.abc import Sequence
from fractions import Fraction
from typing import Any

import imageio_ffmpeg
import jax.numpy as jnp
import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

PathLike = str | os.PathLike

# Suffix → Pillow format name. JPEG and WebP are lossy; PNG round-trips uint8 exactly.
IMAGE_FORMATS = {".png": "PNG", ".jpg": "JPEG", ".jpeg": "JPEG", ".webp": "WEBP"}
VIDEO_SUFFIXES = (".mp4", ".gif")


# --------------------------------------------------------------------------------------------------
# Pixels


def to_uint8(x: Any) -> np.ndarray:
  """Converts pixels to uint8: floats in [0, 1] are scaled by 255, rounded and clipped.

  uint8 input is returned as it is.

  Args:
    x: a numpy or (fully addressable) jax array of any float dtype (bf16 included) or uint8.

  Returns:
    A numpy uint8 array of the same shape.

  Raises:
    TypeError: the dtype is neither floating nor uint8 (e.g. int32 or bool, whose scale is
      ambiguous).
    ValueError: the array holds NaN.
  """
  arr = np.asarray(x)
  if arr.dtype == np.uint8:
    return arr
  # jnp.issubdtype also knows the ml_dtypes floats (bfloat16, float8), which numpy's does not.
  if not jnp.issubdtype(arr.dtype, jnp.floating):
    raise TypeError(f"to_uint8 expects float pixels in [0, 1] or uint8, got dtype {arr.dtype}")
  arr = arr.astype(np.float32)
  nans = int(np.isnan(arr).sum())
  if nans:
    raise ValueError(f"to_uint8: {nans} of {arr.size} pixel values are NaN (shape {arr.shape})")
  # Clip before scaling so ±inf and values slightly outside [0, 1] land on 0 / 255 without overflow.
  return np.rint(np.clip(arr, 0.0, 1.0) * 255.0).astype(np.uint8)


def _image_to_uint8(image: Any, what: str) -> np.ndarray:
  """`image` as uint8 `[H, W]`, `[H, W, 3]` or `[H, W, 4]` (`[H, W, 1]` grey loses its axis)."""
  arr = to_uint8(image)
  if arr.ndim == 3 and arr.shape[-1] == 1:
    arr = arr[..., 0]
  if arr.ndim == 2 or (arr.ndim == 3 and arr.shape[-1] in (3, 4)):
    return arr
  raise ValueError(
    f"{what}: expected an image [H, W, 3], [H, W, 4], [H, W, 1] or [H, W], got shape {arr.shape}"
  )


def _check_suffix(path: pathlib.Path, supported: Sequence[str], kind: str) -> str:
  suffix = path.suffix.lower()
  if suffix not in supported:
    raise ValueError(
      f"{path}: unsupported {kind} suffix {path.suffix!r}; supported: {', '.join(supported)}"
    )
  return suffix


def _existing_file(path: PathLike) -> pathlib.Path:
  path = pathlib.Path(path)
  if not path.exists():
    raise FileNotFoundError(f"{path}: no such file")
  if not path.is_file():
    raise ValueError(f"{path}: expected a file, found a directory or special file")
  return path


# --------------------------------------------------------------------------------------------------
# Images


def save_image(path: PathLike, image: Any, *, quality: int = 95) -> pathlib.Path:
  """Writes one image; the format follows the suffix (.png, .jpg/.jpeg, .webp).

  Args:
    path: output file; its parent folder is created.
    image: `[H, W, 3]` RGB, `[H, W, 4]` RGBA, `[H, W, 1]` or `[H, W]` grey; float in [0, 1] or
      uint8.
    quality: JPEG / WebP quality (1–100); PNG is lossless and ignores it.

  Returns:
    The path written.

  Raises:
    ValueError: unsupported suffix, wrong shape, NaN pixels, or RGBA into JPEG (which has no alpha).
  """
  path = pathlib.Path(path)
  suffix = _check_suffix(path, tuple(IMAGE_FORMATS), "image")
  pixels = _image_to_uint8(image, str(path))
  fmt = IMAGE_FORMATS[suffix]
  if fmt == "JPEG" and pixels.ndim == 3 and pixels.shape[-1] == 4:
    raise ValueError(f"{path}: JPEG cannot store an alpha channel; drop it or save as .png / .webp")
  path.parent.mkdir(parents=True, exist_ok=True)
  options = {} if fmt == "PNG" else {"quality": quality}
  Image.fromarray(pixels).save(path, format=fmt, **options)
  return path


def save_images(
  folder: PathLike, images: Any, *, prefix: str = "image", suffix: str = ".png"
) -> list[pathlib.Path]:
  """Writes a batch `[B, H, W, C]` as `folder/{prefix}_{i:04d}{suffix}`, one file per image.

  Args:
    folder: output folder; created when missing.
    images: `[B, H, W, C]` (C in 1, 3, 4) or `[B, H, W]` grey; float in [0, 1] or uint8.
    prefix: file-name stem before the index.
    suffix: image format, as in `save_image`.

  Returns:
    The paths written, in batch order.
  """
  folder = pathlib.Path(folder)
  _check_suffix(folder / f"{prefix}{suffix}", tuple(IMAGE_FORMATS), "image")
  batch = np.asarray(images)
  if batch.ndim not in (3, 4):
    raise ValueError(
      f"{folder}: expected a batch [B, H, W, C] or [B, H, W], got shape {batch.shape}"
    )
  return [save_image(folder / f"{prefix}_{i:04d}{suffix}", image) for i, image in enumerate(batch)]


def make_grid(
  images: Any,
  rows: int | None = None,
  cols: int | None = None,
  *,
  padding: int = 2,
  pad_value: float = 1.0,
) -> np.ndarray:
  """Tiles a batch into one image, row by row, with `padding` pixels between and around the cells.

  With neither `rows` nor `cols` the grid is as square as possible (`cols = ceil(sqrt(B))`); with
  one of them the other is the smallest that fits the batch. Cells left over are filled with
  `pad_value`.

  Args:
    images: `[B, H, W, C]` or `[B, H, W]`; float in [0, 1] or uint8.
    rows: number of grid rows.
    cols: number of grid columns.
    padding: pixels of `pad_value` between cells and around the border.
    pad_value: fill on the [0, 1] scale (scaled by 255 for uint8 input).

  Returns:
    `[rows * (H + padding) + padding, cols * (W + padding) + padding, C]`: uint8 for uint8 input,
    float32 otherwise (grey input keeps no channel axis).
  """
  batch = np.asarray(images)
  if batch.ndim not in (3, 4):
    raise ValueError(f"make_grid: expected [B, H, W, C] or [B, H, W], got shape {batch.shape}")
  if batch.dtype != np.uint8:
    if not jnp.issubdtype(batch.dtype, jnp.floating):
      raise TypeError(f"make_grid expects float pixels in [0, 1] or uint8, got dtype {batch.dtype}")
    batch = batch.astype(np.float32)
    fill = pad_value
  else:
    fill = round(pad_value * 255)
  n = batch.shape[0]
  if n == 0:
    raise ValueError("make_grid: the batch is empty")
  if padding < 0:
    raise ValueError(f"make_grid: padding must be >= 0, got {padding}")
  if rows is None and cols is None:
    cols = math.ceil(math.sqrt(n))
  if cols is None:
    cols = math.ceil(n / rows)
  if rows is None:
    rows = math.ceil(n / cols)
  if rows < 1 or cols < 1 or rows * cols < n:
    raise ValueError(f"make_grid: a {rows}x{cols} grid cannot hold {n} images")
  h, w = batch.shape[1:3]
  out_shape = (rows * (h + padding) + padding, cols * (w + padding) + padding, *batch.shape[3:])
  grid = np.full(out_shape, fill, dtype=batch.dtype)
  for i, image in enumerate(batch):
    top = padding + (i // cols) * (h + padding)
    left = padding + (i % cols) * (w + padding)
    grid[top : top + h, left : left + w] = image
  return grid


def load_image(
  source: PathLike | Image.Image | Any,
  *,
  size: int | tuple[int, int] | None = None,
  mode: str = "RGB",
) -> np.ndarray:
  """Reads an image into float32 pixels in [0, 1].

  Files are decoded by Pillow and turned upright by their EXIF orientation (photos from phones).
  Float arrays are quantised to 8 bits on the way (they go through Pillow like everything else).

  Args:
    source: a path, a `PIL.Image.Image`, or an array `[H, W, C]` / `[H, W]` (float in [0, 1] or
      uint8).
    size: `(height, width)` or one int for a square; the image is resized to exactly that (aspect
      ratio is not kept) with Lanczos filtering, the filter diffusers' image processor uses. None
      keeps the size.
    mode: Pillow mode to convert to: "RGB" → `[H, W, 3]`, "RGBA" → `[H, W, 4]`, "L" (grey) →
      `[H, W, 1]`. Converting RGBA to RGB drops alpha as Pillow does (no compositing), like
      diffusers' `load_image`.

  Returns:
    float32 `[H, W, C]` in [0, 1].

  Raises:
    FileNotFoundError: the path does not exist.
    ValueError: the decoder rejects the file, or the mode, size or array shape is invalid.
  """
  channels = {"RGB": 3, "RGBA": 4, "L": 1}
  if mode not in channels:
    raise ValueError(f"load_image: mode must be one of {', '.join(channels)}, got {mode!r}")
  if isinstance(source, Image.Image):
    image, name = source, "PIL image"
  elif isinstance(source, str | os.PathLike):
    path = _existing_file(source)
    name = str(path)
    try:
      with Image.open(path) as opened:
        opened.load()
        image = ImageOps.exif_transpose(opened)
    except (UnidentifiedImageError, OSError, SyntaxError) as err:
      raise ValueError(f"{path}: cannot decode image: {err}") from err
  else:
    name = "array"
    image = Image.fromarray(_image_to_uint8(source, "load_image"))
  image = image.convert(mode)
  if size is not None:
    height, width = (size, size) if isinstance(size, int) else tuple(size)
    if height < 1 or width < 1:
      raise ValueError(f"{name}: size must be positive (height, width), got {size}")
    image = image.resize((width, height), resample=Image.Resampling.LANCZOS)
  pixels = np.asarray(image, dtype=np.float32) / 255.0
  return pixels.reshape(image.height, image.width, channels[mode])


# --------------------------------------------------------------------------------------------------
# Audio (WAV)


def _audio_to_2d(audio: Any, what: str) -> np.ndarray:
  """`audio` as float32 `[channels, samples]`; a 1-D array is mono."""
  arr = np.asarray(audio)
  if not jnp.issubdtype(arr.dtype, jnp.floating):
    raise TypeError(f"{what}: expected float audio in [-1, 1], got dtype {arr.dtype}")
  arr = arr.astype(np.float32)
  if arr.ndim == 1:
    arr = arr[None]
  if arr.ndim != 2 or arr.shape[0] < 1 or arr.shape[1] < 1:
    raise ValueError(
      f"{what}: expected audio [channels, samples] (or [samples]), got shape {arr.shape}"
    )
  if arr.shape[0] > 16:
    # Likely [samples, channels]; refuse rather than write thousands of channels.
    raise ValueError(
      f"{what}: audio has {arr.shape[0]} channels (shape {arr.shape}); expected "
      "[channels, samples], transpose it if it is [samples, channels]"
    )
  nans = int(np.isnan(arr).sum())
  if nans:
    raise ValueError(f"{what}: {nans} of {arr.size} audio samples are NaN")
  return arr


def save_wav(path: PathLike, audio: Any, sample_rate: int) -> pathlib.Path:
  """Writes 16-bit PCM WAV.

  Args:
    path: output `.wav` file; its parent folder is created.
    audio: `[channels, samples]` or `[samples]` float in [-1, 1]; values outside are clipped.
    sample_rate: samples per second.

  Returns:
    The path written.
  """
  path = pathlib.Path(path)
  _check_suffix(path, (".wav",), "audio")
  data = _audio_to_2d(audio, str(path))
  if int(sample_rate) != sample_rate or sample_rate < 1:
    raise ValueError(f"{path}: sample_rate must be a positive integer, got {sample_rate}")
  pcm = np.rint(np.clip(data, -1.0, 1.0) * 32767.0).astype("<i2")
  path.parent.mkdir(parents=True, exist_ok=True)
  with wave.open(str(path), "wb") as f:
    f.setnchannels(data.shape[0])
    f.setsampwidth(2)
    f.setframerate(int(sample_rate))
    f.writeframes(np.ascontiguousarray(pcm.T).tobytes())  # WAV interleaves channels per sample.
  return path


def load_wav(path: PathLike) -> tuple[np.ndarray, int]:
  """Reads an integer PCM WAV (8, 16, 24 or 32 bit).

  Returns:
    `(audio, sample_rate)` with audio float32 `[channels, samples]` in [-1, 1].

  Raises:
    FileNotFoundError: the path does not exist.
    ValueError: not a PCM WAV file the `wave` module can read (float WAV included).
  """
  path = _existing_file(path)
  try:
    with wave.open(str(path), "rb") as f:
      channels, width, rate = f.getnchannels(), f.getsampwidth(), f.getframerate()
      raw = f.readframes(f.getnframes())
  except (wave.Error, EOFError) as err:
    raise ValueError(f"{path}: cannot read as integer PCM WAV: {err}") from err
  if width == 1:  # 8-bit WAV is unsigned with 128 as silence.
    data = (np.frombuffer(raw, np.uint8).astype(np.float32) - 128.0) / 128.0
  elif width == 2:
    data = np.frombuffer(raw, "<i2").astype(np.float32) / 32768.0
  elif width == 3:
    b = np.frombuffer(raw, np.uint8).reshape(-1, 3).astype(np.int32)
    value = b[:, 0] | (b[:, 1] << 8) | (b[:, 2] << 16)
    value = np.where(value >= 1 << 23, value - (1 << 24), value)
    data = value.astype(np.float32) / float(1 << 23)
  elif width == 4:
    data = (np.frombuffer(raw, "<i4").astype(np.float64) / float(1 << 31)).astype(np.float32)
  else:
    raise ValueError(f"{path}: {8 * width}-bit samples; expected 8, 16, 24 or 32-bit PCM")
  return data.reshape(-1, channels).T.copy(), rate


# --------------------------------------------------------------------------------------------------
# Video


def _ffmpeg(args: list[str], *, path: PathLike, stdin: Any = None) -> subprocess.CompletedProcess:
  """Runs the bundled ffmpeg; a failure raises ValueError naming `path` with ffmpeg's last words."""
  cmd = [imageio_ffmpeg.get_ffmpeg_exe(), "-hide_banner", "-nostdin", *args]
  result = subprocess.run(cmd, input=stdin, capture_output=True, check=False)
  if result.returncode != 0:
    log = result.stderr.decode(errors="replace")
    header = _input_header(log)
    if "Input #0" in header and not re.search(r"Stream #0:\d+\S*: Video:", header):
      # Readable, but nothing to show: say so instead of echoing ffmpeg's stream-mapping complaint.
      raise ValueError(f"{path}: no video stream found (the file holds only other streams)")
    lines = log.strip().splitlines()
    said = "\n  ".join(lines[-4:]) or f"exit code {result.returncode}"
    raise ValueError(f"{path}: ffmpeg failed (exit code {result.returncode}):\n  {said}")
  return result


def _video_to_uint8(frames: Any, what: str) -> np.ndarray:
  arr = to_uint8(frames)
  if arr.ndim == 4 and arr.shape[-1] == 1:
    arr = np.repeat(arr, 3, axis=-1)
  if arr.ndim != 4 or arr.shape[-1] != 3 or 0 in arr.shape:
    raise ValueError(
      f"{what}: expected frames [F, H, W, 3] (or [F, H, W, 1]), got shape {arr.shape}"
    )
  return arr


def save_video(
  path: PathLike,
  frames: Any,
  fps: float,
  *,
  audio: Any = None,
  sample_rate: int | None = None,
  crf: int = 18,
) -> pathlib.Path:
  """Writes frames as MP4 (H.264, yuv420p, optional AAC audio) or GIF, by suffix.

  MP4: yuv420p halves the chroma resolution, so H.264 needs even sizes. An odd height or width is
  padded by one row / column repeating the edge pixels (the file is then one pixel larger; nothing
  is resampled). The file is written next to `path` under a temporary name and renamed, so a failure
  leaves no partial MP4. With `audio`, it is written to a temporary 16-bit WAV and muxed as AAC;
  both streams keep their own length (none is cut to the other).

  GIF: written by Pillow with a 256-colour palette per frame and looping forever. GIF stores frame
  delays in hundredths of a second, so the rate is `100 / round(100 / fps)` (10, 20, 25, 50 fps are
  exact), and Pillow merges identical consecutive frames into one longer frame. GIF holds no audio.

  Args:
    path: output `.mp4` or `.gif`; its parent folder is created.
    frames: `[F, H, W, 3]` (or `[F, H, W, 1]` grey), float in [0, 1] or uint8.
    fps: frames per second; fractional rates (e.g. 24000/1001) are kept exactly in MP4.
    audio: optional `[channels, samples]` float in [-1, 1] (MP4 only).
    sample_rate: audio samples per second; required with `audio`.
    crf: H.264 constant rate factor (0 lossless … 51 worst; 18 is visually near-lossless).

  Returns:
    The path written.

  Raises:
    ValueError: unsupported suffix, wrong shapes, fps <= 0, audio without sample rate or into a GIF,
      or ffmpeg failing (its message is included).
  """
  path = pathlib.Path(path)
  suffix = _check_suffix(path, VIDEO_SUFFIXES, "video")
  pixels = _video_to_uint8(frames, str(path))
  if not fps > 0:
    raise ValueError(f"{path}: fps must be positive, got {fps}")
  if audio is not None and suffix == ".gif":
    raise ValueError(f"{path}: GIF cannot hold audio; save as .mp4 to keep it")
  if audio is not None:
    if sample_rate is None:
      raise ValueError(f"{path}: audio needs its sample_rate")
    audio = _audio_to_2d(audio, f"{path} (audio)")  # checked here so errors name the video
  if not 0 <= crf <= 51:
    raise ValueError(f"{path}: crf must be in [0, 51], got {crf}")
  path.parent.mkdir(parents=True, exist_ok=True)
  if suffix == ".gif":
    _save_gif(path, pixels, fps)
  else:
    _save_mp4(path, pixels, fps, audio, sample_rate, crf)
  return path


def _save_gif(path: pathlib.Path, pixels: np.ndarray, fps: float) -> None:
  # GIF delays are whole centiseconds and Pillow truncates milliseconds: pass whole ones.
  delay_cs = max(1, round(100 / fps))
  images = [Image.fromarray(frame) for frame in pixels]
  images[0].save(
    path, format="GIF", save_all=True, append_images=images[1:], duration=10 * delay_cs, loop=0
  )


def _save_mp4(
  path: pathlib.Path,
  pixels: np.ndarray,
  fps: float,
  audio: Any,
  sample_rate: int | None,
  crf: int,
) -> None:
  _, height, width, _ = pixels.shape
  if height % 2 or width % 2:
    pixels = np.pad(pixels, ((0, 0), (0, height % 2), (0, width % 2), (0, 0)), mode="edge")
  pixels = np.ascontiguousarray(pixels)
  rate = Fraction(fps).limit_denominator(1_000_000)
  partial = path.with_name(path.name + ".partial")
  with tempfile.TemporaryDirectory(prefix="md_media_") as tmp:
    args = ["-y", "-loglevel", "error"]
    args += ["-f", "rawvideo", "-pix_fmt", "rgb24", "-s", f"{pixels.shape[2]}x{pixels.shape[1]}"]
    args += ["-framerate", f"{rate.numerator}/{rate.denominator}", "-i", "pipe:0"]
    if audio is not None:
      wav = save_wav(pathlib.Path(tmp) / "audio.wav", audio, sample_rate)
      args += ["-i", str(wav), "-map", "0:v:0", "-map", "1:a:0", "-c:a", "aac", "-b:a", "192k"]
    args += ["-c:v", "libx264", "-pix_fmt", "yuv420p", "-crf", str(crf), "-preset", "medium"]
    # faststart puts the index first so browsers can play while downloading.
    args += ["-movflags", "+faststart", "-f", "mp4", str(partial)]
    try:
      # A flat byte view avoids copying the whole video into a bytes object.
      _ffmpeg(args, path=path, stdin=memoryview(pixels).cast("B"))
      os.replace(partial, path)
    finally:
      partial.unlink(missing_ok=True)


# Header lines of `ffmpeg -i`: "Duration: 00:00:01.00, ..." and one per stream, like
# "Stream #0:0[0x1](und): Video: h264 (High), yuv420p(progressive), 64x48, 8 fps, 8 tbr, ...".
_DURATION = re.compile(r"Duration: (\d+):(\d\d):(\d\d(?:\.\d+)?)")
_STREAM = re.compile(r"^\s*Stream #(\d+):(\d+)\S*: (Video|Audio): (.*)$", re.MULTILINE)
_SIZE = re.compile(r", (\d+)x(\d+)(?=[,\s\[]|$)")
_FPS = re.compile(r", (\d+(?:\.\d+)?)(k?) (fps|tbr)")
_RATE = re.compile(r", (\d+) Hz")
# Stream summary printed at verbose level when ffmpeg exits.
_PACKETS = re.compile(r"Input stream #0:(\d+) \(video\): (\d+) packets read")
_SAMPLES = re.compile(r"Input stream #0:(\d+) \(audio\):.*?\((\d+) samples\)")


def _input_header(log: str) -> str:
  """The part of ffmpeg's log that describes input #0 (its output section repeats stream lines)."""
  start = log.find("Input #0")
  end = min((i for i in (log.find("Stream mapping"), log.find("Output #0")) if i >= 0), default=-1)
  return log[max(start, 0) : end if end > start else len(log)]


def _fps_of(stream_line: str) -> float | None:
  found = {kind: float(v) * (1000 if k else 1) for v, k, kind in _FPS.findall(stream_line)}
  return found.get("fps") or found.get("tbr")


def video_info(path: PathLike) -> dict[str, Any]:
  """Reads a video's properties with the bundled ffmpeg (no ffprobe needed).

  Frames are counted from the demuxed packets of the first video stream (exact for H.264 in MP4 and
  for GIF, without decoding); the audio duration is the number of decoded samples of the first audio
  stream over its sample rate (AAC's encoder delay is already removed by the decoder).

  Args:
    path: a video file ffmpeg can read (.mp4, .gif, .webm, .mov, …).

  Returns:
    A dict with `fps` (float, as ffmpeg reports it: two decimals for fractional rates),
    `num_frames`, `width`, `height`, `duration` (container duration in seconds, to the 1/100 s
    that ffmpeg prints; `num_frames / fps` when the container has none), `has_audio`,
    `audio_duration` (seconds, None without audio) and `audio_sample_rate` (None without audio).

  Raises:
    FileNotFoundError: the path does not exist.
    ValueError: ffmpeg cannot read the file or it has no video stream.
  """
  path = _existing_file(path)
  # Optional maps ("?") let an audio-only file through to the "no video stream" check below.
  args = ["-v", "verbose", "-i", str(path), "-map", "0:v:0?", "-map", "0:a:0?", "-c:v", "copy"]
  log = _ffmpeg([*args, "-f", "null", "-"], path=path).stderr.decode(errors="replace")
  header = _input_header(log)
  streams = [(kind, int(index), rest) for _, index, kind, rest in _STREAM.findall(header)]
  video = next(((i, rest) for kind, i, rest in streams if kind == "Video"), None)
  if video is None:
    raise ValueError(f"{path}: no video stream found")
  size = _SIZE.search(video[1])
  packets = {int(i): int(n) for i, n in _PACKETS.findall(log)}
  if size is None or video[0] not in packets:
    raise ValueError(f"{path}: could not parse ffmpeg's description of the video stream:\n{header}")
  fps = _fps_of(video[1])
  num_frames = packets[video[0]]
  duration = None
  if match := _DURATION.search(header):
    hours, minutes, seconds = match.groups()
    duration = 3600 * int(hours) + 60 * int(minutes) + float(seconds)
  elif fps:
    duration = num_frames / fps
  audio = next(((i, rest) for kind, i, rest in streams if kind == "Audio"), None)
  audio_duration = audio_rate = None
  if audio is not None:
    samples = {int(i): int(n) for i, n in _SAMPLES.findall(log)}
    rate = _RATE.search(audio[1])
    if rate is not None:
      audio_rate = int(rate.group(1))
      if audio[0] in samples:
        audio_duration = samples[audio[0]] / audio_rate
  return {
    "fps": fps,
    "num_frames": num_frames,
    "width": int(size.group(1)),
    "height": int(size.group(2)),
    "duration": duration,
    "has_audio": audio is not None,
    "audio_duration": audio_duration,
    "audio_sample_rate": audio_rate,
  }


def load_video(path: PathLike, *, max_frames: int | None = None) -> np.ndarray:
  """Decodes a video's first video stream (every stored frame, none dropped or repeated).

  Args:
    path: a video file ffmpeg can read (.mp4, .gif, .webm, .mov, …).
    max_frames: decode at most this many frames from the start.

  Returns:
    float32 `[F, H, W, 3]` in [0, 1] (H and W after the file's rotation metadata is applied).

  Raises:
    FileNotFoundError: the path does not exist.
    ValueError: ffmpeg cannot decode the file (its message is included) or it holds no frames.
  """
  path = _existing_file(path)
  if max_frames is not None and max_frames < 1:
    raise ValueError(f"{path}: max_frames must be >= 1, got {max_frames}")
  args = ["-i", str(path), "-map", "0:v:0?", "-fps_mode", "passthrough"]
  if max_frames is not None:
    args += ["-frames:v", str(max_frames)]
  result = _ffmpeg([*args, "-f", "rawvideo", "-pix_fmt", "rgb24", "pipe:1"], path=path)
  log = result.stderr.decode(errors="replace")
  output = log[log.find("Output #0") :] if "Output #0" in log else ""
  stream = next((rest for *_, kind, rest in _STREAM.findall(output) if kind == "Video"), "")
  size = _SIZE.search(stream)
  if size is None:
    raise ValueError(f"{path}: could not parse the decoded frame size from ffmpeg's log:\n{output}")
  width, height = int(size.group(1)), int(size.group(2))
  frame_bytes = width * height * 3
  data = np.frombuffer(result.stdout, np.uint8)
  if data.size == 0 or data.size % frame_bytes:
    raise ValueError(
      f"{path}: ffmpeg returned {data.size} bytes, not a positive multiple of one "
      f"{width}x{height} RGB frame ({frame_bytes} bytes)"
    )
  return data.reshape(-1, height, width, 3).astype(np.float32) / 255.0
