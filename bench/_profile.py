"""Where a jitted CPU program spends its time, from a `jax.profiler` trace: milliseconds per call by op
kind (XLA's CPU thunks: YNNPACK matmul / reduction fusions, loop fusions, copies...), summed over the
threads that ran them, and the slowest single ops."""

from __future__ import annotations

import collections
import pathlib
import tempfile

import jax

_SKIP = ("ThunkExecutor", "Slinky", "$", "Pjit", "tf_", "end: ", "ParseArguments", "Handle inputs")


def op_times(fn, *args, calls: int = 3) -> tuple[dict[str, float], list[tuple[str, float]]]:
  """`({kind: ms per call}, [(op, ms per call), ...] slowest first)` of `fn(*args)` (already compiled)."""
  from jax._src.lib import _profile_data  # noqa: PLC0415  (jax's own reader of its trace files)

  jax.block_until_ready(fn(*args))
  with tempfile.TemporaryDirectory() as tmp:
    with jax.profiler.trace(tmp):
      for _ in range(calls):
        jax.block_until_ready(fn(*args))
    trace = sorted(pathlib.Path(tmp).rglob("*.xplane.pb"))[-1]
    data = _profile_data.ProfileData.from_file(str(trace))
  per_op: collections.Counter = collections.Counter()
  for plane in data.planes:
    for line in plane.lines:
      for event in line.events:
        name = event.name
        if name.startswith(_SKIP) or "::" in name or " " in name:
          continue
        per_op[name] += event.duration_ns / 1e6 / calls
  kinds: collections.Counter = collections.Counter()
  for name, ms in per_op.items():
    kinds[name.rsplit(".", 1)[0] if name[-1].isdigit() else name] += ms
  return dict(kinds.most_common()), per_op.most_common()


def print_profile(fn, *args, top: int = 8) -> None:
  kinds, ops = op_times(fn, *args)
  total = sum(kinds.values())
  print(f"profile (ms per call, summed over threads; {total:.1f} ms in all):")
  for kind, ms in list(kinds.items())[:top]:
    print(f"  {ms:8.1f}  {100 * ms / total:4.0f}%  {kind}")
  print("  slowest ops: " + ", ".join(f"{name} {ms:.1f}" for name, ms in ops[:top]))


def add_step_options(parser) -> None:
  """The options of the transformer-step benches (wan.py, ltx.py) about how md runs."""
  parser.add_argument(
    "--profile", action="store_true", help="also print md's time per XLA op kind (jax.profiler)"
  )
  parser.add_argument(
    "--stacked",
    action="store_true",
    help="pass the stacked per-layer parameters as they are (scanned), not as the pipelines do "
    "(md_core.layer_views on a CPU device: one array per layer)",
  )
