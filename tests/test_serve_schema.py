"""md-serve against its own OpenAPI document (`GET /openapi.json`): schemathesis generates bodies, paths and
ids from the schema (valid and invalid, a bounded number of examples) and sends them to a real server on
127.0.0.1. No answer is a 500, and every answer's status, content type and body are ones the document
declares. The pipelines are stand-ins that return at once (the schema, not the models, is under test)."""

import socket
import threading
import time

import numpy as np
import pytest
import schemathesis
import uvicorn
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode
from schemathesis.specs.openapi import checks as openapi_checks

import md_serve


class _ImagePipe:
  """What md-serve asks an md-sd pipeline (the family contract); the call returns grey images at once."""

  media = "image"
  default_size = 32
  last_calls = 0
  block_stacks = False
  cache_defaults = {}

  def noise_layout(self):
    return md_serve.NoiseSpec("image", 8, 4, 8)

  def __call__(self, prompt, *, height, width, num_inference_steps, guidance_scale=5.0, seed=0,
               latents=None, callback=None, cancel=None, progress=False, chunk=1, scheduler=None,
               negative_prompt=None, cache=None):  # fmt: skip
    rows = len(latents) if latents is not None else len(prompt)
    return np.full((rows, height, width, 3), 0.5, np.float32)

  def clear_programs(self):
    pass


class _VideoPipe:
  """A video pipeline without per-row noise (one request per call)."""

  media = "video"
  default_size = 16
  last_calls = 0
  block_stacks = True
  cache_defaults = {}

  def noise_layout(self):
    return None

  def __call__(self, prompt, *, height, width, num_frames, num_inference_steps, guidance_scale=5.0,
               seed=0, callback=None, cancel=None, progress=False, chunk=1,
               num_videos_per_prompt=1, negative_prompt=None):  # fmt: skip
    return np.full((num_videos_per_prompt, num_frames, height, width, 3), 0.5, np.float32)

  def clear_programs(self):
    pass


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


@pytest.fixture(scope="module")
def api():
  models = {
    "img": md_serve.ServedModel("img", _ImagePipe(), max_steps=8),
    "vid": md_serve.ServedModel("vid", _VideoPipe(), num_frames=3, max_frames=5, max_steps=8),
  }
  queue = md_serve.JobQueue(models, max_queue=64, batch_wait_s=0.0)
  port = _free_port()
  server = uvicorn.Server(
    uvicorn.Config(md_serve.make_app(queue), host="127.0.0.1", port=port, log_level="warning")
  )
  thread = threading.Thread(target=server.run, daemon=True)
  thread.start()
  while not server.started:
    time.sleep(0.02)
  yield schemathesis.openapi.from_url(f"http://127.0.0.1:{port}/openapi.json")
  server.should_exit = True
  thread.join(30)


CHECKS = [
  openapi_checks.status_code_conformance,
  openapi_checks.content_type_conformance,
  openapi_checks.response_schema_conformance,
]


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_no_500_and_every_answer_is_in_the_schema(api, mode):
  operations = [result.ok() for result in api.get_all_operations()]
  assert len(operations) == 6
  for operation in operations:
    if mode == GenerationMode.NEGATIVE and operation.method != "post":
      continue  # only the bodies have a schema to break (path ids are any string)

    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(
      max_examples=15, deadline=None, derandomize=True, database=None,
      suppress_health_check=list(HealthCheck),
    )  # fmt: skip
    def check(case):
      response = case.call(timeout=30)
      assert response.status_code < 500, (case.method, case.path, case.body, response.text[:500])
      case.validate_response(response, checks=CHECKS)

    check()
