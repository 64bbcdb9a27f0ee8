"""Gemma 3 text encoder (LTX-2's `text_encoder`) against transformers' outputs: every hidden state with left
padding, local / global layers, with eager attention (tests/fixtures/gemma3, `fully_masked_rows="mean"`) and
with SDPA as diffusers' LTX-2 pipelines run it (tests/fixtures/gemma3_sdpa, the default), key map over both
naming layouts, the real Gemma 3 12B manifest, config reading, tokenizer, errors."""

import dataclasses
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


@pytest.fixture(scope="module")
def io():
  return load_arrays(fixture_path("gemma3") / "io.npz")


@pytest.fixture(scope="module")
def model():
  # The gemma3 fixture is transformers' eager attention: padded queries average the values.
  return md_text.load_gemma3_encoder(fixture_path("gemma3"), fully_masked_rows="mean")


@jax.jit
def _all_layers(graphdef, state, ids, mask):
  return nnx.merge(graphdef, state)(ids, mask)


def _run(model, ids, mask):
  graphdef, state = nnx.split(model)
  return _all_layers(graphdef, state, jnp.asarray(ids), None if mask is None else jnp.asarray(mask))


def test_hidden_states_match_transformers(io, model):
  """Gemma3ForConditionalGeneration's language model: sliding / sliding / global / sliding layers with a
  4-token window over 12 tokens, GQA, left padding; every hidden state (padded positions included)."""
  assert model.cfg.layer_types[2] == "full_attention" and model.cfg.sliding_window == 4
  out = _run(model, io["input_ids"], io["attention_mask"])
  chex.assert_shape(out.hidden_states, (5, 3, 12, 32))
  chex.assert_trees_all_close(out.hidden_states, io["hidden_states"], atol=1e-4, rtol=0)
  chex.assert_trees_all_close(out.last_hidden_state, io["hidden_states"][-1], atol=1e-4, rtol=0)
  # No mask is an all-ones mask (same compiled function).
  out = _run(model, io["input_ids"], np.ones_like(io["attention_mask"]))
  chex.assert_trees_all_close(out.hidden_states, io["hidden_states_nomask"], atol=1e-4, rtol=0)
  # The mask matters (row 2 has 3 real tokens at the end), and so does the window: a model without one
  # (every layer global) gives other states.
  ref, full = io["hidden_states"], io["hidden_states_nomask"]
  assert np.abs(ref[-1, 2, 9:] - full[-1, 2, 9:]).max() > 1e-3
  cfg = md_text.Gemma3Config.from_json(
    fixture_path("gemma3") / "text_encoder", layer_types=("full_attention",) * 4
  )
  wide = md_core.load_weights(
    lambda: md_text.Gemma3Encoder(cfg, rngs=nnx.Rngs(0)),
    md_core.open_checkpoint(fixture_path("gemma3") / "text_encoder"),
    md_text.convert_gemma3_key,
    allow_unused=md_text.GEMMA3_ALLOW_UNUSED,
    progress=False,
  )
  out = _run(wide, io["input_ids"], np.ones_like(io["attention_mask"]))
  assert float(jnp.abs(out.hidden_states[1] - full[1]).max()) > 1e-3


def test_hidden_states_match_transformers_sdpa():
  """The default follows transformers' SDPA attention (from_pretrained's default, what LTX2Pipeline runs):
  a query that sees no key gives zeros, so padded positions stay zero here; every position within 1e-4, and
  the pipeline's packed `prompt_embeds` of the empty prompt too."""
  ref = load_arrays(fixture_path("gemma3_sdpa") / "io.npz")
  ids, mask = ref["input_ids"], ref["attention_mask"]
  assert mask[0].sum() == 1  # the empty prompt: only <bos>
  model = md_text.load_gemma3_encoder(fixture_path("gemma3"))
  assert model.cfg.fully_masked_rows == "zeros"
  out = _run(model, ids, mask)
  chex.assert_trees_all_close(out.hidden_states, ref["hidden_states"], atol=1e-4, rtol=0)
  embeds = md_text.ltx2_prompt_embeds(model, jnp.asarray(ids), jnp.asarray(mask))
  chex.assert_trees_all_close(embeds, ref["prompt_embeds"], atol=1e-4, rtol=0)
  # Eager's mean differs there (only there).
  eager = _run(
    md_text.load_gemma3_encoder(fixture_path("gemma3"), fully_masked_rows="mean"), ids, mask
  )
  pad = ~mask.astype(bool)
  assert float(jnp.abs(eager.hidden_states[:, pad]).max()) > 1e-1
  chex.assert_trees_all_close(
    eager.hidden_states[:, ~pad], ref["hidden_states"][:, ~pad], atol=1e-4, rtol=0
  )


@pytest.mark.parametrize("rows", ("zeros", "mean"))
def test_softcapped_attention_treats_masked_rows_alike(io, rows):
  """The dense soft-capped path (a cap so large that tanh is linear) gives md-attention's results, padded
  rows included, in either mode."""
  folder = fixture_path("gemma3")
  plain = md_text.load_gemma3_encoder(folder, fully_masked_rows=rows)
  capped = md_core.load_weights(
    lambda: md_text.Gemma3Encoder(
      dataclasses.replace(plain.cfg, attn_logit_softcapping=1e6), rngs=nnx.Rngs(0)
    ),
    md_core.open_checkpoint(folder / "text_encoder"),
    md_text.convert_gemma3_key,
    allow_unused=md_text.GEMMA3_ALLOW_UNUSED,
    progress=False,
  )
  want = _run(plain, io["input_ids"], io["attention_mask"]).hidden_states
  got = _run(capped, io["input_ids"], io["attention_mask"]).hidden_states
  chex.assert_trees_all_close(got, want, atol=1e-4, rtol=0)


def test_output_selection(io, model):
  ids, mask = jnp.asarray(io["input_ids"]), jnp.asarray(io["attention_mask"])
  out = model(ids, mask, output_layers=(3, 0, -1))
  chex.assert_trees_all_close(out.hidden_states, io["hidden_states"][[3, 0, 4]], atol=1e-4, rtol=0)


def test_keymap_alone():
  convert = md_text.convert_gemma3_key
  want = md_core.Target(("layers", "q_proj", "kernel"), "linear", layer=7)
  for prefix in ("language_model.model.", "model.language_model.", "model.", ""):
    assert convert(f"{prefix}layers.7.self_attn.q_proj.weight") == want
  assert convert("model.layers.3.pre_feedforward_layernorm.weight") == md_core.Target(
    ("layers", "pre_feedforward_layernorm", "scale"), layer=3
  )
  assert convert("language_model.model.embed_tokens.weight") == md_core.Target(
    ("embed_tokens", "embedding")
  )
  assert convert("model.language_model.norm.weight") == md_core.Target(("norm", "scale"))
  for unused in (
    "lm_head.weight",
    "vision_tower.vision_model.encoder.layers.0.mlp.fc1.weight",
    "multi_modal_projector.mm_input_projection_weight",
    "model.layers.x.mlp.up_proj.weight",
  ):
    assert convert(unused) is None


def test_manifest_coverage_gemma3_12b():
  """The real google/gemma-3-12b-it (LTX-2's text encoder): every language-model tensor mapped with the
  right shape; the SigLIP tower and projector are the only unused tensors."""
  data = load_manifest("gemma3_12b_text_encoder")
  shapes = {k: v["shape"] for k, v in data["tensors"].items()}
  cfg = md_text.GEMMA3_VARIANTS["gemma-3-12b"]
  problems = md_core.coverage(
    shapes,
    lambda: md_text.Gemma3Encoder(cfg, rngs=nnx.Rngs(0)),
    md_text.convert_gemma3_key,
    allow_unused=md_text.GEMMA3_ALLOW_UNUSED,
  )
  assert problems == []
  unmapped = {k.split(".")[1] for k in shapes if md_text.convert_gemma3_key(k) is None}
  assert unmapped == {"vision_tower", "multi_modal_projector"}
  # Without the allow-list the vision tensors are reported, not silently skipped.
  assert md_core.coverage(
    shapes, lambda: md_text.Gemma3Encoder(cfg, rngs=nnx.Rngs(0)), md_text.convert_gemma3_key
  )
  config = repo_root() / "tools" / "configs" / "ltx" / "gemma3_12b_text_encoder.json"
  assert md_text.Gemma3Config.from_json(config) == cfg
  assert cfg.layer_types.count("full_attention") == 8 and cfg.layer_types[5] == "full_attention"


def test_real_size_prompt_embeds_shape():
  """Gemma 3 12B under eval_shape: LTX-2's 1024-token prompt → 49 stacked states, [B, 1024, 3840 * 49]."""
  model = nnx.eval_shape(
    lambda: md_text.Gemma3Encoder(md_text.GEMMA3_VARIANTS["gemma-3-12b"], rngs=nnx.Rngs(0))
  )
  graphdef, state = nnx.split(model)
  ids = jax.ShapeDtypeStruct((1, 1024), jnp.int32)
  out = jax.eval_shape(
    lambda st, i: md_text.ltx2_prompt_embeds(nnx.merge(graphdef, st), i, i), state, ids
  )
  assert out.shape == (1, 1024, 3840 * 49)


def test_config_reading_and_errors():
  path = fixture_path("gemma3") / "text_encoder" / "config.json"
  cfg = md_text.Gemma3Config.from_json(path)  # transformers 5: rope_parameters, layer_types
  assert cfg == md_text.GEMMA3_VARIANTS["tiny"]
  text = json.loads(path.read_text())["text_config"]
  # The hub's older keys give the same config.
  hub = {k: v for k, v in text.items() if k not in ("rope_parameters", "layer_types")}
  hub.update(rope_theta=1000.0, rope_local_base_freq=100.0)
  hub["rope_scaling"] = {"rope_type": "linear", "factor": 4.0}
  assert md_text.Gemma3Config.from_dict(hub) == cfg
  with pytest.raises(ValueError, match="model_type='llama'"):
    md_text.Gemma3Config.from_dict({**text, "model_type": "llama"})
  with pytest.raises(ValueError, match=r"keys \['num_experts'\] are not supported"):
    md_text.Gemma3Config.from_dict({**text, "num_experts": 8})
  with pytest.raises(ValueError, match="rope type 'yarn' is not supported"):
    md_text.Gemma3Config.from_dict({**hub, "rope_scaling": {"rope_type": "yarn", "factor": 2.0}})
  with pytest.raises(ValueError, match="num_key_value_heads=3 must divide num_attention_heads=4"):
    md_text.Gemma3Config.from_dict({**text, "num_key_value_heads": 3})
  with pytest.raises(ValueError, match=r"layer_types \['chunked_attention'\] are not supported"):
    md_text.Gemma3Config.from_dict({**text, "layer_types": ["chunked_attention"] * 4})
  with pytest.raises(ValueError, match="layer_types has 2 entries for num_hidden_layers=4"):
    md_text.Gemma3Config.from_dict({**text, "layer_types": ["full_attention"] * 2})
  with pytest.raises(ValueError, match="hidden_activation='silu'"):
    md_text.Gemma3Config.from_dict({**text, "hidden_activation": "silu"})
  with pytest.raises(
    ValueError, match=r"fully_masked_rows='nan' is not one of \('zeros', 'mean'\)"
  ):
    md_text.Gemma3Config.from_dict(text, fully_masked_rows="nan")


def test_tokenizer_left_padding_and_truncation_warning(model, io):
  tok = md_text.load_tokenizer(fixture_path("gemma3"))
  prompts = ["  a photo of a cat ", "An astronaut riding a horse on the moon, highly detailed"]
  with pytest.warns(UserWarning, match=r"prompt 1 is \d+ tokens long; \d+ token\(s\) were cut"):
    tokens = md_text.gemma3_tokenize(tok, prompts, max_length=12)
  assert tokens.ids.shape == (2, 12) and tokens.mask[1].all()
  n = int(tokens.mask[0].sum())
  assert 1 < n < 12 and tokens.mask[0, -n:].all() and not tokens.mask[0, :-n].any()  # left padding
  assert tokens.ids[0, -n] == tok.bos_token_id and (tokens.ids[0, :-n] == tok.pad_token_id).all()
  right = md_text.gemma3_tokenize(tok, prompts[:1], max_length=12, padding_side="right")
  np.testing.assert_array_equal(right.ids[0, :n], tokens.ids[0, -n:])
  with pytest.raises(ValueError, match="padding_side='middle'"):
    md_text.gemma3_tokenize(tok, "a cat", padding_side="middle")


def test_input_errors(model):
  ids = np.zeros((1, 5), np.int32)
  with pytest.raises(
    ValueError, match=r"token id 128 is outside this Gemma 3's vocabulary \[0, 128\)"
  ):
    model(np.array([[1, 128]], np.int32))
  with pytest.raises(ValueError, match=r"output layer 5 is out of range: .* 4 layers"):
    model(ids, output_layers=(5,))
  with pytest.raises(ValueError, match=r"input_ids must be \[B, S\]"):
    model(np.zeros((5,), np.int32))
  with pytest.raises(TypeError, match="integer token ids"):
    model(np.zeros((1, 5), np.float32))
  with pytest.raises(ValueError, match=r"attention_mask must be \[B, S\] = \(1, 5\)"):
    model(ids, np.ones((1, 6), np.int32))


def test_missing_tensor_and_layouts(tmp_path, io):
  """A checkpoint without a tensor names it; the Gemma3ForCausalLM layout (`model.` prefix) loads to the same
  weights; the vision tower of the fixture is skipped only because it is allow-listed."""
  src = fixture_path("gemma3") / "text_encoder"
  ckpt = md_core.open_checkpoint(src)
  lm = {
    k.replace("language_model.model.", "model."): np.asarray(ckpt[k])
    for k in ckpt.keys()
    if k.startswith("language_model.")
  }
  folder = tmp_path / "causal_lm"
  folder.mkdir()
  text = json.loads((src / "config.json").read_text())["text_config"]
  (folder / "config.json").write_text(json.dumps(text))
  md_core.save_safetensors(folder / "model.safetensors", lm)
  causal = md_text.load_gemma3_encoder(folder, subfolder=None)
  ref = md_text.load_gemma3_encoder(fixture_path("gemma3"))
  chex.assert_trees_all_equal(nnx.state(causal), nnx.state(ref))

  broken = tmp_path / "broken"
  broken.mkdir()
  (broken / "config.json").write_text(json.dumps(text))
  lm.pop("model.layers.2.self_attn.k_norm.weight")
  md_core.save_safetensors(broken / "model.safetensors", lm)
  with pytest.raises(md_core.WeightLoadError, match=r"layers/k_norm/scale"):
    md_text.load_gemma3_encoder(broken, subfolder=None)
  with pytest.raises(md_core.WeightLoadError, match=r"vision_tower"):
    md_core.load_weights(
      lambda: md_text.Gemma3Encoder(md_text.GEMMA3_VARIANTS["tiny"], rngs=nnx.Rngs(0)),
      ckpt,
      md_text.convert_gemma3_key,
      progress=False,
    )


@pytest.mark.slow
def test_sharded_bf16_load(io):
  """Stacked weights placed on an 8-device mesh (fsdp 2 x tensor 4) give the reference states; bf16
  weights stay close to the f32 reference."""
  import md_sharding as mds

  mesh = mds.make_mesh(mds.MeshConfig(ici_fsdp_parallelism=2, ici_tensor_parallelism=4))
  model = md_text.load_gemma3_encoder(fixture_path("gemma3"), mesh=mesh, fully_masked_rows="mean")
  assert tuple(model.layers.q_proj.kernel[...].sharding.spec) == (None, "fsdp", "tensor")
  out = _run(model, io["input_ids"], io["attention_mask"])
  chex.assert_trees_all_close(out.hidden_states, io["hidden_states"], atol=1e-4, rtol=0)
  model = md_text.load_gemma3_encoder(
    fixture_path("gemma3"), mesh=mesh, dtype=jnp.bfloat16, fully_masked_rows="mean"
  )
  out = _run(model, io["input_ids"], io["attention_mask"])
  assert out.hidden_states.dtype == jnp.bfloat16
  err = jnp.abs(out.hidden_states.astype(jnp.float32) - io["hidden_states"]).max()
  assert float(err) < 0.25, err
