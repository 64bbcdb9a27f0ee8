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
  GET  /openapi.json               the request schema
With a bearer token set, /v1/* needs `Authorization: Bearer <token>` (or `?token=` for event streams and
files, which browsers fetch without headers).

Exposure: every route but /healthz answers only requests whose Host is one of `allowed_hosts` (loopback
names by default) and whose Origin, when a browser sends one, is the page's own or one of
`allowed_origins`; generation bodies must be `application/json` (a page on another site cannot post a
form or text to the server without a CORS preflight, which is never granted). Result URLs are relative
(or under the configured `public_url`): the Host header is never copied into them.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hmac
import io
import json
import os
import pathlib
import re
import tempfile
import time
import urllib.parse
from collections.abc import Mapping, Sequence
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
from md_serve._schema import openapi

LOOPBACK = ("127.0.0.1", "localhost", "::1")
TOKEN_ENV = "MD_SERVE_TOKEN"
_JSON = re.compile(r"\s*application/json\s*(;.*)?", re.I)
_INDEX = re.compile(r"[0-9]{1,6}")


def read_token(file: str | os.PathLike | None = None, env: str = TOKEN_ENV) -> str | None:
  """The bearer token from `file` (its first line; the file should be readable by the server's user
  only), else from the environment variable `env`, else None: so it never has to be on a command line,
  where `ps` shows it.

  Raises:
    ValueError: `file` is missing or empty.
  """
  if file:
    path = pathlib.Path(file).expanduser()
    if not path.is_file():
      raise ValueError(f"token file {str(path)!r} does not exist")
    lines = path.read_text().strip().splitlines()
    if not lines or not lines[0].strip():
      raise ValueError(f"token file {str(path)!r} is empty")
    return lines[0].strip()
  return os.environ.get(env) or None


def _host_name(netloc: str) -> str:
  """`host[:port]` or `[v6]:port` -> the host name, lower case."""
  netloc = netloc.strip().lower()
  if netloc.startswith("["):
    return netloc[1 : netloc.find("]")] if "]" in netloc else netloc
  return netloc.rsplit(":", 1)[0] if netloc.count(":") == 1 else netloc


async def _read_body(request: Request, limit: int, timeout_s: float) -> bytes:
  """The body, read as it streams in: at most `limit` bytes (413 past that, before the rest is read) and
  within `timeout_s` (408)."""
  length = request.headers.get("content-length")
  if length is not None and (not length.isdigit() or int(length) > limit):
    raise RequestError("body", f"the body is {length} bytes; at most {limit}", 413)
  chunks, size = [], 0

  async def read():
    nonlocal size
    async for chunk in request.stream():
      size += len(chunk)
      if size > limit:
        raise RequestError("body", f"the body is over {limit} bytes", 413)
      chunks.append(chunk)

  try:
    await asyncio.wait_for(read(), timeout_s)
  except TimeoutError:
    raise RequestError("body", f"the body did not arrive within {timeout_s:g} s", 408) from None
  return b"".join(chunks)


def _decode(raw: bytes) -> Any:
  try:
    return json.loads(raw)
  except (ValueError, RecursionError) as e:  # bad JSON, a 5000-digit number, deep nesting
    raise RequestError("body", f"the body is not valid JSON: {str(e)[:200]}") from None


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
  finish_timeout_s: float | None = 300.0,
  max_body_bytes: int = 64 * 1024,
  body_timeout_s: float = 30.0,
  allowed_hosts: Sequence[str] | None = LOOPBACK,
  allowed_origins: Sequence[str] = (),
  public_url: str = "",
  title: str = "md",
) -> Starlette:
  """The Starlette app serving `queue` (see the module docstring for the routes and exposure).

  Args:
    queue: the job queue (it owns the models and the worker).
    token: a bearer token /v1/* requires (None: open; see `read_token`).
    shutdown: on server stop, "finish" runs accepted jobs first, "cancel" cancels them.
    finish_timeout_s: how long "finish" runs them; what is left then is cancelled, each job recorded
      (status, event, a stderr line). None: as long as they take.
    max_body_bytes: larger request bodies get 413 (counted as they stream in).
    body_timeout_s: a body not complete within this gets 408.
    allowed_hosts: the host names requests may address (the Host header, port aside); None: any (only
      behind a proxy that checks it).
    allowed_origins: origins (`https://example.com`) whose pages may call the API besides the server's
      own page.
    public_url: the base of result URLs (e.g. `https://md.example.com`); "": relative URLs.
    title: the page's title.
  """
  hosts = None if allowed_hosts is None else {h.strip("[]").lower() for h in allowed_hosts}
  origins = {o.rstrip("/").lower() for o in allowed_origins}
  base = public_url.rstrip("/")

  def authorised(request: Request) -> bool:
    if not token:
      return True
    got = request.headers.get("authorization", "")
    given = got[7:] if got.lower().startswith("bearer ") else request.query_params.get("token", "")
    return hmac.compare_digest(given.encode(), token.encode())

  def exposure_error(request: Request) -> JSONResponse | None:
    host = request.headers.get("host", "")
    if hosts is not None and _host_name(host) not in hosts:
      return _error(421, f"Host {host[:100]!r} is not one this server answers", "host")
    origin = request.headers.get("origin")
    if origin is not None:
      o = origin.rstrip("/").lower()
      if o not in origins and urllib.parse.urlsplit(o).netloc != host.lower():
        return _error(403, f"Origin {origin[:100]!r} may not call this server", "origin")
    return None

  def guard(handler, *, auth: bool = True):
    async def wrapped(request: Request):
      refused = exposure_error(request)
      if refused is not None:
        return refused
      if auth and not authorised(request):
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
        out.append({"url": f"{base}/v1/files/{job.id}/{i}"})
      else:
        # Off the event loop: ffmpeg takes a while for a video.
        blob, mime = await asyncio.to_thread(encoded_result, job, i)
        out.append({"b64_json": base64.b64encode(blob).decode(), "mime_type": mime})
      if job.scores is not None:
        out[-1]["score"] = job.scores[i]
    return out

  async def generate(request: Request, kind: str):
    if not _JSON.fullmatch(request.headers.get("content-type", "")):
      return _error(415, "the body must be JSON (Content-Type: application/json)", "content-type")
    try:
      body = _decode(await _read_body(request, max_body_bytes, body_timeout_s))
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
      if await request.is_disconnected():  # nobody will read the result: free the worker
        queue.cancel(job.id, "the client disconnected")
        return Response(status_code=499)
      await asyncio.sleep(0.02)
    if job.status != "succeeded":
      status = 409 if job.status == "cancelled" else job.http_status
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
    if job is None or not _INDEX.fullmatch(index) or int(index) >= len(job.results):
      return _error(404, "no such result", "index")
    blob, mime = await asyncio.to_thread(encoded_result, job, int(index))
    return Response(blob, media_type=mime)

  limits = {
    "max_body_bytes": max_body_bytes,
    "body_timeout_s": body_timeout_s,
    "max_queue": queue.max_queue,
    "max_batch": queue.max_batch,
    "job_timeout_s": queue.job_timeout_s,
    "max_programs": queue.max_programs,
  }

  async def models(request: Request):
    data = [m.describe() for m in queue.models.values()]
    return JSONResponse({"object": "list", "data": data, "limits": limits})

  async def healthz(request: Request):
    return JSONResponse({"status": "ok", "queue_depth": queue.depth, "time": time.time()})

  async def metrics(request: Request):
    return Response(queue.metrics(), media_type="text/plain; version=0.0.4")

  schema = openapi(title)

  async def openapi_json(request: Request):
    return JSONResponse(schema)

  async def page(request: Request):
    return HTMLResponse(PAGE.replace("{{title}}", title))

  @contextlib.asynccontextmanager
  async def lifespan(app):
    yield
    await asyncio.to_thread(queue.shutdown, shutdown, finish_timeout_s)

  routes = [
    Route("/", guard(page, auth=False)),
    Route("/healthz", healthz),
    Route("/metrics", guard(metrics, auth=False)),
    Route("/openapi.json", guard(openapi_json, auth=False)),
    Route("/v1/models", guard(models)),
    Route("/v1/images/generations", guard(images), methods=["POST"]),
    Route("/v1/videos/generations", guard(videos), methods=["POST"]),
    Route("/v1/jobs/{job_id}", guard(job_status), methods=["GET"]),
    Route("/v1/jobs/{job_id}", guard(job_cancel), methods=["DELETE"]),
    Route("/v1/jobs/{job_id}/events", guard(job_events)),
    Route("/v1/files/{job_id}/{index}", guard(file), name="file"),
  ]
  return Starlette(routes=routes, lifespan=lifespan)


def header_timeout_protocol(header_timeout_s: float) -> type:
  """uvicorn's h11 protocol, closing a connection whose request line and headers are not complete within
  `header_timeout_s` of the connection or of the previous response (slow-header clients)."""
  from uvicorn.protocols.http.h11_impl import H11Protocol  # noqa: PLC0415

  class Protocol(H11Protocol):
    def connection_made(self, transport):
      super().connection_made(transport)
      self._arm()

    def _arm(self):
      self._header_timer = self.loop.call_later(header_timeout_s, self._headers_late)

    def _headers_late(self):
      waiting = self.cycle is None or self.cycle.response_complete
      if waiting and not self.transport.is_closing():
        self.transport.close()

    def handle_events(self):
      cycle = self.cycle
      super().handle_events()
      if self.cycle is not cycle:  # a request's headers arrived
        self._header_timer.cancel()

    def on_response_complete(self):
      super().on_response_complete()
      self._header_timer.cancel()
      self._arm()

    def connection_lost(self, exc):
      self._header_timer.cancel()
      super().connection_lost(exc)

  return Protocol


def serve(
  models: Mapping[str, Any],
  *,
  host: str = "127.0.0.1",
  port: int = 8000,
  token: str | None = None,
  shutdown: str = "finish",
  finish_timeout_s: float | None = 300.0,
  warmup: bool = False,
  allowed_hosts: Sequence[str] | None = None,
  allowed_origins: Sequence[str] = (),
  public_url: str = "",
  header_timeout_s: float = 10.0,
  idle_timeout_s: float = 5.0,
  max_connections: int = 64,
  **queue_options: Any,
) -> None:
  """Runs the server until interrupted (Ctrl-C / SIGTERM stop it cleanly, see `make_app`'s `shutdown`).

  Args:
    models: `{name: ServedModel}`.
    host: the address to bind (loopback by default; anything else should sit behind a TLS terminator,
      with a token).
    port: the port (1..65535).
    token: optional bearer token (`read_token` reads one from a file or the environment).
    shutdown: "finish" or "cancel" (what happens to accepted jobs on stop).
    finish_timeout_s: how long "finish" may take before the rest is cancelled (None: no limit).
    warmup: run `JobQueue.warm_up` (every model × batch bucket once) before listening; one line each.
    allowed_hosts: Host names requests may use (None: the loopback names, plus `host` when it is a name
      or address other than 0.0.0.0 / ::).
    allowed_origins: other sites whose pages may call the API (see `make_app`).
    public_url: the base of result URLs ("": relative).
    header_timeout_s: a connection that has not sent a request's headers within this is closed.
    idle_timeout_s: an idle keep-alive connection is closed after this.
    max_connections: connections served at once (more get 503).
    **queue_options: `JobQueue` options (max_queue, max_batch, batch_buckets, preview_every, verifier,
      job_timeout_s, max_programs...).

  Raises:
    ValueError: a port out of range or an unknown shutdown mode.
  """
  import uvicorn  # noqa: PLC0415

  if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
    raise ValueError(f"port={port!r} is out of range: expected 1..65535")
  if shutdown not in ("finish", "cancel"):
    raise ValueError(f"shutdown={shutdown!r}: expected 'finish' or 'cancel'")
  if allowed_hosts is None:
    allowed_hosts = LOOPBACK + (() if host in ("0.0.0.0", "::", "") else (host,))
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
  app = make_app(
    queue, token=token, shutdown=shutdown, finish_timeout_s=finish_timeout_s,
    allowed_hosts=allowed_hosts,
    allowed_origins=allowed_origins, public_url=public_url,
  )  # fmt: skip
  print(f"md-serve: ready, listening on http://{host}:{port}/", flush=True)
  uvicorn.run(
    app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=30,
    http=header_timeout_protocol(header_timeout_s), timeout_keep_alive=int(max(1, idle_timeout_s)),
    limit_concurrency=max_connections, h11_max_incomplete_event_size=16 * 1024,
  )  # fmt: skip
