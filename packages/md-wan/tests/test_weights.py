"""Wan transformer key map alone, real checkpoints' key manifests, configs, dtypes and load errors."""

import json

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import md_core
import md_wan
from md_core.testing import fixture_path, load_manifest, repo_root

T = md_core.Target

# manifest (tests/fixtures/manifests/wan_<name>.json.gz) → (config file in tools/configs/wan, VARIANTS key)
REAL = {
  "2.1_t2v_1.3b": ("wan2.1_t2v_1.3b_transformer", "2.1-t2v-1.3b"),
  "2.1_t2v_14b": ("wan2.1_t2v_14b_transformer", "2.1-t2v-14b"),
  "2.1_i2v_14b_480p": ("wan2.1_i2v_14b_480p_transformer", "2.1-i2v-14b"),
  "2.1_flf2v_14b_720p": ("wan2.1_flf2v_14b_720p_transformer", "2.1-flf2v-14b"),
  "2.2_t2v_a14b_transformer": ("wan2.2_t2v_a14b_transformer", "2.2-t2v-a14b"),
  "2.2_t2v_a14b_transformer_2": ("wan2.2_t2v_a14b_transformer_2", "2.2-t2v-a14b"),
  "2.2_i2v_a14b_transformer": ("wan2.2_i2v_a14b_transformer", "2.2-i2v-a14b"),
  "2.2_ti2v_5b": ("wan2.2_ti2v_5b_transformer", "2.2-ti2v-5b"),
}


def test_convert_key_alone():
  ck = md_wan.convert_key
  assert ck("blocks.3.attn1.to_q.weight") == T(
    ("blocks", "attn1", "to_q", "kernel"), "linear", layer=3
  )
  assert ck("blocks.0.attn2.to_out.0.bias") == T(("blocks", "attn2", "to_out", "bias"), layer=0)
  assert ck("blocks.12.attn1.norm_k.weight") == T(("blocks", "attn1", "norm_k", "scale"), layer=12)
  assert ck("blocks.1.attn2.add_k_proj.weight") == T(
    ("blocks", "attn2", "add_k_proj", "kernel"), "linear", layer=1
  )
  assert ck("blocks.1.attn2.norm_added_k.weight").path == (
    "blocks",
    "attn2",
    "norm_added_k",
    "scale",
  )
  assert ck("blocks.2.ffn.net.0.proj.weight") == T(
    ("blocks", "ffn", "proj_in", "kernel"), "linear", layer=2
  )
  assert ck("blocks.2.ffn.net.2.bias") == T(("blocks", "ffn", "proj_out", "bias"), layer=2)
  assert ck("blocks.5.norm2.bias") == T(("blocks", "norm2", "bias"), layer=5)
  assert ck("blocks.5.scale_shift_table") == T(("blocks", "scale_shift_table"), layer=5)
  assert ck("scale_shift_table") == T(("scale_shift_table",))
  assert ck("patch_embedding.weight") == T(("patch_embedding", "kernel"), "conv3d")
  assert ck("condition_embedder.time_proj.weight") == T(("time_proj", "kernel"), "linear")
  assert ck("condition_embedder.time_embedder.linear_2.bias") == T(
    ("time_embedder", "linear_2", "bias")
  )
  assert ck("condition_embedder.image_embedder.norm1.weight") == T(
    ("image_embedder", "norm1", "scale")
  )
  assert ck("condition_embedder.image_embedder.ff.net.0.proj.weight") == T(
    ("image_embedder", "ff", "proj_in", "kernel"), "linear"
  )
  assert ck("condition_embedder.image_embedder.pos_embed") == T(("image_embedder", "pos_embed"))
  assert ck("proj_out.weight") == T(("proj_out", "kernel"), "linear")
  for unknown in (
    "blocks.1.attn2.norm_added_q.weight",
    "rope.freqs_cos",
    "blocks.x.attn1.to_q.weight",
  ):
    assert ck(unknown) is None


@pytest.mark.parametrize("name", list(REAL))
def test_real_manifest_coverage(name):
  config_file, variant = REAL[name]
  data = load_manifest(f"wan_{name}")
  shapes = {k: v["shape"] for k, v in data["tensors"].items()}
  cfg = md_wan.WanConfig.from_json(
    repo_root() / "tools" / "configs" / "wan" / f"{config_file}.json"
  )
  assert cfg == md_wan.VARIANTS[variant]
  problems = md_core.coverage(
    shapes,
    lambda: md_wan.WanTransformer(cfg, rngs=nnx.Rngs(0)),
    md_wan.convert_key,
    allow_unused=md_wan.ALLOW_UNUSED,
  )
  assert problems == []


def test_parameter_counts_match_the_published_sizes():
  """DESIGN.md §6: Wan 1.3B holds 1.42B parameters; Wan2.1-I2V-14B holds 16.4B."""

  def count(variant):
    model = nnx.eval_shape(
      lambda: md_wan.WanTransformer(md_wan.VARIANTS[variant], rngs=nnx.Rngs(0))
    )
    return sum(np.prod(v.shape) for v in jax_leaves(nnx.state(model)))

  assert round(count("2.1-t2v-1.3b") / 1e9, 2) == 1.42
  assert round(count("2.1-i2v-14b") / 1e9, 1) == 16.4


def jax_leaves(tree):
  import jax

  return jax.tree.leaves(tree)


def test_bf16_load_keeps_reference_f32_tables():
  model = md_wan.load_transformer(fixture_path("wan_transformer") / "i2v", dtype=jnp.bfloat16)
  assert model.blocks.attn1.to_q.kernel[...].dtype == jnp.bfloat16
  assert model.patch_embedding.kernel[...].dtype == jnp.bfloat16
  for param in (
    model.scale_shift_table,
    model.blocks.scale_shift_table,
    model.time_embedder.linear_1.kernel,
    model.blocks.norm2.scale,
    model.image_embedder.norm1.scale,
    model.image_embedder.norm2.bias,
  ):
    assert param[...].dtype == jnp.float32


def test_extra_reference_tensor_is_allowed_and_unknown_is_an_error(tmp_path):
  src = fixture_path("wan_transformer") / "t2v" / "transformer"
  ckpt = md_core.open_checkpoint(src)
  tensors = {k: np.asarray(ckpt[k]) for k in ckpt}
  tensors["blocks.0.attn2.norm_added_q.weight"] = np.ones(48, np.float32)
  (tmp_path / "transformer").mkdir()
  md_core.save_safetensors(tmp_path / "transformer" / "model.safetensors", tensors)
  (tmp_path / "transformer" / "config.json").write_text((src / "config.json").read_text())
  md_wan.load_transformer(tmp_path)  # the reference ignores norm_added_q too
  tensors["blocks.0.attn1.to_qkv.weight"] = np.ones((144, 48), np.float32)
  del tensors["blocks.1.ffn.net.2.bias"]
  md_core.save_safetensors(tmp_path / "transformer" / "model.safetensors", tensors)
  with pytest.raises(md_core.WeightLoadError) as e:
    md_wan.load_transformer(tmp_path)
  assert "'blocks.0.attn1.to_qkv.weight' (144, 48) maps to no parameter" in str(e.value)
  assert "'blocks/ffn/proj_out/bias' (2, 48) is stacked over 2 layers" in str(e.value)
  assert "missing layers [1]" in str(e.value)


def test_config_errors():
  base = json.loads(
    (fixture_path("wan_transformer") / "t2v" / "transformer" / "config.json").read_text()
  )
  assert md_wan.WanConfig.from_dict(base) == md_wan.VARIANTS["tiny"]
  with pytest.raises(ValueError, match=r"keys \['window_size'\] are not supported"):
    md_wan.WanConfig.from_dict({**base, "window_size": [-1, -1]})
  with pytest.raises(ValueError, match="config is for 'WanVACETransformer3DModel'"):
    md_wan.WanConfig.from_dict({**base, "_class_name": "WanVACETransformer3DModel"})
  with pytest.raises(ValueError, match="qk_norm='layer_norm' is not supported"):
    md_wan.WanConfig.from_dict({**base, "qk_norm": "layer_norm"})
  with pytest.raises(ValueError, match="attention='flash' is not one of"):
    md_wan.WanConfig.from_dict(base, attention="flash")
  with pytest.raises(ValueError, match="remat='some' is not one of"):
    md_wan.WanConfig.from_dict(base, remat="some")
  with pytest.raises(ValueError, match="added_kv_proj_dim=48 needs image_dim"):
    md_wan.WanConfig.from_dict({**base, "added_kv_proj_dim": 48})
  with pytest.raises(ValueError, match="patch_size=.* must be three positive ints"):
    md_wan.WanConfig.from_dict({**base, "patch_size": [2, 2]})


@pytest.mark.slow
def test_remat_gives_the_same_output():
  ref = np.load(fixture_path("wan_transformer") / "t2v.npz")
  import chex
  import jax

  model = md_wan.load_transformer(fixture_path("wan_transformer") / "t2v", remat="dots")
  graphdef, state = nnx.split(model)

  @jax.jit
  def loss(state):
    out = nnx.merge(graphdef, state)(
      jnp.asarray(ref["hidden_states"]), jnp.asarray(ref["timestep"]),
      jnp.asarray(ref["encoder_hidden_states"]),
    )  # fmt: skip
    return jnp.sum(out * out), out

  (_, out), grads = jax.value_and_grad(loss, has_aux=True)(state)
  chex.assert_trees_all_close(out, ref["sample"], atol=1e-4, rtol=0)
  chex.assert_tree_all_finite(grads)
