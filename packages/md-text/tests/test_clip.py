"""CLIP text and vision encoders against transformers (tests/fixtures/clip, tools/fixtures/clip.py)."""

import json
import shutil

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import md_core
import md_sharding as mds
import md_text
from md_core.testing import fixture_path, load_arrays, load_manifest

ATOL = 1e-4


@pytest.fixture(scope="module")
def ref():
  return load_arrays(fixture_path("clip") / "outputs.npz")


def _run(model, *args, **kwargs):
  graphdef, state = nnx.split(model)
  return jax.jit(lambda s, *a: nnx.merge(graphdef, s)(*a, **kwargs))(state, *args)


def test_text_encoder_matches_transformers(ref):
  model = md_text.load_clip_text(fixture_path("clip"), progress=False)
  assert type(model) is md_text.CLIPTextModel  # architectures: CLIPTextModel
  out = _run(model, jnp.asarray(ref["ids"]))
  assert out.text_embeds is None
  chex.assert_shape(out.hidden_states, (4, 3, 16, 32))
  chex.assert_trees_all_close(out.last_hidden_state, ref["te1_last"], atol=ATOL, rtol=0)
  chex.assert_trees_all_close(out.hidden_states, ref["te1_hidden"], atol=ATOL, rtol=0)
  # eos_token_id=2: pooled at the largest id (the first end-of-text token here).
  chex.assert_trees_all_close(out.pooler_output, ref["te1_pooled"], atol=ATOL, rtol=0)


def test_text_encoder_padding_mask(ref):
  model = md_text.load_clip_text(fixture_path("clip"), progress=False)
  out = _run(model, jnp.asarray(ref["ids"]), attention_mask=jnp.asarray(ref["mask"]))
  chex.assert_trees_all_close(out.last_hidden_state, ref["te1_masked_last"], atol=ATOL, rtol=0)


def test_text_encoder_with_projection_matches_transformers(ref):
  model = md_text.load_clip_text(fixture_path("clip"), subfolder="text_encoder_2", progress=False)
  assert type(model) is md_text.CLIPTextModelWithProjection
  out = _run(model, jnp.asarray(ref["ids_bang"]))
  chex.assert_trees_all_close(out.last_hidden_state, ref["te2_last"], atol=ATOL, rtol=0)
  chex.assert_trees_all_close(out.hidden_states, ref["te2_hidden"], atol=ATOL, rtol=0)
  # A real eos_token_id: pooled at its first occurrence even though "!" (id 0) pads.
  chex.assert_trees_all_close(out.pooler_output, ref["te2_pooled"], atol=ATOL, rtol=0)
  chex.assert_trees_all_close(out.text_embeds, ref["te2_embeds"], atol=ATOL, rtol=0)
  # The penultimate layer SDXL conditions on, without the hidden-state stack.
  lean = _run(model, jnp.asarray(ref["ids_bang"]), output_hidden_states=False)
  assert lean.hidden_states is None
  chex.assert_trees_all_close(lean.text_embeds, ref["te2_embeds"], atol=ATOL, rtol=0)


def test_vision_encoder_matches_transformers(ref):
  model = md_text.load_clip_vision(fixture_path("clip"), progress=False)
  assert type(model) is md_text.CLIPVisionModelWithProjection
  out = _run(model, md_text.nchw_to_nhwc(jnp.asarray(ref["pixels"])))
  chex.assert_shape(out.hidden_states, (4, 2, 17, 32))
  chex.assert_trees_all_close(out.last_hidden_state, ref["vis_last"], atol=ATOL, rtol=0)
  chex.assert_trees_all_close(out.hidden_states, ref["vis_hidden"], atol=ATOL, rtol=0)
  chex.assert_trees_all_close(out.pooler_output, ref["vis_pooled"], atol=ATOL, rtol=0)
  chex.assert_trees_all_close(out.image_embeds, ref["vis_embeds"], atol=ATOL, rtol=0)


def test_vision_checkpoint_with_projection_loads_without_it(ref):
  # Wan I2V reads hidden_states[-2] of a CLIPVisionModel from a file that also holds the projection.
  model = md_text.load_clip_vision(fixture_path("clip"), with_projection=False, progress=False)
  assert type(model) is md_text.CLIPVisionModel
  out = _run(model, md_text.nchw_to_nhwc(jnp.asarray(ref["pixels"])))
  assert out.image_embeds is None
  chex.assert_trees_all_close(out.hidden_states[-2], ref["vis_hidden"][-2], atol=ATOL, rtol=0)


def _relayout(tmp_path, component, rename):
  """A copy of a fixture component whose tensor names are rewritten by `rename`."""
  src = fixture_path("clip") / component
  dst = tmp_path / component
  shutil.copytree(src, dst)
  ckpt = md_core.open_checkpoint(src)
  tensors = {rename(k): np.array(ckpt[k]) for k in ckpt}
  (dst / "model.safetensors").unlink()
  md_core.save_safetensors(dst / "model.safetensors", tensors)
  return dst


def test_hub_legacy_layout_loads(tmp_path, ref):
  # Hub files prefix every tensor with text_model. and may carry the old position_ids buffer.
  dst = _relayout(tmp_path, "text_encoder", lambda k: "text_model." + k)
  ckpt = md_core.open_checkpoint(dst)
  tensors = {k: np.array(ckpt[k]) for k in ckpt}
  tensors["text_model.embeddings.position_ids"] = np.arange(16, dtype=np.int64)[None]
  md_core.save_safetensors(dst / "model.safetensors", tensors)
  model = md_text.load_clip_text(dst, subfolder=None, progress=False)
  out = _run(model, jnp.asarray(ref["ids"]))
  chex.assert_trees_all_close(out.last_hidden_state, ref["te1_last"], atol=ATOL, rtol=0)


def test_unprefixed_vision_layout_loads(tmp_path, ref):
  dst = _relayout(tmp_path, "image_encoder", lambda k: k.removeprefix("vision_model."))
  model = md_text.load_clip_vision(dst, subfolder=None, progress=False)
  out = _run(model, md_text.nchw_to_nhwc(jnp.asarray(ref["pixels"])))
  chex.assert_trees_all_close(out.image_embeds, ref["vis_embeds"], atol=ATOL, rtol=0)


def test_convert_key_alone():
  t = md_text.clip_text_convert_key("text_model.encoder.layers.7.self_attn.q_proj.weight")
  assert t == md_core.Target(
    ("encoder", "layers", "self_attn", "q_proj", "kernel"), "linear", layer=7
  )
  assert md_text.clip_text_convert_key("encoder.layers.7.self_attn.q_proj.weight") == t
  t = md_text.clip_text_convert_key("encoder.layers.0.layer_norm2.weight")
  assert t == md_core.Target(("encoder", "layers", "layer_norm2", "scale"), layer=0)
  assert md_text.clip_text_convert_key("text_projection.weight").path == (
    "text_projection",
    "kernel",
  )
  assert md_text.clip_text_convert_key("text_model.final_layer_norm.bias").path == (
    "final_layer_norm",
    "bias",
  )
  assert md_text.clip_text_convert_key("text_model.embeddings.position_ids") is None
  assert md_text.clip_text_convert_key("logit_scale") is None
  t = md_text.clip_vision_convert_key("vision_model.embeddings.patch_embedding.weight")
  assert t == md_core.Target(("embeddings", "patch_embedding", "kernel"), "conv2d")
  assert md_text.clip_vision_convert_key("vision_model.pre_layrnorm.bias").path == (
    "pre_layrnorm",
    "bias",
  )
  assert md_text.clip_vision_convert_key("visual_projection.weight").layout == "linear"


MANIFESTS = [
  ("clip_l_text", md_text.CLIPTextModel, md_text.CLIPTextConfig, "clip-l"),
  ("clip_openclip_h_text", md_text.CLIPTextModel, md_text.CLIPTextConfig, "openclip-h"),
  (
    "clip_openclip_bigg_text_projection",
    md_text.CLIPTextModelWithProjection,
    md_text.CLIPTextConfig,
    "openclip-bigg",
  ),
  (
    "clip_openclip_h_vision_wan",
    md_text.CLIPVisionModelWithProjection,
    md_text.CLIPVisionConfig,
    "openclip-h",
  ),
]


@pytest.mark.parametrize("name,cls,config_cls,variant", MANIFESTS)
def test_real_checkpoint_key_manifests(name, cls, config_cls, variant):
  data = load_manifest(name)
  shapes = {k: v["shape"] for k, v in data["tensors"].items()}
  is_text = config_cls is md_text.CLIPTextConfig
  config = md_text.CLIP_TEXT_VARIANTS[variant] if is_text else md_text.CLIP_VISION_VARIANTS[variant]
  convert = md_text.clip_text_convert_key if is_text else md_text.clip_vision_convert_key
  problems = md_core.coverage(shapes, lambda: cls(config, rngs=nnx.Rngs(0)), convert)
  assert problems == []
  # Every hub name carries the legacy prefix this map must accept.
  prefix = "text_model." if is_text else "vision_model."
  assert all(k.startswith(prefix) or k.endswith("_projection.weight") for k in shapes)


def test_real_configs_parse_to_variants():
  root = md_core.testing.repo_root() / "tools" / "configs" / "sd"
  for file, want in [
    ("clip_l_text.json", md_text.CLIP_TEXT_VARIANTS["clip-l"]),
    ("openclip_h_text.json", md_text.CLIP_TEXT_VARIANTS["openclip-h"]),
    ("openclip_bigg_text_projection.json", md_text.CLIP_TEXT_VARIANTS["openclip-bigg"]),
  ]:
    config = {k: v for k, v in json.loads((root / file).read_text()).items() if k != "_comment"}
    assert md_text.CLIPTextConfig.from_dict(config) == want
  config = json.loads((root / "openclip_h_vision_wan.json").read_text())
  config.pop("_comment")
  vision = md_text.CLIPVisionConfig.from_dict(config)
  assert vision == md_text.CLIP_VISION_VARIANTS["openclip-h"] and vision.num_positions == 257


def test_config_errors():
  with pytest.raises(ValueError, match=r"config keys \['rope_theta'\] are not supported"):
    md_text.CLIPTextConfig.from_dict({"hidden_size": 32, "rope_theta": 1.0})
  with pytest.raises(ValueError, match="hidden_act='swish' is not supported"):
    md_text.CLIPTextConfig(hidden_act="swish")
  with pytest.raises(ValueError, match="num_attention_heads=5 must divide hidden_size=32"):
    md_text.CLIPTextConfig(hidden_size=32, num_attention_heads=5)
  with pytest.raises(ValueError, match="patch_size=5 must divide image_size=28"):
    md_text.CLIPVisionConfig(image_size=28, patch_size=5)
  # A whole CLIPConfig reads its text / vision parts.
  full = {"model_type": "clip", "text_config": {"hidden_size": 64, "num_attention_heads": 4}}
  assert md_text.CLIPTextConfig.from_dict(full).hidden_size == 64
  # Missing keys take transformers' defaults (eos 49407: pool at its first occurrence).
  assert md_text.CLIPTextConfig.from_dict({}).eos_token_id == 49407


def test_input_errors():
  # Shapes are checked before any weight is read, so abstract models do.
  tiny = md_text.CLIP_TEXT_VARIANTS["tiny"]
  model = nnx.eval_shape(lambda: md_text.CLIPTextModel(tiny, rngs=nnx.Rngs(0)))
  with pytest.raises(ValueError, match="input_ids have 17 tokens but max_position_embeddings=16"):
    model(jnp.zeros((1, 17), jnp.int32))
  with pytest.raises(ValueError, match="input_ids must be integer"):
    model(jnp.zeros((1, 4), jnp.float32))
  tiny = md_text.CLIP_VISION_VARIANTS["tiny"]
  vision = nnx.eval_shape(lambda: md_text.CLIPVisionModel(tiny, rngs=nnx.Rngs(0)))
  with pytest.raises(ValueError, match=r"pixel_values must be channels-last \[B, 28, 28, 3\]"):
    vision(jnp.zeros((1, 3, 28, 28)))


def test_missing_component_and_truncated_file(tmp_path):
  with pytest.raises(FileNotFoundError, match="checkpoint has no component 'text_encoder_3'"):
    md_text.load_clip_text(fixture_path("clip"), subfolder="text_encoder_3", progress=False)
  dst = tmp_path / "text_encoder"
  shutil.copytree(fixture_path("clip") / "text_encoder", dst)
  data = (dst / "model.safetensors").read_bytes()
  (dst / "model.safetensors").write_bytes(data[:-64])
  with pytest.raises(
    md_core.SafetensorsError, match=r"model.safetensors: tensor .* \(truncated file\?\)"
  ):
    md_text.load_clip_text(dst, subfolder=None, progress=False)


def _set_mesh(mesh):
  return jax.set_mesh(mesh) if hasattr(jax, "set_mesh") else jax.sharding.use_mesh(mesh)


def test_sharded_text_encoder_matches_single_device(ref):
  mesh = mds.make_mesh(
    mds.MeshConfig(ici_data_parallelism=2, ici_fsdp_parallelism=2, ici_tensor_parallelism=2)
  )
  model = md_text.load_clip_text(
    fixture_path("clip"), subfolder="text_encoder_2", mesh=mesh, progress=False
  )
  q = model.encoder.layers.self_attn.q_proj.kernel[...]  # (layers, embed, heads) = (3, 32, 32)
  assert tuple(q.sharding.spec) == (None, "fsdp", "tensor")
  ids = jnp.concatenate([jnp.asarray(ref["ids_bang"])] * 2 + [jnp.asarray(ref["ids_bang"])[:2]])
  with _set_mesh(mesh):
    out = _run(model, ids)
  assert out.text_embeds.sharding.spec[0] in (("data", "fsdp"), "data")
  chex.assert_trees_all_close(out.text_embeds[:3], ref["te2_embeds"], atol=ATOL, rtol=0)


def test_image_preprocess_matches_clip_image_processor(ref):
  # PIL's resize on the host, as the reference (tests/fixtures/clip_preprocess has more cases).
  pixels = md_text.clip_image_preprocess(jnp.asarray(ref["photo"])[None], size=56)
  chex.assert_shape(pixels, (1, 56, 56, 3))
  chex.assert_trees_all_close(md_text.nchw_to_nhwc(ref["photo_pixels"]), pixels, atol=1e-6, rtol=0)
  # Floats in [0, 1] mean the same as uint8.
  floats = md_text.clip_image_preprocess(jnp.asarray(ref["photo"])[None] / 255.0, size=56)
  chex.assert_trees_all_close(floats, pixels, atol=1e-6, rtol=0)
  with pytest.raises(ValueError, match=r"images\[0\] must be .* RGB array \[H, W, 3\]"):
    md_text.clip_image_preprocess(jnp.zeros((1, 3, 8, 8)))


def _abstract_call(cls, config, x):
  model = nnx.eval_shape(lambda: cls(config, rngs=nnx.Rngs(0)))
  graphdef, state = nnx.split(model)
  return jax.eval_shape(lambda s, x: nnx.merge(graphdef, s)(x), state, x)


def test_real_size_output_shapes():
  # Wan 2.1 I2V: 224 px in 14 px patches → 257 tokens; it reads hidden_states[-2].
  vision = md_text.CLIP_VISION_VARIANTS["openclip-h"]
  out = _abstract_call(
    md_text.CLIPVisionModelWithProjection,
    vision,
    jax.ShapeDtypeStruct((2, 224, 224, 3), jnp.float32),
  )
  assert out.hidden_states.shape == (33, 2, 257, 1280) and out.image_embeds.shape == (2, 1024)
  # SDXL's bigG: 77 tokens, penultimate hidden state and 1280-d pooled projection.
  text = md_text.CLIP_TEXT_VARIANTS["openclip-bigg"]
  out = _abstract_call(
    md_text.CLIPTextModelWithProjection, text, jax.ShapeDtypeStruct((2, 77), jnp.int32)
  )
  assert out.hidden_states.shape == (33, 2, 77, 1280) and out.text_embeds.shape == (2, 1280)
