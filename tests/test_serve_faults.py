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
    config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning", **options)
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
  server = _Server(md_serve.make_app(queue))
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
