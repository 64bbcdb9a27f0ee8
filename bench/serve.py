"""md-serve benchmarks on md's default image and video models (models/) and the tiny SD fixture, CPU, localhost.

uv run --no-sync python bench/serve.py load     # 50 requests from 10 concurrent clients: p50/p95, throughput
uv run --no-sync python bench/serve.py load-tiny   # the same on the tiny random SD fixture at 32x32
uv run --no-sync python bench/serve.py search   # best score vs denoiser calls -> packages/md-serve/search.png
uv run --no-sync python bench/serve.py search-shapes   # the same on models/shapes-sd -> search_shapes.png
uv run --no-sync python bench/serve.py search-shapes-video   # on models/shapes-wan -> search_shapes_video.png

`load` serves md's default image model (models/shapes-sd at its 64x64, 10 steps, guidance 3, the shapes
prompts in turn; `load-tiny`: the tiny random SD fixture at 32x32). It starts the server on 127.0.0.1 (a
free port) in this process, warms every batch bucket, then sends
the requests with httpx and checks that none is lost (every one answered 200 with its own job, the
queue's accepted count equals its succeeded count). `search` runs md_serve.search with a brightness
verifier (mean pixel value: meaningful on random weights) for budgets 1..16 on three prompts, random and
zero-order, and draws the mean best score against the denoiser calls spent. `search-shapes` does the same
on md's default image model (models/shapes-sd) with md_serve.ShapesVerifier (the share of the caption's
colour, shape, position and background the analyser sees) on the 20 held-out-pair prompts of
`md_train.shapes_sd.quality_prompts()`, 10 steps, and also reports the analyser's colour and shape rates of
the chosen samples. `search-shapes-video` does the same on md's default video model (models/shapes-wan:
64×64, 9 frames, 10 steps, guidance 3) over its 20 held-out-pair prompts, where the verifier also checks
the motion direction.
"""

import concurrent.futures
import json
import pathlib
import socket
import sys
import threading
import time

import numpy as np

import md_sd
import md_serve
from md_core import testing

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _pipe():
  return md_sd.load_pipeline(testing.fixture_path("sd_pipeline") / "sd")


def load(requests: int = 50, clients: int = 10, steps: int = 10, model: str = "default") -> dict:
  """`model`: "default" (md's shapes-sd at its own size, shapes prompts, guidance 3) or "tiny" (the tiny
  random SD fixture at 32x32, guidance 5)."""
  import httpx
  import uvicorn

  if model == "default":
    from md_train import shapes_sd

    pipe = md_sd.load_pipeline(ROOT / "models" / "shapes-sd")
    size, guidance = int(pipe.default_size), 3.0
    texts = [p for group in shapes_sd.quality_prompts().values() for p in group]
  else:
    pipe, size, guidance, texts = _pipe(), 32, 5.0, [f"p{i}" for i in range(requests)]
  served = md_serve.ServedModel("sd", pipe, default_size=(size, size))
  queue = md_serve.JobQueue(
    {"sd": served}, max_queue=64, max_batch=4, batch_buckets=(1, 2, 4), batch_wait_s=0.02
  )
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  server = uvicorn.Server(
    uvicorn.Config(md_serve.make_app(queue), host="127.0.0.1", port=port, log_level="warning")
  )
  thread = threading.Thread(target=server.run, daemon=True)
  thread.start()
  while not server.started:
    time.sleep(0.02)
  url = f"http://127.0.0.1:{port}"
  body = {"size": f"{size}x{size}", "steps": steps, "guidance": guidance}
  with httpx.Client(base_url=url, timeout=600) as c:  # warm-up: every bucket once
    for n in (1, 2, 4):
      assert (
        c.post("/v1/images/generations", json={"prompt": "w", "n": n, **body}).status_code == 200
      )
  accepted0, batches0 = queue.stats["accepted"], queue.stats["batches"]

  def client(k: int) -> list[tuple[float, int, str]]:
    out = []
    with httpx.Client(base_url=url, timeout=600) as c:
      for i in range(k, requests, clients):
        t = time.perf_counter()
        prompt = texts[i % len(texts)]
        r = c.post("/v1/images/generations", json={"prompt": prompt, "seed": i, **body})
        out.append((time.perf_counter() - t, r.status_code, r.json().get("id", "")))
    return out

  start = time.perf_counter()
  with concurrent.futures.ThreadPoolExecutor(clients) as pool:
    rows = [r for part in pool.map(client, range(clients)) for r in part]
  wall = time.perf_counter() - start
  server.should_exit = True
  thread.join(60)
  lat = np.asarray([r[0] for r in rows])
  ok = [r for r in rows if r[1] == 200]
  return {
    "model": model,
    "size": size,
    "requests": requests,
    "clients": clients,
    "steps": steps,
    "answered_200": len(ok),
    "unique_jobs": len({r[2] for r in ok}),
    "accepted": queue.stats["accepted"] - accepted0,
    "succeeded": queue.stats["succeeded"] - 3,  # less the warm-up requests
    "lost": requests - len(ok),
    "p50_s": round(float(np.percentile(lat, 50)), 3),
    "p95_s": round(float(np.percentile(lat, 95)), 3),
    "throughput_img_per_s": round(requests / wall, 2),
    "wall_s": round(wall, 2),
    "batched_calls": queue.stats["batches"] - batches0,
    "mean_rows_per_call": round(requests / max(1, queue.stats["batches"] - batches0), 2),
  }


class Brightness:
  def score(self, images, prompts):
    return np.asarray(images, np.float32).mean(axis=tuple(range(1, np.ndim(images))))


def _plot(curves: dict, path: pathlib.Path, title: str) -> None:
  """A small line plot with PIL (no plotting library): best score vs denoiser calls."""
  from PIL import Image, ImageDraw

  w, h, m = 640, 420, 60
  img = Image.new("RGB", (w, h), "white")
  d = ImageDraw.Draw(img)
  xs = [x for pts in curves.values() for x, _ in pts]
  ys = [y for pts in curves.values() for _, y in pts]
  x0, x1 = 0, max(xs)
  y0, y1 = min(ys), max(ys)
  pad = (y1 - y0) * 0.1 or 0.01
  y0, y1 = y0 - pad, y1 + pad
  px = lambda x: m + (x - x0) / (x1 - x0) * (w - 2 * m)  # noqa: E731
  py = lambda y: h - m - (y - y0) / (y1 - y0) * (h - 2 * m)  # noqa: E731
  d.rectangle([m, m, w - m, h - m], outline="black")
  for i in range(5):
    yv = y0 + (y1 - y0) * i / 4
    d.text((4, py(yv) - 6), f"{yv:.3f}", fill="black")
    xv = x0 + (x1 - x0) * i / 4
    d.text((px(xv) - 10, h - m + 6), f"{xv:.0f}", fill="black")
  d.text((w // 2 - 60, h - 22), "denoiser calls per prompt", fill="black")
  d.text((m, 20), title, fill="black")
  colours = ["#1f77b4", "#d62728", "#2ca02c"]
  for k, (name, pts) in enumerate(curves.items()):
    c = colours[k % 3]
    d.line([(px(x), py(y)) for x, y in pts], fill=c, width=2)
    for x, y in pts:
      d.ellipse([px(x) - 3, py(y) - 3, px(x) + 3, py(y) + 3], fill=c)
    d.text((w - m - 120, m + 10 + 16 * k), name, fill=c)
  img.save(path)


def search_curve(budgets=(1, 2, 4, 8, 16)) -> dict:
  pipe = _pipe()
  prompts = ["a red circle", "a blue square", "a green star"]
  kw = dict(height=32, width=32, num_inference_steps=3, guidance_scale=5.0, progress=False)
  curves, table = {}, {}
  for method in ("random", "zero_order"):
    pts = []
    for b in budgets:
      rs = [md_serve.search(pipe, p, Brightness(), b, method=method, **kw) for p in prompts]
      pts.append((float(np.mean([r.calls for r in rs])), float(np.mean([r.scores[0] for r in rs]))))
    curves[method] = pts
    table[method] = [
      {"budget": b, "calls": c, "score": round(s, 4)} for b, (c, s) in zip(budgets, pts)
    ]
  title = "best verifier score (mean brightness), tiny SD, 3 prompts"
  _plot(curves, ROOT / "packages/md-serve/search.png", title)
  return table


def _shapes_search_table(
  pipe, prompts, kw, budgets, fields, plot: pathlib.Path, title: str
) -> dict:
  """Random and zero-order search with md_serve.ShapesVerifier over `prompts`: per budget, the mean best
  score, the denoiser calls per prompt, the analyser's rates (`fields`) of the chosen samples, and the
  wall time; the score-vs-calls curves drawn to `plot`."""
  import md_data

  verifier = md_serve.ShapesVerifier()
  curves, table = {}, {}
  for method in ("random", "zero_order"):
    pts, rows = [], []
    for b in budgets:
      t = time.perf_counter()
      rs = [md_serve.search(pipe, p, verifier, b, method=method, **kw) for p in prompts]
      found = md_data.score(np.stack([r.images[0] for r in rs]), list(prompts))
      calls = float(np.mean([r.calls for r in rs]))
      score = float(np.mean([r.scores[0] for r in rs]))
      pts.append((calls, score))
      rows.append(
        {"budget": b, "calls": calls, "score": round(score, 4)}
        | {f: round(getattr(found, f), 3) for f in fields}
        | {"seconds": round(time.perf_counter() - t, 1)}
      )
      print(method, rows[-1], flush=True)
    curves[method], table[method] = pts, rows
  _plot(curves, plot, title)
  return table


def search_shapes_curve(budgets=(1, 2, 4, 8, 16)) -> dict:
  from md_train import shapes_sd

  pipe = md_sd.load_pipeline(ROOT / "models" / "shapes-sd")
  prompts = shapes_sd.quality_prompts()["held_out"]
  kw = dict(num_inference_steps=10, guidance_scale=3.0, progress=False)
  fields = ("colour", "shape", "position", "background")
  title = "best shapes-verifier score, models/shapes-sd, 20 held-out-pair prompts"
  plot = ROOT / "packages/md-serve/search_shapes.png"
  return _shapes_search_table(pipe, prompts, kw, budgets, fields, plot, title)


def search_shapes_video_curve(budgets=(1, 2, 4, 8, 16)) -> dict:
  import md_wan
  from md_train import shapes_models

  pipe = md_wan.load_pipeline(ROOT / "models" / "shapes-wan")
  prompts = shapes_models.quality_prompts()["held_out"]
  kw = dict(
    height=64, width=64, num_frames=9, num_inference_steps=10, guidance_scale=3.0,
    max_sequence_length=16,
  )  # fmt: skip
  fields = ("colour", "shape", "direction", "background")
  title = "best shapes-verifier score, models/shapes-wan, 20 held-out-pair prompts"
  plot = ROOT / "packages/md-serve/search_shapes_video.png"
  return _shapes_search_table(pipe, prompts, kw, budgets, fields, plot, title)


if __name__ == "__main__":
  what = sys.argv[1] if len(sys.argv) > 1 else "load"
  runs = {
    "load": load,
    "load-tiny": lambda: load(model="tiny"),
    "search": search_curve,
    "search-shapes": search_shapes_curve,
    "search-shapes-video": search_shapes_video_curve,
  }
  if what not in runs:
    raise SystemExit(f"unknown benchmark {what!r}; choose one of {', '.join(runs)}")
  result = runs[what]()
  print(json.dumps(result, indent=1))
