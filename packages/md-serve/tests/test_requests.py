"""Request checking without a pipeline: every bad field named, sizes with the nearest valid values."""

import pytest

import md_serve


class _ImagePipe:
  """Just what md-serve asks an md-sd pipeline (the family contract): what it makes, its noise layout
  (4 latent channels, VAE factor 8), its default size, the call."""

  media = "image"
  default_size = 64

  def noise_layout(self):
    return md_serve.NoiseSpec("image", 8, 4, 8)

  def __call__(self, prompt, *, height, width, num_inference_steps, scheduler=None, latents=None):
    raise AssertionError("not called here")


@pytest.fixture(scope="module")
def models():
  return {"m": md_serve.ServedModel("m", _ImagePipe(), max_pixels=128 * 128)}


def test_defaults_and_bucket(models):
  r = md_serve.parse_request({"prompt": "a cat"}, "image", models)
  assert (r.model, r.n, r.height, r.width, r.seed, r.response_format) == (
    "m",
    1,
    64,
    64,
    0,
    "b64_json",
  )
  other = md_serve.parse_request({"prompt": "a dog", "seed": 5, "n": 2}, "image", models)
  assert r.bucket() == other.bucket()  # prompts, seeds and n batch together
  wider = md_serve.parse_request({"prompt": "a dog", "size": "128x64"}, "image", models)
  assert (wider.height, wider.width) == (64, 128) and wider.bucket() != r.bucket()
  spec = models["m"].spec
  assert spec.shape(2, 64, 128) == (2, 4, 8, 16)
  assert (spec.draw(3, 2, 64, 64) == spec.draw(3, 2, 64, 64)).all()


@pytest.mark.parametrize(
  "body, param, words",
  [
    ({"prompt": "x", "size": "70x64"}, "size", "nearest valid width: 64 or 72"),
    ({"prompt": "x", "size": "64x60"}, "size", "height 60 is not a positive multiple of 8"),
    ({"prompt": "x", "size": "256x256"}, "size", "at most 16384"),
    ({"prompt": "x", "steps": 0}, "steps", "out of range"),
    ({"prompt": "x", "seed": "1"}, "seed", "must be an integer"),
    ({"prompt": "x", "guidance": -1}, "guidance", "in 0..100"),
    ({"prompt": "x", "loras": "a"}, "loras", "must be a list"),
    ({"prompt": "x", "loras": [{"name": "a"}]}, "loras[0].name", "loaded: []"),
    ({"prompt": "x", "cache_options": {"a": 1}}, "cache_options", "without cache"),
    ({"prompt": "x", "wait": "no"}, "wait", "true or false"),
    ({"prompt": "x", "promt": 1}, "promt", "did you mean 'prompt'"),
    ({"prompt": "x", "search": {"budget": 0}}, "search.budget", "out of range"),
    ({"prompt": 3}, "prompt", "must be a string"),
  ],
)
def test_bad_fields(models, body, param, words):
  with pytest.raises(md_serve.RequestError) as e:
    md_serve.parse_request(body, "image", models)
  assert e.value.param == param and words in str(e.value), (e.value.param, str(e.value))
  assert e.value.status == 400
