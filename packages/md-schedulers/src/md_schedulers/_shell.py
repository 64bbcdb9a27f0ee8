"""The shell every family pipeline puts around the one loop: the loop program from the pipeline's jit
memo, the first carry, `drive` over the steps, and what the run leaves on the pipeline (the denoiser
calls made and the cache's final state).

A family writes only its chunk (`run(carry, lo, hi, *args)`, a jitted `run_steps` over its denoiser);
the step cache is passed here once and reaches the chunk, the memo key, the first carry and `drive`.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any, Protocol

from md_schedulers._base import SchedulerState, num_calls
from md_schedulers._sample import SampleState, StepCache, drive, init_state


class LoopHost(Protocol):
  """What the shell needs of a pipeline (`md_core.pipeline.Pipeline` has it all)."""

  last_calls: int
  last_cache: Any

  def jit(self, key: Hashable, make: Callable[[], Any]) -> Any: ...

  def context(self) -> Any: ...

  def place(self, tree: Any) -> Any: ...


def sample_pipeline(
  pipe: LoopHost,
  key: tuple[Hashable, ...],
  make_run: Callable[[StepCache | None], Callable[..., SampleState]],
  latents: Any,
  state: SchedulerState,
  *,
  args: tuple[Any, ...] = (),
  begin: int = 0,
  stop: int | None = None,
  cache: StepCache | None = None,
  chunk: int | str | None = "auto",
  callback: Callable[[int, Any, Any], Any] | None = None,
  cancel: Callable[[], bool] | None = None,
  progress: bool = False,
) -> SampleState:
  """Samples `latents` over the scheduler calls `[begin, stop)` with the pipeline's loop.

  Args:
    pipe: the pipeline (its jit memo, mesh context and placement); its `last_calls` and `last_cache`
      are set from the run.
    key: the loop program's memo key (static settings of the chunk; the cache is added here).
    make_run: `make_run(cache)` builds the jitted chunk `run(carry, lo, hi, *args)`.
    latents: the initial latents (placed on the pipeline's mesh here).
    state: the scheduler's initial state.
    args: the chunk's arguments after the bounds (parameters, conditioning, scales).
    begin: the first call run (a refining run starts part-way).
    stop: the call to stop before (default: every call; SDXL's base of an ensemble stops early).
    cache: the step cache (md-cache policy) or None.
    chunk, callback, cancel, progress: as `drive`.

  Returns:
    The final `SampleState`.
  """
  run = pipe.jit((*key, cache), lambda: make_run(cache))
  with pipe.context():  # under the mesh, context-parallel attention finds its axis
    carry = init_state(pipe.place(latents), state, cache=cache)
    carry = drive(
      run, carry, begin, num_calls(state) if stop is None else stop, args=args,
      chunk=chunk, callback=callback, cancel=cancel, progress=bool(progress), cache=cache,
    )  # fmt: skip
  pipe.last_calls, pipe.last_cache = int(carry.calls), carry.cache
  return carry
