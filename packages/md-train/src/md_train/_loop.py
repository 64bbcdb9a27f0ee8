"""The training loop: a `Recipe` (what to train) and `fit` (run it to a step count, resumably).

    recipe = md_train.recipes.wan21_tiny(config)      # or any function returning a Recipe
    state = md_train.fit(recipe, steps=1000, workdir="runs/wan", checkpoint_every=100)

`fit` resumes from `<workdir>/checkpoints` when a checkpoint is there: the train state, the data
iterator's position (when the iterator has `state()` / `restore(s)`) and the run's fingerprint, which must
equal the recipe's. A resumed run then takes the same batches and random draws as an uninterrupted one, so
its parameters and optimizer state end bit for bit the same.
"""

from __future__ import annotations

import json
import pathlib
import time
import weakref
from collections.abc import Callable, Iterator, Mapping
from typing import Any, NamedTuple

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from md_train._checkpoint import Checkpointer
from md_train._metrics import MetricsWriter, compiled_flops, peak_flops_per_second
from md_train._step import TrainState

CHECKPOINTS_DIR = "checkpoints"
PROFILE_DIR = "profile"  # fit's jax.profiler traces, under the workdir

StepFn = Callable[[TrainState, Any], tuple[TrainState, Mapping[str, jax.Array]]]


class Recipe(NamedTuple):
  """Everything `fit` needs to train one model.

  Attributes:
    state: the starting train state (`init_state(...)`); a resumed run restores into its structure.
    step: `step(state, batch) -> (state, metrics)` (e.g. `make_train_step(loss_fn, optimizer)`);
      metrics hold at least `loss` (and `lr`, `grad_norm` as `train_step` gives them).
    batches: an iterator of the step's batches; when it has `state()` (JSON-able) and `restore(s)`,
      its position is checkpointed.
    eval: `eval(state) -> {name: value}`, run every `eval_every` steps (None: no evaluation).
    export: `export(state, folder)` writes the trained model (e.g. in the diffusers layout).
    fingerprint: a JSON-able description of the model, data and optimizer settings; resuming from a
      checkpoint written with another fingerprint is refused.
  """

  state: TrainState
  step: StepFn
  batches: Iterator[Any]
  eval: Callable[[TrainState], Mapping[str, float]] | None = None
  export: Callable[[TrainState, pathlib.Path], None] | None = None
  fingerprint: dict = {}


def batch_sharding(mesh: jax.sharding.Mesh | None, batch_size: int) -> NamedSharding | None:
  """The sharding of a batch's leading axis over the mesh's data-parallel axes (`data` x `fsdp`).

  Raises:
    ValueError: `batch_size` is not a multiple of the data-parallel device count (the axes named).
  """
  if mesh is None:
    return None
  axes = tuple(a for a in ("data", "fsdp") if a in mesh.shape)
  count = 1
  for a in axes:
    count *= mesh.shape[a]
  if batch_size < 1 or batch_size % count:
    shape = " x ".join(f"{a}={mesh.shape[a]}" for a in axes)
    low = max(count, batch_size // count * count)
    raise ValueError(
      f"batch_size={batch_size} must be a positive multiple of the data-parallel device count "
      f"{count} (mesh {shape}); use batch_size={low}"
      + (f" or {low + count}" if low != batch_size else "")
      + ", or fewer devices on data / fsdp"
    )
  return NamedSharding(mesh, PartitionSpec(axes))


def _json_safe(value: Any) -> Any:
  return json.loads(json.dumps(value, default=str))


def fit(
  recipe: Recipe,
  *,
  steps: int,
  workdir: str | pathlib.Path | None = None,
  checkpoint_every: int = 0,
  keep: int = 3,
  eval_every: int = 0,
  log_every: int = 1,
  progress: bool = True,
  peak_flops: float | None = None,
  on_step: Callable[[int], None] | None = None,
  profile_start: int = 0,
  profile_steps: int = 0,
  profile_dir: str | pathlib.Path | None = None,
) -> TrainState:
  """Trains `recipe` until its state reaches step `steps`.

  With a `workdir`, the run resumes from the newest checkpoint in `<workdir>/checkpoints` (the state,
  the data position, after checking the fingerprint), saves every `checkpoint_every` steps and at the
  end (the newest `keep` are kept), and logs to `<workdir>/metrics.jsonl` and `<workdir>/tb/`.

  Every `log_every` steps it logs `loss`, `lr`, `grad_norm` (and the step's other metrics),
  `step_time` (wall seconds per step since the last log), `tflops_per_device` (the compiled step's
  FLOPs by XLA's cost model over the step time) and `mfu` (those FLOP/s over `peak_flops`, default
  the measured matmul FLOP/s of the first device at the parameters' dtype). Every `eval_every` steps
  (and at the last) it logs `recipe.eval(state)`.

  Args:
    recipe: what to train.
    steps: the step count to reach (the state's `step`, counted over resumes).
    workdir: the run's folder, or None for a run without checkpoints or files.
    checkpoint_every: save every this many steps (0: only at the end).
    keep: checkpoints to keep.
    eval_every: evaluate every this many steps and at the last (0: never).
    log_every: log every this many steps (0: only the last step).
    progress: show a progress bar with the loss.
    peak_flops: FLOP/s per device for MFU.
    on_step: called with each step number after that step is dispatched and before anything is
      written for it (tests use it to stop a run in the middle of a step).
    profile_start, profile_steps: a `jax.profiler` trace of steps `profile_start + 1` ..
      `profile_start + profile_steps` (MaxDiffusion's `skip_first_n_steps_for_profiler` /
      `profiler_steps`; the first steps compile and warm up), written to `profile_dir` (default
      `<workdir>/profile`), readable by TensorBoard's profile plugin or Perfetto; 0 steps: no trace.

  Returns:
    The final state.

  Raises:
    ValueError: a bad setting, a checkpoint of another run (differing fingerprint keys named), or a
      data source that yields nothing.
  """
  for name, value, zero in (
    ("checkpoint_every", checkpoint_every, "only at the end"),
    ("eval_every", eval_every, "never"),
    ("log_every", log_every, "only the last step"),
  ):
    if not isinstance(value, int) or value < 0:
      raise ValueError(f"{name}={value!r} must be an int >= 0 (0: {zero})")
  if not isinstance(steps, int) or steps < 0:
    raise ValueError(f"steps={steps!r} must be an int >= 0")
  for name, value in (("profile_start", profile_start), ("profile_steps", profile_steps)):
    if not isinstance(value, int) or value < 0:
      raise ValueError(f"{name}={value!r} must be an int >= 0")
  if profile_steps and profile_dir is None and workdir is None:
    raise ValueError("profile_steps needs a profile_dir (or a workdir: <workdir>/profile)")
  trace_dir = None
  if profile_steps:
    trace_dir = pathlib.Path(profile_dir or pathlib.Path(workdir) / PROFILE_DIR)
  from md_core import progress as md_progress

  state, batches = recipe.state, recipe.batches
  fingerprint = _json_safe(dict(recipe.fingerprint))
  resumable = hasattr(batches, "state") and hasattr(batches, "restore")
  ckpt = writer = None
  start = int(jax.device_get(state.step))
  if workdir is not None:
    workdir = pathlib.Path(workdir)
    ckpt = Checkpointer(workdir / CHECKPOINTS_DIR, keep=keep, every=checkpoint_every)
    if ckpt.latest_step() is not None:
      try:
        state, info = ckpt.restore(state, fingerprint=fingerprint)
      except BaseException:
        # Closed before the error leaves: Orbax's background threads otherwise race the interpreter's
        # shutdown and print their own traceback after the error's one line.
        ckpt.close()
        raise
      if resumable and info["data"] is not None:
        batches.restore(info["data"])
      start = int(info["step"])
      if progress:
        print(f"resumed from {ckpt.directory} at step {start}", flush=True)
    if jax.process_index() == 0:  # one writer for the run (every process saves its checkpoint part)
      writer = MetricsWriter(workdir, resume_step=start)

  step_fn, flops = _compile(recipe.step, state, batches, start < steps)
  peak = peak_flops
  if peak is None and flops is not None:
    dtype = next((a.dtype for a in jax.tree.leaves(state.params)), "float32")
    peak = peak_flops_per_second(dtype)
  # The batch drawn (and compiled on) before the loop is the first one trained on.
  first = step_fn.first_batch if hasattr(step_fn, "first_batch") else None

  def log(step, scalars):
    if writer is not None:
      writer.write(step, scalars)

  bar = None
  if progress and md_progress.progress_enabled() and start < steps:
    import tqdm

    bar = tqdm.tqdm(total=steps, initial=start, desc="training", unit="step")
  last_time, last_step = time.perf_counter(), start
  tracing = False
  unchecked = None  # (step, loss) of the step whose loss is checked once the next one is dispatched

  def check_loss(n, loss):
    value = float(jax.device_get(loss))
    if not np.isfinite(value):
      latest = ckpt.latest_step() if ckpt is not None else None
      kept = f"; the newest checkpoint is step {latest}" if latest is not None else ""
      raise FloatingPointError(
        f"training stopped: the loss is {value} at step {n}{kept} (lower the learning rate, check "
        "the data or the loss)"
      )

  try:
    for n in range(start + 1, steps + 1):
      if first is not None:
        batch, first = first, None
      else:
        batch = _next_batch(batches, n)
      if trace_dir is not None and n == profile_start + 1:
        jax.profiler.start_trace(str(trace_dir))
        tracing = True
      state, metrics = step_fn(state, batch)
      if unchecked is not None:  # the previous step's loss: ready by now, no wait on this step
        check_loss(*unchecked)
      unchecked = (n, metrics["loss"]) if "loss" in metrics else None
      if tracing and (n == profile_start + profile_steps or n == steps):
        jax.block_until_ready(state)
        jax.profiler.stop_trace()
        tracing = False
      if on_step is not None:
        on_step(n)
      md_progress.report_step(n, steps, "training")
      last = n == steps
      if (log_every and n % log_every == 0) or last:
        metrics = jax.device_get(metrics)
        now = time.perf_counter()
        seconds = (now - last_time) / max(n - last_step, 1)
        last_time, last_step = now, n
        scalars = {k: v for k, v in metrics.items() if getattr(v, "ndim", 0) == 0}
        scalars["step_time"] = seconds
        if flops is not None:
          scalars["tflops_per_device"] = flops / seconds / 1e12
          if peak:
            scalars["mfu"] = flops / seconds / peak
        log(n, scalars)
        if bar is not None:
          bar.set_postfix(loss=f"{float(scalars['loss']):.4f}", refresh=False)
      if bar is not None:
        bar.update(1)
      if recipe.eval is not None and eval_every and (n % eval_every == 0 or last):
        log(n, {k: v for k, v in recipe.eval(state).items()})
      if ckpt is not None and (ckpt.should_save(n) or last):
        if unchecked is not None:  # never save a state that a non-finite loss produced
          check_loss(*unchecked)
          unchecked = None
        ckpt.save(
          state,
          data=_json_safe(batches.state()) if resumable else None,
          fingerprint=fingerprint,
          force=last,
        )
    if unchecked is not None:
      check_loss(*unchecked)
    if ckpt is not None and start >= steps and ckpt.latest_step() != start:
      data = _json_safe(batches.state()) if resumable else None
      ckpt.save(state, data=data, fingerprint=fingerprint, force=True)
  finally:
    if tracing:  # stopped early (an error, Ctrl-C): keep what was traced
      jax.profiler.stop_trace()
    if bar is not None:
      bar.close()
    if ckpt is not None:
      ckpt.close()
    if writer is not None:
      writer.close()
  return state


def _next_batch(batches: Iterator[Any], n: int) -> Any:
  try:
    return next(batches)
  except StopIteration:
    raise ValueError(
      f"the data source ran out before step {n} (it gave {n - 1} batch(es) in this run); give "
      "more data, a repeating iterator, or fewer steps"
    ) from None


class _Compiled:
  """The recipe's step, compiled once on the first batch (kept to train on first)."""

  def __init__(self, compiled, first_batch):
    self.compiled, self.first_batch = compiled, first_batch

  def __call__(self, state, batch):
    try:
      return self.compiled(state, batch)
    except TypeError as e:
      shapes = jax.tree.map(lambda x: tuple(np.shape(x)), batch)
      raise ValueError(
        f"a batch with shapes {shapes} does not fit the step compiled on the first batch ({e}); "
        "every batch must have the first one's shapes and dtypes"
      ) from None


# Compiled steps per jitted step function and input signature: fits that share a step (tests, a run
# restarted in the same process) compile it once.
_COMPILED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _signature(tree: Any) -> tuple:
  leaves, treedef = jax.tree.flatten(tree)
  return treedef, tuple(
    (tuple(np.shape(x)), str(getattr(x, "dtype", type(x))), getattr(x, "sharding", None))
    for x in leaves
  )


def _compile(step: StepFn, state: TrainState, batches: Iterator[Any], needed: bool):
  """(the step to call, its FLOPs or None): a jitted step is lowered and compiled once on the first
  batch, and that compiled program runs every step."""
  if not needed or not hasattr(step, "lower"):
    return step, None
  first = _next_batch(batches, int(jax.device_get(state.step)) + 1)
  key = _signature((state, first))
  try:
    memo = _COMPILED.setdefault(step, {})
  except TypeError:  # not weak-referenceable
    memo = {}
  if key not in memo:
    compiled = step.lower(state, first).compile()
    memo[key] = (compiled, compiled_flops(compiled))
  compiled, flops = memo[key]
  return _Compiled(compiled, first), flops
