"""md_core.pipeline: prompts, sizes, batch placement, the jit memo, component lookup."""

import json

import jax
import numpy as np
import pytest

import md_core
from md_core import pipeline as mdp


def test_a_string_is_one_prompt_and_bad_prompts_are_refused():
  assert mdp.as_prompts("a cat") == ["a cat"]
  assert mdp.as_prompts(("a", "b")) == ["a", "b"]
  assert mdp.as_prompts(None) is None
  with pytest.raises(TypeError, match="prompt must be a str or a list of str, got int"):
    mdp.as_prompts(3)
  with pytest.raises(TypeError, match=r"negative_prompt .* holds \['int'\]"):
    mdp.as_prompts(["a", 1], "negative_prompt")


def test_size_errors_name_the_nearest_valid_sizes():
  assert mdp.check_multiple("height", 64, 16) == 64
  with pytest.raises(
    mdp.SizeError, match="height=70 is not a multiple of 16; the nearest valid: 64 or 80"
  ):
    mdp.check_multiple("height", 70, 16)
  with pytest.raises(mdp.SizeError, match="width=8 is too small: the smallest valid width is 16"):
    mdp.check_multiple("width", 8, 16)
  with pytest.raises(mdp.SizeError, match="must be an int"):
    mdp.check_multiple("width", 16.0, 16)
  assert issubclass(mdp.SizeError, ValueError)


def test_batch_placement_over_data_and_fsdp():
  devices = np.asarray(jax.devices()[:8]).reshape(2, 2, 2, 1)
  mesh = jax.sharding.Mesh(devices, ("data", "fsdp", "context", "tensor"))
  assert mdp.batch_spec(mesh, 4) == ("data", "fsdp")
  assert mdp.batch_spec(mesh, 2) == "data"
  assert mdp.batch_spec(mesh, 3) is None
  x = mdp.place_batch(mesh, {"a": np.ones((4, 3)), "b": np.ones((2,))})
  assert x["a"].sharding.spec[0] == ("data", "fsdp")
  assert x["b"].sharding.spec[0] == "data"
  assert mdp.place_batch(None, 5) == 5


def test_jit_memo_is_bounded_and_reuses():
  memo = mdp.JitMemo(capacity=2)
  made = []
  make = lambda k: lambda: made.append(k) or k  # noqa: E731
  assert memo("a", make("a")) == "a" and memo("a", make("a")) == "a"
  memo("b", make("b"))
  memo("c", make("c"))
  assert len(memo) == 2 and made == ["a", "b", "c"]
  memo("a", make("a"))  # evicted, made again
  assert made == ["a", "b", "c", "a"]


def test_seed_key():
  k = mdp.seed_key(3)
  assert mdp.seed_key(k) is k
  with pytest.raises(TypeError, match="seed must be an int"):
    mdp.seed_key("3")


def test_components(tmp_path):
  (tmp_path / "model_index.json").write_text(
    json.dumps(
      {"_class_name": "WanPipeline", "vae": ["diffusers", "X"], "transformer_2": [None, None]}
    )
  )
  (tmp_path / "vae").mkdir()
  index, cls = mdp.read_index(tmp_path, ("WanPipeline",), "Wan pipeline")
  assert (
    cls == "WanPipeline" and mdp.listed(index, "vae") and not mdp.listed(index, "transformer_2")
  )
  assert mdp.component(tmp_path, "vae", index) == tmp_path / "vae"
  with pytest.raises(
    FileNotFoundError, match=r"component 'transformer' is missing .* lists \['vae'\]"
  ):
    mdp.component(tmp_path, "transformer", index)
  with pytest.raises(ValueError, match="pipeline class 'WanPipeline' is not one md loads here"):
    mdp.read_index(tmp_path, ("FluxPipeline",), "Flux pipeline")
  with pytest.raises(FileNotFoundError, match="no model_index.json; pass a diffusers SD folder"):
    mdp.read_index(tmp_path / "vae", ("X",), "SD")
  assert md_core.pipeline is mdp
