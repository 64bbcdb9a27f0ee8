"""The job queue: bounded, batching compatible requests into one shape bucket, run by one worker thread.

A request becomes a `Job` (queued → running → succeeded | failed | cancelled). The worker takes the oldest
job, waits `batch_wait_s` for more, and runs every queued job with the same `GenRequest.bucket()` (up to
`max_batch` rows) in one pipeline call: prompts side by side, each request's initial noise drawn from its
own seed, the rows padded to the smallest of `batch_buckets` that holds them (so a few batch sizes compile,
not one per count). Progress events (step i of n, a low-resolution preview every `preview_every` steps
for image models) go to each job's event list; cancelling a job frees its slot at once, and stops the loop
at the next step boundary when no other job in its batch is still wanted.
"""

from __future__ import annotations

import base64
import collections
import dataclasses
import io
import itertools
import math
import sys
import threading
import time
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from PIL import Image

import md_schedulers
from md_cache import settings as cache_settings
from md_serve._models import ServedModel
from md_serve._requests import GenRequest, RequestError

_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
_compiles = [0]
_listening = [False]
_lock = threading.Lock()


def _on_event(event: str, duration: float, **_: Any) -> None:
  if event == _COMPILE_EVENT:
    _compiles[0] += 1


def compile_count() -> int:
  """XLA compiles in this process since md-serve started counting (`start_counting_compiles`)."""
  return _compiles[0]


def start_counting_compiles() -> None:
  """Registers the compile listener once (jax.monitoring)."""
  with _lock:
    if not _listening[0]:
      jax.monitoring.register_event_duration_secs_listener(_on_event)
      _listening[0] = True


class QueueFull(Exception):
  """The queue holds `max_queue` jobs; `retry_after` is the seconds a client should wait."""

  def __init__(self, retry_after: int):
    super().__init__(f"the job queue is full; retry after {retry_after}s")
    self.retry_after = retry_after


class ShuttingDown(Exception):
  """The server is stopping and takes no new jobs."""


DONE = ("succeeded", "failed", "cancelled")


@dataclasses.dataclass
class Job:
  """One request's life. `events` grows while it runs; `results` are uint8 arrays."""

  request: GenRequest
  id: str = dataclasses.field(default_factory=lambda: "job-" + uuid.uuid4().hex[:16])
  status: str = "queued"
  created: float = dataclasses.field(default_factory=time.time)
  started: float | None = None
  finished: float | None = None
  step: int = 0
  total: int = 0
  error: str | None = None
  results: list = dataclasses.field(default_factory=list)
  audio: list | None = None  # per result `[channels, samples]` in [-1, 1] (LTX-2), else None
  sample_rate: int | None = None
  fps: float = 8.0  # a video's frame rate (LTX-2 says its own)
  scores: list | None = None
  batch_rows: int = 0
  events: list = dataclasses.field(default_factory=list)
  cancel_requested: bool = False
  http_status: int = (
    500  # what a failure answers: 422 the pipeline refused the request, 504 deadline
  )
  done: threading.Event = dataclasses.field(default_factory=threading.Event)

  def emit(self, kind: str, **data: Any) -> None:
    self.events.append({"event": kind, "job": self.id, **data})

  def finish(self, status: str, error: str | None = None) -> None:
    if self.status in DONE:
      return
    self.status, self.error, self.finished = status, error, time.time()
    self.emit(status, **({"error": error} if error else {}))
    self.done.set()

  def describe(self) -> dict:
    out = {
      "id": self.id,
      "object": "job",
      "status": self.status,
      "kind": self.request.kind,
      "model": self.request.model,
      "prompt": self.request.prompt,
      "n": self.request.n,
      "step": self.step,
      "total": self.total,
      "created": int(self.created),
      "batch_rows": self.batch_rows,
    }
    if self.error:
      out["error"] = self.error
    if self.started and self.finished:
      out["seconds"] = round(self.finished - self.started, 4)
    if self.scores is not None:
      out["scores"] = self.scores
    return out


def _preview(latents: np.ndarray) -> str:
  """A latent-space preview (first three channels, each stretched to [0, 255]) as a base64 PNG."""
  x = np.asarray(latents, np.float32)[..., :3]
  lo, hi = x.min(axis=(0, 1)), x.max(axis=(0, 1))
  x = (x - lo) / np.maximum(hi - lo, 1e-6)
  if x.shape[-1] < 3:
    x = np.repeat(x[..., :1], 3, axis=-1)
  buf = io.BytesIO()
  Image.fromarray((x * 255).astype(np.uint8)).save(buf, format="PNG")
  return base64.b64encode(buf.getvalue()).decode()


class JobQueue:
  """Bounded job queue with one worker thread.

  Args:
    models: `{name: ServedModel}`.
    max_queue: jobs waiting or running before `submit` raises `QueueFull` (HTTP 429).
    max_batch: rows (images or videos) per pipeline call.
    batch_buckets: the batch sizes calls are padded to (sorted; a count above the largest runs as is).
    batch_wait_s: how long the worker waits after the first job for compatible ones.
    preview_every: a preview event every k steps (0: none).
    verifier: the verifier requests with `search` use (None: such requests fail).
    chunk: steps per host dispatch (the loop's `chunk`; progress and cancel act at its boundaries).
    keep_jobs: finished jobs remembered for `GET /v1/jobs/{id}`.
    job_timeout_s: a job still running this long after it started fails at the next step boundary
      (None: no deadline).
    max_programs: distinct program shapes (model, size, frames, steps, rows, cache) kept compiled; a new
      one past that frees every compiled program (`jax.clear_caches` and each pipeline's memo), so memory
      stays bounded however many sizes requests ask for (the ones in use compile again).
  """

  def __init__(
    self,
    models: Mapping[str, ServedModel],
    *,
    max_queue: int = 16,
    max_batch: int = 4,
    batch_buckets: Sequence[int] = (1, 2, 4),
    batch_wait_s: float = 0.05,
    preview_every: int = 0,
    verifier: Any = None,
    chunk: int | str | None = 1,
    keep_jobs: int = 256,
    job_timeout_s: float | None = 600.0,
    max_programs: int = 8,
  ):
    start_counting_compiles()
    self.models = dict(models)
    self.max_queue, self.max_batch = int(max_queue), int(max_batch)
    self.batch_buckets = sorted(int(b) for b in batch_buckets)
    self.batch_wait_s, self.preview_every = float(batch_wait_s), int(preview_every)
    self.verifier, self.chunk, self.keep_jobs = verifier, chunk, int(keep_jobs)
    self.job_timeout_s = None if job_timeout_s is None else float(job_timeout_s)
    self.max_programs = int(max_programs)
    self._programs: collections.OrderedDict[tuple, None] = collections.OrderedDict()
    self.jobs: collections.OrderedDict[str, Job] = collections.OrderedDict()
    self._pending: list[Job] = []
    self._cond = threading.Condition()
    self._closing = False
    self._running: list[Job] = []
    self.stats = collections.Counter()
    self.step_seconds_sum = 0.0
    self.job_seconds = collections.deque(maxlen=64)
    self.compiles_at_start = compile_count()
    self._thread = threading.Thread(target=self._work, name="md-serve-worker", daemon=True)
    self._thread.start()

  # --- the front --------------------------------------------------------------------------------------
  @property
  def depth(self) -> int:
    """Jobs accepted and not finished (queued + running)."""
    with self._cond:
      return len(self._pending) + sum(j.status == "running" for j in self._running)

  def retry_after(self) -> int:
    per_job = float(np.mean(self.job_seconds)) if self.job_seconds else 1.0
    return max(1, math.ceil(per_job * max(1, self.depth) / max(1, self.max_batch)))

  def submit(self, request: GenRequest) -> Job:
    """Queues a request.

    Raises:
      RequestError: its cache policy does not apply to its model.
      QueueFull: `max_queue` jobs are already waiting or running.
      ShuttingDown: `shutdown` was called.
    """
    if request.cache:
      self.make_cache(self.models[request.model], request)  # refused now, not in the worker
    with self._cond:
      if self._closing:
        raise ShuttingDown("the server is shutting down")
      if len(self._pending) + len(self._running) >= self.max_queue:
        self.stats["rejected"] += 1
        raise QueueFull(self.retry_after())
      job = Job(request)
      job.emit("queued", position=len(self._pending))
      self.jobs[job.id] = job
      while len(self.jobs) > self.keep_jobs:
        old = next(iter(self.jobs))
        if self.jobs[old].status not in DONE:
          break
        self.jobs.pop(old)
      self._pending.append(job)
      self.stats["accepted"] += 1
      self._cond.notify_all()
    return job

  def warm_up(
    self, body: Mapping[str, Any] | None = None, *, buckets: Sequence[int] | None = None
  ) -> list[dict]:
    """Runs one request per model and batch bucket (`n` = the bucket, the model's default size and
    frames, the request defaults or `body`'s fields), so requests of those shapes find their programs
    compiled, or with an executable store (`md_core.ExecutableStore`) loaded from disk. Call it before
    serving; its jobs are then dropped from the listings and counters. Returns one row per run: model,
    bucket, seconds and the XLA compiles it made.

    Raises:
      RuntimeError: a warm-up request failed (its error).
    """
    from md_serve._requests import parse_request  # noqa: PLC0415

    rows = []
    for name, model in self.models.items():
      for bucket in sorted(set(buckets or self.batch_buckets)):
        request = parse_request(
          {"prompt": "warm-up", **(body or {}), "model": name, "n": int(bucket)},
          model.kind,
          self.models,
          max_n=max(int(bucket), self.max_batch),
        )
        before, start = compile_count(), time.perf_counter()
        job = self.submit(request)
        job.done.wait()
        if job.status != "succeeded":
          raise RuntimeError(f"warm-up of {name!r} with n={bucket}: {job.status}: {job.error}")
        rows.append(
          dict(
            model=name,
            bucket=int(bucket),
            seconds=round(time.perf_counter() - start, 3),
            compiles=compile_count() - before,
          )
        )
    with self._cond:
      self.jobs.clear()
      self.stats.clear()
      self.job_seconds.clear()
      self.step_seconds_sum = 0.0
    return rows

  def cancel(self, job_id: str, reason: str = "cancelled by request") -> Job | None:
    """Cancels a queued job at once, a running one at the next step boundary (its slot is freed now)."""
    with self._cond:
      job = self.jobs.get(job_id)
      if job is None or job.status in DONE:
        return job
      job.cancel_requested = True
      if job in self._pending:
        self._pending.remove(job)
      if job in self._running:
        self._running.remove(job)
      job.finish("cancelled", reason)
      self.stats["cancelled"] += 1
      self._cond.notify_all()
    return job

  def shutdown(self, mode: str = "finish", timeout: float | None = None) -> list[Job]:
    """Stops taking jobs; `"finish"` runs every accepted job first (for at most `timeout` seconds, None:
    as long as they take, each within the job deadline), `"cancel"` cancels them. A job that does not
    succeed gets a `cancelled` or `failed` status and event and one stderr line: none is lost silently.
    Returns once the worker has stopped (never with a program still running), with the jobs that did
    not succeed."""
    if mode not in ("finish", "cancel"):
      raise ValueError(f"shutdown mode {mode!r}: expected 'finish' or 'cancel'")
    with self._cond:
      self._closing = True
      unfinished = list(self._pending) + list(self._running)
      if mode == "cancel":
        self._cancel_all("server shut down")
      self._cond.notify_all()
    self._thread.join(timeout)
    if self._thread.is_alive():  # finish ran out of time: what is left is cancelled and said so
      with self._cond:
        self._cancel_all(f"server shut down ({timeout:g} s to finish ran out)")
      self._thread.join()
    return [j for j in unfinished if j.status != "succeeded"]

  def _cancel_all(self, reason: str) -> None:
    for job in list(self._pending) + list(self._running):
      if job.status in DONE:
        continue
      job.cancel_requested = True
      job.finish("cancelled", reason)
      self.stats["cancelled"] += 1
      print(f"md-serve: {job.id} cancelled: {reason} ({job.request.prompt!r})", file=sys.stderr)
    self._pending.clear()

  # --- the worker -------------------------------------------------------------------------------------
  def _take(self) -> list[Job] | None:
    with self._cond:
      while not self._pending:
        if self._closing:
          return None
        self._cond.wait(0.5)
      first_at = self._pending[0].created
    wait = self.batch_wait_s - (time.time() - first_at)
    if wait > 0:
      time.sleep(wait)
    with self._cond:
      if not self._pending:
        return []
      first = self._pending[0]
      batch, rows = [], 0
      alone = bool(first.request.search) or self.models[first.request.model].spec is None
      for job in list(self._pending):
        if job.request.bucket() != first.request.bucket() or job.request.search:
          if job is not first:
            continue
        if rows + job.request.n > self.max_batch and batch:
          break
        batch.append(job)
        rows += job.request.n
        if alone:
          break
      for job in batch:
        self._pending.remove(job)
        job.status, job.started = "running", time.time()
        job.batch_rows = rows
        job.emit("running", batch_rows=rows)
      self._running = list(batch)
    return batch

  def _work(self) -> None:
    while True:
      batch = self._take()
      if batch is None:
        return
      if not batch:
        continue
      try:
        if batch[0].request.search:
          self._run_search(batch[0])
        else:
          self._run(batch)
      except md_schedulers.Cancelled:
        for job in batch:
          if self._late(job):
            job.http_status = 504
            job.finish("failed", f"the job ran past its deadline of {self.job_timeout_s:g} s")
            self.stats["failed"] += 1
          else:
            job.finish("cancelled", "cancelled by request")
      except Exception as e:  # a failed batch fails its jobs, never the worker
        for job in batch:
          # The pipeline's ValueError / TypeError is a request it refuses (e.g. a size its model
          # cannot take): the client's to fix (422); anything else is the server's (500).
          job.http_status = 422 if isinstance(e, ValueError | TypeError) else 500
          job.finish("failed", f"{type(e).__name__}: {e}")
        self.stats["failed"] += len(batch)
      finally:
        with self._cond:
          self._running = []
          self._cond.notify_all()

  def _late(self, job: Job) -> bool:
    return (
      self.job_timeout_s is not None
      and job.started is not None
      and time.time() - job.started > self.job_timeout_s
    )

  def _use_program(self, model: ServedModel, r: GenRequest, rows: int) -> None:
    """Notes the program shape a call is about to use; past `max_programs` shapes every compiled
    program is freed (the memos and jax's caches), so the memory they hold stays bounded."""
    key = (r.model, r.height, r.width, r.num_frames, r.steps, rows, r.cache, bool(r.search))
    if key in self._programs:
      self._programs.move_to_end(key)
      return
    if len(self._programs) >= self.max_programs:
      self._programs.clear()
      for m in self.models.values():
        m.pipe.clear_programs()
      jax.clear_caches()
      self.stats["program_evictions"] += 1
    self._programs[key] = None

  def _kwargs(self, model: ServedModel, r: GenRequest, jobs: list[Job]) -> dict:
    kw = dict(
      model.call_kwargs,
      height=r.height,
      width=r.width,
      num_inference_steps=r.steps,
      guidance_scale=r.guidance,
      progress=False,
      chunk=self.chunk,
    )
    if model.kind == "video":
      kw["num_frames"] = r.num_frames
    if r.scheduler:
      kw["scheduler"] = r.scheduler
    if r.cache:
      kw["cache"] = self.make_cache(model, r)
    return kw

  def make_cache(self, model: ServedModel, r: GenRequest) -> Any:
    """The md-cache policy of a checked request (`parse_request` took its options: numbers and
    registered names only, so nothing here reads a file).

    Raises:
      RequestError: the policy does not apply to the model's denoiser (param "cache").
    """
    pipe = model.pipe  # asked through the family contract: block_stacks, cache_defaults
    policy = cache_settings.POLICIES[r.cache]
    if policy.needs == "blocks" and not pipe.block_stacks:
      raise RequestError(
        "cache", f"cache {r.cache!r} needs transformer blocks; {model.name} has a UNet"
      )
    if policy.needs == "unet" and pipe.block_stacks:
      raise RequestError("cache", f"cache {r.cache!r} is for UNets; {model.name} has a transformer")
    options = {**pipe.cache_defaults.get(r.cache, {}), **dict(r.cache_options)}
    ratios = options.pop("mag_ratios", None)
    if ratios is not None:
      options["mag_ratios"] = np.asarray(ratios, np.float32)
    try:
      return policy.factory(**options)
    except ValueError as e:
      raise RequestError("cache_options", f"cache {r.cache!r}: {e}") from None

  def _progress(self, jobs: list[Job], model: ServedModel, total: int):
    last = [time.perf_counter()]
    bounds = list(itertools.accumulate([0] + [j.request.n for j in jobs]))

    def callback(step, timestep, latents):
      now = time.perf_counter()
      self.step_seconds_sum += now - last[0]
      self.stats["steps"] += 1
      last[0] = now
      i = int(step) + 1
      want_preview = (
        self.preview_every and model.kind == "image" and (i % self.preview_every == 0 or i == total)
      )
      host = np.asarray(latents) if want_preview else None
      for k, job in enumerate(jobs):
        if job.status != "running":
          continue
        job.step, job.total = i, total
        extra = {}
        if host is not None:
          extra["preview"] = _preview(host[bounds[k]])
        job.emit("progress", step=i, total=total, **extra)
      return None

    return callback

  def _run(self, jobs: list[Job]) -> None:
    r = jobs[0].request
    model = self.models[r.model]
    pipe, spec = model.pipe, model.spec
    model.set_loras(r.loras)
    prompts = [j.request.prompt for j in jobs for _ in range(j.request.n)]
    kw = self._kwargs(model, r, jobs)
    if r.negative_prompt:
      kw["negative_prompt"] = r.negative_prompt
    if spec is not None:
      rows = len(prompts)
      size = next((b for b in self.batch_buckets if b >= rows), rows)
      noise = [
        spec.draw(j.request.seed, j.request.n, r.height, r.width, r.num_frames) for j in jobs
      ]
      if size > rows:
        prompts += [prompts[-1]] * (size - rows)
        noise.append(spec.draw(0, size - rows, r.height, r.width, r.num_frames))
      kw["latents"] = np.concatenate(noise)
      kw["seed"] = r.seed
    else:
      kw["seed"] = r.seed
      kw["num_images_per_prompt" if model.kind == "image" else "num_videos_per_prompt"] = r.n
      prompts = [r.prompt]
    total = r.steps

    def cancel():
      return all(j.cancel_requested or self._late(j) for j in jobs)

    self._use_program(model, r, len(prompts))

    out = pipe(prompts, callback=self._progress(jobs, model, total), cancel=cancel, **kw)
    # LTX-2 returns its video with a soundtrack (`frames`, `audio`, `sample_rate`): both are kept.
    audio, rate = getattr(out, "audio", None), getattr(out, "sample_rate", None)
    fps = getattr(out, "frame_rate", None)
    out = np.asarray(getattr(out, "frames", out))
    self.stats["batches"] += 1
    self.stats["denoiser_calls"] += int(pipe.last_calls)
    pixels = (np.clip(out, 0.0, 1.0) * 255).round().astype(np.uint8)
    at = 0
    for job in jobs:
      job.results = list(pixels[at : at + job.request.n])
      if audio is not None:
        job.audio = [np.asarray(a, np.float32) for a in audio[at : at + job.request.n]]
        job.sample_rate = int(rate)
      if fps is not None:
        job.fps = float(fps)
      at += job.request.n
      if job.status == "running":
        job.step = job.total = total
        self.job_seconds.append(time.time() - job.started)
        self.stats["succeeded"] += 1
        job.finish("succeeded")

  def _run_search(self, job: Job) -> None:
    from md_serve._search import search  # noqa: PLC0415

    r = job.request
    model = self.models[r.model]
    if self.verifier is None:
      raise ValueError("this server has no verifier: start it with one to use search")
    model.set_loras(r.loras)
    opts = dict(r.search)
    kw = self._kwargs(model, r, [job])
    kw.pop("progress", None)
    h, w = kw.pop("height"), kw.pop("width")
    frames = kw.pop("num_frames", None)
    if r.negative_prompt:
      kw["negative_prompt"] = r.negative_prompt

    def cancel():
      return job.cancel_requested or self._late(job)

    self._use_program(model, r, self.max_batch)

    def on_round(samples, budget, best):
      job.step, job.total = samples, budget
      job.emit("progress", step=samples, total=budget, best_score=best)

    result = search(
      model.pipe, r.prompt, self.verifier, max(opts["budget"], r.n), method=opts["method"],
      seed=r.seed, n=r.n, height=h, width=w, num_frames=frames, max_batch=self.max_batch,
      callback=on_round, cancel=cancel, **kw,
    )  # fmt: skip
    self.stats["denoiser_calls"] += result.calls
    job.results = list((np.clip(result.images, 0, 1) * 255).round().astype(np.uint8))
    job.scores = [float(s) for s in result.scores]
    if job.status == "running":
      self.job_seconds.append(time.time() - job.started)
      self.stats["succeeded"] += 1
      job.finish("succeeded")

  def metrics(self) -> str:
    """Prometheus text exposition of the queue's counters."""
    s = self.stats
    lines = [
      ("md_serve_queue_depth", "gauge", "jobs queued or running", self.depth),
      ("md_serve_jobs_accepted_total", "counter", "jobs accepted", s["accepted"]),
      ("md_serve_jobs_succeeded_total", "counter", "jobs finished", s["succeeded"]),
      ("md_serve_jobs_failed_total", "counter", "jobs failed", s["failed"]),
      ("md_serve_jobs_cancelled_total", "counter", "jobs cancelled", s["cancelled"]),
      ("md_serve_jobs_rejected_total", "counter", "requests refused (queue full)", s["rejected"]),
      ("md_serve_batches_total", "counter", "pipeline calls", s["batches"]),
      ("md_serve_denoiser_calls_total", "counter", "denoiser calls", s["denoiser_calls"]),
      ("md_serve_compiles_total", "counter", "XLA compiles in this process", compile_count()),
      (
        "md_serve_program_evictions_total",
        "counter",
        "frees of every compiled program",
        s["program_evictions"],
      ),
    ]
    out = []
    for name, kind, help_, value in lines:
      out += [f"# HELP {name} {help_}", f"# TYPE {name} {kind}", f"{name} {value}"]
    out += [
      "# HELP md_serve_step_seconds time between denoising steps (host-observed)",
      "# TYPE md_serve_step_seconds summary",
      f"md_serve_step_seconds_sum {self.step_seconds_sum:.6f}",
      f"md_serve_step_seconds_count {s['steps']}",
    ]
    return "\n".join(out) + "\n"
