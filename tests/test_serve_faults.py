"""md-serve under hostile requests: a real uvicorn server on 127.0.0.1 (a free port) over the tiny SD and
Wan pipelines, driven with httpx as an attacker or a careless client would. Each case expects the clear
outcome (a 4xx naming the field, a refused connection) and a queue that still runs jobs afterwards.
"""

import os
import socket
import threading
import time

import httpx
import pytest
import uvicorn

import md_sd
import md_serve
import md_wan
from md_core import testing

IMAGE = {"size": "32x32", "steps": 2, "guidance": 5.0}
VIDEO = {"size": "16x16", "steps": 2, "num_frames": 5}
RATIOS = [1.0, 0.98, 0.97, 0.95]  # inline MagCache ratios (any finite numbers will do)


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


class _Server:
  """A uvicorn server in a thread (stopped with should_exit, as on SIGTERM)."""

  def __init__(self, app, **options):
    self.port = _free_port()
    self.url = f"http://127.0.0.1:{self.port}"
    config = uvicorn.Config(
      app, host="127.0.0.1", port=self.port, log_level="warning",
      http=md_serve.header_timeout_protocol(1.0), **options,
    )  # fmt: skip
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
  sd = md_sd.load_pipeline(testing.fixture_path("sd_pipeline") / "sd")
  image = md_serve.ServedModel("sd-tiny", sd, default_size=(32, 32), max_pixels=64 * 64)
  wan = md_wan.load_pipeline(testing.fixture_path("wan_pipeline") / "t2v")
  video = md_serve.ServedModel(
    "wan-tiny", wan, default_size=(16, 16), num_frames=5, max_frames=9,
    mag_ratios={"calibrated": RATIOS},
  )  # fmt: skip
  queue = md_serve.JobQueue(
    {"sd-tiny": image, "wan-tiny": video}, max_queue=4, max_batch=1, batch_buckets=(1,),
    batch_wait_s=0.0,
  )  # fmt: skip
  server = _Server(md_serve.make_app(queue, body_timeout_s=1.0))
  client = httpx.Client(base_url=server.url, timeout=120)
  yield server, client, queue
  client.close()
  server.stop()


def _video(client, **fields):
  return client.post("/v1/videos/generations", json={"prompt": "a cat", **VIDEO, **fields})


def _refused(r, param: str, *words: str):
  assert 400 <= r.status_code < 500, (r.status_code, r.text)
  err = r.json()["error"]
  assert err["param"] == param, err
  for w in words:
    assert w in err["message"], err
  return err


# --- requests never name server files ---------------------------------------------------------------


def test_mag_ratios_as_a_path_is_refused_without_reading_it(served, tmp_path):
  _, client, queue = served
  real = tmp_path / "ratios.json"
  real.write_text('{"mag_ratios": [1.0, 1.0]}')
  answers = []
  for path in (str(real), str(tmp_path / "missing.json"), "/etc/passwd", "/dev/zero"):
    r = _video(client, cache="magcache", cache_options={"mag_ratios": path})
    answers.append(_refused(r, "cache_options.mag_ratios", "registered")["message"])
  # The answer does not tell whether a path exists: an existing and a missing file get the same words.
  assert answers[0].replace(str(real), "X") == answers[1].replace(
    str(tmp_path / "missing.json"), "X"
  )
  assert queue.depth == 0


def test_mag_ratios_naming_a_pipe_answers_at_once(served, tmp_path):
  _, client, queue = served
  fifo = tmp_path / "fifo"
  os.mkfifo(fifo)
  start = time.perf_counter()
  r = _video(client, cache="magcache", cache_options={"mag_ratios": str(fifo)}, wait=False)
  _refused(r, "cache_options.mag_ratios")
  assert time.perf_counter() - start < 10 and queue.depth == 0


@pytest.mark.parametrize(
  "value, words",
  [
    ([1.0] * 1001, "1 to 1000 numbers"),
    ([], "1 to 1000 numbers"),
    ([1.0, "2"], "mag_ratios[1] must be a finite number"),
    ([1.0, True], "mag_ratios[1] must be a finite number"),
    ([1.0, [2.0]], "mag_ratios[1]"),
    ({"path": "/dev/zero"}, "list of numbers or a registered name"),
    (7, "list of numbers or a registered name"),
  ],
)
def test_mag_ratios_must_be_a_bounded_list_of_finite_numbers(served, value, words):
  _, client, _ = served
  _refused(
    _video(client, cache="magcache", cache_options={"mag_ratios": value}),
    "cache_options.mag_ratios",
    words,
  )


def test_non_finite_mag_ratios_are_refused(served):
  _, client, _ = served
  for token in (b"NaN", b"Infinity", b"-Infinity", b"1e999"):
    body = b'{"prompt": "a cat", "size": "16x16", "cache": "magcache", "cache_options": '
    body += b'{"mag_ratios": [1.0, ' + token + b"]}}"
    r = client.post(
      "/v1/videos/generations", content=body, headers={"content-type": "application/json"}
    )
    _refused(r, "cache_options.mag_ratios", "finite")
    body = b'{"prompt": "a cat", "size": "16x16", "cache": "magcache", "cache_options": '
    body += b'{"mag_ratios": [1.0], "threshold": ' + token + b"}}"
    r = client.post(
      "/v1/videos/generations", content=body, headers={"content-type": "application/json"}
    )
    _refused(r, "cache_options.threshold", "0..10")


def test_a_huge_list_is_refused_before_it_is_read_whole(served):
  _, client, _ = served
  r = _video(client, cache="magcache", cache_options={"mag_ratios": [0.5] * 200_000})
  assert r.status_code == 413, r.text
  assert r.json()["error"]["param"] == "body"


@pytest.mark.parametrize(
  "cache, options, param",
  [
    ("magcache", {"threshold": "0.1"}, "cache_options.threshold"),
    ("magcache", {"threshold": -1}, "cache_options.threshold"),
    ("magcache", {"calibrate": 1}, "cache_options.calibrate"),
    ("magcache", {"coefficients": "flux"}, "cache_options.coefficients"),
    ("teacache", {"coefficients": "/etc/passwd"}, "cache_options.coefficients"),
    ("teacache", {"coefficients": [1.0] * 17}, "cache_options.coefficients"),
    ("taylorseer", {"factors_dtype": "../../x"}, "cache_options.factors_dtype"),
    ("taylorseer", {"max_order": 50}, "cache_options.max_order"),
    ("no_such_cache", {}, "cache"),
    ("deepcache", {}, "cache"),  # a UNet cache on a transformer model
  ],
)
def test_every_cache_option_is_checked(served, cache, options, param):
  _, client, _ = served
  body = {"cache": cache, "cache_options": options} if options else {"cache": cache}
  _refused(_video(client, **body), param)


def test_inline_and_registered_ratios_run_and_the_queue_stays_usable(served):
  _, client, queue = served
  for ratios in (RATIOS, "calibrated"):
    r = _video(client, cache="magcache", cache_options={"mag_ratios": ratios})
    assert r.status_code == 200, r.text
    assert r.json()["data"][0]["mime_type"] == "video/mp4"
  _refused(_video(client, cache="magcache", cache_options={"mag_ratios": "other"}),
           "cache_options.mag_ratios", "registered: ['calibrated']")  # fmt: skip
  models = client.get("/v1/models").json()["data"]
  assert {m["id"]: m["mag_ratios"] for m in models} == {"sd-tiny": [], "wan-tiny": ["calibrated"]}
  r = client.post("/v1/images/generations", json={"prompt": "a cat", **IMAGE})
  assert r.status_code == 200, r.text
  assert queue.depth == 0


# --- cross-site requests ----------------------------------------------------------------------------


@pytest.mark.parametrize(
  "content_type",
  ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", None],
)
def test_only_json_bodies_are_taken(served, content_type):
  _, client, queue = served
  headers = {"content-type": content_type} if content_type else {}
  body = b'{"prompt": "a cat", "size": "32x32", "steps": 2}'
  r = client.post("/v1/images/generations", content=body, headers=headers)
  _refused(r, "content-type", "application/json")
  assert r.status_code == 415 and queue.depth == 0


def test_origin_and_host_are_checked(served):
  server, client, queue = served
  body = {"prompt": "a cat", **IMAGE, "wait": False}
  r = client.post("/v1/images/generations", json=body, headers={"origin": "https://evil.example"})
  _refused(r, "origin", "evil.example")
  assert r.status_code == 403 and queue.depth == 0
  r = client.get("/v1/models", headers={"host": "evil.example"})  # DNS rebinding
  _refused(r, "host", "evil.example")
  assert client.get("/", headers={"host": "evil.example:80"}).status_code == 421
  assert client.get("/healthz", headers={"host": "evil.example"}).status_code == 200
  same = client.get("/v1/models", headers={"origin": server.url})
  assert same.status_code == 200  # the server's own page
  local = client.get("/v1/models", headers={"host": f"localhost:{server.port}"})
  assert local.status_code == 200


def test_allowed_origins_and_public_url(served):
  _, _, queue = served
  # Its own queue: stopping this server shuts its queue down (the module's server keeps its own).
  own = md_serve.JobQueue({"sd-tiny": queue.models["sd-tiny"]}, batch_wait_s=0.0)
  app = md_serve.make_app(
    own, allowed_hosts=["md.example.com"], allowed_origins=["https://app.example.com"],
    public_url="https://md.example.com/",
  )  # fmt: skip
  server = _Server(app)
  try:
    with httpx.Client(base_url=server.url, timeout=60, headers={"host": "md.example.com"}) as c:
      assert c.get("/v1/models").status_code == 200
      ok = c.get("/v1/models", headers={"origin": "https://app.example.com"})
      assert ok.status_code == 200
      assert c.get("/v1/models", headers={"origin": "https://other.example"}).status_code == 403
      r = c.post(
        "/v1/images/generations",
        json={"prompt": "a cat", **IMAGE, "response_format": "url"},
        headers={"origin": "https://app.example.com"},
      )
      assert r.status_code == 200, r.text
      assert r.json()["data"][0]["url"].startswith("https://md.example.com/v1/files/job-")
    with httpx.Client(base_url=server.url, timeout=10) as c:
      assert c.get("/v1/models").status_code == 421  # 127.0.0.1 is not in this server's list
  finally:
    server.server.should_exit = True
    server.thread.join(30)


def test_token_from_a_file_or_the_environment(tmp_path, monkeypatch):
  monkeypatch.delenv(md_serve.TOKEN_ENV, raising=False)
  assert md_serve.read_token() is None
  monkeypatch.setenv(md_serve.TOKEN_ENV, "from-env")
  assert md_serve.read_token() == "from-env"
  file = tmp_path / "token"
  file.write_text("from-file\n")
  assert md_serve.read_token(file) == "from-file"  # the file wins
  file.write_text("\n")
  with pytest.raises(ValueError, match="is empty"):
    md_serve.read_token(file)
  with pytest.raises(ValueError, match="does not exist"):
    md_serve.read_token(tmp_path / "missing")


# --- bounds -----------------------------------------------------------------------------------------


def test_models_advertise_their_bounds(served):
  _, client, _ = served
  listing = client.get("/v1/models").json()
  image, video = listing["data"]
  assert (image["max_pixels"], image["max_steps"]) == (4 * 32 * 32, 100)
  assert (video["max_frames"], video["max_pixels"]) == (9, 4 * 16 * 16)
  assert listing["limits"]["max_body_bytes"] == 64 * 1024
  assert listing["limits"]["job_timeout_s"] == 600
  _refused(client.post("/v1/images/generations", json={"prompt": "x", "steps": 101}), "steps")
  _refused(
    client.post("/v1/images/generations", json={"prompt": "x", "size": "128x128"}),
    "size", "at most 4096",
  )  # fmt: skip


def _raw(server, data: bytes, wait: float = 10.0) -> bytes:
  """Sends `data` on a fresh connection and returns what comes back until the server closes it."""
  with socket.create_connection(("127.0.0.1", server.port), timeout=wait) as sock:
    sock.sendall(data)
    out = b""
    while chunk := sock.recv(65536):
      out += chunk
    return out


def test_a_streamed_body_is_cut_at_the_limit(served):
  server, client, _ = served

  def chunks():
    for _ in range(1000):  # 64 MB if it were read whole
      yield b"x" * 65536

  r = client.post(
    "/v1/images/generations", content=chunks(), headers={"content-type": "application/json"}
  )
  _refused(r, "body", "over 65536 bytes")
  assert r.status_code == 413
  claim = b"POST /v1/images/generations HTTP/1.1\r\nhost: 127.0.0.1\r\n"
  claim += b"content-type: application/json\r\ncontent-length: 50000000\r\n\r\n"
  start = time.perf_counter()
  assert b" 413 " in _raw(server, claim).split(b"\r\n")[0]
  assert time.perf_counter() - start < 5  # answered at once, not after reading 50 MB


def test_slow_bodies_and_slow_headers_are_cut(served):
  server, _, queue = served
  head = b"POST /v1/images/generations HTTP/1.1\r\nhost: 127.0.0.1\r\n"
  head += b"content-type: application/json\r\ncontent-length: 100\r\n\r\n{"
  start = time.perf_counter()
  assert b" 408 " in _raw(server, head).split(b"\r\n")[0]  # body_timeout_s=1
  start = time.perf_counter()
  assert _raw(server, b"GET /healthz HTTP/1.1\r\nhost: 127.0.0.1\r\n") == b""  # headers never end
  assert time.perf_counter() - start < 5  # closed after header_timeout_s=1
  with socket.create_connection(("127.0.0.1", server.port), timeout=10) as idle:
    start = time.perf_counter()
    assert idle.recv(10) == b""  # a connection that sends nothing is closed as well
    assert time.perf_counter() - start < 5
  assert queue.depth == 0


def test_job_deadline_and_program_bound(served):
  _, _, queue = served
  image = queue.models["sd-tiny"]
  models = {"sd-tiny": image}
  q = md_serve.JobQueue(
    models, max_batch=1, batch_buckets=(1,), batch_wait_s=0.0, job_timeout_s=0.3
  )
  try:
    long = md_serve.parse_request({"prompt": "x", **IMAGE, "steps": 100}, "image", models)
    job = q.submit(long)
    assert job.done.wait(120)
    assert job.status == "failed" and job.http_status == 504 and "deadline of 0.3 s" in job.error
  finally:
    q.shutdown("cancel")
  q = md_serve.JobQueue(models, max_batch=1, batch_buckets=(1,), batch_wait_s=0.0, max_programs=2)
  try:
    for size in ("32x32", "16x16", "32x16", "32x32"):
      req = md_serve.parse_request({"prompt": "x", **IMAGE, "size": size}, "image", models)
      before = md_serve.compile_count()
      job = q.submit(req)
      assert job.done.wait(120) and job.status == "succeeded", job.error
      compiled = md_serve.compile_count() - before
    assert q.stats["program_evictions"] == 1  # the third shape freed the first two
    assert compiled > 0  # so 32x32 compiled again: its program was really dropped
    assert "md_serve_program_evictions_total 1" in q.metrics()
  finally:
    q.shutdown("cancel")


# --- no 500s ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
  "raw, param, status",
  [
    (b'{"prompt": "x", "seed": ' + b"9" * 5000 + b"}", "body", 400),
    (b'{"prompt": "x", "seed": ' + b"9" * 4000 + b"}", "seed", 400),
    (b"[" * 30000 + b"]" * 30000, "body", 400),
    (b'{"prompt": "x", "guidance": NaN}', "guidance", 400),
    (b'{"prompt": "x", "guidance": Infinity}', "guidance", 400),
    (b'{"prompt": "x", "guidance": 1e999}', "guidance", 400),
    (b'{"prompt": "x", "loras": [{"name": ["a"]}]}', "loras[0].name", 400),
    (b'{"prompt": "x", "loras": [{"name": "a", "scale": NaN}]}', "loras[0]", 400),
    (b'{"prompt": "x", "n": 1.5}', "n", 400),
    (b'{"prompt": "x", "search": {"method": ["random"]}}', "search.method", 400),
    (b'{"prompt": "x", "size": {"w": 32}}', "size", 400),
    (b'"\xff\xfe"', "body", 400),
  ],
)
def test_hostile_bodies_get_a_4xx(served, raw, param, status):
  _, client, queue = served
  r = client.post(
    "/v1/images/generations", content=raw, headers={"content-type": "application/json"}
  )
  assert r.status_code == status, r.text
  assert r.json()["error"]["param"].startswith(param), r.json()
  assert queue.depth == 0


def test_odd_file_and_job_ids_are_404(served):
  _, client, _ = served
  for path in ("/v1/files/x/%C2%B2", "/v1/files/x/99999999999", "/v1/files/x/-1", "/v1/jobs/%00"):
    assert client.get(path).status_code == 404, path
  assert client.delete("/v1/jobs/" + "x" * 5000).status_code == 404


def test_a_size_the_pipeline_refuses_is_422_not_500(served):
  _, client, queue = served
  # 40 is a multiple of the advertised 8 but the tiny UNet halves its latents once more.
  r = client.post("/v1/images/generations", json={"prompt": "x", **IMAGE, "size": "40x40"})
  assert r.status_code == 422, r.text
  assert "UNet" in r.json()["error"]["message"]
  ok = client.post("/v1/images/generations", json={"prompt": "x", **IMAGE})
  assert ok.status_code == 200 and queue.depth == 0


# --- reliability ------------------------------------------------------------------------------------


def test_a_client_that_disconnects_cancels_its_job(served):
  _, client, queue = served
  body = {"prompt": "a long run", **IMAGE, "steps": 100}
  with pytest.raises(httpx.ReadTimeout):
    client.post("/v1/images/generations", json=body, timeout=1.0)
  deadline = time.time() + 30
  job = next(reversed(queue.jobs.values()))
  while job.status not in ("cancelled", "succeeded", "failed") and time.time() < deadline:
    time.sleep(0.05)
  assert job.status == "cancelled" and job.error == "the client disconnected", job.describe()
  assert job.step < 100
  while queue._running and time.time() < deadline:
    time.sleep(0.02)
  assert queue.depth == 0


def test_finish_shutdown_with_more_work_than_time_records_every_job(served, capfd):
  _, _, queue = served
  models = {"sd-tiny": queue.models["sd-tiny"]}
  q = md_serve.JobQueue(models, max_batch=1, batch_buckets=(1,), batch_wait_s=0.0)
  req = md_serve.parse_request({"prompt": "x", **IMAGE, "steps": 100}, "image", models)
  jobs = [q.submit(req) for _ in range(4)]
  while jobs[0].status == "queued":
    time.sleep(0.01)
  left = q.shutdown("finish", timeout=0.2)
  assert not q._thread.is_alive()  # returned only once the worker stopped
  assert all(j.status in ("succeeded", "cancelled") for j in jobs)
  assert {j.id for j in left} == {j.id for j in jobs if j.status == "cancelled"} and left
  err = capfd.readouterr().err
  for j in left:
    assert f"{j.id} cancelled: server shut down (0.2 s to finish ran out)" in err
