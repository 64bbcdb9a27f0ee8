"""LTX-2's feature extractor and text connectors against diffusers' `LTX2TextConnectors`
(tests/fixtures/ltx2_text): LTX-2.0 and LTX-2.3 layouts, left and right padding, the whole prompt path
(tokenizer → Gemma 3 → packing → connectors) against the pipeline's own, key map, real-size manifests,
errors."""

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

PROMPTS = [
  "  a photo of a cat ",
  "An astronaut riding a horse on the moon, highly detailed, dramatic light",
]


@pytest.fixture(scope="module")
def io():
  return load_arrays(fixture_path("ltx2_text") / "io.npz")


@pytest.fixture(scope="module")
def connectors():
  return {
    name: md_text.load_ltx2_connectors(fixture_path("ltx2_text"), subfolder=name)
    for name in ("connectors", "connectors_23")
  }


def _run_both(model, embeds, mask_left, mask_right):
  """The connectors on left- and right-padded masks, one compiled function. LTX-2.3 does not read the
  padding side, so both masks go through it as one batch."""
  graphdef, state = nnx.split(model)

  @jax.jit
  def run(st, e, ml, mr):
    m = nnx.merge(graphdef, st)
    if m.cfg.per_modality_projections:
      out = m(jnp.concatenate([e, e]), jnp.concatenate([ml, mr]))
      b = e.shape[0]
      return {
        side: jax.tree.map(lambda x, i=i: x[i * b : (i + 1) * b], out)
        for i, side in enumerate(("left", "right"))
      }
    return {"left": m(e, ml, padding_side="left"), "right": m(e, mr, padding_side="right")}

  return run(state, jnp.asarray(embeds), jnp.asarray(mask_left), jnp.asarray(mask_right))


@pytest.mark.parametrize("name", ["connectors", "connectors_23"])
def test_connectors_match_diffusers(io, connectors, name):
  """LTX-2.0 (masked mean/range norm, shared projection, registers, split rope) and LTX-2.3 (token RMS
  norm, per-modality projections with bias, gated attention, interleaved rope, a register-free audio
  connector that masks padding), each with left and right padding."""
  both = _run_both(connectors[name], io["hidden"], io["mask_left"], io["mask_right"])
  for side, out in both.items():
    chex.assert_trees_all_close(out.video, io[f"{name}_{side}_video"], atol=1e-4, rtol=0)
    chex.assert_trees_all_close(out.audio, io[f"{name}_{side}_audio"], atol=1e-4, rtol=0)
    np.testing.assert_array_equal(out.mask, io[f"{name}_{side}_mask"])
  # The padding matters: the same states with the other padding side give other outputs.
  other = io[f"{name}_right_video"]
  assert np.abs(np.asarray(out.video) - io[f"{name}_left_video"]).max() > 1e-3
  assert np.abs(other - io[f"{name}_left_video"]).max() > 1e-3


def test_prompt_path_end_to_end(io, connectors):
  """Tokenize (left padding, <bos>, cut at 16 with a warning) → Gemma 3 (all 5 hidden states) → packing →
  LTX-2.0 connectors, against LTX2Pipeline.encode_prompt with guidance (negative prompt "") and the
  connectors on [negative, positive] as the pipeline calls them."""
  tok = md_text.load_tokenizer(fixture_path("gemma3"))
  with pytest.warns(UserWarning, match=r"prompt 3 is 35 tokens long; 19 token\(s\) were cut"):
    tokens = md_text.gemma3_tokenize(tok, ["", ""] + PROMPTS, max_length=16)
  np.testing.assert_array_equal(tokens.ids, io["prompt_ids"])
  np.testing.assert_array_equal(tokens.mask, io["prompt_mask"])
  assert tokens.mask[0].sum() == 1 and tokens.ids[0, -1] == tok.bos_token_id  # "": <bos> only
  assert tokens.mask[2, 0] == 0 and tokens.mask[2, -1] == 1  # left padding
  graphdef_c, state_c = nnx.split(connectors["connectors"])

  def run(encoder):
    graphdef_e, state_e = nnx.split(encoder)

    @jax.jit
    def fn(se, sc, ids, mask):
      enc, conn = nnx.merge(graphdef_e, se), nnx.merge(graphdef_c, sc)
      embeds = md_text.ltx2_prompt_embeds(enc, ids, mask)
      return embeds, md_text.encode_ltx2_prompt(enc, conn, ids, mask)

    return fn(state_e, state_c, jnp.asarray(tokens.ids), jnp.asarray(tokens.mask))

  # This fixture's Gemma ran transformers' eager attention (padded queries average the values).
  embeds, out = run(md_text.load_gemma3_encoder(fixture_path("gemma3"), fully_masked_rows="mean"))
  chex.assert_shape(embeds, (4, 16, 32 * 5))
  chex.assert_trees_all_close(embeds, io["prompt_embeds"], atol=1e-4, rtol=0)
  chex.assert_trees_all_close(out.video, io["e2e_video"], atol=1e-4, rtol=0)
  chex.assert_trees_all_close(out.audio, io["e2e_audio"], atol=1e-4, rtol=0)
  np.testing.assert_array_equal(out.mask, io["e2e_mask"])
  # The default (SDPA: zeros there) changes only the padded raw states, which the connectors never see.
  embeds, out = run(md_text.load_gemma3_encoder(fixture_path("gemma3")))
  valid = io["prompt_mask"].astype(bool)
  chex.assert_trees_all_close(embeds[valid], io["prompt_embeds"][valid], atol=1e-4, rtol=0)
  assert float(jnp.abs(embeds[~valid]).max()) == 0.0
  chex.assert_trees_all_close(out.video, io["e2e_video"], atol=1e-4, rtol=0)
  chex.assert_trees_all_close(out.audio, io["e2e_audio"], atol=1e-4, rtol=0)


def test_feature_extractor_pieces(io):
  """Packing is layer-fastest; the masked mean/range norm zeroes padding and spans `scale_factor`."""
  hidden = jnp.asarray(
    np.random.default_rng(0).normal(size=(3, 2, 4, 8)), jnp.float32
  )  # [L, B, S, C]
  packed = md_text.ltx2_pack_hidden_states(hidden)
  chex.assert_shape(packed, (2, 4, 24))
  np.testing.assert_array_equal(packed[1, 2, 5 * 3 + 2], hidden[2, 1, 2, 5])
  x = packed.reshape(2, 4, 8, 3)
  out = md_text.ltx2_masked_mean_range_norm(x, jnp.asarray([4, 2]), padding_side="left")
  out = np.asarray(out).reshape(2, 4, 8, 3)
  assert (out[1, :2] == 0).all() and (out[1, 2:] != 0).all()
  span = out[1, 2:].max(axis=(0, 1)) - out[1, 2:].min(axis=(0, 1))
  np.testing.assert_allclose(span, 8.0, rtol=1e-5)
  with pytest.raises(ValueError, match="padding_side must be 'left' or 'right'"):
    md_text.ltx2_masked_mean_range_norm(x, jnp.asarray([4, 2]), padding_side="top")


def test_keymap_alone():
  convert = md_text.convert_ltx2_connectors_key
  assert convert("text_proj_in.weight") == md_core.Target(("text_proj_in", "kernel"), "linear")
  assert convert("audio_text_proj_in.bias") == md_core.Target(("audio_text_proj_in", "bias"))
  assert convert("video_connector.learnable_registers") == md_core.Target(
    ("video_connector", "learnable_registers")
  )
  assert convert("audio_connector.transformer_blocks.1.attn1.to_out.0.weight") == md_core.Target(
    ("audio_connector", "blocks", "attn", "to_out", "kernel"), "linear", layer=1
  )
  assert convert("video_connector.transformer_blocks.0.attn1.norm_k.weight") == md_core.Target(
    ("video_connector", "blocks", "attn", "norm_k", "scale"), layer=0
  )
  assert convert("video_connector.transformer_blocks.0.ff.net.0.proj.bias") == md_core.Target(
    ("video_connector", "blocks", "ff", "proj_in", "bias"), layer=0
  )
  assert (
    convert("video_connector.transformer_blocks.0.attn1.to_gate_logits.weight").layout == "linear"
  )
  for unknown in (
    "video_connector.transformer_blocks.x.attn1.to_q.weight",
    "video_connector.transformer_blocks.0.attn1.norm_q.bias",
    "video_connector.rope.freqs",
    "text_embedding_projection.aggregate_embed.weight",
  ):
    assert convert(unknown) is None


@pytest.mark.parametrize(
  "manifest, variant", [("ltx2_connectors", "ltx-2"), ("ltx2_connectors_23", "ltx-2.3")]
)
def test_manifest_coverage(manifest, variant):
  data = load_manifest(manifest)
  shapes = {k: v["shape"] for k, v in data["tensors"].items()}
  cfg = md_text.LTX2_CONNECTORS_VARIANTS[variant]
  problems = md_core.coverage(
    shapes,
    lambda: md_text.LTX2TextConnectors(cfg, rngs=nnx.Rngs(0)),
    md_text.convert_ltx2_connectors_key,
  )
  assert problems == []
  config = repo_root() / "tools" / "configs" / "ltx" / f"{manifest}.json"
  assert md_text.LTX2ConnectorsConfig.from_json(config) == cfg


def test_real_size_shapes():
  """LTX-2.0 and 2.3 connectors under eval_shape on a 1024-token prompt of Gemma 3 12B's 49 states."""
  embeds = jax.ShapeDtypeStruct((1, 1024, 3840 * 49), jnp.bfloat16)
  mask = jax.ShapeDtypeStruct((1, 1024), jnp.int32)
  for variant, widths in (("ltx-2", (3840, 3840)), ("ltx-2.3", (4096, 2048))):
    model = nnx.eval_shape(
      lambda v=variant: md_text.LTX2TextConnectors(
        md_text.LTX2_CONNECTORS_VARIANTS[v], rngs=nnx.Rngs(0)
      )
    )
    graphdef, state = nnx.split(model)
    out = jax.eval_shape(lambda st, e, m, g=graphdef: nnx.merge(g, st)(e, m), state, embeds, mask)
    assert (out.video.shape, out.audio.shape) == ((1, 1024, widths[0]), (1, 1024, widths[1]))


def test_errors(tmp_path, connectors):
  model = connectors["connectors"]
  good = jnp.zeros((1, 16, 160))
  mask = jnp.ones((1, 16), jnp.int32)
  with pytest.raises(ValueError, match=r"text_embeds has 100 features; .* 32 x 5 = 160"):
    model(jnp.zeros((1, 16, 100)), mask)
  with pytest.raises(ValueError, match=r"attention_mask must be \[B, S\] = \(1, 16\)"):
    model(good, jnp.ones((1, 8), jnp.int32))
  with pytest.raises(ValueError, match="padding_side must be 'left' or 'right'"):
    model(good, mask, padding_side="both")
  with pytest.raises(ValueError, match="sequence length 10 must be a multiple of its 4 learnable"):
    model(jnp.zeros((1, 10, 160)), jnp.ones((1, 10), jnp.int32))

  config = json.loads((fixture_path("ltx2_text") / "connectors" / "config.json").read_text())
  with pytest.raises(ValueError, match=r"keys \['num_experts'\] are not supported"):
    md_text.LTX2ConnectorsConfig.from_dict({**config, "num_experts": 2})
  with pytest.raises(ValueError, match="rope_type='yarn'"):
    md_text.LTX2ConnectorsConfig.from_dict({**config, "rope_type": "yarn"})
  with pytest.raises(ValueError, match=r"video connector is 4 heads x 8 = 32 wide .* gives 64"):
    md_text.LTX2ConnectorsConfig.from_dict({**config, "caption_channels": 64})

  # A checkpoint missing a tensor: the loader names it.
  from safetensors.numpy import load_file, save_file

  src = fixture_path("ltx2_text") / "connectors"
  tensors = load_file(str(src / "diffusion_pytorch_model.safetensors"))
  tensors.pop("audio_connector.transformer_blocks.0.attn1.to_v.bias")
  (tmp_path / "config.json").write_text(json.dumps(config))
  save_file(tensors, str(tmp_path / "diffusion_pytorch_model.safetensors"))
  with pytest.raises(md_core.WeightLoadError, match=r"audio_connector/blocks/attn/to_v/bias"):
    md_text.load_ltx2_connectors(tmp_path, subfolder=None)


@pytest.mark.slow
def test_sharded_connectors(io):
  """Connectors placed on an 8-device mesh (fsdp 2 x tensor 4) equal the reference; bf16 stays close."""
  import md_sharding as mds

  mesh = mds.make_mesh(mds.MeshConfig(ici_fsdp_parallelism=2, ici_tensor_parallelism=4))
  for dtype, tol in ((None, 1e-4), (jnp.bfloat16, 0.1)):
    model = md_text.load_ltx2_connectors(fixture_path("ltx2_text"), mesh=mesh, dtype=dtype)
    assert model.video_connector.blocks.attn.to_q.kernel[...].sharding.spec[-1] == "tensor"
    both = _run_both(model, io["hidden"], io["mask_left"], io["mask_right"])
    for side, out in both.items():
      err = jnp.abs(out.video.astype(jnp.float32) - io[f"connectors_{side}_video"]).max()
      assert float(err) < tol, (side, dtype, err)
      err = jnp.abs(out.audio.astype(jnp.float32) - io[f"connectors_{side}_audio"]).max()
      assert float(err) < tol, (side, dtype, err)


# diffusers name → original single-file name: the inverse of the public conversion script's renames.
def _original_name(name: str) -> str:
  for new, old in (
    ("text_proj_in.", "text_embedding_projection.aggregate_embed."),
    ("video_text_proj_in.", "text_embedding_projection.video_aggregate_embed."),
    ("audio_text_proj_in.", "text_embedding_projection.audio_aggregate_embed."),
  ):
    if name.startswith(new):
      return old + name[len(new) :]
  name = name.replace("video_connector.", "video_embeddings_connector.")
  name = name.replace("audio_connector.", "audio_embeddings_connector.")
  name = name.replace("transformer_blocks.", "transformer_1d_blocks.")
  name = name.replace(".norm_q.", ".q_norm.").replace(".norm_k.", ".k_norm.")
  return "model.diffusion_model." + name


def test_original_single_file_names(tmp_path, connectors):
  """The original single file's names (connectors under `model.diffusion_model.…_embeddings_connector`,
  the projection under `text_embedding_projection`) load to the same weights, the file's transformer / VAE /
  vocoder tensors skipped; the real LTX-2 and 2.3 manifests in original names are covered."""
  from safetensors.numpy import load_file, save_file

  convert = md_text.ltx2_connectors_original_to_diffusers
  assert (
    convert(
      "model.diffusion_model.audio_embeddings_connector.transformer_1d_blocks.1.attn1.k_norm.weight"
    )
    == "audio_connector.transformer_blocks.1.attn1.norm_k.weight"
  )
  assert (
    convert("text_embedding_projection.video_aggregate_embed.bias") == "video_text_proj_in.bias"
  )
  assert convert("model.diffusion_model.transformer_blocks.0.attn1.q_norm.weight") is None

  for name in ("connectors", "connectors_23"):
    src = fixture_path("ltx2_text") / name / "diffusion_pytorch_model.safetensors"
    tensors = {_original_name(k): v for k, v in load_file(str(src)).items()}
    tensors["model.diffusion_model.transformer_blocks.0.attn1.to_q.weight"] = np.zeros(
      (2, 2), np.float32
    )
    tensors["vae.decoder.conv_in.conv.weight"] = np.zeros((1,), np.float32)
    path = tmp_path / f"{name}.safetensors"
    save_file(tensors, str(path))
    cfg = md_text.LTX2ConnectorsConfig.from_json(src.parent)
    model = md_text.load_ltx2_connectors_original(path, config=cfg)
    chex.assert_trees_all_equal(nnx.state(model), nnx.state(connectors[name]))
  with pytest.raises(ValueError, match="config='ltx-3' is not one of"):
    md_text.load_ltx2_connectors_original(path, config="ltx-3")

  for manifest, variant in (("ltx2_connectors", "ltx-2"), ("ltx2_connectors_23", "ltx-2.3")):
    data = load_manifest(manifest)
    shapes = {_original_name(k): v["shape"] for k, v in data["tensors"].items()}
    shapes["model.diffusion_model.transformer_blocks.0.attn1.to_q.weight"] = [4096, 4096]
    cfg = md_text.LTX2_CONNECTORS_VARIANTS[variant]
    problems = md_core.coverage(
      shapes,
      lambda cfg=cfg: md_text.LTX2TextConnectors(cfg, rngs=nnx.Rngs(0)),
      md_text.convert_ltx2_connectors_original_key,
      allow_unused=md_text.LTX2_CONNECTORS_ORIGINAL_ALLOW_UNUSED,
    )
    assert problems == []


@pytest.fixture(scope="module")
def rope32():
  return load_arrays(fixture_path("ltx2_text_rope32") / "io.npz")


@pytest.mark.parametrize("rope_type,heads,head_dim", [("split", 8, 64), ("interleaved", 4, 32)])
def test_float32_rope_tables_match_torch(rope32, rope_type, heads, head_dim):
  """`rope_double_precision=False`: frequencies from torch's float32 linspace and a once-rounded pow, as
  diffusers' `LTX2RotaryPosEmbed1d` builds them."""
  cfg = md_text.LTX2ConnectorsConfig(
    rope_double_precision=False, rope_type=rope_type, connector_rope_base_seq_len=32
  )
  cos, sin = md_text.connector_rope_tables(cfg, heads, head_dim, 8)  # [S, H, D]
  want_cos, want_sin = rope32[f"{rope_type}_cos"][0], rope32[f"{rope_type}_sin"][0]
  if rope_type == "split":  # [H, S, D/2] → md's [S, H, D] (both halves share the frequencies)
    want_cos = np.concatenate([want_cos, want_cos], -1).transpose(1, 0, 2)
    want_sin = np.concatenate([want_sin, want_sin], -1).transpose(1, 0, 2)
  else:  # [S, H*D]
    want_cos, want_sin = want_cos.reshape(cos.shape), want_sin.reshape(sin.shape)
  # torch's vectorised float32 pow (SLEEF, 1-ulp accurate) is not correctly rounded on a few percent of
  # the frequencies, where md's once-rounded pow is 1 ulp (2.4e-4 at 1.5e4) away; everywhere else the
  # tables agree to float32 cos / sin rounding. NumPy's float32 linspace / pow were 1.9e-3 off.
  for got, want in ((cos, want_cos), (sin, want_sin)):
    err = np.abs(np.asarray(got, np.float64) - want)
    assert err.max() <= 2.5e-4, err.max()
    assert np.mean(err > 2e-6) <= 0.02, np.mean(err > 2e-6)


def test_float32_rope_connectors_match_diffusers(tmp_path, io, rope32):
  """The ltx2_text LTX-2.0 connectors run with `rope_double_precision=False` as diffusers runs them."""
  src = fixture_path("ltx2_text") / "connectors"
  config = json.loads((src / "config.json").read_text())
  config["rope_double_precision"] = False
  (tmp_path / "config.json").write_text(json.dumps(config))
  weights = "diffusion_pytorch_model.safetensors"
  (tmp_path / weights).symlink_to(src / weights)
  model = md_text.load_ltx2_connectors(tmp_path, subfolder=None)
  assert not model.cfg.rope_double_precision
  out = model(jnp.asarray(io["hidden"]), jnp.asarray(io["mask_right"]), padding_side="right")
  chex.assert_trees_all_close(out.video, rope32["right_video"], atol=1e-4, rtol=0)
  chex.assert_trees_all_close(out.audio, rope32["right_audio"], atol=1e-4, rtol=0)
