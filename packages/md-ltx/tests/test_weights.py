"""LTX-Video key maps alone and against the real checkpoints' key manifests (diffusers and single file)."""

import pytest
from flax import nnx

import md_core
import md_ltx
from md_core.testing import fixture_path, load_manifest, repo_root

T = md_core.Target

# manifest stem (tests/fixtures/manifests/ltx_<name>.json.gz) → (config file in tools/configs/ltx, VARIANTS key)
REAL = {
  "video_2b_0.9": ("ltx_video_2b_0.9_transformer", "0.9-2b"),
  "video_13b_0.9.7_dev": ("ltx_video_13b_0.9.7_dev_transformer", "0.9.7-13b"),
}


def test_convert_key_alone():
  ck = md_ltx.convert_key
  assert ck("transformer_blocks.3.attn1.to_q.weight") == T(
    ("blocks", "attn1", "to_q", "kernel"), "linear", layer=3
  )
  assert ck("transformer_blocks.0.attn2.to_out.0.bias") == T(
    ("blocks", "attn2", "to_out", "bias"), layer=0
  )
  assert ck("transformer_blocks.7.attn1.norm_k.weight") == T(
    ("blocks", "attn1", "norm_k", "scale"), layer=7
  )
  assert ck("transformer_blocks.2.ff.net.0.proj.weight") == T(
    ("blocks", "ff", "proj_in", "kernel"), "linear", layer=2
  )
  assert ck("transformer_blocks.2.ff.net.2.bias") == T(
    ("blocks", "ff", "proj_out", "bias"), layer=2
  )
  assert ck("transformer_blocks.5.scale_shift_table") == T(("blocks", "scale_shift_table"), layer=5)
  assert ck("scale_shift_table") == T(("scale_shift_table",))
  assert ck("proj_in.weight") == T(("proj_in", "kernel"), "linear")
  assert ck("time_embed.linear.bias") == T(("time_proj", "bias"))
  assert ck("time_embed.emb.timestep_embedder.linear_2.weight") == T(
    ("time_embedder", "linear_2", "kernel"), "linear"
  )
  assert ck("caption_projection.linear_1.weight") == T(
    ("caption_projection", "proj_in", "kernel"), "linear"
  )
  assert ck("transformer_blocks.0.attn1.to_out.1.weight") is None
  assert ck("vae.decoder.conv_in.conv.bias") is None


def test_original_names_alone():
  o = md_ltx.original_to_diffusers
  assert o("model.diffusion_model.patchify_proj.weight") == "proj_in.weight"
  assert o("model.diffusion_model.adaln_single.emb.timestep_embedder.linear_1.bias") == (
    "time_embed.emb.timestep_embedder.linear_1.bias"
  )
  assert o("model.diffusion_model.transformer_blocks.4.attn1.q_norm.weight") == (
    "transformer_blocks.4.attn1.norm_q.weight"
  )
  assert o("vae.encoder.conv_in.conv.weight") is None
  assert md_ltx.convert_original_key(
    "model.diffusion_model.transformer_blocks.4.attn2.k_norm.weight"
  ) == T(("blocks", "attn2", "norm_k", "scale"), layer=4)


def _manifest(name):
  data = load_manifest(f"ltx_{name}")
  return {k: v["shape"] for k, v in data["tensors"].items()}


@pytest.mark.parametrize("name", sorted(REAL))
def test_real_checkpoints_are_covered(name):
  config_file, variant = REAL[name]
  cfg = md_ltx.LTXConfig.from_json(repo_root() / "tools/configs/ltx" / f"{config_file}.json")
  assert cfg == md_ltx.VARIANTS[variant]
  model = nnx.eval_shape(lambda: md_ltx.LTXTransformer(cfg, rngs=nnx.Rngs(0)))
  assert md_core.coverage(_manifest(name), model, md_ltx.convert_key) == []
  original = _manifest(f"{name}_original")
  assert md_core.coverage(original, model, md_ltx.convert_original_key) == []

  class Shapes(dict):
    def shape(self, key):
      return tuple(self[key])

  assert md_ltx.original_config(Shapes(original)) == cfg


def test_load_errors_name_the_tensor(tmp_path):
  import numpy as np

  ckpt = md_core.open_checkpoint(fixture_path("ltx_transformer") / "transformer")
  tensors = {k: np.asarray(ckpt[k]) for k in ckpt}
  tensors["transformer_blocks.0.attn1.to_q.weight"] = np.zeros((32, 16), np.float32)
  del tensors["proj_out.bias"]
  folder = tmp_path / "transformer"
  folder.mkdir()
  md_core.save_safetensors(folder / "diffusion_pytorch_model.safetensors", tensors)
  (folder / "config.json").write_text(
    (fixture_path("ltx_transformer") / "transformer" / "config.json").read_text()
  )
  with pytest.raises(md_core.WeightLoadError) as e:
    md_ltx.load_transformer(folder, subfolder=None)
  msg = str(e.value)
  assert "'transformer_blocks.0.attn1.to_q.weight' has shape (32, 16)" in msg
  assert "'proj_out/bias' (8,) has no tensor" in msg
