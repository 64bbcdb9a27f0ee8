"""T5 / UMT5 encoders against transformers' outputs (tests/fixtures/umt5; every layer's hidden states:
tests/fixtures/t5_hidden_states), key maps, manifests, errors."""

import json

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import md_core
import md_text
from md_core.testing import fixture_path, load_arrays, load_manifest

KINDS = ("umt5", "t5", "t5_relu")


@pytest.fixture(scope="module")
def io():
  return load_arrays(fixture_path("umt5") / "io.npz")


@jax.jit
def _encode(graphdef, state, ids, mask):
  return nnx.merge(graphdef, state)(ids, mask)


def _run(model, ids, mask):
  graphdef, state = nnx.split(model)
  return _encode(graphdef, state, jnp.asarray(ids), None if mask is None else jnp.asarray(mask))


@pytest.mark.parametrize("kind", KINDS)
def test_matches_transformers(io, kind):
  model = md_text.load_t5_encoder(fixture_path("umt5") / kind)
  assert model.cfg.per_layer_bias == (kind == "umt5")
  assert model.cfg.gated == (kind != "t5_relu")
  out = _run(model, io["input_ids"], io["attention_mask"])
  chex.assert_shape(out, (3, 24, 32))
  chex.assert_trees_all_close(out, io[f"{kind}_out"], atol=1e-5, rtol=0)
  out = _run(model, io["input_ids"], None)
  chex.assert_trees_all_close(out, io[f"{kind}_out_nomask"], atol=1e-5, rtol=0)


@pytest.mark.parametrize("kind", KINDS)
def test_hidden_states_match_transformers(io, kind):
  """`output_hidden_states=True`: embeddings, each layer's output, the final normed one, as transformers."""
  ref = load_arrays(fixture_path("t5_hidden_states") / "io.npz")[f"{kind}_hidden_states"]
  model = md_text.load_t5_encoder(fixture_path("umt5") / kind)
  graphdef, state = nnx.split(model)
  fn = jax.jit(lambda s, i, m: nnx.merge(graphdef, s)(i, m, output_hidden_states=True))
  out = fn(state, jnp.asarray(io["input_ids"]), jnp.asarray(io["attention_mask"]))
  assert isinstance(out, md_text.T5EncoderOutput)
  chex.assert_shape(out.hidden_states, (model.cfg.num_layers + 1, 3, 24, 32))
  chex.assert_trees_all_close(out.hidden_states, ref, atol=1e-5, rtol=0)
  chex.assert_trees_all_close(out.last_hidden_state, io[f"{kind}_out"], atol=1e-5, rtol=0)
  np.testing.assert_array_equal(out.hidden_states[-1], out.last_hidden_state)


def test_padding_changes_only_what_it_should(io):
  """Masked keys matter: the padded rows differ from the unmasked run, the full row does not."""
  out, full = io["umt5_out"], io["umt5_out_nomask"]
  np.testing.assert_allclose(out[0], full[0], atol=1e-6)
  assert np.abs(out[1, :17] - full[1, :17]).max() > 1e-3


def test_relative_position_buckets_closed_form():
  b = md_text.relative_position_buckets(1, 200, num_buckets=32, max_distance=128)[0]
  # Keys after the query take the upper half; offsets < 8 have a bucket each, larger ones share
  # log-spaced buckets: bucket 8 + floor(8 * log(d / 8) / log(16)), capped at the last one.
  assert list(b[:8]) == [0, 16 + 1, 16 + 2, 16 + 3, 16 + 4, 16 + 5, 16 + 6, 16 + 7]
  assert b[90] == 16 + 14 and b[120] == b[128] == b[199] == 31
  back = md_text.relative_position_buckets(200, 1, num_buckets=32, max_distance=128)[:, 0]
  assert back[0] == 0 and back[5] == 5 and back[199] == 15
  assert b[11] == 16 + 8 and b[12] == 16 + 9


def test_keymap_alone():
  umt5 = md_text.make_t5_keymap(md_text.T5_VARIANTS["umt5-xxl"])
  t5 = md_text.make_t5_keymap(md_text.T5_VARIANTS["t5-v1_1-xxl"])
  name = "encoder.block.7.layer.0.SelfAttention.q.weight"
  assert umt5(name) == md_core.Target(("blocks", "q", "kernel"), "linear", layer=7)
  bias = "encoder.block.{}.layer.0.SelfAttention.relative_attention_bias.weight"
  assert umt5(bias.format(3)) == md_core.Target(
    ("blocks", "relative_attention_bias", "embedding"), layer=3
  )
  assert t5(bias.format(0)) == md_core.Target(("relative_attention_bias", "embedding"))
  assert t5(bias.format(3)) is None
  assert umt5("shared.weight") == md_core.Target(("shared", "embedding"))
  assert umt5("encoder.block.1.layer.1.DenseReluDense.wo.weight").layer == 1
  assert umt5("encoder.embed_tokens.weight") is None
  assert umt5("decoder.block.0.layer.0.SelfAttention.q.weight") is None
  assert md_text.convert_t5_key("encoder.final_layer_norm.weight") == md_core.Target(
    ("final_layer_norm", "scale")
  )


@pytest.mark.parametrize(
  "manifest, variant",
  [("umt5_xxl_encoder", "umt5-xxl"), ("umt5_t5_v1_1_xxl_encoder", "t5-v1_1-xxl")],
)
def test_manifest_coverage(manifest, variant):
  data = load_manifest(manifest)
  shapes = {k: v["shape"] for k, v in data["tensors"].items()}
  cfg = md_text.T5_VARIANTS[variant]
  problems = md_core.coverage(
    shapes,
    lambda: md_text.T5Encoder(cfg, rngs=nnx.Rngs(0)),
    md_text.make_t5_keymap(cfg),
    allow_unused=md_text.T5_ALLOW_UNUSED,
  )
  assert problems == []
  # The real config.json gives the same config as the table.
  folder = md_core.testing.repo_root() / "tools" / "configs" / "wan"
  name = {"umt5-xxl": "umt5_xxl_text_encoder", "t5-v1_1-xxl": "t5_v1_1_xxl_text_encoder"}[variant]
  assert md_text.T5Config.from_json(folder / f"{name}.json") == cfg


def test_tied_embedding_layout_is_accepted(tmp_path, io):
  """A file holding both `shared.weight` and the tied `encoder.embed_tokens.weight` loads the same."""
  src = fixture_path("umt5") / "umt5"
  ckpt = md_core.open_checkpoint(src)
  tensors = {k: np.asarray(ckpt[k]) for k in ckpt}
  tensors["encoder.embed_tokens.weight"] = tensors["shared.weight"]
  md_core.save_safetensors(tmp_path / "model.safetensors", tensors)
  (tmp_path / "config.json").write_text((src / "config.json").read_text())
  model = md_text.load_t5_encoder(tmp_path)
  out = _run(model, io["input_ids"], io["attention_mask"])
  chex.assert_trees_all_close(out, io["umt5_out"], atol=1e-5, rtol=0)


def test_half_precision_follows_transformers(io):
  """bf16 as Wan loads it: everything bf16 (transformers keeps `wo` in float32 for float16 only); the
  output is within bf16 noise of transformers' own bf16 run (measured 0.039 at output scale 4.6; the
  bf16 reference itself is 0.059 from the float32 one)."""
  model = md_text.load_t5_encoder(fixture_path("umt5") / "umt5", dtype=jnp.bfloat16)
  assert model.blocks.q.kernel[...].dtype == jnp.bfloat16
  assert model.blocks.wo.kernel[...].dtype == jnp.bfloat16
  out = _run(model, io["input_ids"], io["attention_mask"])
  assert out.dtype == jnp.bfloat16
  err = float(jnp.max(jnp.abs(out.astype(jnp.float32) - io["umt5_out_bf16"])))
  assert err < 0.06, err
  half = md_text.load_t5_encoder(fixture_path("umt5") / "umt5", dtype=jnp.float16)
  assert half.blocks.wo.kernel[...].dtype == jnp.float32
  out = _run(half, io["input_ids"], io["attention_mask"])
  assert out.dtype == jnp.float16
  # The float32 `wo` widens the residual stream: the stack of hidden states keeps float32.
  states = half(jnp.asarray(io["input_ids"]), output_hidden_states=True).hidden_states
  assert states.dtype == jnp.float32
  assert float(jnp.max(jnp.abs(out.astype(jnp.float32) - io["umt5_out"]))) < 0.02


def test_config_errors():
  base = json.loads((fixture_path("umt5") / "umt5" / "config.json").read_text())
  with pytest.raises(ValueError, match="model_type='bert'"):
    md_text.T5Config.from_dict({**base, "model_type": "bert"})
  with pytest.raises(ValueError, match=r"keys \['rope_theta'\] are not supported"):
    md_text.T5Config.from_dict({**base, "rope_theta": 1.0})
  with pytest.raises(ValueError, match="feed_forward_proj='gated-gelu-x'"):
    md_text.T5Config.from_dict({**base, "feed_forward_proj": "gated-gelu-x"})
  with pytest.raises(ValueError, match="unknown activation 'tanh'"):
    md_text.T5Config.from_dict({**base, "feed_forward_proj": "tanh"})
  with pytest.raises(ValueError, match=r"lacks \['d_ff'\]"):
    md_text.T5Config.from_dict({k: v for k, v in base.items() if k != "d_ff"})
  with pytest.raises(ValueError, match="remat='sometimes'"):
    md_text.T5Config.from_dict(base, remat="sometimes")


def test_input_errors():
  model = nnx.eval_shape(
    lambda: md_text.T5Encoder(md_text.T5_VARIANTS["tiny-umt5"], rngs=nnx.Rngs(0))
  )
  graphdef, state = nnx.split(model)

  def trace(*args):  # the checks run while tracing; nothing is computed
    args = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in args]
    return jax.eval_shape(lambda st, *a: nnx.merge(graphdef, st)(*a), state, *args)

  assert trace(np.zeros((1, 5), np.int32)).shape == (1, 5, 32)
  with pytest.raises(ValueError, match=r"input_ids must be \[B, S\]"):
    trace(np.zeros((5,), np.int32))
  with pytest.raises(TypeError, match="integer token ids"):
    trace(np.zeros((1, 5), np.float32))
  with pytest.raises(ValueError, match=r"attention_mask must be \[B, S\] = \(1, 5\)"):
    trace(np.zeros((1, 5), np.int32), np.ones((1, 6)))


def test_remat_and_sharded_load_give_the_same_output(io):
  """Remat changes nothing numerically; loading onto an 8-device mesh places the stacked weights."""
  import md_sharding as mds

  mesh = mds.make_mesh(mds.MeshConfig(ici_fsdp_parallelism=2, ici_tensor_parallelism=4))
  model = md_text.load_t5_encoder(fixture_path("umt5") / "umt5", mesh=mesh, remat="full")
  spec = model.blocks.q.kernel[...].sharding.spec
  assert tuple(spec) == (None, "fsdp", "tensor")
  out = _run(model, io["input_ids"], io["attention_mask"])
  chex.assert_trees_all_close(out, io["umt5_out"], atol=1e-5, rtol=0)
