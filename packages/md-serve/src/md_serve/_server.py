"""The HTTP front: a Starlette app over a `JobQueue`, and `serve` to run it with uvicorn.

Routes:
  GET  /                          the web page
  GET  /healthz                   {"status": "ok", "queue_depth": ...}
  GET  /metrics                   Prometheus text (queue depth, step latency, compile count...)
  GET  /v1/models                 the models, their kinds, sizes and LoRAs
  POST /v1/images/generations     OpenAI-style body (prompt, n, size "WxH", response_format) + md fields
  POST /v1/videos/generations     the same for video models (num_frames, video_format mp4 | gif)
  GET  /v1/jobs/{id}              a job's status (and its data once done)
  GET  /v1/jobs/{id}/events       server-sent events: queued, running, progress (step i of n, preview), done
  DELETE /v1/jobs/{id}            cancel
  GET  /v1/files/{id}/{i}         result i of a job (PNG; a video as H.264 MP4 or animated GIF)
With a bearer token set, /v1/* needs `Authorization: Bearer <token>` (or `?token=` for event streams and
files, which browsers fetch without headers).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hmac
import io
import json
import pathlib
import tempfile
import time
from collections.abc import Mapping
from typing import Any

import numpy as np
from PIL import Image
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from starlette.routing import Route

import md_core
from md_core import media
from md_serve._jobs import DONE, JobQueue, QueueFull, ShuttingDown
from md_serve._page import PAGE
from md_serve._requests import RequestError, parse_request


def _error(status: int, message: str, param: str | None = None, **headers: str) -> JSONResponse:
  body = {"error": {"message": message, "type": "invalid_request_error", "param": param}}
  return JSONResponse(body, status_code=status, headers=headers or None)


def encode_result(
  pixels: np.ndarray,
  fps: float = 8,
  video_format: str = "mp4",
  audio: np.ndarray | None = None,
  sample_rate: int | None = None,
) -> tuple[bytes, str]:
  """Encodes one result: a uint8 image `[H, W, 3]` as PNG, a video `[F, H, W, 3]` as MP4 or GIF.

  Args:
    pixels: the result, uint8.
    fps: a video's frame rate.
    video_format: "mp4" (H.264, yuv420p, through md_core.media's ffmpeg; an odd height or width is
      padded by one edge pixel, as `media.save_video` does) or "gif" (looping, 256 colours per frame).
    audio: a video's soundtrack `[channels, samples]` in [-1, 1], muxed into the MP4 as AAC (a GIF holds
      no sound: it is left out).
    sample_rate: the soundtrack's samples per second.

  Returns:
    The file's bytes and its MIME type.
  """
  if pixels.ndim == 4:
    if video_format not in ("mp4", "gif"):
      raise ValueError(f"video_format must be 'mp4' or 'gif', got {video_format!r}")
    with tempfile.TemporaryDirectory(prefix="md_serve_") as tmp:
      sound = audio if video_format == "mp4" else None
      path = media.save_video(
        pathlib.Path(tmp) / f"result.{video_format}", pixels, fps, audio=sound,
        sample_rate=sample_rate if sound is not None else None,
      )  # fmt: skip
      return path.read_bytes(), "video/mp4" if video_format == "mp4" else "image/gif"
  buf = io.BytesIO()
  Image.fromarray(pixels).save(buf, format="PNG")
  return buf.getvalue(), "image/png"


def make_app(
  queue: JobQueue,
  *,
  token: str | None = None,
  shutdown: str = "finish",
  max_body_bytes: int = 64 * 1024,
  title: str = "md",
) -> Starlette:
  """The Starlette app serving `queue` (see the module docstring for the routes).

  Args:
    queue: the job queue (it owns the models and the worker).
    token: a bearer token /v1/* requires (None: open).
    shutdown: on server stop, "finish" runs accepted jobs first, "cancel" cancels them.
    max_body_bytes: larger request bodies get 413.
    title: the page's title.
  """

  def authorised(request: Request) -> bool:
    if not token:
      return True
    got = request.headers.get("authorization", "")
    given = got[7:] if got.lower().startswith("bearer ") else request.query_params.get("token", "")
    return hmac.compare_digest(given.encode(), token.encode())

  def guard(handler):
    async def wrapped(request: Request):
      if not authorised(request):
        return _error(401, "missing or wrong bearer token", "authorization")
      return await handler(request)

    return wrapped

  def job_or_404(request: Request):
    return queue.jobs.get(request.path_params["job_id"])

  encoded: dict[tuple[str, int], tuple[bytes, str]] = {}

  def encoded_result(job, index: int) -> tuple[bytes, str]:
    # The latest results are kept encoded, so a video goes through ffmpeg once however often its
    # data or file is fetched.
    key = (job.id, index)
    if key not in encoded:
      while len(encoded) >= 32:
        encoded.pop(next(iter(encoded)))
      audio = job.audio[index] if job.audio else None
      encoded[key] = encode_result(
        job.results[index], job.fps, video_format=job.request.video_format, audio=audio,
        sample_rate=job.sample_rate,
      )  # fmt: skip
    return encoded[key]

  async def data_of(job, request: Request) -> list[dict]:
    out = []
    for i in range(len(job.results)):
      if job.request.response_format == "url":
        out.append({"url": str(request.url_for("file", job_id=job.id, index=str(i)))})
      else:
        # Off the event loop: ffmpeg takes a while for a video.
        blob, mime = await asyncio.to_thread(encoded_result, job, i)
        out.append({"b64_json": base64.b64encode(blob).decode(), "mime_type": mime})
      if job.scores is not None:
        out[-1]["score"] = job.scores[i]
    return out

  async def generate(request: Request, kind: str):
    raw = await request.body()
    if len(raw) > max_body_bytes:
      return _error(413, f"the body is {len(raw)} bytes; at most {max_body_bytes}", "body")
    try:
      body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
      return _error(400, f"the body is not valid JSON: {e}", "body")
    try:
      req = parse_request(body, kind, queue.models, max_n=queue.max_batch)
      job = queue.submit(req)
    except RequestError as e:
      return _error(e.status, str(e), e.param)
    except QueueFull as e:
      return _error(429, str(e), None, **{"Retry-After": str(e.retry_after)})
    except ShuttingDown as e:
      return _error(503, str(e))
    if not req.wait:
      return JSONResponse(
        {**job.describe(), "events_url": f"/v1/jobs/{job.id}/events"}, status_code=202
      )
    while not job.done.is_set():
      await asyncio.sleep(0.01)
    if job.status != "succeeded":
      status = 409 if job.status == "cancelled" else 500
      return _error(status, f"job {job.id} {job.status}: {job.error}", None)
    return JSONResponse(
      {"created": int(job.created), "id": job.id, "data": await data_of(job, request)}
    )

  async def images(request: Request):
    return await generate(request, "image")

  async def videos(request: Request):
    return await generate(request, "video")

  async def job_status(request: Request):
    job = job_or_404(request)
    if job is None:
      return _error(404, f"no job {request.path_params['job_id']!r}", "job_id")
    out = job.describe()
    if job.status == "succeeded":
      out["data"] = await data_of(job, request)
    return JSONResponse(out)

  async def job_cancel(request: Request):
    job = queue.cancel(request.path_params["job_id"])
    if job is None:
      return _error(404, f"no job {request.path_params['job_id']!r}", "job_id")
    return JSONResponse(job.describe())

  async def job_events(request: Request):
    job = job_or_404(request)
    if job is None:
      return _error(404, f"no job {request.path_params['job_id']!r}", "job_id")

    async def stream():
      sent = 0
      while True:
        events = job.events
        while sent < len(events):
          event = events[sent]
          sent += 1
          yield f"event: {event['event']}\ndata: {json.dumps(event)}\n\n"
        if job.status in DONE and sent >= len(job.events):
          return
        if await request.is_disconnected():
          return
        await asyncio.sleep(0.02)

    headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    return StreamingResponse(stream(), media_type="text/event-stream", headers=headers)

  async def file(request: Request):
    job = job_or_404(request)
    index = request.path_params["index"]
    if job is None or not index.isdigit() or int(index) >= len(job.results):
      return _error(404, "no such result", "index")
    blob, mime = await asyncio.to_thread(encoded_result, job, int(index))
    return Response(blob, media_type=mime)

  async def models(request: Request):
    return JSONResponse({"object": "list", "data": [m.describe() for m in queue.models.values()]})

  async def healthz(request: Request):
    return JSONResponse({"status": "ok", "queue_depth": queue.depth, "time": time.time()})

  async def metrics(request: Request):
    return Response(queue.metrics(), media_type="text/plain; version=0.0.4")

  async def page(request: Request):
    return HTMLResponse(PAGE.replace("{{title}}", title))

  @contextlib.asynccontextmanager
  async def lifespan(app):
    yield
    await asyncio.to_thread(queue.shutdown, shutdown)

  routes = [
    Route("/", page),
    Route("/healthz", healthz),
    Route("/metrics", metrics),
    Route("/v1/models", guard(models)),
    Route("/v1/images/generations", guard(images), methods=["POST"]),
    Route("/v1/videos/generations", guard(videos), methods=["POST"]),
    Route("/v1/jobs/{job_id}", guard(job_status), methods=["GET"]),
    Route("/v1/jobs/{job_id}", guard(job_cancel), methods=["DELETE"]),
    Route("/v1/jobs/{job_id}/events", guard(job_events)),
    Route("/v1/files/{job_id}/{index}", guard(file), name="file"),
  ]
  return Starlette(routes=routes, lifespan=lifespan)


def serve(
  models: Mapping[str, Any],
  *,
  host: str = "127.0.0.1",
  port: int = 8000,
  token: str | None = None,
  shutdown: str = "finish",
  warmup: bool = False,
  **queue_options: Any,
) -> None:
  """Runs the server until interrupted (Ctrl-C / SIGTERM stop it cleanly, see `make_app`'s `shutdown`).

  Args:
    models: `{name: ServedModel}`.
    host: the address to bind.
    port: the port.
    token: optional bearer token.
    shutdown: "finish" or "cancel" (what happens to accepted jobs on stop).
    warmup: run `JobQueue.warm_up` (every model × batch bucket once) before listening; one line each.
    **queue_options: `JobQueue` options (max_queue, max_batch, batch_buckets, preview_every, verifier...).
  """
  import uvicorn  # noqa: PLC0415

  queue = JobQueue(models, **queue_options)
  if warmup:
    for row in queue.warm_up():
      print(
        f"warm-up: {row['model']} n={row['bucket']}: {row['seconds']:.1f} s, "
        f"{row['compiles']} compile(s)",
        flush=True,
      )
    store = md_core.executable_store()
    if store is not None:
      print(
        f"executables in {store.folder}: {store.stats['loaded']} read back, "
        f"{store.stats['compiled']} compiled and written",
        flush=True,
      )
  app = make_app(queue, token=token, shutdown=shutdown)
  print(f"md-serve: ready, listening on http://{host}:{port}/", flush=True)
  uvicorn.run(app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=30)
