"""What LTX-Video's and LTX-2's pipelines share about video latents: the size rules and token packing."""

from __future__ import annotations

from md_core.pipeline import SizeError


def nearest(value: int, step: int, offset: int) -> str:
  """The valid value(s) of the form `offset + step * k` next to `value`, as text for an error."""
  below = max(offset, offset + step * ((value - offset) // step))
  return str(below) if below == value else f"{below} or {below + step}"


def check_video_size(
  what: str, height: int, width: int, num_frames: int, multiple: int, frame_step: int
) -> None:
  """Checks that height and width are positive multiples of `multiple` and `num_frames = 1 + frame_step *
  k`.

  Raises:
    SizeError: (`md_core.pipeline.SizeError`, a ValueError) naming each bad value with the nearest
      valid ones.
  """
  bad = [
    f"{name}={v} → {nearest(max(v, multiple), multiple, multiple)}"
    for name, v in (("height", height), ("width", width))
    if v <= 0 or v % multiple
  ]
  if num_frames < 1 or (num_frames - 1) % frame_step:
    bad.append(f"num_frames={num_frames} → {nearest(max(num_frames, 1), frame_step, 1)}")
  if bad:
    raise SizeError(
      f"the {what} takes height and width multiples of {multiple} and num_frames = 1 + "
      f"{frame_step}k; got {height}x{width}, {num_frames} frames; nearest valid: {', '.join(bad)}"
    )


def pack_tokens(x, p: int, pt: int):
  """`[B, F, H, W, C]` → `[B, S, C * pt * p * p]` (tokens frame-major; features channel-major)."""
  b, f, h, w, c = x.shape
  x = x.reshape(b, f // pt, pt, h // p, p, w // p, p, c).transpose(0, 1, 3, 5, 7, 2, 4, 6)
  return x.reshape(b, (f // pt) * (h // p) * (w // p), c * pt * p * p)


def unpack_tokens(x, f: int, h: int, w: int, p: int, pt: int):
  """The inverse of `pack_tokens` for a latent grid of `f x h x w`."""
  b = x.shape[0]
  x = x.reshape(b, f // pt, h // p, w // p, -1, pt, p, p).transpose(0, 1, 5, 2, 6, 3, 7, 4)
  return x.reshape(b, f, h, w, -1)
