"""Tests for md_core.media: pixels, images, grids, WAV, MP4/GIF video and their errors."""

import wave

import jax.numpy as jnp
import numpy as np
import pytest
from PIL import Image

from md_core import media


def _gradient_frames(num_frames=8, height=47, width=63):
  """Smooth moving colour ramps: easy for H.264 and GIF palettes, so round trips stay close."""
  y = np.linspace(0.0, 1.0, height, dtype=np.float32)[:, None]
  x = np.linspace(0.0, 1.0, width, dtype=np.float32)[None, :]
  frames = []
  for f in range(num_frames):
    shift = f / (2 * num_frames)
    r = np.broadcast_to(np.clip(x * 0.8 + shift, 0, 1), (height, width))
    g = np.broadcast_to(np.clip(y * 0.8 + shift, 0, 1), (height, width))
    b = 0.5 + 0.4 * np.sin(2 * np.pi * (x + y) / 2 + f / 3) * np.ones_like(r)
    frames.append(np.stack([r, g, b], axis=-1))
  return np.stack(frames).astype(np.float32)  # [F, H, W, 3]


def _sine(seconds, sample_rate, channels=2):
  t = np.arange(int(seconds * sample_rate)) / sample_rate
  return np.stack([0.5 * np.sin(2 * np.pi * (220 * (c + 1)) * t) for c in range(channels)])


# Pixels -------------------------------------------------------------------------------------------


def test_to_uint8_rounds_and_clips():
  x = np.array([-0.5, 0.0, 0.4 / 255, 0.6 / 255, 0.5, 254.6 / 255, 1.0, 1.5, np.inf, -np.inf])
  np.testing.assert_array_equal(
    media.to_uint8(x.astype(np.float32)), [0, 0, 0, 1, 128, 255, 255, 255, 255, 0]
  )


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32, np.float64])
def test_to_uint8_accepts_every_float_dtype(dtype):
  levels = np.arange(256, dtype=np.float64) / 255
  x = jnp.asarray(levels, dtype) if dtype is not np.float64 else levels
  got = media.to_uint8(x)
  assert got.dtype == np.uint8
  # Exact for dtypes with enough mantissa; bf16 (8 bits) stores levels to within 1/255.
  tol = 1 if dtype == jnp.bfloat16 else 0
  assert np.abs(got.astype(int) - np.arange(256)).max() <= tol


def test_to_uint8_uint8_passes_and_bad_inputs_fail():
  x = np.arange(12, dtype=np.uint8).reshape(2, 2, 3)
  assert media.to_uint8(x) is x
  with pytest.raises(TypeError, match="int32"):
    media.to_uint8(np.zeros(3, np.int32))
  with pytest.raises(TypeError, match="bool"):
    media.to_uint8(np.zeros(3, bool))
  with pytest.raises(ValueError, match="2 of 4 pixel values are NaN"):
    media.to_uint8(np.array([0.0, np.nan, 1.0, np.nan], np.float32))


# Images -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
  "shape, mode", [((5, 7, 3), "RGB"), ((5, 7, 4), "RGBA"), ((5, 7), "L"), ((5, 7, 1), "L")]
)
def test_png_round_trip_is_exact(tmp_path, shape, mode):
  pixels = np.random.default_rng(0).integers(0, 256, shape, dtype=np.uint8)
  path = media.save_image(tmp_path / "deep" / "folder" / "x.png", pixels)
  assert path.is_file()
  got = media.load_image(path, mode=mode)
  assert got.dtype == np.float32
  np.testing.assert_array_equal(media.to_uint8(got), pixels.reshape(got.shape))


def test_float_image_round_trips_through_png(tmp_path):
  pixels = np.random.default_rng(1).integers(0, 256, (6, 4, 3)).astype(np.float32) / 255
  got = media.load_image(media.save_image(tmp_path / "x.png", jnp.asarray(pixels, jnp.float32)))
  np.testing.assert_allclose(got, pixels, atol=1e-6)


@pytest.mark.parametrize("suffix", [".jpg", ".jpeg", ".webp"])
def test_lossy_formats_stay_close(tmp_path, suffix):
  image = _gradient_frames(1, 32, 48)[0]
  got = media.load_image(media.save_image(tmp_path / f"x{suffix}", image))
  assert got.shape == (32, 48, 3)
  assert np.abs(got - image).mean() < 0.02


def test_save_images_writes_a_batch(tmp_path):
  batch = np.random.default_rng(2).integers(0, 256, (3, 4, 5, 3), dtype=np.uint8)
  paths = media.save_images(tmp_path / "out", batch, prefix="sample")
  assert [p.name for p in paths] == ["sample_0000.png", "sample_0001.png", "sample_0002.png"]
  for path, image in zip(paths, batch, strict=True):
    np.testing.assert_array_equal(media.to_uint8(media.load_image(path)), image)


def test_load_image_from_pil_and_array_with_resize():
  rgb = np.zeros((10, 20, 3), np.uint8)
  rgb[..., 0] = 200
  rgb[..., 2] = 40
  from_pil = media.load_image(Image.fromarray(rgb), size=(6, 8))
  from_array = media.load_image(rgb, size=(6, 8))
  assert from_pil.shape == (6, 8, 3)
  # A constant image stays constant under Lanczos resizing.
  np.testing.assert_allclose(
    from_pil, np.broadcast_to([200 / 255, 0, 40 / 255], (6, 8, 3)), atol=1e-6
  )
  np.testing.assert_array_equal(from_pil, from_array)
  assert media.load_image(rgb, size=4).shape == (4, 4, 3)
  grey = media.load_image(rgb, mode="L")
  assert grey.shape == (10, 20, 1)


def test_load_image_applies_exif_orientation(tmp_path):
  pixels = np.zeros((4, 6, 3), np.uint8)
  pixels[0, 0] = 255  # marks the stored top-left corner
  exif = Image.Exif()
  exif[0x0112] = 6  # "rotate 90° clockwise to display"
  Image.fromarray(pixels).save(tmp_path / "phone.png", exif=exif)
  got = media.load_image(tmp_path / "phone.png")
  assert got.shape == (6, 4, 3)
  np.testing.assert_array_equal(media.to_uint8(got), np.rot90(pixels, k=-1))


def test_image_errors(tmp_path):
  image = np.zeros((4, 4, 3), np.float32)
  with pytest.raises(ValueError, match=r"x\.bmp.*unsupported image suffix.*\.png, \.jpg, \.jpeg"):
    media.save_image(tmp_path / "x.bmp", image)
  with pytest.raises(ValueError, match=r"expected an image .*got shape \(2, 4, 4, 3\)"):
    media.save_image(tmp_path / "x.png", np.zeros((2, 4, 4, 3), np.float32))
  with pytest.raises(ValueError, match="JPEG cannot store an alpha channel"):
    media.save_image(tmp_path / "x.jpg", np.zeros((4, 4, 4), np.float32))
  with pytest.raises(FileNotFoundError, match="missing.png"):
    media.load_image(tmp_path / "missing.png")
  (tmp_path / "bad.png").write_bytes(b"not an image at all")
  with pytest.raises(ValueError, match=r"bad\.png: cannot decode image"):
    media.load_image(tmp_path / "bad.png")
  png = media.save_image(tmp_path / "cut.png", np.random.default_rng(0).random((64, 64, 3)))
  (tmp_path / "truncated.png").write_bytes(png.read_bytes()[:200])
  with pytest.raises(ValueError, match=r"truncated\.png: cannot decode image"):
    media.load_image(tmp_path / "truncated.png")
  with pytest.raises(ValueError, match="mode must be one of RGB, RGBA, L, got 'CMYK'"):
    media.load_image(image, mode="CMYK")


# Grids --------------------------------------------------------------------------------------------


def test_make_grid_places_cells_and_pads():
  batch = np.stack([np.full((2, 3, 1), v, np.float32) for v in (0.1, 0.2, 0.3, 0.4, 0.5)])
  grid = media.make_grid(batch, padding=1, pad_value=0.0)  # 5 images → 3 columns, 2 rows
  assert grid.shape == (2 * 3 + 1, 3 * 4 + 1, 1)
  for i, value in enumerate((0.1, 0.2, 0.3, 0.4, 0.5)):
    top, left = 1 + (i // 3) * 3, 1 + (i % 3) * 4
    np.testing.assert_array_equal(grid[top : top + 2, left : left + 3], np.float32(value))
  assert grid[0].max() == 0.0 and grid[:, 0].max() == 0.0
  np.testing.assert_array_equal(grid[4:6, 9:12], 0.0)  # the empty sixth cell
  assert media.make_grid(batch, rows=1, padding=0).shape == (2, 15, 1)
  assert media.make_grid(batch, cols=2, padding=0).shape == (6, 6, 1)
  as_uint8 = media.make_grid(media.to_uint8(batch), rows=5, cols=1, padding=2)
  assert as_uint8.dtype == np.uint8 and as_uint8.shape == (5 * 4 + 2, 7, 1)
  assert as_uint8[0, 0, 0] == 255
  with pytest.raises(ValueError, match="a 2x2 grid cannot hold 5 images"):
    media.make_grid(batch, rows=2, cols=2)
  with pytest.raises(ValueError, match=r"got shape \(2, 3\)"):
    media.make_grid(batch[0, :, :, 0])


# WAV ----------------------------------------------------------------------------------------------


def test_wav_round_trip(tmp_path):
  audio = _sine(0.25, 8000)
  path = media.save_wav(tmp_path / "a" / "x.wav", jnp.asarray(audio, jnp.float32), 8000)
  got, rate = media.load_wav(path)
  assert rate == 8000 and got.shape == (2, 2000) and got.dtype == np.float32
  np.testing.assert_allclose(got, audio, atol=1.0 / 32767)
  mono, _ = media.load_wav(media.save_wav(tmp_path / "m.wav", np.array([0.0, 2.0, -2.0]), 100))
  np.testing.assert_allclose(mono, [[0.0, 32767 / 32768, -32767 / 32768]])  # clipped to ±1


def test_load_wav_reads_24_bit(tmp_path):
  values = np.array([0, 1 << 22, -(1 << 22), (1 << 23) - 1, -(1 << 23)], np.int64)
  raw = b"".join(int(v).to_bytes(3, "little", signed=True) for v in values)
  with wave.open(str(tmp_path / "x.wav"), "wb") as f:
    f.setnchannels(1)
    f.setsampwidth(3)
    f.setframerate(48000)
    f.writeframes(raw)
  got, rate = media.load_wav(tmp_path / "x.wav")
  assert rate == 48000
  np.testing.assert_allclose(got[0], values / float(1 << 23))


def test_wav_errors(tmp_path):
  with pytest.raises(ValueError, match="2 of 4 audio samples are NaN"):
    media.save_wav(tmp_path / "x.wav", np.array([[0.0, np.nan], [np.nan, 0.0]]), 100)
  with pytest.raises(TypeError, match="int16"):
    media.save_wav(tmp_path / "x.wav", np.zeros((1, 4), np.int16), 100)
  with pytest.raises(ValueError, match="transpose it"):
    media.save_wav(tmp_path / "x.wav", np.zeros((1000, 2), np.float32), 100)
  with pytest.raises(ValueError, match=r"unsupported audio suffix '\.mp3'; supported: \.wav"):
    media.save_wav(tmp_path / "x.mp3", np.zeros((1, 4), np.float32), 100)
  with pytest.raises(FileNotFoundError, match="nope.wav"):
    media.load_wav(tmp_path / "nope.wav")
  (tmp_path / "bad.wav").write_bytes(b"RIFF0000WAVEjunk")
  with pytest.raises(ValueError, match=r"bad\.wav: cannot read as integer PCM WAV"):
    media.load_wav(tmp_path / "bad.wav")


# Video --------------------------------------------------------------------------------------------


def test_mp4_round_trip_pads_odd_sizes(tmp_path):
  frames = _gradient_frames(8, 47, 63)
  path = media.save_video(tmp_path / "v" / "x.mp4", jnp.asarray(frames, jnp.bfloat16), fps=8)
  assert not list(path.parent.glob("*.partial"))
  info = media.video_info(path)
  assert info == {
    "fps": 8.0,
    "num_frames": 8,
    "width": 64,  # padded up to even sizes with the edge pixels
    "height": 48,
    "duration": pytest.approx(1.0, abs=1e-3),
    "has_audio": False,
    "audio_duration": None,
    "audio_sample_rate": None,
  }
  got = media.load_video(path)
  assert got.shape == (8, 48, 64, 3) and got.dtype == np.float32
  bf16 = np.asarray(jnp.asarray(frames, jnp.bfloat16), np.float32)
  error = np.abs(got[:, :47, :63] - bf16)
  assert error.mean() < 0.01 and error.max() < 0.1  # H.264 at crf 18 is lossy but close
  # The padded row and column repeat the edge.
  assert np.abs(got[:, 47] - got[:, 46]).mean() < 0.01
  assert np.abs(got[:, :, 63] - got[:, :, 62]).mean() < 0.01
  assert media.load_video(path, max_frames=3).shape == (3, 48, 64, 3)


def test_mp4_with_audio_has_the_right_audio_stream(tmp_path):
  frames = _gradient_frames(12, 32, 48)
  path = media.save_video(
    tmp_path / "x.mp4", frames, fps=24, audio=_sine(0.5, 16000), sample_rate=16000
  )
  info = media.video_info(path)
  assert info["num_frames"] == 12 and info["fps"] == 24.0
  assert (info["width"], info["height"]) == (48, 32)
  assert info["has_audio"] and info["audio_sample_rate"] == 16000
  assert info["audio_duration"] == pytest.approx(0.5, abs=0.01)
  assert info["duration"] == pytest.approx(0.5, abs=0.03)
  assert media.load_video(path).shape == (12, 32, 48, 3)


def test_gif_round_trip(tmp_path):
  frames = _gradient_frames(6, 20, 30)
  path = media.save_video(tmp_path / "x.gif", media.to_uint8(frames), fps=10)
  info = media.video_info(path)
  assert (info["num_frames"], info["width"], info["height"]) == (6, 30, 20)
  assert info["fps"] == 10.0 and info["duration"] == pytest.approx(0.6, abs=1e-3)
  assert not info["has_audio"]
  got = media.load_video(path)
  assert got.shape == (6, 20, 30, 3)
  error = np.abs(got - frames)  # one 256-colour palette per frame
  assert error.mean() < 0.02 and error.max() < 0.08


def test_video_errors(tmp_path):
  frames = _gradient_frames(2, 8, 8)
  with pytest.raises(
    ValueError, match=r"unsupported video suffix '\.avi'; supported: \.mp4, \.gif"
  ):
    media.save_video(tmp_path / "x.avi", frames, fps=8)
  with pytest.raises(ValueError, match=r"expected frames \[F, H, W, 3\].*got shape \(8, 8, 3\)"):
    media.save_video(tmp_path / "x.mp4", frames[0], fps=8)
  with pytest.raises(ValueError, match="fps must be positive, got 0"):
    media.save_video(tmp_path / "x.mp4", frames, fps=0)
  with pytest.raises(ValueError, match="GIF cannot hold audio"):
    media.save_video(tmp_path / "x.gif", frames, fps=8, audio=_sine(0.1, 8000), sample_rate=8000)
  with pytest.raises(ValueError, match="audio needs its sample_rate"):
    media.save_video(tmp_path / "x.mp4", frames, fps=8, audio=_sine(0.1, 8000))
  with pytest.raises(ValueError, match=r"x\.mp4 \(audio\): expected audio \[channels, samples\]"):
    media.save_video(tmp_path / "x.mp4", frames, fps=8, audio=np.zeros((2, 2, 2)), sample_rate=8)
  assert not list(tmp_path.glob("x.mp4*"))
  with pytest.raises(FileNotFoundError, match="missing.mp4"):
    media.load_video(tmp_path / "missing.mp4")
  with pytest.raises(FileNotFoundError, match="missing.mp4"):
    media.video_info(tmp_path / "missing.mp4")
  (tmp_path / "bad.mp4").write_bytes(b"\x00" * 64 + b"definitely not a video")
  for read in (media.load_video, media.video_info):
    with pytest.raises(
      ValueError, match=r"(?s)bad\.mp4: ffmpeg failed \(exit code \d+\):\n.*Invalid data"
    ):
      read(tmp_path / "bad.mp4")
  wav = media.save_wav(tmp_path / "a.wav", _sine(0.1, 8000), 8000)
  for read in (media.load_video, media.video_info):
    with pytest.raises(ValueError, match=r"a\.wav: no video stream found"):
      read(wav)
