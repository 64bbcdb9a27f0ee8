"""Training metrics: JSON lines and TensorBoard event files, and the step's FLOPs for TFLOP/s and MFU.

`MetricsWriter(workdir)` appends one JSON object per logged step to `<workdir>/metrics.jsonl` and the same
scalars to TensorBoard under `<workdir>/tb/`. A run resumed from step `n` first drops what an interrupted
run logged after `n` from the JSON lines and rebuilds TensorBoard's events from the lines kept, so both
read as one uninterrupted run.
"""

from __future__ import annotations

import json
import math
import os
import pathlib
import time
from collections.abc import Mapping
from typing import Any

import jax

METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tb"


class MetricsWriter:
  """Writes scalars per step to `<workdir>/metrics.jsonl` and TensorBoard (`<workdir>/tb/`).

  Args:
    workdir: the run's folder (created when missing).
    resume_step: the step the run continues from: logged steps after it are dropped.
    tensorboard: also write TensorBoard events.
  """

  def __init__(self, workdir: str | os.PathLike, *, resume_step: int = 0, tensorboard: bool = True):
    self.workdir = pathlib.Path(workdir)
    self.workdir.mkdir(parents=True, exist_ok=True)
    self.path = self.workdir / METRICS_FILE
    kept = []
    if self.path.exists():
      kept = [line for line in self.path.read_text().splitlines() if _step_of(line) <= resume_step]
      self.path.write_text("".join(f"{line}\n" for line in kept))
    self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - closed by close()
    self._tb = None
    if tensorboard:
      from tensorboardX import SummaryWriter

      # TensorBoard is rebuilt from the JSON lines kept: a killed writer may not have flushed its last
      # events, and steps after the checkpoint must go.
      folder = self.workdir / TENSORBOARD_DIR
      for old in folder.glob("events.out.tfevents.*") if folder.is_dir() else ():
        old.unlink()
      # A unique file per writer: two runs in one second would otherwise share a file name.
      suffix = f".{os.getpid()}.{time.time_ns()}"
      self._tb = SummaryWriter(str(folder), filename_suffix=suffix)
      for line in kept:
        row = json.loads(line)
        step = row.pop("step")
        self._add_scalars(step, row)
      self._tb.flush()

  def _add_scalars(self, step: int, values: Mapping[str, float | None]) -> None:
    for name, value in values.items():
      if value is not None:
        self._tb.add_scalar(name, value, int(step))

  def write(self, step: int, scalars: Mapping[str, float]) -> None:
    """Logs `scalars` (name → number) at `step`: one JSON line and one TensorBoard scalar each."""
    values = {k: _number(v) for k, v in scalars.items()}
    self._file.write(json.dumps({"step": int(step), **values}) + "\n")
    self._file.flush()
    if self._tb is not None:
      self._add_scalars(step, values)
      self._tb.flush()

  def close(self) -> None:
    self._file.close()
    if self._tb is not None:
      self._tb.close()

  def __enter__(self) -> MetricsWriter:
    return self

  def __exit__(self, *exc) -> None:
    self.close()


def _step_of(line: str) -> float:
  try:
    return int(json.loads(line)["step"])
  except (ValueError, KeyError, TypeError):
    return math.inf  # an unreadable (half-written) line is dropped


def _number(value: Any) -> float | None:
  value = float(jax.device_get(value))
  return value if math.isfinite(value) else None


def read_metrics(workdir: str | os.PathLike) -> list[dict[str, Any]]:
  """The JSON lines of `<workdir>/metrics.jsonl`, in order."""
  path = pathlib.Path(workdir) / METRICS_FILE
  return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def compiled_flops(compiled: Any) -> float | None:
  """FLOPs of one call of a compiled program (`jax.jit(f).lower(...).compile()`) by XLA's cost model,
  per device for a program partitioned over a mesh; None when the backend does not tell."""
  try:
    cost = compiled.cost_analysis()
  except Exception:  # noqa: BLE001 - some backends do not implement it
    return None
  if isinstance(cost, (list, tuple)):
    cost = cost[0] if cost else None
  if not cost or "flops" not in cost:
    return None
  flops = float(cost["flops"])
  return flops if flops > 0 else None


def peak_flops_per_second(dtype: Any = "float32") -> float:
  """The first device's measured matmul FLOP/s at `dtype` (md_schedulers' measurement, cached), the
  default peak for MFU."""
  import md_schedulers

  return md_schedulers.matmul_flops_per_second(dtype)
