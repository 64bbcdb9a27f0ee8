"""Progress bars for long work, on the host and inside jitted loops, with one switch for all.

The switch, in order of precedence: `progress_disabled()` / `set_progress(...)` in the program, then
the environment variable `MD_PROGRESS` (`0`, `false`, `no` or `off` disable), then on by default.

Host loops (loading tensors, training) wrap their iterable in `track`. Jitted loops (the denoising
`fori_loop`/`scan`) call a `tick` from `make_step_callback` in the loop body: it sends the step
index to the host with `jax.debug.callback`, which advances a tqdm bar there. The callback takes the
step and returns nothing, so no value of the computation depends on it: results are the same with
and without it.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import IO, Any, TypeVar

import jax
import tqdm

T = TypeVar("T")

_ENV_VAR = "MD_PROGRESS"
_OFF_VALUES = ("0", "false", "no", "off")
# None: follow the environment variable. A bool set by set_progress / progress_disabled wins over
# it.
_override: bool | None = None
# What the process is doing now, for a one-line report when it is stopped (see `where`): the phase
# named by `phase(...)` and the last step a step callback saw (label, steps done, total).
_phase: str | None = None
_last_step: tuple[str | None, int, int] | None = None


def progress_enabled() -> bool:
  """Whether progress bars are shown now (see the module docstring for the precedence)."""
  if _override is not None:
    return _override
  return os.environ.get(_ENV_VAR, "1").strip().lower() not in _OFF_VALUES


def set_progress(enabled: bool | None) -> None:
  """Turns progress bars on or off for the whole process; None goes back to `MD_PROGRESS`."""
  global _override
  _override = None if enabled is None else bool(enabled)


@contextlib.contextmanager
def progress_disabled() -> Iterator[None]:
  """Hides progress bars inside the `with` block, then restores the previous setting."""
  global _override
  previous = _override
  _override = False
  try:
    yield
  finally:
    _override = previous


@contextlib.contextmanager
def phase(name: str, *, announce: bool = False, file: IO[str] | None = None) -> Iterator[None]:
  """Names what the process does inside the `with` block (e.g. "loading", "generating").

  `where()` reports it, e.g. when Ctrl-C stops the run; with `announce` and progress on, the name is
  also printed (one line on stderr) as the phase starts.

  Args:
    name: the phase, a gerund or noun phrase.
    announce: print `name…` when progress is on.
    file: stream the announcement goes to (default: stderr).
  """
  global _phase, _last_step
  previous = _phase
  _phase, _last_step = name, None
  if announce and progress_enabled():
    import sys

    print(f"{name}…", file=file or sys.stderr, flush=True)
  yield  # on an exception the phase stays named, so the report says where the run stopped
  _phase = previous


def report_step(done: int, total: int, desc: str | None = None) -> None:
  """Records the last step reached by a host-driven loop (what `where()` reports, e.g. on Ctrl-C)."""
  global _last_step
  _last_step = (desc, int(done), int(total))


def where() -> str:
  """Where the process is: the current phase and the last step reported, e.g. "at step 3/900 of
  denoising (generating)"; "" when nothing was named."""
  parts = []
  if _last_step is not None:
    desc, done, total = _last_step
    parts.append(f"at step {done}/{total}" + (f" of {desc}" if desc else ""))
  if _phase:
    parts.append(f"({_phase})" if parts else f"while {_phase}")
  return " ".join(parts)


def track(
  iterable: Iterable[T],
  total: int | None = None,
  desc: str | None = None,
  *,
  file: IO[str] | None = None,
  **tqdm_kwargs: Any,
) -> Iterable[T]:
  """Iterates `iterable` with a tqdm bar, or returns it untouched when progress is off.

  Args:
    iterable: what to iterate.
    total: number of items when `len(iterable)` does not tell.
    desc: label in front of the bar.
    file: stream the bar writes to (default: stderr).
    **tqdm_kwargs: passed on to `tqdm.tqdm` (e.g. `unit="tensor"`, `leave=False`).

  Returns:
    An iterable over the same items.
  """
  if not progress_enabled():
    return iterable
  return tqdm.tqdm(iterable, total=total, desc=desc, file=file, **tqdm_kwargs)


class _HostBar:
  """Host side of a step callback: one tqdm bar per run of the jitted loop.

  Unordered callbacks may arrive out of order, so the bar moves to the highest step seen instead of
  counting calls. A bar closes when it reaches `total`; the next step seen opens a new one (the
  compiled program's next invocation). Step 0 arriving on an open bar also opens a new one, so a run
  that died midway does not leave its bar to the next run.
  """

  def __init__(self, total: int, desc: str | None, file: IO[str] | None, kwargs: dict[str, Any]):
    self.total, self.desc, self.file, self.kwargs = total, desc, file, kwargs
    self.bar: tqdm.tqdm | None = None
    self.done = 0  # steps completed in the current run
    self.lock = threading.Lock()  # callbacks may run on runtime threads

  def __call__(self, step: Any) -> None:
    global _last_step
    done = int(step) + 1
    with self.lock:
      if self.bar is None or (done == 1 and self.done >= 1):
        if self.bar is not None:
          self.bar.close()
        self.bar = tqdm.tqdm(total=self.total, desc=self.desc, file=self.file, **self.kwargs)
        self.done = 0
      if done > self.done:
        self.bar.update(done - self.done)
        self.done = done
      _last_step = (self.desc, self.done, self.total)
      if self.done >= self.total:
        self.bar.close()
        self.bar = None


def make_step_callback(
  total: int,
  desc: str | None = None,
  *,
  file: IO[str] | None = None,
  **tqdm_kwargs: Any,
) -> Callable[[Any], None]:
  """Returns `tick(step)`: advances a host progress bar from inside a jitted loop.

  Call `tick(i)` in the body of a `jax.lax.fori_loop` / `scan` with the 0-based step index (a traced
  int); the bar shows `i + 1` of `total` and closes at `total`. Each run of the compiled program
  opens a fresh bar.

  The switch is read when this function is called, normally while tracing: when progress is off,
  `tick` is a Python no-op that adds nothing to the program. jax caches traces per function and
  shape, so a function already traced keeps the choice made at its first trace (with or without the
  callback) until it is traced again. When on, `tick` is an unordered `jax.debug.callback`: ordered
  callbacks are refused in programs that span several devices, and the host side tolerates any
  arrival order because it moves the bar to the largest step seen. The callback has no outputs, so
  it never changes the computation's values; it only makes the device report each step to the host.

  Args:
    total: number of steps (the loop's trip count).
    desc: label in front of the bar.
    file: stream the bar writes to (default: stderr).
    **tqdm_kwargs: passed on to `tqdm.tqdm`.

  Returns:
    `tick(step) -> None`.
  """
  if total < 1:
    raise ValueError(f"make_step_callback: total must be >= 1, got {total}")
  if not progress_enabled():
    return lambda step: None
  host = _HostBar(total, desc, file, tqdm_kwargs)

  def tick(step: Any) -> None:
    jax.debug.callback(host, step)

  return tick
