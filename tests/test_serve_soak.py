"""A bounded soak of md-serve (slow): 300 requests over 40 distinct sizes and step counts on the tiny SD
pipeline, from 8 concurrent clients, through a real server on 127.0.0.1. Every request is answered (200)
or refused (4xx / 429), and the process's RSS ends within `BOUND_MB` of its size once `max_programs`
shapes are compiled: with `max_programs` the compiled programs of new shapes replace the old ones instead
of piling up. The figures are printed (bench/README.md keeps them)."""

import concurrent.futures
import itertools
import resource
import socket
import threading
import time

import httpx
import pytest
import uvicorn

import md_sd
import md_serve
from md_core import testing

MAX_PROGRAMS = 8
BOUND_MB = (
  150  # RSS growth allowed past the warm size (measured: +59 MB); unbounded, ~30 MB per shape
)
SIZES = [
  (h, w) for h in (16, 32, 48, 64) for w in (16, 32, 48, 64)
]  # the tiny UNet: multiples of 16
SHAPES = [(h, w, steps) for steps in (2, 3, 4) for h, w in SIZES][:40]
REQUESTS = 300


def _rss_mb() -> float:
  with open("/proc/self/statm") as f:
    return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


@pytest.mark.slow
def test_soak_300_requests_over_40_shapes_keeps_rss_bounded():
  pipe = md_sd.load_pipeline(testing.fixture_path("sd_pipeline") / "sd")
  model = md_serve.ServedModel("sd", pipe, default_size=(32, 32), max_pixels=64 * 64, max_steps=4)
  queue = md_serve.JobQueue(
    {"sd": model}, max_queue=16, max_batch=4, batch_buckets=(4,), batch_wait_s=0.05,
    max_programs=MAX_PROGRAMS,
  )  # fmt: skip
  port = _free_port()
  server = uvicorn.Server(
    uvicorn.Config(md_serve.make_app(queue), host="127.0.0.1", port=port, log_level="warning")
  )
  thread = threading.Thread(target=server.run, daemon=True)
  thread.start()
  while not server.started:
    time.sleep(0.02)
  # Requests come in runs of one shape (the way a client sweeps settings), 7-8 per shape.
  per_shape = [REQUESTS // len(SHAPES) + (i < REQUESTS % len(SHAPES)) for i in range(len(SHAPES))]
  plan = list(itertools.chain.from_iterable([s] * k for s, k in zip(SHAPES, per_shape)))
  codes, warm, start = [], None, time.perf_counter()

  def one(client, shape):
    h, w, steps = shape
    body = {"prompt": "a red circle", "size": f"{w}x{h}", "steps": steps, "seed": len(codes)}
    for _ in range(20):
      r = client.post("/v1/images/generations", json=body)
      if r.status_code != 429:
        return r.status_code
      time.sleep(float(r.headers["retry-after"]) / 4)
    return 429

  try:
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=300) as client:
      with concurrent.futures.ThreadPoolExecutor(8) as pool:
        for i, shape in enumerate(SHAPES):
          runs = [s for s in plan if s == shape]
          codes += list(pool.map(lambda s: one(client, s), runs))
          if i + 1 == MAX_PROGRAMS:
            warm = _rss_mb()
          print(f"soak: shape {i + 1}/{len(SHAPES)} {shape}: RSS {_rss_mb():.0f} MB", flush=True)
    final = _rss_mb()
  finally:
    server.should_exit = True
    thread.join(60)
  seconds = time.perf_counter() - start
  growth = final - warm
  print(
    f"soak: {len(codes)} requests over {len(SHAPES)} shapes in {seconds:.0f} s; RSS warm "
    f"{warm:.0f} MB (after {MAX_PROGRAMS} shapes), final {final:.0f} MB, growth {growth:+.0f} MB "
    f"(bound {BOUND_MB}); evictions {queue.stats['program_evictions']}; codes "
    f"{sorted(set(codes))}"
  )
  assert len(codes) == REQUESTS
  assert all(c == 200 or 400 <= c < 500 for c in codes), sorted(set(codes))
  assert queue.stats["program_evictions"] >= len(SHAPES) // MAX_PROGRAMS - 1
  assert growth < BOUND_MB
