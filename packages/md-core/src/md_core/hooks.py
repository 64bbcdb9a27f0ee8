"""The block hook: how a sampling loop (md-schedulers) reaches the block stacks a model traces through
`md_core.scan_layers`, without either importing the other's internals. Needs nothing but the standard
library, so md-schedulers can use it without md-core's model dependencies."""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from typing import Any, Protocol


class BlockHook(Protocol):
  """What `block_hook` takes: called once per hookable block stack while a model is traced."""

  def __call__(
    self, run: Callable[[Any, int, int], Any], carry: Any, *, num_layers: int, index: int
  ) -> Any: ...


class _Active:
  def __init__(self, hook: BlockHook):
    self.hook = hook
    self.count = 0


_HOOK: contextvars.ContextVar[_Active | None] = contextvars.ContextVar(
  "md_block_hook", default=None
)


@contextlib.contextmanager
def block_hook(hook: BlockHook | None) -> Iterator[None]:
  """Routes every hookable `scan_layers` traced inside the block through `hook` (None: no hook)."""
  token = _HOOK.set(None if hook is None else _Active(hook))
  try:
    yield
  finally:
    _HOOK.reset(token)


def active_hook() -> Any:
  """The hook `block_hook` set for the code being traced now (with its stack `count`), or None."""
  return _HOOK.get()
