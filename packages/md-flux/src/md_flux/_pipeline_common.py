"""What the Flux.1 and Flux.2 Klein pipelines share: sizes, 2x2 packing, position ids, the schedule, and
running the shared loop (`md_schedulers.drive` over jitted `run_steps` chunks).

Both pipeline modules import from here and never from each other.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np

import md_schedulers as mdsch
from md_core import call as mdc
from md_core import pipeline as mdp

OUTPUT_TYPES = ("np", "latent")


def check_size(height: int, width: int, factor: int = 16) -> None:
  """Checks that height and width are positive multiples of `factor` (the VAE's factor times the 2x2
  packing: 16 for Flux).

  Raises:
    md_core.pipeline.SizeError: (a ValueError) naming each bad size and the nearest valid ones.
  """
  bad = [(n, v) for n, v in (("height", height), ("width", width)) if v <= 0 or v % factor]
  if bad:
    hints = ", ".join(
      f"{n}={v} → {' or '.join(str(s) for s in mdp.nearest_multiples(max(v, 1), factor))}"
      for n, v in bad
    )
    raise mdp.SizeError(
      f"height and width must be positive multiples of {factor} (the VAE's factor × 2x2 packing); got "
      f"height={height}, width={width}; nearest valid: {hints}"
    )


def check_output_type(output_type: str) -> None:
  mdc.check_output_type(output_type, OUTPUT_TYPES)


def pack_latents(latents: jax.Array) -> jax.Array:
  """`[B, h, w, C]` channels-last latents → the reference's packed `[B, h/2 * w/2, C * 4]`
  (features ordered channel, then row and column within the 2x2 patch)."""
  b, h, w, c = latents.shape
  x = latents.reshape(b, h // 2, 2, w // 2, 2, c).transpose(0, 1, 3, 5, 2, 4)
  return x.reshape(b, (h // 2) * (w // 2), c * 4)


def unpack_latents(packed: jax.Array, h: int, w: int) -> jax.Array:
  """The inverse of `pack_latents`: `[B, h/2 * w/2, C * 4]` → `[B, h, w, C]`."""
  b, _, f = packed.shape
  c = f // 4
  x = packed.reshape(b, h // 2, w // 2, c, 2, 2).transpose(0, 1, 4, 2, 5, 3)
  return x.reshape(b, h, w, c)


def image_ids(rows: int, cols: int, *, time: float = 0.0, axes: int = 3) -> np.ndarray:
  """Position ids `[rows * cols, axes]` of packed image tokens: `(time, row, col)` for Flux.1 (3
  axes) and `(time, row, col, 0)` for Flux.2 (4 axes)."""
  ids = np.zeros((rows, cols, axes), np.float32)
  ids[..., 0] = time
  ids[..., 1] = np.arange(rows, dtype=np.float32)[:, None]
  ids[..., 2] = np.arange(cols, dtype=np.float32)[None, :]
  return ids.reshape(rows * cols, axes)


def schedule(
  config: Mapping[str, Any], num_inference_steps: int, sigmas: Sequence[float] | None, mu: float
) -> tuple[mdsch.Scheduler, mdsch.SchedulerState]:
  """The checkpoint's scheduler and its state: sigmas `linspace(1, 1/n, n)` unless given (the
  scheduler's own flow sigmas win when `use_flow_sigmas` is set, as in the reference), shifted by `mu`.

  Raises:
    ValueError: fewer than one step.
  """
  n = int(num_inference_steps)
  if n < 1:
    raise ValueError(f"num_inference_steps must be at least 1, got {n}")
  sched = mdsch.from_config(config)
  if sigmas is None:
    sigmas = np.linspace(1.0, 1.0 / n, n)
  if config.get("use_flow_sigmas"):
    sigmas = None
  return sched, sched.init(n, sigmas=sigmas, mu=mu)


def run_fn(denoise: Callable[..., Any], sched: mdsch.Scheduler, guide: Any, cache: Any):
  """The jitted chunk `run(carry, lo, hi, params, cond, scales)` of the shared loop over steps
  `[lo, hi)` (traced bounds: one program whatever the chunk) with the pipeline's denoiser."""

  def run(carry, lo, hi, params, cond, scales):
    return mdsch.run_steps(
      denoise, sched, carry, lo, hi, cond, params=params, guidance=guide, scales=scales, cache=cache
    )

  return jax.jit(run)


def run_loop(
  pipe: mdp.Pipeline,
  run: Callable[..., mdsch.SampleState],
  latents: jax.Array,
  state: mdsch.SchedulerState,
  *,
  args: tuple[Any, ...] = (),
  cache: mdsch.StepCache | None,
  chunk: int | str | None,
  callback: Callable[[int, Any, Any], Any] | None,
  cancel: Callable[[], bool] | None,
  progress: bool,
) -> mdsch.SampleState:
  """Samples from `latents` (placed on the pipeline's mesh) over every scheduler call with
  `md_schedulers.drive`; `run(carry, lo, hi, *args)` is the pipeline's jitted chunk."""
  with pipe.context():
    carry = mdsch.init_state(pipe.place(latents), state, cache=cache)
    return mdsch.drive(
      run, carry, 0, mdsch.num_calls(state), args=args,
      chunk=chunk, callback=callback, cancel=cancel, progress=bool(progress), cache=cache,
    )  # fmt: skip
