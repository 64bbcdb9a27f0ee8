"""Wan transformer with `image_dim` and no `added_kv_proj_dim`: the image tokens join the text tokens in
cross-attention, as diffusers does (tests/fixtures/wan_i2v_noadded)."""

import json

import chex
import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import md_core
import md_wan
from md_core.testing import fixture_path, load_arrays, load_manifest, repo_root

FIXTURE = "wan_i2v_noadded"
CASES = ("i2v", "flf2v")
TOL = 1e-4  # measured max error ~1e-6 (f32)


@jax.jit
def _apply(graphdef, state, x, t, text, image):
  return nnx.merge(graphdef, state)(x, t, text, image)


def _run(model, ref):
  graphdef, state = nnx.split(model)
  args = (
    ref["hidden_states"], ref["timestep"], ref["encoder_hidden_states"],
    ref["encoder_hidden_states_image"],
  )  # fmt: skip
  return _apply(graphdef, state, *(jnp.asarray(a) for a in args))


@pytest.mark.parametrize("case", CASES)
def test_matches_diffusers(case):
  model = md_wan.load_transformer(fixture_path(FIXTURE) / case)
  assert model.cfg.image_dim == 20 and model.cfg.added_kv_proj_dim is None
  assert not hasattr(model.blocks.attn2, "add_k_proj")
  ref = load_arrays(fixture_path(FIXTURE) / f"{case}.npz")
  out = _run(model, ref)
  chex.assert_shape(out, ref["sample"].shape)
  chex.assert_trees_all_close(out, ref["sample"], atol=TOL, rtol=0)


def test_image_tokens_change_the_output():
  """The image tokens are really read (not dropped): other tokens give another prediction."""
  model = md_wan.load_transformer(fixture_path(FIXTURE) / "i2v")
  ref = load_arrays(fixture_path(FIXTURE) / "i2v.npz")
  other = dict(ref, encoder_hidden_states_image=ref["encoder_hidden_states_image"][::-1])
  assert float(jnp.max(jnp.abs(_run(model, other) - ref["sample"]))) > 1e-2


def test_real_size_key_map_covers_the_config():
  data = load_manifest("manifest_i2v_14b_noadded", fixture_path(FIXTURE))
  shapes = {k: v["shape"] for k, v in data["tensors"].items()}
  assert not any("add_k_proj" in k for k in shapes)
  config = json.loads(
    (repo_root() / "tools" / "configs" / "wan" / "wan2.1_i2v_14b_480p_transformer.json").read_text()
  )
  cfg = md_wan.WanConfig.from_dict({**config, "added_kv_proj_dim": None})
  problems = md_core.coverage(
    shapes,
    lambda: md_wan.WanTransformer(cfg, rngs=nnx.Rngs(0)),
    md_wan.convert_key,
    allow_unused=md_wan.ALLOW_UNUSED,
  )
  assert problems == []


def test_config_and_input_errors():
  base = json.loads((fixture_path(FIXTURE) / "i2v" / "transformer" / "config.json").read_text())
  with pytest.raises(ValueError, match=r"added_kv_proj_dim=48 needs image_dim"):
    md_wan.WanConfig.from_dict({**base, "image_dim": None, "added_kv_proj_dim": 48})
  model = md_wan.load_transformer(fixture_path(FIXTURE) / "i2v")
  ref = load_arrays(fixture_path(FIXTURE) / "i2v.npz")
  x, t, text = (jnp.asarray(ref[k]) for k in ("hidden_states", "timestep", "encoder_hidden_states"))
  with pytest.raises(ValueError, match="pass encoder_hidden_states_image"):
    model(x, t, text)
  with pytest.raises(ValueError, match=r"must be \[B, tokens, image_dim=20\]"):
    model(x, t, text, jnp.zeros((2, 5, 16)))
