"""What LTX-Video's and LTX-2's pipelines share about video latents: the size rules, token packing and
the inputs of the timestep-conditioned VAE decode."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

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


def decode_inputs(latents, decode_timestep, decode_noise_scale, decode_noise, key):
  """The inputs of a timestep-conditioned LTX VAE decode of `latents` `[B, f, h, w, C]`: per-video
  timesteps and noise scales `[B]` (a number for all, or one per video; the scale defaults to the
  timestep), the noise channels-last (`decode_noise` in the reference's `[B, C, f, h, w]`, or drawn from
  `key`) and the VAE's own key.

  Raises:
    ValueError: a per-video list of the wrong length, or noise of the wrong shape.
  """
  b = latents.shape[0]

  def per_video(v, what):
    v = [float(v)] * b if np.isscalar(v) else [float(x) for x in v]
    if len(v) != b:
      raise ValueError(f"{what} has {len(v)} entries for {b} videos")
    return jnp.asarray(v, jnp.float32)

  timestep = per_video(decode_timestep, "decode_timestep")
  scale = (
    timestep if decode_noise_scale is None else per_video(decode_noise_scale, "decode_noise_scale")
  )
  key_noise, key_vae = jax.random.split(key)
  if decode_noise is None:
    noise = jax.random.normal(key_noise, latents.shape, jnp.float32)
  else:
    noise = jnp.asarray(decode_noise, jnp.float32)
    want = (b, latents.shape[-1], *latents.shape[1:4])
    if noise.shape != want:
      raise ValueError(f"decode_noise must be [B, C, F, H, W] = {want}, got {noise.shape}")
    noise = jnp.transpose(noise, (0, 2, 3, 4, 1))
  return timestep, scale, noise, key_vae
