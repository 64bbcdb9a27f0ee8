"""The one sampling loop every md pipeline runs: schedulers × a family's denoiser, guidance, experts, caches.

A family supplies `denoise(params, x, t, cond, *, step) -> prediction`: model-input assembly and the model
call, nothing else. `x` holds every guidance branch stacked on the batch axis in the canonical row order
of `md_schedulers.guidance` (`[negative, positive, perturbed, isolated]`, each `B` rows), `t` the
per-row timesteps `[n * B]` of the scheduler's current call, `cond` whatever the family needs (text
states already stacked in the same row order, image latents, masks…) and `step` the traced step index
(for per-step inputs such as ControlNet windows). The loop owns the rest: scaling the model input, the
branch batching, the guidance maths, the scheduler step, expert switching, starting and stopping
part-way, the step-cache hook and progress.

Two ways to run it:
- `sample(...)`: pure and traceable — the whole range in one `fori_loop` inside the caller's `jit` (or a
  training step).
- `drive(run, carry, start, stop, ...)`: host-driven jitted chunks of steps. `run(carry, lo, hi)` is the
  caller's jitted `run_steps` (traced bounds: one compiled program whatever the chunk); between chunks
  the host reports progress, calls a per-step `callback(step, timestep, latents)`, honours a `cancel()`
  request and lets Ctrl-C (KeyboardInterrupt) through at a step boundary. One chunk stays in flight
  ahead of the one being waited for, so the device never idles on the host.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

import md_core
from md_core import progress as md_progress
from md_schedulers._base import Scheduler, SchedulerState, current_timestep, num_calls
from md_schedulers.guidance import NO_GUIDANCE, Guidance, combine


class StepCache(NamedTuple):
  """The loop's cache hook: pure functions over a NamedTuple state carried through the loop (md-cache
  builds these). All decisions are traced values, so thresholds change without recompiling.

  Attributes:
    init: `init(latents, num_steps) -> state`.
    decide: `decide(state, step, t, sample) -> (reuse, prediction)`: `reuse` a bool scalar; when True
      the loop takes `prediction` (shaped like the guided prediction) instead of calling the denoiser.
    update: `update(state, step, t, sample, prediction, reused) -> state`, after every step.
    hook: optional `hook(state, step, t, sample) -> md_core block hook` with a `.state` attribute read
      back after the denoiser call (block-level caches); the denoiser then always runs. Called with
      `joint=True` as well when the guidance's branches are one call in the reference
      (`Guidance.one_call`): the hook then decides once for all rows.
    prepare: optional `prepare(run_one, carry) -> carry`, called once before the first step with
      `run_one(carry)` running that step (to be traced abstractly, e.g. by `jax.eval_shape`): lets a
      block-level cache size its state from the model's hidden states.
    negative: optional `(skip, fill)` for a cache of the guidance's `negative` branch (CFG cache):
      `skip(state, step, t, sample) -> bool` says whether the denoiser runs without the negative rows;
      `fill(state, step, t, outputs, skipped) -> (outputs, state)` takes the model output per branch
      name (`skipped` a Python bool: True when "negative" is missing) and returns them with the
      negative branch filled in. On a skipped step the denoiser sees the other branches' rows, and
      every `cond` leaf with `num_branches × B` leading rows (the row-stacked conditioning) is cut
      to them; other leaves pass whole.
  """

  init: Callable[[Any, int], Any]
  decide: Callable[..., tuple[jax.Array, Any]]
  update: Callable[..., Any]
  hook: Callable[..., Any] | None = None
  prepare: Callable[[Callable[[Any], Any], Any], Any] | None = None
  negative: tuple[Callable[..., Any], Callable[..., Any]] | None = None


class Expert(NamedTuple):
  """One denoiser of a multi-expert schedule (Wan 2.2's high- and low-noise transformers).

  Attributes:
    denoise: the family denoiser for this expert.
    params: its parameters (a jit argument).
    until: the step index (exclusive) where this expert hands over to the next; the last one's is the
      end of the schedule.
    scales: this expert's per-step guidance scales (None: the shared `scales`).
  """

  denoise: Callable[..., Any]
  params: Any
  until: int
  scales: Mapping[str, Any] | None = None


class SampleState(NamedTuple):
  """The loop carry.

  Attributes:
    latents: the sample (an array `[B, …]`, or a pytree of them for several modalities).
    scheduler: the scheduler's state (its `step` is the next model call).
    cache: the step cache's state (None without a cache).
    calls: (), int32. Denoiser calls made so far (a reused step adds none).
  """

  latents: Any
  scheduler: SchedulerState
  cache: Any
  calls: jax.Array


class Cancelled(Exception):
  """`drive` stopped at a step boundary because `cancel()` returned True."""

  def __init__(self, step: int, total: int, state: SampleState):
    super().__init__(f"cancelled at step {step}/{total}")
    self.step, self.total, self.state = step, total, state


def init_state(
  latents: Any, state: SchedulerState, *, cache: StepCache | None = None
) -> SampleState:
  """The carry at the first step: latents, scheduler state, the cache's initial state, no calls."""
  cache_state = None if cache is None else cache.init(latents, num_calls(state))
  return SampleState(latents, state, cache_state, jnp.zeros((), jnp.int32))


def _batch_rows(x: Any, n: int) -> Any:
  return x if n == 1 else jax.tree.map(lambda a: jnp.concatenate([a] * n, axis=0), x)


def _scheduler_step(scheduler: Scheduler, st: SchedulerState, pred: Any, x: Any, key):
  leaves, tree = jax.tree.flatten(x)
  preds = jax.tree.leaves(pred)
  if len(leaves) == 1:
    new, st = scheduler.step(st, preds[0].astype(leaves[0].dtype), leaves[0], key)
    return jax.tree.unflatten(tree, [new]), st
  if st.memory:
    raise ValueError(
      f"{scheduler.name} carries a history per sample; a multi-modality sample needs a memoryless "
      "scheduler (flow-match Euler)"
    )
  outs, new_st = [], st
  for leaf, p in zip(leaves, preds):
    out, new_st = scheduler.step(st, p.astype(leaf.dtype), leaf, key)
    outs.append(out)
  return jax.tree.unflatten(tree, outs), new_st


def _segments(experts: Sequence[Expert], lo, hi):
  """Each expert's `[begin, end)` within `[lo, hi)` (bounds may be traced)."""
  out, begin = [], 0
  for e in experts:
    out.append((e, jnp.maximum(lo, begin), jnp.minimum(hi, e.until)))
    begin = e.until
  return out


def run_steps(
  denoise: Callable[..., Any] | None,
  scheduler: Scheduler,
  carry: SampleState,
  lo: Any,
  hi: Any,
  cond: Any,
  *,
  params: Any = None,
  guidance: Guidance = NO_GUIDANCE,
  scales: Mapping[str, Any] | None = None,
  experts: Sequence[Expert] | None = None,
  cache: StepCache | None = None,
  key: jax.Array | None = None,
  progress: Callable[[Any], None] | None = None,
) -> SampleState:
  """Runs scheduler calls `[lo, hi)` (static or traced ints) from `carry`; pure and traceable.

  Args:
    denoise: `denoise(params, x, t, cond, *, step) -> prediction` (None when `experts` are given).
    scheduler: the scheduler whose state is in `carry`.
    carry: from `init_state` or a previous chunk.
    lo, hi: the step range.
    cond: the family's conditioning (a pytree; a jit argument).
    params: the denoiser's parameters.
    guidance: which guidance terms to compute; the denoiser sees `guidance.num_branches × B` rows.
    scales: per-step scales (`guidance.per_step`): name → `[steps]` or `[steps, B]`.
    experts: several denoisers by step range, each with its own params and optionally scales.
    cache: a step cache (None: every step calls the denoiser).
    key: PRNG key for stochastic schedulers (folded with the step index).
    progress: `tick(i)` called in the body with the step index (in-jit progress bars).

  Returns:
    The carry after step `hi - 1`.
  """
  if experts is None:
    if denoise is None:
      raise ValueError("sample: pass a denoiser, or experts")
    experts = [Expert(denoise, params, num_calls(carry.scheduler), None)]
  elif denoise is not None:
    raise ValueError("sample: pass either a denoiser or experts, not both")
  if scheduler.stochastic and key is None:
    raise ValueError(f"{scheduler.name} is stochastic: sample needs a key")
  n = guidance.num_branches
  missing = [s for s in guidance.scale_names if s not in (scales or {})]
  for e in experts:
    if e.scales is None and missing:
      raise ValueError(f"guidance {guidance} needs per-step scales {missing}")

  def body(expert: Expert, first_step=None):
    """The loop body of one expert; `first_step` (the step where it takes over from the previous
    expert, None for the first expert) always runs the denoiser: a step cache's reference prediction
    is the other expert's there, so reusing it would mix the two models (MaxDiffusion's SenCache
    forces that step too)."""
    step_scales = scales if expert.scales is None else expert.scales

    def step(i, c: SampleState) -> SampleState:
      x, st = c.latents, c.scheduler
      t = current_timestep(st)
      b = jax.tree.leaves(x)[0].shape[0]
      s_i = {
        k: tuple(jnp.asarray(a)[i] for a in v) if isinstance(v, tuple) else jnp.asarray(v)[i]
        for k, v in (step_scales or {}).items()
      }
      sigma = st.sigmas[st.step]

      def model(k, cond_k):  # the denoiser on `k` branches' rows
        xin = jax.tree.map(lambda a: scheduler.scale_model_input(st, a), x)
        tb = jnp.broadcast_to(t, (k * b,))
        out = expert.denoise(expert.params, _batch_rows(xin, k), tb, cond_k, step=i)
        return jax.tree.map(lambda o, a: o.astype(a.dtype), out, _batch_rows(x, k))

      def compute():
        return combine(guidance, model(n, cond), s_i, sample=x, sigma=sigma)

      cache_state, calls = c.cache, c.calls
      if cache is not None and cache.negative is not None:
        pred, cache_state = _negative_cached(
          cache.negative, cache_state, i, t, x, model, cond, guidance, s_i, sigma
        )
        reused = jnp.zeros((), bool)
      elif cache is None:
        pred, reused = compute(), jnp.zeros((), bool)
      elif cache.hook is not None:
        # A cache deciding for the whole batch where the reference runs the branches in one call.
        joint = {"joint": True} if guidance.one_call else {}
        hook = cache.hook(cache_state, i, t, x, **joint)
        with md_core.block_hook(hook):
          pred = compute()
        cache_state, reused = hook.state, jnp.zeros((), bool)
      else:
        reused, candidate = cache.decide(cache_state, i, t, x)
        reused = jnp.asarray(reused, bool)
        if first_step is not None:
          reused = reused & (i != first_step)
        pred = jax.lax.cond(reused, lambda: candidate, compute)
      calls = calls + jnp.where(reused, 0, 1).astype(jnp.int32)
      if cache is not None:
        cache_state = cache.update(cache_state, i, t, x, pred, reused)
      step_key = None if not scheduler.stochastic else jax.random.fold_in(key, i)
      x, st = _scheduler_step(scheduler, st, pred, x, step_key)
      if progress is not None:
        progress(i)
      return SampleState(x, st, cache_state, calls)

    return step

  switch = None
  for expert, begin, end in _segments(experts, lo, hi):
    carry = jax.lax.fori_loop(begin, end, body(expert, switch), carry)
    switch = expert.until
  return carry


def _negative_cached(negative, state, i, t, x, model, cond, guidance, s_i, sigma):
  """One step with a cache of the negative branch: the denoiser on every row, or (when `skip` says so)
  on the other branches' rows with the negative output filled in by the cache."""
  skip, fill = negative
  names = guidance.branches
  if names[0] != "negative":
    raise ValueError(
      "this cache reuses the unconditional (negative) branch of classifier-free guidance, and this "
      "call runs none: use guidance_scale > 1 (true_cfg_scale > 1 with a negative prompt on Flux.1), "
      "or a step-level cache (taylorseer, sencache)"
    )
  if set(names) != {"negative", "positive"}:
    raise ValueError(
      f"the CFG cache runs with classifier-free guidance alone; this call also computes "
      f"{[k for k in names if k not in ('negative', 'positive')]} (STG / modality guidance)"
    )
  n, b = len(names), jax.tree.leaves(x)[0].shape[0]

  def split(out, keys):
    parts = [jnp.split(a, len(keys), axis=0) for a in jax.tree.leaves(out)]
    tree = jax.tree.structure(out)
    return {k: jax.tree.unflatten(tree, [p[j] for p in parts]) for j, k in enumerate(keys)}

  def join(outs):
    leaves = [jax.tree.leaves(outs[k]) for k in names]
    tree = jax.tree.structure(outs[names[0]])
    return jax.tree.unflatten(tree, [jnp.concatenate(ls, axis=0) for ls in zip(*leaves)])

  def finish(outs, st):
    return combine(guidance, join(outs), s_i, sample=x, sigma=sigma), st

  def full():
    return finish(*fill(state, i, t, split(model(n, cond), names), False))

  def without_negative():
    rows = n * b
    kept = jax.tree.map(
      lambda a: a[b:] if getattr(a, "ndim", 0) and a.shape[0] == rows else a, cond
    )
    refusal = (
      "the CFG cache runs the denoiser on the rows of the branches other than `negative` "
      f"({(n - 1) * b} of {rows}), and this family's denoiser cannot take them (it repeats per-sample "
      "inputs by a fixed branch count)"
    )
    try:
      out = model(n - 1, kept)
    except (TypeError, ValueError, ZeroDivisionError) as e:
      raise ValueError(f"{refusal}: {e}") from e
    got = {a.shape[0] for a in jax.tree.leaves(out)}
    if got != {(n - 1) * b}:
      raise ValueError(f"{refusal}: it returned {sorted(got)} rows")
    return finish(*fill(state, i, t, split(out, names[1:]), True))

  return jax.lax.cond(jnp.asarray(skip(state, i, t, x), bool), without_negative, full)


def sample(
  denoise: Callable[..., Any] | None,
  scheduler: Scheduler,
  latents: Any,
  state: SchedulerState,
  cond: Any,
  *,
  params: Any = None,
  guidance: Guidance = NO_GUIDANCE,
  scales: Mapping[str, Any] | None = None,
  start: int = 0,
  stop: int | None = None,
  experts: Sequence[Expert] | None = None,
  cache: StepCache | None = None,
  key: jax.Array | None = None,
  progress: Callable[[Any], None] | None = None,
) -> SampleState:
  """Samples from `latents` over scheduler calls `[start, stop)` in one traced loop (see `run_steps`).

  `state` must already point at `start` (`md_schedulers.start_at` for img2img / denoising_start).
  Returns the final `SampleState` (`.latents` the result, `.calls` the denoiser calls made).
  """
  stop = num_calls(state) if stop is None else stop
  carry = init_state(latents, state, cache=cache)

  def run(c, lo, hi):
    return run_steps(
      denoise, scheduler, c, lo, hi, cond, params=params, guidance=guidance, scales=scales,
      experts=experts, cache=cache, key=key, progress=progress,
    )  # fmt: skip

  if cache is not None and cache.prepare is not None:
    carry = cache.prepare(lambda c: run(c, start, start + 1), carry)
  return run(carry, start, stop)


LONG_RUN_SECONDS = 300.0  # drive warns when the steps left are expected to take longer
AUTO_CHUNK_SECONDS = 0.05  # chunk="auto": the work one dispatch should hold
AUTO_CHUNK_MAX = 64


def drive(
  run: Callable[..., SampleState],
  carry: SampleState,
  start: int,
  stop: int,
  *,
  args: tuple[Any, ...] = (),
  chunk: int | str | None = "auto",
  callback: Callable[[int, Any, Any], Any] | None = None,
  cancel: Callable[[], bool] | None = None,
  progress: bool | str | Callable[[int], None] = False,
  cache: StepCache | None = None,
) -> SampleState:
  """Runs `run(carry, lo, hi, *args)` (a jitted `run_steps`) over `[start, stop)` in chunks from the host.

  With a progress bar, a jitted `run` (one with `.lower`) is first lowered for one step to report the
  FLOPs per step from its program; the bar reads "compiling" until the first chunk is done; after the
  next one the host knows the time per step, and warns when the steps left should take more than
  `LONG_RUN_SECONDS` (or `$MD_LONG_RUN_SECONDS`).

  Args:
    run: the caller's jitted chunk; its bounds are traced, so every chunk runs one compiled program.
    carry: the starting carry.
    start, stop: the step range.
    args: the chunk's other arguments (parameters, conditioning, scales), passed after the bounds.
    chunk: steps per chunk; None runs the whole range in one call; "auto" starts with one step and
      then sizes chunks to about `AUTO_CHUNK_SECONDS` of work each (at most `AUTO_CHUNK_MAX` steps), so a
      fast model pays no per-step dispatch and a slow one still stops within a step.
    callback: `callback(step, timestep, latents)` after each step (forces `chunk=1`); latents are the
      sample after that step. Returning False stops like `cancel`.
    cancel: polled at every step boundary; True stops with `Cancelled`.
    progress: a host progress bar over the steps (True, or its label; shown when md_core.progress is
      on), or `progress(done)` called after each chunk with the steps completed.
    cache: the step cache `run` was built with; its `prepare` (if any) sees the first carry.

  Returns:
    The carry after the last step.

  Raises:
    Cancelled: `cancel()` returned True (or `callback` returned False); holds the carry reached.
  """
  if stop <= start:
    return carry
  total = stop - start
  md_progress.report_step(0, total, "denoising")

  def one(c, lo, hi):
    return run(c, np.int32(lo), np.int32(hi), *args)

  if cache is not None and cache.prepare is not None:
    carry = cache.prepare(lambda c: one(c, start, start + 1), carry)
  if callback is not None:
    chunk = 1
  if chunk is not None and chunk != "auto" and (isinstance(chunk, bool) or int(chunk) < 1):
    raise ValueError(f"chunk={chunk!r}: expected a positive number of steps, 'auto' or None")
  size = total if chunk is None else 1 if chunk == "auto" else int(chunk)
  bar = None
  if progress is not None and not callable(progress) and progress:
    if md_progress.progress_enabled():
      import tqdm  # noqa: PLC0415

      label = progress if isinstance(progress, str) else "denoising"
      flops = step_flops(run, carry, start, args)
      warned = False
      if flops:
        x = jax.tree.leaves(carry.latents)[0]
        # Expected time at half the device's measured matmul rate (what the DiTs reach on CPU).
        expected = flops * total / (0.5 * matmul_flops_per_second(x.dtype))
        tqdm.tqdm.write(
          f"{label}: {total} steps on latents {list(x.shape)}, {flops / 1e9:.3g} GFLOP per step, "
          f"expected {_duration(expected)} on {jax.devices()[0].device_kind}",
          file=sys.stderr,
        )
        warned = _warn_if_long(label, expected / total, total, flops)
      bar = tqdm.tqdm(total=total, desc="compiling")
      bar.label, bar.flops, bar.warned = label, flops, warned
  try:
    return _drive(one, carry, size, chunk == "auto", start, stop, callback, cancel, progress, bar)
  finally:
    if bar is not None:
      bar.close()


def step_flops(
  run: Any, carry: SampleState, start: int, args: tuple[Any, ...] = ()
) -> float | None:
  """FLOPs of one step of a jitted chunk `run(carry, lo, hi, *args)`, from its lowered program (XLA's
  cost analysis counts a loop body once); None when `run` is not jitted or the analysis has no count."""
  lower = getattr(run, "lower", None)
  if lower is None:
    return None
  try:
    cost = lower(carry, np.int32(start), np.int32(start + 1), *args).cost_analysis()
  except Exception:  # noqa: BLE001 - an estimate only; the run itself reports real errors
    return None
  cost = cost[0] if isinstance(cost, list | tuple) and cost else cost
  flops = float((cost or {}).get("flops", 0.0))
  return flops if flops > 0 else None


def _warn_if_long(label: str, per_step: float, left: int, flops: float | None) -> bool:
  """Warns (one line on stderr) when `left` steps of `per_step` seconds exceed the long-run limit."""
  import os  # noqa: PLC0415

  import tqdm  # noqa: PLC0415

  limit = float(os.environ.get("MD_LONG_RUN_SECONDS", LONG_RUN_SECONDS))
  expected = per_step * left
  if expected <= limit:
    return False
  rate = f", {flops / per_step / 1e9:.3g} GFLOP/s" if flops else ""
  tqdm.tqdm.write(
    f"warning: {label} needs about {expected:.0f} s more ({per_step:.3g} s per step{rate}); "
    "fewer steps or a smaller size finish sooner",
    file=sys.stderr,
  )
  return True


def _duration(seconds: float) -> str:
  if seconds < 1:
    return "under a second"
  if seconds < 120:
    return f"about {seconds:.0f} s"
  return f"about {seconds / 60:.0f} min"


_MATMUL_RATE: dict[str, float] = {}


def matmul_flops_per_second(dtype: Any = jnp.float32, n: int = 1024) -> float:
  """The default device's measured FLOP/s on an `n`² matmul (best of three, cached per dtype)."""
  import time  # noqa: PLC0415

  key = f"{jnp.dtype(dtype).name}:{n}"
  if key not in _MATMUL_RATE:
    a = jnp.ones((n, n), dtype)
    f = jax.jit(lambda a: a @ a)
    jax.block_until_ready(f(a))
    best = float("inf")
    for _ in range(3):
      t = time.perf_counter()
      jax.block_until_ready(f(a))
      best = min(best, time.perf_counter() - t)
    _MATMUL_RATE[key] = 2 * n**3 / max(best, 1e-9)
  return _MATMUL_RATE[key]


def _drive(one, carry, size, auto, start, stop, callback, cancel, progress, bar):
  import time  # noqa: PLC0415

  in_flight: SampleState | None = None
  timed: tuple[float, int] | None = None  # (host time, steps done) after the first chunk
  lo = start
  while lo < stop:
    hi = min(stop, lo + size)
    timestep = None
    if callback is not None:
      timestep = carry.scheduler.timesteps[carry.scheduler.step]
    nxt = one(carry, lo, hi)
    if in_flight is not None:
      jax.block_until_ready(in_flight.calls)  # keep one chunk queued ahead, no more
    in_flight, carry = nxt, nxt
    if callback is not None:
      jax.block_until_ready(carry.calls)
      if callback(lo, timestep, carry.latents) is False:
        raise Cancelled(hi, stop, carry)
    md_progress.report_step(hi - start, stop - start, "denoising")
    if timed is None and (bar is not None or auto):
      jax.block_until_ready(carry.calls)  # the first chunk holds the compile
      timed = (time.perf_counter(), hi - start)
      if bar is not None:
        bar.set_description(bar.label)
    elif timed is not None and timed[1] is not None and hi < stop:
      jax.block_until_ready(carry.calls)
      per_step = (time.perf_counter() - timed[0]) / max(hi - start - timed[1], 1)
      if bar is not None and not bar.warned:
        bar.warned = _warn_if_long(bar.label, per_step, stop - hi, bar.flops)
      if auto:
        size = int(min(AUTO_CHUNK_MAX, max(1, AUTO_CHUNK_SECONDS // max(per_step, 1e-9))))
      timed = (timed[0], None)
    if bar is not None:
      bar.update(hi - lo)
    elif callable(progress):
      progress(hi - start)
    if cancel is not None and hi < stop and cancel():
      jax.block_until_ready(carry.calls)
      raise Cancelled(hi, stop, carry)
    lo = hi
  return carry
