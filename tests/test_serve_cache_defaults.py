"""A served model gets its own family's cache defaults (the family contract's `cache_defaults`), not
another family's: Flux.1 and LTX-Video served through a real uvicorn server on 127.0.0.1, each asked for
TeaCache without coefficients, run with that family's published polynomial
(`md_cache.TEACACHE_COEFFICIENTS["flux"]` / `["ltx-video"]`)."""

import socket
import threading
import time

import httpx
import pytest
import uvicorn

import md_cache
import md_flux
import md_ltx
import md_serve
from md_cache import settings as cache_settings
from md_core import testing


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


@pytest.fixture(scope="module")
def served():
  made = []  # the coefficients each TeaCache the server made was given

  def teacache(threshold=None, coefficients="identity"):
    made.append(coefficients)
    return md_cache.teacache(threshold, coefficients)

  policies = dict(cache_settings.POLICIES)
  cache_settings.POLICIES["teacache"] = policies["teacache"]._replace(factory=teacache)
  flux = md_flux.load_pipeline(testing.fixture_path("flux_pipeline") / "dev")
  ltx = md_ltx.load_pipeline(testing.fixture_path("ltx_pipeline") / "t2v")
  models = {
    "flux": md_serve.ServedModel("flux", flux, default_size=(32, 32), max_pixels=64 * 64),
    "ltx": md_serve.ServedModel("ltx", ltx, default_size=(32, 32), num_frames=9, max_frames=9),
  }
  queue = md_serve.JobQueue(models, max_queue=4, max_batch=1, batch_buckets=(1,), batch_wait_s=0)
  port = _free_port()
  server = uvicorn.Server(
    uvicorn.Config(md_serve.make_app(queue), host="127.0.0.1", port=port, log_level="warning")
  )
  thread = threading.Thread(target=server.run, daemon=True)
  thread.start()
  deadline = time.time() + 30
  while not server.started:
    assert time.time() < deadline, "uvicorn did not start"
    time.sleep(0.02)
  client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=300)
  yield client, made
  client.close()
  server.should_exit = True
  thread.join(30)
  cache_settings.POLICIES.clear()
  cache_settings.POLICIES.update(policies)


@pytest.mark.parametrize(
  "model, route, extra, family",
  [
    ("flux", "/v1/images/generations", {}, "flux"),
    ("ltx", "/v1/videos/generations", {"num_frames": 9}, "ltx-video"),
  ],
)
def test_served_family_gets_its_own_teacache_polynomial(served, model, route, extra, family):
  client, made = served
  before = len(made)
  body = {"model": model, "prompt": "a red circle", "size": "32x32", "steps": 2, "seed": 1}
  r = client.post(route, json={**body, **extra, "cache": "teacache"})
  assert r.status_code == 200, r.text
  # Checked at submit and built for the run; before the contract md-serve gave both Wan's (none).
  assert made[before:] and set(made[before:]) == {family}, made[before:]
  assert len(md_cache.TEACACHE_COEFFICIENTS[family]) == 5
