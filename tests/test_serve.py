"""md-serve end to end: a real uvicorn server on 127.0.0.1 (a free port) over the tiny SD pipeline, driven
with httpx; the web page in headless Chromium (Debian's chromium + chromium-driver, through selenium).

One module-scoped server: the pipeline compiles its one batch bucket (4 rows, 32 x 32) once, with run-time
LoRA slots for two adapters (tests/fixtures/lora); every later request reuses that program.
"""

import base64
import concurrent.futures
import io
import json
import re
import socket
import threading
import time

import httpx
import numpy as np
import pytest
import uvicorn
from PIL import Image

import md_sd
import md_serve
import md_wan
from md_core import media, testing

STEPS = 4
LONG = 300  # steps of the runs that are cancelled (one more compiled program, shared)
COMMON = {"size": "32x32", "steps": STEPS, "guidance": 5.0}


class _Brightness:
  """A verifier for tests: mean pixel value (meaningful on random weights)."""

  def score(self, images, prompts):
    return np.asarray(images, np.float32).mean(axis=tuple(range(1, np.ndim(images))))


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


class _Server:
  """A uvicorn server in a thread (stopped with should_exit, as on SIGTERM)."""

  def __init__(self, app):
    self.port = _free_port()
    self.url = f"http://127.0.0.1:{self.port}"
    config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning")
    self.server = uvicorn.Server(config)
    self.thread = threading.Thread(target=self.server.run, daemon=True)
    self.thread.start()
    deadline = time.time() + 30
    while not self.server.started:
      assert time.time() < deadline, "uvicorn did not start"
      time.sleep(0.02)

  def stop(self):
    self.server.should_exit = True
    self.thread.join(30)
    assert not self.thread.is_alive()


@pytest.fixture(scope="module")
def served():
  pipe = md_sd.load_pipeline(testing.fixture_path("sd_pipeline") / "sd")
  root = testing.fixture_path("lora")
  loras = {n: root / f"sd_{n}.safetensors" for n in "ab"}
  model = md_serve.ServedModel(
    "sd-tiny",
    pipe,
    loras=loras,
    lora_rank=8,
    default_size=(32, 32),
    max_pixels=64 * 64,
    max_steps=LONG,
  )
  wan = md_wan.load_pipeline(testing.fixture_path("wan_pipeline") / "t2v")
  video = md_serve.ServedModel("wan-tiny", wan, default_size=(16, 16), num_frames=5, max_frames=9)
  queue = md_serve.JobQueue(
    {"sd-tiny": model, "wan-tiny": video}, max_queue=6, max_batch=4, batch_buckets=(4,), batch_wait_s=0.25,
    preview_every=2, verifier=_Brightness(),
  )  # fmt: skip
  server = _Server(md_serve.make_app(queue, title="md test"))
  client = httpx.Client(base_url=server.url, timeout=120)
  # Warm-up: the one compiled bucket.
  r = client.post("/v1/images/generations", json={"prompt": "warm up", **COMMON})
  assert r.status_code == 200, r.text
  yield server, client, queue, model
  client.close()
  server.stop()
  assert not queue._thread.is_alive()


def _png(item) -> np.ndarray:
  assert item["mime_type"] == "image/png"
  return np.asarray(Image.open(io.BytesIO(base64.b64decode(item["b64_json"]))))


def _metric(client, name) -> float:
  text = client.get("/metrics").text
  m = re.search(rf"^{name} ([0-9.e+-]+)$", text, re.M)
  assert m, f"{name} not in /metrics"
  return float(m.group(1))


def test_generation_n_and_formats(served):
  _, client, _, _ = served
  r = client.post(
    "/v1/images/generations", json={"prompt": "a red circle", "n": 2, "seed": 3, **COMMON}
  )
  assert r.status_code == 200, r.text
  data = r.json()["data"]
  assert len(data) == 2
  a, b = (_png(d) for d in data)
  assert a.shape == b.shape == (32, 32, 3) and a.dtype == np.uint8
  assert np.abs(a.astype(int) - b).max() > 0  # two noise rows of one seed differ
  again = client.post(
    "/v1/images/generations",
    json={"prompt": "a red circle", "n": 1, "seed": 3, "response_format": "url", **COMMON},
  )
  assert again.status_code == 200, again.text
  url = again.json()["data"][0]["url"]
  assert url.startswith("/v1/files/")  # relative: the Host header is never copied into it
  png = client.get(url)
  assert png.status_code == 200 and png.headers["content-type"] == "image/png"
  same = np.asarray(Image.open(io.BytesIO(png.content)))
  np.testing.assert_array_equal(same, a)  # same seed, same first row, whatever the batch


def test_concurrent_compatible_requests_share_one_call(served):
  _, client, queue, model = served
  calls_before = _metric(client, "md_serve_denoiser_calls_total")
  batches_before = _metric(client, "md_serve_batches_total")
  bodies = [{"prompt": f"shape {i}", "seed": 10 + i, **COMMON} for i in range(3)]
  with concurrent.futures.ThreadPoolExecutor(3) as pool:
    rs = list(pool.map(lambda b: client.post("/v1/images/generations", json=b), bodies))
  assert [r.status_code for r in rs] == [200] * 3
  ids = [r.json()["id"] for r in rs]
  assert {queue.jobs[i].batch_rows for i in ids} == {3}
  assert _metric(client, "md_serve_batches_total") - batches_before == 1
  calls = _metric(client, "md_serve_denoiser_calls_total") - calls_before
  assert calls == model.pipe.last_calls == STEPS  # one loop for three requests (3 x STEPS alone)
  solo = client.post("/v1/images/generations", json=bodies[1]).json()["data"][0]
  np.testing.assert_array_equal(_png(solo), _png(rs[1].json()["data"][0]))


def test_lora_swap_per_request_never_recompiles(served):
  _, client, _, _ = served
  before = _metric(client, "md_serve_compiles_total")
  out = {}
  for name, loras in [
    ("base", []), ("a", [{"name": "a", "scale": 1.0}]), ("b", [{"name": "b", "scale": 1.5}]),
    ("ab", [{"name": "a", "scale": 0.7}, {"name": "b", "scale": 1.3}]), ("base2", []),
  ]:  # fmt: skip
    r = client.post("/v1/images/generations", json={"prompt": "a cat", "loras": loras, **COMMON})
    assert r.status_code == 200, r.text
    out[name] = _png(r.json()["data"][0]).astype(int)
  assert _metric(client, "md_serve_compiles_total") == before
  for name in ("a", "b", "ab"):
    assert np.abs(out[name] - out["base"]).max() > 2, name
  assert np.abs(out["a"] - out["b"]).max() > 2
  np.testing.assert_array_equal(out["base2"], out["base"])  # the slots are emptied again


def _events(client, job_id, until=None):
  events = []
  with client.stream("GET", f"/v1/jobs/{job_id}/events") as r:
    assert r.headers["content-type"].startswith("text/event-stream")
    for line in r.iter_lines():
      if line.startswith("data: "):
        events.append(json.loads(line[6:]))
        if until is not None and until(events[-1]):
          break
  return events


def test_progress_events_with_previews(served):
  _, client, _, _ = served
  r = client.post("/v1/images/generations", json={"prompt": "a dot", "wait": False, **COMMON})
  assert r.status_code == 202
  job = r.json()
  events = _events(client, job["id"])
  kinds = [e["event"] for e in events]
  assert kinds[0] == "queued" and kinds[-1] == "succeeded" and "running" in kinds
  steps = [(e["step"], e["total"]) for e in events if e["event"] == "progress"]
  assert steps == [(i, STEPS) for i in range(1, STEPS + 1)]
  previews = [e for e in events if "preview" in e]
  assert [e["step"] for e in previews] == [2, 4]  # every 2 steps
  small = Image.open(io.BytesIO(base64.b64decode(previews[0]["preview"])))
  assert small.size == (4, 4)  # latent resolution: 32 / 8
  done = client.get(f"/v1/jobs/{job['id']}").json()
  assert done["status"] == "succeeded" and len(done["data"]) == 1


def test_cancel_mid_run_frees_the_slot(served):
  _, client, queue, _ = served
  body = {"prompt": "a long run", "wait": False, **COMMON, "steps": LONG}
  job = client.post("/v1/images/generations", json=body).json()
  seen = _events(client, job["id"], until=lambda e: e["event"] == "progress" and e["step"] >= 3)
  assert seen[-1]["step"] >= 3
  r = client.delete(f"/v1/jobs/{job['id']}")
  assert r.status_code == 200 and r.json()["status"] == "cancelled"
  assert queue.depth == 0  # the slot is free at once
  deadline = time.time() + 30
  while queue._running and time.time() < deadline:  # the loop stops at the next step boundary
    time.sleep(0.01)
  state = client.get(f"/v1/jobs/{job['id']}").json()
  assert state["status"] == "cancelled" and 3 <= state["step"] < LONG
  assert not queue._running
  ok = client.post("/v1/images/generations", json={"prompt": "after", **COMMON})
  assert ok.status_code == 200


@pytest.mark.parametrize(
  "body, param, words",
  [
    (b'{"prompt": "a cat", ', "body", "not valid JSON"),
    (b'["a cat"]', "body", "JSON object"),
    ({"prompt": "a cat", "sizes": "32x32"}, "sizes", "did you mean 'size'"),
    ({"prompt": "a cat", "size": "4096x4096"}, "size", "at most 4096"),
    ({"prompt": "a cat", "size": "36x32"}, "size", "nearest valid width: 32 or 40"),
    ({"prompt": "a cat", "size": "big"}, "size", '"WxH"'),
    ({"prompt": "a cat", "loras": [{"name": "nope"}]}, "loras[0].name", "unknown LoRA 'nope'"),
    ({"prompt": "a cat", "response_format": "jpeg"}, "response_format", "b64_json"),
    ({"prompt": "a cat", "n": 0}, "n", "out of range"),
    ({"prompt": ""}, "prompt", "required"),
    ({"prompt": "a cat", "model": "sdxl"}, "model", "not a image model"),
  ],
)
def test_bad_requests_name_the_field(served, body, param, words):
  _, client, _, _ = served
  if isinstance(body, bytes):
    r = client.post(
      "/v1/images/generations", content=body, headers={"content-type": "application/json"}
    )
  else:
    r = client.post("/v1/images/generations", json=body)
  assert r.status_code == 400, r.text
  err = r.json()["error"]
  assert err["param"] == param and words in err["message"], err


def test_video_generation_is_an_mp4_or_a_gif(served, tmp_path):
  _, client, _, _ = served
  body = {"prompt": "a cat walking", "size": "16x16", "num_frames": 5, "steps": 2, "n": 2}
  r = client.post("/v1/videos/generations", json=body)
  assert r.status_code == 200, r.text
  data = r.json()["data"]
  assert len(data) == 2 and data[0]["mime_type"] == "video/mp4"
  mp4 = tmp_path / "result.mp4"
  mp4.write_bytes(base64.b64decode(data[0]["b64_json"]))
  info = media.video_info(mp4)
  assert (info["num_frames"], info["width"], info["height"]) == (5, 16, 16), info
  gif_r = client.post("/v1/videos/generations", json={**body, "video_format": "gif"})
  assert gif_r.status_code == 200, gif_r.text
  item = gif_r.json()["data"][0]
  assert item["mime_type"] == "image/gif"
  gif = Image.open(io.BytesIO(base64.b64decode(item["b64_json"])))
  assert gif.n_frames == 5 and gif.size == (16, 16)
  # The same seed: the GIF's first frame is the MP4's first frame, up to H.264's loss.
  first = media.load_video(mp4, max_frames=1)[0] * 255.0  # floats in [0, 1]
  assert np.abs(first - np.asarray(gif.convert("RGB"), np.float32)).mean() < 12
  url = client.post("/v1/videos/generations", json={**body, "response_format": "url"})
  file = client.get(url.json()["data"][0]["url"])
  assert file.status_code == 200 and file.headers["content-type"] == "video/mp4"
  assert file.content == base64.b64decode(data[0]["b64_json"])  # same seed, same bytes
  # Search works on the video model too: the best of 3 videos, scored as a whole clip.
  found = client.post(
    "/v1/videos/generations", json={**body, "n": 1, "search": {"budget": 3, "method": "random"}}
  )
  assert found.status_code == 200, found.text
  assert (
    found.json()["data"][0]["score"]
    >= _Brightness().score(media.load_video(mp4)[None], ["a cat walking"])[0] - 0.02
  )  # the seed-0 video (the first candidate), up to H.264's loss
  fmt = client.post("/v1/videos/generations", json={**body, "video_format": "webm"})
  assert fmt.status_code == 400 and fmt.json()["error"]["param"] == "video_format"
  bad = client.post("/v1/videos/generations", json={**body, "num_frames": 4})
  assert bad.status_code == 400 and bad.json()["error"]["param"] == "num_frames"
  for field in ("num_frames", "video_format"):
    wrong = client.post("/v1/images/generations", json={"prompt": "a cat", field: 5})
    assert wrong.status_code == 400 and wrong.json()["error"]["param"] == field
  kind = client.post("/v1/videos/generations", json={"prompt": "a cat", "model": "sd-tiny"})
  assert kind.status_code == 400 and "video models: ['wan-tiny']" in kind.json()["error"]["message"]


def test_search_option(served):
  _, client, _, _ = served
  plain = client.post("/v1/images/generations", json={"prompt": "a star", "seed": 0, **COMMON})
  base = float(_Brightness().score(_png(plain.json()["data"][0])[None] / 255.0, ["a star"])[0])
  body = {"prompt": "a star", "seed": 0, "search": {"budget": 6, "method": "random"}, **COMMON}
  r = client.post("/v1/images/generations", json=body)
  assert r.status_code == 200, r.text
  item = r.json()["data"][0]
  found = float(_Brightness().score(_png(item)[None] / 255.0, ["a star"])[0])
  assert item["score"] >= base - 1e-6 and abs(found - item["score"]) < 3e-3  # uint8 rounding
  bad = client.post("/v1/images/generations", json={**body, "search": {"method": "beam"}})
  assert bad.status_code == 400 and bad.json()["error"]["param"] == "search.method"


def test_full_queue_is_429_with_retry_after(served):
  _, client, queue, _ = served
  body = {"prompt": "fill", "wait": False, **COMMON, "steps": LONG}
  codes, jobs = [], []
  for _ in range(8):
    r = client.post("/v1/images/generations", json=body)
    codes.append(r.status_code)
    if r.status_code == 202:
      jobs.append(r.json()["id"])
    else:
      assert r.status_code == 429
      assert int(r.headers["retry-after"]) >= 1
  assert codes.count(202) == 6 and codes.count(429) == 2
  assert _metric(client, "md_serve_queue_depth") == 6
  for job_id in jobs:
    assert client.delete(f"/v1/jobs/{job_id}").json()["status"] == "cancelled"
  assert queue.depth == 0
  assert _metric(client, "md_serve_jobs_rejected_total") >= 2


def test_healthz_and_metrics(served):
  _, client, _, _ = served
  h = client.get("/healthz")
  assert h.status_code == 200 and h.json()["status"] == "ok"
  text = client.get("/metrics").text
  for name in ("md_serve_queue_depth", "md_serve_step_seconds", "md_serve_compiles_total"):
    assert f"# TYPE {name}" in text
  assert _metric(client, "md_serve_step_seconds_count") > 0
  assert _metric(client, "md_serve_compiles_total") > 0
  models = client.get("/v1/models").json()["data"]
  assert [(m["id"], m["kind"]) for m in models] == [("sd-tiny", "image"), ("wan-tiny", "video")]
  assert models[0]["loras"] == ["a", "b"]


def test_bearer_token(served):
  _, _, _, model = served
  # Its own queue: stopping this server shuts its queue down (the module's server keeps its own).
  queue = md_serve.JobQueue({"sd-tiny": model})
  other = _Server(md_serve.make_app(queue, token="s3cret"))
  try:
    with httpx.Client(base_url=other.url, timeout=60) as c:
      assert c.get("/v1/models").status_code == 401
      assert c.get("/v1/models", headers={"Authorization": "Bearer wrong"}).status_code == 401
      ok = c.get("/v1/models", headers={"Authorization": "Bearer s3cret"})
      assert ok.status_code == 200 and ok.json()["data"][0]["id"] == "sd-tiny"
      assert c.get("/healthz").status_code == 200  # health stays open
  finally:
    other.stop()
  assert not queue._thread.is_alive()


def test_shutdown_cancels_or_finishes_every_accepted_job(served):
  _, _, _, model = served
  req = md_serve.parse_request(
    {"prompt": "x", **COMMON, "steps": LONG}, "image", {"sd-tiny": model}
  )
  q = md_serve.JobQueue({"sd-tiny": model}, max_batch=4, batch_buckets=(4,), batch_wait_s=0.0)
  jobs = [q.submit(req) for _ in range(5)]
  while jobs[0].status == "queued":
    time.sleep(0.01)
  left = q.shutdown("cancel")
  assert {j.id for j in left} == {j.id for j in jobs}
  assert all(j.status == "cancelled" and j.events[-1]["event"] == "cancelled" for j in jobs)
  with pytest.raises(md_serve.ShuttingDown):
    q.submit(req)
  quick = md_serve.parse_request({"prompt": "x", **COMMON}, "image", {"sd-tiny": model})
  q = md_serve.JobQueue({"sd-tiny": model}, max_batch=4, batch_buckets=(4,), batch_wait_s=0.0)
  jobs = [q.submit(quick) for _ in range(6)]
  assert q.shutdown("finish") == []
  assert all(j.status == "succeeded" and len(j.results) == 1 for j in jobs)


def _chromium():
  from selenium import webdriver
  from selenium.webdriver.chrome.service import Service

  options = webdriver.ChromeOptions()
  options.binary_location = "/usr/bin/chromium"
  for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--window-size=1000,900"):
    options.add_argument(arg)
  return webdriver.Chrome(service=Service("/usr/bin/chromedriver"), options=options)


def test_web_page_in_headless_chromium(served, tmp_path):
  from selenium.webdriver.common.by import By
  from selenium.webdriver.support.ui import Select, WebDriverWait

  server, _, _, _ = served
  driver = _chromium()
  try:
    driver.get(server.url + "/")
    wait = WebDriverWait(driver, 60, poll_frequency=0.01)
    wait.until(
      lambda d: d.find_element(By.ID, "size").get_attribute("value") == "32x32",
      "the page did not list the models",
    )
    assert driver.title == "md test"
    lora = [o.get_attribute("value") for o in driver.find_elements(By.CSS_SELECTOR, "#lora option")]
    assert lora == ["", "a", "b"]
    driver.find_element(By.ID, "prompt").send_keys("a blue square")
    steps = driver.find_element(By.ID, "steps")
    steps.clear()
    steps.send_keys(str(STEPS))
    driver.find_element(By.ID, "go").click()
    bar = driver.find_element(By.ID, "bar")
    wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, "#result img.result"), "no result shown")
    assert driver.find_element(By.ID, "status").text == "succeeded"
    # The bar advanced through every step event, in order, and ends full.
    assert driver.execute_script("return window.mdProgress") == list(range(1, STEPS + 1))
    assert bar.get_attribute("max") == str(STEPS)
    assert int(float(bar.get_attribute("value"))) == STEPS
    img = driver.find_element(By.CSS_SELECTOR, "#result img.result")
    assert img.get_attribute("src").startswith("data:image/png;base64,")
    assert driver.execute_script("return arguments[0].naturalWidth", img) == 32
    assert driver.find_elements(By.CSS_SELECTOR, "#preview img")  # the latent preview was shown
    assert len(driver.find_elements(By.CSS_SELECTOR, "#gallery img")) == 1
    shot = tmp_path / "page.png"
    assert driver.save_screenshot(str(shot))
    png = Image.open(shot)
    assert png.size[0] >= 800 and np.asarray(png).std() > 1  # a drawn page, not a blank one
    driver.refresh()  # the gallery is this browser's: it survives a reload
    wait.until(lambda d: len(d.find_elements(By.CSS_SELECTOR, "#gallery img")) == 1)
    # A video model's result is an MP4 that plays in a <video> element.
    wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, "#model option[value='wan-tiny']"))
    Select(driver.find_element(By.ID, "model")).select_by_value("wan-tiny")
    assert driver.find_element(By.ID, "size").get_attribute("value") == "16x16"
    driver.find_element(By.ID, "prompt").send_keys("a cat walking")
    driver.find_element(By.ID, "go").click()
    wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, "#result video.result"), "no video shown")
    video = driver.find_element(By.CSS_SELECTOR, "#result video.result")
    assert video.get_attribute("src").startswith("data:video/mp4;base64,")
    wait.until(
      lambda d: d.execute_script("return arguments[0].readyState", video) >= 2,
      "the browser did not decode the MP4",
    )
    assert driver.execute_script(
      "return [arguments[0].videoWidth, arguments[0].videoHeight]", video
    ) == [16, 16]
    assert len(driver.find_elements(By.CSS_SELECTOR, "#gallery video")) == 1
  finally:
    driver.quit()
