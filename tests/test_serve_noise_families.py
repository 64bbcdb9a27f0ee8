"""md-serve's per-row initial noise for Flux.1, Flux.2 Klein and LTX-Video, on their tiny random-init
pipelines (tests/fixtures): the spec's shape is the one the pipeline takes, a row drawn from a seed is the
noise the pipeline draws itself for that seed, a batch of two seeds' rows gives each row what that row
gives alone, the job queue runs two requests with different seeds in one pipeline call, and search runs
on Flux.1. LTX-2 has no spec (its video also depends on audio noise that `latents=` does not carry).
"""

import functools

import numpy as np
import pytest

import md_serve
from md_core import media, testing

STEPS = 2
PROMPTS = ("a red circle", "a blue square")
# Per family: the fixture folder, the call's settings and the spec's shape for 2 rows at that size.
FAMILIES = {
  # Flux.1 dev: packed tokens [n, (H/16)(W/16), 4C] with 4C = 16. The server passes no
  # max_sequence_length, so neither do these calls (one set of compiled programs for every test).
  "flux": (("flux_pipeline", "dev"), dict(height=32, width=48, guidance_scale=3.5), (2, 6, 16)),
  # Flux.2 Klein (not distilled: guidance runs a negative row per prompt): [n, 4C, H/16, W/16].
  "klein": (
    ("flux2_pipeline", "klein"),
    dict(
      height=32,
      width=48,
      guidance_scale=4.0,
      max_sequence_length=40,
      text_encoder_out_layers=(1, 2, 3),
    ),
    (2, 16, 2, 3),
  ),
  # LTX-Video (8x space, 4x time, 8 channels): [n, C, (F-1)/4 + 1, H/8, W/8].
  "ltx": (
    ("ltx_pipeline", "t2v"),
    dict(height=32, width=32, num_frames=9, max_sequence_length=16),
    (2, 8, 3, 4, 4),
  ),
}


@functools.cache
def _pipe(family: str):
  import md_flux
  import md_ltx

  (folder, name), _, _ = FAMILIES[family]
  path = testing.fixture_path(folder) / name
  return (md_ltx if family == "ltx" else md_flux).load_pipeline(path)


def _call(family: str, prompts, **kw) -> np.ndarray:
  """The pipeline's result; the final latents unless `output_type` says otherwise (rows meet only in
  the denoising loop: decoding is per row, and the queue test below checks images end to end)."""
  settings = {**FAMILIES[family][1], "output_type": "latent", **kw}
  out = _pipe(family)(list(prompts), num_inference_steps=STEPS, progress=False, **settings)
  return np.asarray(out)


def _size(family: str) -> tuple[int, int, int]:
  s = FAMILIES[family][1]
  return s["height"], s["width"], s.get("num_frames", 1)


class _Brightness:
  """A verifier for tests: mean pixel value (meaningful on random weights)."""

  def score(self, images, prompts):
    return np.asarray(images, np.float32).mean(axis=tuple(range(1, np.ndim(images))))


@pytest.mark.parametrize("family", list(FAMILIES))
def test_spec_shape_is_what_the_pipeline_takes_and_draws(family):
  spec = md_serve.noise_spec(_pipe(family))
  assert spec is not None
  assert spec.kind == ("video" if family == "ltx" else "image")
  h, w, f = _size(family)
  assert spec.shape(2, h, w, f) == FAMILIES[family][2]
  row = spec.draw(3, 1, h, w, f)
  assert row.shape == spec.shape(1, h, w, f) and row.dtype == np.float32
  np.testing.assert_array_equal(row, spec.draw(3, 1, h, w, f))  # a seed always gives the same row
  # The row is the noise the pipeline draws itself for seed 3.
  given = _call(family, PROMPTS[:1], latents=row, seed=3)
  own = _call(family, PROMPTS[:1], seed=3)
  np.testing.assert_allclose(given, own, atol=1e-6, rtol=0)
  # The pipeline checks the layout: two rows for one prompt are refused.
  with pytest.raises(ValueError, match="latents"):
    _call(family, PROMPTS[:1], latents=spec.draw(3, 2, h, w, f), seed=3)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_batch_of_two_seeds_gives_each_row_what_it_gives_alone(family):
  spec = md_serve.noise_spec(_pipe(family))
  h, w, f = _size(family)
  rows = np.concatenate([spec.draw(5, 1, h, w, f), spec.draw(9, 1, h, w, f)])
  batched = _call(family, PROMPTS, latents=rows, seed=0)
  assert batched.shape[0] == 2
  assert np.abs(batched[0] - batched[1]).max() > 1e-3  # two prompts, two noises: two samples
  for i, prompt in enumerate(PROMPTS):
    alone = _call(family, [prompt], latents=rows[i : i + 1], seed=0)
    np.testing.assert_allclose(batched[i], alone[0], atol=1e-5, rtol=0, err_msg=f"row {i}")


def test_queue_runs_two_seeds_of_flux_in_one_call():
  pipe = _pipe("flux")
  model = md_serve.ServedModel("flux-tiny", pipe, default_size=(32, 48))
  assert model.describe()["batched_seeds"] and model.multiple == 16
  queue = md_serve.JobQueue({"flux-tiny": model}, max_batch=2, batch_buckets=(2,), batch_wait_s=1.0)
  try:
    common = {"size": "48x32", "steps": STEPS, "guidance": 3.5}
    requests = [
      md_serve.parse_request({"prompt": p, "seed": s, **common}, "image", queue.models)
      for p, s in zip(PROMPTS, (11, 12), strict=True)
    ]
    jobs = [queue.submit(r) for r in requests]
    for job in jobs:
      assert job.done.wait(300), "the job did not finish"
      assert job.status == "succeeded", job.error
    assert [j.batch_rows for j in jobs] == [2, 2]
    assert queue.stats["batches"] == 1
    assert queue.stats["denoiser_calls"] == pipe.last_calls == STEPS  # one loop for both
  finally:
    queue.shutdown()
  # Each request's image is its seed's row of the pipeline on both rows (to the uint8 rounding); with
  # the tests above, that is the plain pipeline call with the request's seed alone.
  spec = model.spec
  rows = np.concatenate([spec.draw(s, 1, 32, 48) for s in (11, 12)])
  images = _call("flux", PROMPTS, latents=rows, seed=11, output_type="np")
  for i, job in enumerate(jobs):
    want = (np.clip(images[i], 0, 1) * 255).round()
    assert np.abs(job.results[0].astype(np.float32) - want).max() <= 1


def test_search_on_flux_picks_the_brighter_noise():
  pipe = _pipe("flux")
  spec = md_serve.noise_spec(pipe)
  settings = dict(FAMILIES["flux"][1])
  h, w = settings.pop("height"), settings.pop("width")
  result = md_serve.search(
    pipe, "a cat", _Brightness(), 2, height=h, width=w, max_batch=2,
    num_inference_steps=STEPS, **settings,
  )  # fmt: skip
  assert result.samples == 2 and result.calls == 2 * STEPS and len(result.history) == 2
  # The candidates: seed 0's noise, then seed 1's (random search), each sampled with sampler seed 0.
  candidates = np.concatenate([spec.draw(0, 1, h, w), spec.draw(1, 1, h, w)])
  images = _call("flux", ["a cat"] * 2, latents=candidates, seed=0, output_type="np")
  scores = _Brightness().score(images, ["a cat"] * 2)
  best = int(np.argmax(scores))
  np.testing.assert_allclose(result.scores[0], scores[best], atol=1e-5)
  np.testing.assert_array_equal(result.latents, candidates[best : best + 1])
  np.testing.assert_allclose(result.images[0], images[best], atol=1e-5, rtol=0)


def test_ltx2_runs_one_request_per_call_and_keeps_its_audio(tmp_path):
  import md_ltx

  pipe = md_ltx.load_ltx2_pipeline(testing.fixture_path("ltx2_pipeline") / "pipe")
  assert md_serve.noise_spec(pipe) is None
  model = md_serve.ServedModel(
    "ltx2-tiny", pipe, default_size=(32, 64), call_kwargs=dict(spatio_temporal_guidance_blocks=(1,))
  )
  assert model.kind == "video" and not model.describe()["batched_seeds"]
  with pytest.raises(ValueError, match="no per-row noise"):
    md_serve.search(pipe, "a cat", _Brightness(), 2, height=32, width=64, num_frames=9)
  # Served, an LTX-2 video keeps its soundtrack: the MP4 holds the frames and the audio.
  queue = md_serve.JobQueue({"ltx2-tiny": model}, max_batch=2, batch_buckets=(1,), batch_wait_s=0.0)
  try:
    body = {"prompt": "a cat", "num_frames": 9, "steps": 2, "guidance": 1.0}
    job = queue.submit(md_serve.parse_request(body, "video", queue.models))
    assert job.done.wait(600) and job.status == "succeeded", (job.status, job.error)
  finally:
    queue.shutdown("cancel")
  frames = job.results[0]
  assert frames.ndim == 4 and frames.shape[-1] == 3 and job.audio[0].ndim == 2
  blob, mime = md_serve.encode_result(
    job.results[0], job.fps, audio=job.audio[0], sample_rate=job.sample_rate
  )
  path = tmp_path / "ltx2.mp4"
  path.write_bytes(blob)
  info = media.video_info(path)
  assert mime == "video/mp4" and info["has_audio"], info
  assert (info["num_frames"], info["height"], info["width"]) == frames.shape[:3], info
