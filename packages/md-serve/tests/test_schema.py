"""The OpenAPI schema's pydantic models and `parse_request` agree: a body the schema refuses is refused by
the server with the same field named, and the server's defaults pass the schema."""

import math

import pydantic
import pytest

import md_serve


class _ImagePipe:
  media = "image"
  default_size = 64

  def noise_layout(self):
    return md_serve.NoiseSpec("image", 8, 4, 8)

  def __call__(self, prompt, *, height, width, num_inference_steps, scheduler=None, latents=None):
    raise AssertionError("not called here")


MODELS = {"m": md_serve.ServedModel("m", _ImagePipe(), max_pixels=128 * 128)}


@pytest.mark.parametrize(
  "body",
  [
    {"prompt": "a cat"},
    {"prompt": "a cat", "n": 2, "size": "64x64", "steps": 10, "guidance": 7, "seed": 3},
    {"prompt": "a cat", "response_format": "url", "wait": False, "negative_prompt": "dog"},
    {"prompt": "a cat", "search": {"budget": 4, "method": "zero_order"}},
  ],
)
def test_accepted_bodies_fit_the_schema(body):
  md_serve.parse_request(body, "image", MODELS)
  md_serve.GenerationRequest.model_validate(body)


@pytest.mark.parametrize(
  "body, param",
  [
    ({"prompt": "x", "steps": 0}, "steps"),
    ({"prompt": "x", "seed": "1"}, "seed"),
    ({"prompt": "x", "seed": -1}, "seed"),
    ({"prompt": "x", "guidance": -1}, "guidance"),
    ({"prompt": "x", "guidance": math.nan}, "guidance"),
    ({"prompt": "x", "guidance": True}, "guidance"),
    ({"prompt": "x", "n": 1.5}, "n"),
    ({"prompt": "x", "loras": "a"}, "loras"),
    ({"prompt": "x", "wait": "no"}, "wait"),
    ({"prompt": "x", "promt": 1}, "promt"),
    ({"prompt": "x", "search": {"budget": 0}}, "search"),
    ({"prompt": "x", "search": {"method": "best"}}, "search"),
    ({"prompt": 3}, "prompt"),
    ({"prompt": " "}, "prompt"),
    ({"prompt": "x", "size": "big"}, "size"),
    ({"prompt": "x", "response_format": "jpeg"}, "response_format"),
    ({"prompt": "x", "cache": "nope"}, "cache"),
    (
      {"prompt": "x", "cache": "magcache", "cache_options": {"mag_ratios": {"a": 1}}},
      "cache_options",
    ),
    ({"prompt": "x", "loras": [{"name": "a", "scale": 1000}]}, "loras"),
  ],
)
def test_refused_by_both_naming_the_same_field(body, param):
  with pytest.raises(pydantic.ValidationError) as schema_error:
    md_serve.GenerationRequest.model_validate(body)
  assert str(schema_error.value.errors()[0]["loc"][0]) == param
  with pytest.raises(md_serve.RequestError) as server_error:
    md_serve.parse_request(body, "image", MODELS)
  assert server_error.value.param.split(".")[0].split("[")[0] == param, server_error.value.param
