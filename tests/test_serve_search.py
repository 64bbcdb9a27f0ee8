"""md_serve.search on the tiny SD pipeline (random weights): a pixel-statistic verifier whose score means
something on any image (mean brightness), so the searches' gains are real numbers; md-data's shapes
verifier and the CLIP verifier checked on their own inputs."""

import numpy as np
import pytest

import md_data
import md_sd
import md_serve
from md_core import testing

PROMPTS = ["a red circle", "a blue square", "a green star"]
KW = dict(height=32, width=32, num_inference_steps=3, guidance_scale=5.0)


class Brightness:
  """Mean pixel value: a verifier for tests (meaningful on random-weight images)."""

  def score(self, images, prompts):
    assert len(images) == len(prompts)
    return np.asarray(images, np.float32).mean(axis=tuple(range(1, np.ndim(images))))


@pytest.fixture(scope="module")
def pipe():
  return md_sd.load_pipeline(testing.fixture_path("sd_pipeline") / "sd")


def test_random_search_score_rises_with_budget_and_beats_seed_0(pipe):
  spec = md_serve.noise_spec(pipe)
  table = {}
  for prompt in PROMPTS:
    table[prompt] = [
      md_serve.search(pipe, prompt, Brightness(), b, method="random", progress=False, **KW)
      for b in (1, 2, 4, 8)
    ]
  for prompt, results in table.items():
    # Budget 1 is the seed-0 sample: the same as a direct call with seed 0's noise.
    lat = np.concatenate([spec.draw(0, 1, 32, 32), np.zeros((3, *spec.shape(1, 32, 32)[1:]))])
    direct = np.asarray(pipe([prompt] * 4, latents=lat.astype(np.float32), progress=False, **KW))[0]
    np.testing.assert_allclose(results[0].images[0], direct, atol=1e-5)
    scores = [float(r.scores[0]) for r in results]
    assert scores == sorted(scores), (prompt, scores)  # non-decreasing in the budget
    assert scores[-1] >= float(Brightness().score(direct[None], [prompt])[0])
    assert [r.samples for r in results] == [1, 2, 4, 8]
    assert [r.calls for r in results] == [3, 6, 12, 24]  # 3 denoiser calls per sample
    assert results[-1].history[-1] == (24, scores[-1])
  gain = np.mean([table[p][-1].scores[0] - table[p][0].scores[0] for p in PROMPTS])
  assert gain > 0.005, gain  # budget 8 is brighter than seed 0 on average (measured ~0.02)


def test_zero_order_and_path_search(pipe):
  seed0 = md_serve.search(pipe, PROMPTS[0], Brightness(), 1, progress=False, **KW)
  zo = md_serve.search(
    pipe, PROMPTS[0], Brightness(), 9, method="zero_order", neighbours=4, step_size=0.5, **KW
  )
  assert zo.samples == 9 and len(zo.history) == 3  # 1 + 4 + 4
  assert zo.scores[0] >= seed0.scores[0]
  # The best neighbour is near the start (a sphere step), not a fresh draw.
  start = md_serve.noise_spec(pipe).draw(0, 1, 32, 32)
  cos = float(np.sum(zo.latents * start) / np.linalg.norm(zo.latents) / np.linalg.norm(start))
  assert cos > 0.5 if zo.scores[0] > seed0.scores[0] else np.allclose(zo.latents, start)
  path = md_serve.search(pipe, PROMPTS[0], Brightness(), 4, method="path", n=2, **KW)
  assert path.images.shape == (2, 32, 32, 3) and path.scores[0] >= path.scores[1]
  np.testing.assert_array_equal(path.latents, start)  # the initial noise stays fixed
  assert path.samples == 4 and path.calls == 12
  with pytest.raises(ValueError, match="method='beam'"):
    md_serve.search(pipe, PROMPTS[0], Brightness(), 4, method="beam", **KW)
  with pytest.raises(ValueError, match="budget=1 must be at least n=2"):
    md_serve.search(pipe, PROMPTS[0], Brightness(), 1, n=2, **KW)


def test_shapes_verifier_scores_agreement_with_the_caption():
  config = md_data.ShapesConfig(size=32)
  samples = [md_data.shapes_sample(config, 0, i) for i in range(6)]
  images = np.stack([s.pixels for s in samples])
  right = md_serve.ShapesVerifier().score(images, [s.caption for s in samples])
  wrong = md_serve.ShapesVerifier().score(images, [samples[(i + 1) % 6].caption for i in range(6)])
  assert right.shape == (6,) and right.dtype == np.float32
  assert right.mean() > 0.8 and right.mean() > wrong.mean() + 0.2, (right, wrong)


def test_clip_verifier_on_a_local_clip():
  v = md_serve.ClipVerifier(testing.fixture_path("clip"), text_subfolder="text_encoder_2")
  rng = np.random.default_rng(0)
  images = rng.uniform(size=(3, 40, 40, 3)).astype(np.float32)
  a = v.score(images, ["a cat", "a cat", "a dog"])
  assert a.shape == (3,) and np.all(np.abs(a) <= 1.0 + 1e-6)
  b = v.score(images[::-1], ["a dog", "a cat", "a cat"])  # the same pairs, in another order
  np.testing.assert_allclose(b[::-1], a, atol=1e-5)
  assert not np.allclose(a[0], a[1])  # another image, another score
