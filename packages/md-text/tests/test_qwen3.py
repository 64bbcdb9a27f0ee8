"""Qwen3 text encoder against transformers' outputs and the FLUX.2 [klein] pipeline's prompt embeddings
(tests/fixtures/qwen3), key map, real-size manifests, errors."""

import json

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import md_core
import md_text
from md_core.testing import fixture_path, load_arrays, load_manifest, repo_root

PROMPTS = ["a photo of a cat", "An astronaut riding a horse on the moon, highly detailed"]
ALL = (0, 1, 2, 3, 4)


@pytest.fixture(scope="module")
def io():
  return load_arrays(fixture_path("qwen3") / "io.npz")


@pytest.fixture(scope="module")
def model():
  return md_text.load_qwen3_encoder(fixture_path("qwen3"))


@jax.jit
def _all_layers(graphdef, state, ids, mask):
  return nnx.merge(graphdef, state)(ids, mask, output_layers=ALL)


def _run(model, ids, mask):
  graphdef, state = nnx.split(model)
  return _all_layers(graphdef, state, jnp.asarray(ids), None if mask is None else jnp.asarray(mask))


def test_hidden_states_match_transformers(io, model):
  """GQA (4 query / 2 kv heads), head_dim 16 != 32/4, right padding at different lengths."""
  assert model.cfg.num_key_value_heads == 2 and model.cfg.head_dim == 16
  out = _run(model, io["input_ids"], io["attention_mask"])
  chex.assert_shape(out.hidden_states, (5, 3, 12, 32))
  chex.assert_trees_all_close(out.hidden_states, io["hidden_states"], atol=1e-4, rtol=0)
  chex.assert_trees_all_close(out.last_hidden_state, io["hidden_states"][-1], atol=1e-4, rtol=0)
  out = _run(model, io["input_ids"], None)
  chex.assert_trees_all_close(out.hidden_states, io["hidden_states_nomask"], atol=1e-4, rtol=0)
  # The mask matters: row 2 (3 real tokens) differs from the unmasked run past its real tokens only.
  ref, full = io["hidden_states"], io["hidden_states_nomask"]
  np.testing.assert_allclose(ref[:, 0], full[:, 0], atol=1e-6)
  np.testing.assert_allclose(ref[:, 2, :3], full[:, 2, :3], atol=1e-5)
  assert np.abs(ref[-1, 2, 3:] - full[-1, 2, 3:]).max() > 1e-3


def test_klein_prompt_embeddings_end_to_end(io, model):
  """Tokenizer + chat format + padding + hidden states (1, 2, 3) stacked, against
  Flux2KleinPipeline._get_qwen3_prompt_embeds; prompt 1 is cut at max_length=40."""
  tok = md_text.load_tokenizer(fixture_path("qwen3"))
  with pytest.warns(UserWarning, match=r"prompt 1 is 49 tokens long .* 9 token\(s\) were cut"):
    tokens = md_text.qwen3_tokenize(tok, PROMPTS, max_length=40)
  np.testing.assert_array_equal(tokens.ids, io["prompt_ids"])
  np.testing.assert_array_equal(tokens.mask, io["prompt_mask"])
  assert tokens.mask[0].sum() == 30  # prompt 0 is padded
  embeds = jax.jit(
    lambda ids, mask: md_text.encode_flux2_prompt(model, ids, mask, layers=(1, 2, 3))
  )(jnp.asarray(tokens.ids), jnp.asarray(tokens.mask))
  chex.assert_shape(embeds, (2, 40, 96))
  chex.assert_trees_all_close(embeds, io["prompt_embeds"], atol=1e-4, rtol=0)


def test_tokenizer_chat_template_matches_the_written_format(io):
  tok = md_text.load_tokenizer(fixture_path("qwen3"))
  tokens = md_text.qwen3_tokenize(tok, PROMPTS[:1], max_length=40, chat_template="tokenizer")
  np.testing.assert_array_equal(tokens.ids, io["prompt_ids"][:1])


def test_output_selection_and_early_stop(io, model):
  """Any order, negative indices, and stopping after the deepest requested layer give the same states."""
  ids, mask = jnp.asarray(io["input_ids"]), jnp.asarray(io["attention_mask"])
  out = model(ids, mask, output_layers=(3, 0, -1, 2))
  chex.assert_trees_all_close(
    out.hidden_states, io["hidden_states"][[3, 0, 4, 2]], atol=1e-4, rtol=0
  )
  early = model(ids, mask, output_layers=(2, 1), stop_early=True)
  assert early.last_hidden_state is None
  chex.assert_trees_all_close(early.hidden_states, io["hidden_states"][[2, 1]], atol=1e-4, rtol=0)
  assert model(ids, mask).hidden_states.shape == (0, 3, 12, 32)


def test_keymap_alone():
  convert = md_text.convert_qwen3_key
  assert convert("model.layers.7.self_attn.q_proj.weight") == md_core.Target(
    ("layers", "q_proj", "kernel"), "linear", layer=7
  )
  assert convert("layers.7.self_attn.k_norm.weight") == md_core.Target(
    ("layers", "k_norm", "scale"), layer=7
  )
  assert convert("model.layers.0.mlp.down_proj.weight").layout == "linear"
  assert convert("model.embed_tokens.weight") == md_core.Target(("embed_tokens", "embedding"))
  assert convert("model.norm.weight") == md_core.Target(("norm", "scale"))
  assert convert("lm_head.weight") is None
  assert convert("model.layers.x.mlp.up_proj.weight") is None
  assert convert("model.layers.0.self_attn.rotary_emb.inv_freq") is None


@pytest.mark.parametrize(
  "manifest, variant, has_head",
  [("qwen3_4b_text_encoder", "qwen3-4b", False), ("qwen3_8b_text_encoder", "qwen3-8b", True)],
)
def test_manifest_coverage(manifest, variant, has_head):
  data = load_manifest(manifest)
  shapes = {k: v["shape"] for k, v in data["tensors"].items()}
  assert ("lm_head.weight" in shapes) == has_head
  cfg = md_text.QWEN3_VARIANTS[variant]
  problems = md_core.coverage(
    shapes,
    lambda: md_text.Qwen3Encoder(cfg, rngs=nnx.Rngs(0)),
    md_text.convert_qwen3_key,
    allow_unused=md_text.QWEN3_ALLOW_UNUSED,
  )
  assert problems == []
  # The real config.json gives the same config as the table.
  config = repo_root() / "tools" / "configs" / "flux" / f"{manifest}.json"
  assert md_text.Qwen3Config.from_json(config) == cfg


def test_real_size_klein_embeddings_shape():
  """Qwen3-4B under eval_shape: Klein's (9, 18, 27) stacked → [B, 512, 7680] (the transformer's joint dim)."""
  model = nnx.eval_shape(
    lambda: md_text.Qwen3Encoder(md_text.QWEN3_VARIANTS["qwen3-4b"], rngs=nnx.Rngs(0))
  )
  graphdef, state = nnx.split(model)
  ids = jax.ShapeDtypeStruct((1, 512), jnp.int32)
  out = jax.eval_shape(
    lambda st, i: md_text.encode_flux2_prompt(nnx.merge(graphdef, st), i, i), state, ids
  )
  assert out.shape == (1, 512, 7680)


def test_config_from_fixture_and_errors():
  path = fixture_path("qwen3") / "text_encoder" / "config.json"
  cfg = md_text.Qwen3Config.from_json(path)  # transformers 5 layout: rope_parameters, layer_types
  assert cfg == md_text.QWEN3_VARIANTS["tiny"]
  base = json.loads(path.read_text())
  with pytest.raises(ValueError, match="model_type='llama'"):
    md_text.Qwen3Config.from_dict({**base, "model_type": "llama"})
  with pytest.raises(ValueError, match=r"keys \['moe_intermediate_size'\] are not supported"):
    md_text.Qwen3Config.from_dict({**base, "moe_intermediate_size": 8})
  with pytest.raises(ValueError, match="rope type 'yarn' is not supported"):
    md_text.Qwen3Config.from_dict({**base, "rope_parameters": {"rope_type": "yarn"}})
  with pytest.raises(ValueError, match="num_key_value_heads=3 must divide num_attention_heads=4"):
    md_text.Qwen3Config.from_dict({**base, "num_key_value_heads": 3})
  with pytest.raises(ValueError, match=r"lacks \['intermediate_size'\]"):
    md_text.Qwen3Config.from_dict({k: v for k, v in base.items() if k != "intermediate_size"})


def test_input_errors(model):
  ids = np.zeros((1, 5), np.int32)
  with pytest.raises(
    ValueError, match=r"token id 320 is outside this Qwen3's vocabulary \[0, 320\)"
  ):
    model(np.array([[1, 320]], np.int32))
  with pytest.raises(ValueError, match=r"token id -1 is outside"):
    model(np.array([[-1, 3]], np.int32))
  with pytest.raises(
    ValueError, match=r"output layer 5 is out of range: .* 4 layers.* 0 \(embeddings\) \.\. 4"
  ):
    model(ids, output_layers=(5,))
  with pytest.raises(ValueError, match=r"output layer -6 is out of range.*-5 \.\. -1"):
    model(ids, output_layers=(-6,))
  with pytest.raises(ValueError, match=r"input_ids must be \[B, S\]"):
    model(np.zeros((5,), np.int32))
  with pytest.raises(TypeError, match="integer token ids"):
    model(np.zeros((1, 5), np.float32))
  with pytest.raises(ValueError, match=r"attention_mask must be \[B, S\] = \(1, 5\)"):
    model(ids, np.ones((1, 6), np.int32))
  tok = md_text.load_tokenizer(fixture_path("qwen3"))
  with pytest.raises(ValueError, match="chat_template='chatml'"):
    md_text.qwen3_tokenize(tok, "a cat", chat_template="chatml")


def test_sharded_bf16_load(io):
  """Stacked weights placed on an 8-device mesh; bf16 weights stay close to the f32 reference."""
  import md_sharding as mds

  mesh = mds.make_mesh(mds.MeshConfig(ici_fsdp_parallelism=2, ici_tensor_parallelism=4))
  model = md_text.load_qwen3_encoder(fixture_path("qwen3"), mesh=mesh, dtype=jnp.bfloat16)
  assert tuple(model.layers.q_proj.kernel[...].sharding.spec) == (None, "fsdp", "tensor")
  out = _run(model, io["input_ids"], io["attention_mask"])
  assert out.hidden_states.dtype == jnp.bfloat16
  err = jnp.abs(out.hidden_states.astype(jnp.float32) - io["hidden_states"]).max()
  assert float(err) < 0.15, err


def test_qwen3_model_layout_and_lm_head_load(tmp_path, io):
  """Bare `Qwen3Model` names (no `model.` prefix) load, and a stored `lm_head.weight` (Qwen3-8B) is skipped."""
  src = fixture_path("qwen3") / "text_encoder"
  ckpt = md_core.open_checkpoint(src)
  tensors = {k.removeprefix("model."): np.asarray(ckpt[k]) for k in ckpt}
  tensors["lm_head.weight"] = np.zeros((320, 32), np.float32)
  md_core.save_safetensors(tmp_path / "model.safetensors", tensors)
  (tmp_path / "config.json").write_text((src / "config.json").read_text())
  model = md_text.load_qwen3_encoder(tmp_path, subfolder=None)
  out = _run(model, io["input_ids"], io["attention_mask"])
  chex.assert_trees_all_close(out.hidden_states, io["hidden_states"], atol=1e-4, rtol=0)
