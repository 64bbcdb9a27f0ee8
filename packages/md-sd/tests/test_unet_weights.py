"""md-sd configs, key maps against the real checkpoints' key manifests, and clear errors."""

import json

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import md_core
import md_sd
from md_core.testing import fixture_path, load_manifest, repo_root

CONFIGS = repo_root() / "tools" / "configs" / "sd"


def _manifest(name):
  data = load_manifest(name)
  return {k: v["shape"] for k, v in data["tensors"].items()}


@pytest.mark.parametrize(
  "manifest, config, variant",
  [
    ("unet_sd15", "unet_sd15.json", "sd1.5"),
    ("unet_sd21", "unet_sd21.json", "sd2.1"),
    ("unet_sdxl_base", "unet_sdxl_base.json", "sdxl-base"),
  ],
)
def test_real_unet_manifests_are_covered(manifest, config, variant):
  cfg = md_sd.UNetConfig.from_json(CONFIGS / config)
  assert cfg == md_sd.VARIANTS[variant]
  shapes = _manifest(manifest)
  problems = md_core.coverage(
    shapes, lambda: md_sd.UNet2DConditionModel(cfg), md_sd.unet_key_map(cfg)
  )
  assert problems == []


@pytest.mark.parametrize(
  "manifest, config, variant",
  [
    ("controlnet_sd15_canny", "controlnet_sd15_canny.json", "sd1.5"),
    ("controlnet_sdxl_canny", "controlnet_sdxl_canny.json", "sdxl"),
  ],
)
def test_real_controlnet_manifests_are_covered(manifest, config, variant):
  cfg = md_sd.ControlNetConfig.from_json(CONFIGS / config)
  assert cfg == md_sd.CONTROLNET_VARIANTS[variant]
  problems = md_core.coverage(
    _manifest(manifest),
    lambda: md_sd.ControlNetModel(cfg),
    md_sd.unet_key_map(cfg),
  )
  assert problems == []


def test_sdxl_parameter_count():
  cfg = md_sd.VARIANTS["sdxl-base"]
  model = nnx.eval_shape(lambda: md_sd.UNet2DConditionModel(cfg))
  count = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
  assert count == 2_567_463_684  # the SDXL base UNet's published 2.6B


@pytest.mark.parametrize(
  "name, linear, want",
  [
    (
      "down_blocks.1.attentions.0.transformer_blocks.0.attn1.to_q.weight",
      False,
      md_core.Target(
        ("down_blocks", 1, "attentions", 0, "transformer_blocks", 0, "attn1", "to_q", "kernel"),
        "linear",
      ),
    ),
    (
      "up_blocks.2.attentions.1.transformer_blocks.3.attn2.to_out.0.bias",
      False,
      md_core.Target(
        ("up_blocks", 2, "attentions", 1, "transformer_blocks", 3, "attn2", "to_out", "bias")
      ),
    ),
    (
      "mid_block.attentions.0.transformer_blocks.0.ff.net.0.proj.weight",
      False,
      md_core.Target(
        ("mid_block", "attentions", 0, "transformer_blocks", 0, "ff", "proj_in", "kernel"), "linear"
      ),
    ),
    (
      "mid_block.attentions.0.transformer_blocks.0.ff.net.2.weight",
      False,
      md_core.Target(
        ("mid_block", "attentions", 0, "transformer_blocks", 0, "ff", "proj_out", "kernel"),
        "linear",
      ),
    ),
    (
      "down_blocks.0.attentions.1.proj_in.weight",
      False,
      md_core.Target(("down_blocks", 0, "attentions", 1, "proj_in", "kernel"), "conv2d"),
    ),
    (
      "down_blocks.0.attentions.1.proj_in.weight",
      True,
      md_core.Target(("down_blocks", 0, "attentions", 1, "proj_in", "kernel"), "linear"),
    ),
    (
      "down_blocks.0.attentions.1.norm.weight",
      False,
      md_core.Target(("down_blocks", 0, "attentions", 1, "norm", "scale")),
    ),
    (
      "up_blocks.0.resnets.2.conv_shortcut.weight",
      False,
      md_core.Target(("up_blocks", 0, "resnets", 2, "conv_shortcut", "kernel"), "conv2d"),
    ),
    (
      "down_blocks.2.resnets.0.time_emb_proj.weight",
      False,
      md_core.Target(("down_blocks", 2, "resnets", 0, "time_emb_proj", "kernel"), "linear"),
    ),
    (
      "down_blocks.0.downsamplers.0.conv.weight",
      False,
      md_core.Target(("down_blocks", 0, "downsampler", "conv", "kernel"), "conv2d"),
    ),
    (
      "up_blocks.1.upsamplers.0.conv.bias",
      False,
      md_core.Target(("up_blocks", 1, "upsampler", "conv", "bias")),
    ),
    (
      "time_embedding.linear_1.weight",
      False,
      md_core.Target(("time", "time_embedding", "linear_1", "kernel"), "linear"),
    ),
    (
      "add_embedding.linear_2.bias",
      False,
      md_core.Target(("time", "add_embedding", "linear_2", "bias")),
    ),
    ("conv_norm_out.weight", False, md_core.Target(("conv_norm_out", "scale"))),
    ("conv_in.weight", False, md_core.Target(("conv_in", "kernel"), "conv2d")),
    (
      "controlnet_cond_embedding.blocks.3.weight",
      False,
      md_core.Target(("controlnet_cond_embedding", "blocks", 3, "kernel"), "conv2d"),
    ),
    (
      "controlnet_down_blocks.11.bias",
      False,
      md_core.Target(("controlnet_down_blocks", 11, "bias")),
    ),
    (
      "controlnet_mid_block.weight",
      False,
      md_core.Target(("controlnet_mid_block", "kernel"), "conv2d"),
    ),
  ],
)
def test_convert_key(name, linear, want):
  assert md_sd.convert_unet_key(name, linear_projection=linear) == want


@pytest.mark.parametrize(
  "name",
  [
    "down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_k.lora_A.weight",
    "class_embedding.linear_1.weight",
    "down_blocks.0.resnets.0.norm1.running_mean",
    "encoder_hid_proj.weight",
    "mid_block.resnets.0.conv1",
  ],
)
def test_convert_key_unknown_names(name):
  assert md_sd.convert_unet_key(name) is None


def test_wrong_checkpoint_is_one_clear_error():
  """An SD 2.x file read with an SD 1.x config: linear vs conv projections, widths, listed by name."""
  folder = fixture_path("unet")
  cfg = md_sd.UNetConfig.from_json(folder / "sd1" / "config.json")
  ckpt = md_core.open_checkpoint(folder / "sdxl")
  with pytest.raises(md_core.WeightLoadError, match=r"add_embedding.linear_1.weight.*maps to"):
    md_core.load_weights(
      lambda: md_sd.UNet2DConditionModel(cfg),
      ckpt,
      md_sd.unet_key_map(cfg),
      progress=False,
    )


def test_unsupported_config_keys_are_errors():
  d = json.loads((CONFIGS / "unet_sd15.json").read_text())
  with pytest.raises(ValueError, match=r"class_embed_type='timestep' is not supported"):
    md_sd.UNetConfig.from_dict({**d, "class_embed_type": "timestep"})
  with pytest.raises(ValueError, match=r"time_cond_proj_dim=256 is not supported"):
    md_sd.UNetConfig.from_dict({**d, "time_cond_proj_dim": 256})
  with pytest.raises(ValueError, match=r"down block type 'SimpleCrossAttnDownBlock2D'"):
    md_sd.UNetConfig.from_dict({**d, "down_block_types": ["SimpleCrossAttnDownBlock2D"] * 4})
  with pytest.raises(ValueError, match=r"addition_embed_type='text' is not supported"):
    md_sd.UNetConfig.from_dict({**d, "addition_embed_type": "text"})
  with pytest.raises(ValueError, match=r"unknown config key\(s\) \['my_new_flag'\]"):
    md_sd.UNetConfig.from_dict({**d, "my_new_flag": True})
  with pytest.raises(
    ValueError, match=r"attention_head_dim=\[5, 10\] must have one entry per block"
  ):
    md_sd.UNetConfig.from_dict({**d, "attention_head_dim": [5, 10]})
  c = json.loads((CONFIGS / "controlnet_sd15_canny.json").read_text())
  with pytest.raises(ValueError, match=r"global_pool_conditions=True is not supported"):
    md_sd.ControlNetConfig.from_dict({**c, "global_pool_conditions": True})
  with pytest.raises(ValueError, match=r"'rgb' or 'bgr'"):
    md_sd.ControlNetConfig.from_dict({**c, "controlnet_conditioning_channel_order": "yuv"})


@pytest.fixture(scope="module")
def tiny():
  # Abstract: every check below fails before any computation.
  return nnx.eval_shape(lambda: md_sd.UNet2DConditionModel(md_sd.VARIANTS["tiny"]))


def test_bad_inputs_are_clear_errors(tiny):
  ehs = jnp.zeros((1, 5, 32))
  with pytest.raises(
    ValueError, match=r"\(10, 8\) must be multiples of 2 .* e.g. \(10, 8\)|multiples of 2"
  ):
    tiny(jnp.zeros((1, 9, 8, 4)), 1.0, ehs)
  with pytest.raises(
    ValueError, match=r"width 768, the model's cross-attention takes cross_attention_dim=32"
  ):
    tiny(jnp.zeros((1, 8, 8, 4)), 1.0, jnp.zeros((1, 5, 768)))
  with pytest.raises(ValueError, match=r"sample has 8 channels, the model takes in_channels=4"):
    tiny(jnp.zeros((1, 4, 8, 8)), 1.0, ehs)
  with pytest.raises(ValueError, match=r"timestep must be a scalar, \[1\] or \[B=1\]"):
    tiny(jnp.zeros((1, 8, 8, 4)), jnp.zeros((3,)), ehs)
  with pytest.raises(
    ValueError, match=r"down_block_additional_residuals has 2 tensors, the UNet has 4"
  ):
    tiny(jnp.zeros((1, 8, 8, 4)), 1.0, ehs, down_block_additional_residuals=[jnp.zeros(1)] * 2)


def test_sdxl_needs_added_conds():
  cfg = md_sd.UNetConfig(
    **{
      **md_sd.VARIANTS["tiny"].__dict__,
      "addition_embed_type": "text_time",
      "addition_time_embed_dim": 4,
      "projection_class_embeddings_input_dim": 8 + 6 * 4,
    }
  )
  model = nnx.eval_shape(lambda: md_sd.UNet2DConditionModel(cfg))
  x, ehs = jnp.zeros((1, 8, 8, 4)), jnp.zeros((1, 5, 32))
  with pytest.raises(ValueError, match=r"added_cond_kwargs needs \['text_embeds', 'time_ids'\]"):
    model(x, 1.0, ehs)
  with pytest.raises(
    ValueError, match=r"give 30 features .* projection_class_embeddings_input_dim=32"
  ):
    model(
      x,
      1.0,
      ehs,
      added_cond_kwargs={"text_embeds": jnp.zeros((1, 6)), "time_ids": jnp.zeros((1, 6))},
    )


def test_controlnet_image_size_error():
  cfg = md_sd.CONTROLNET_VARIANTS["tiny"]
  net = nnx.eval_shape(lambda: md_sd.ControlNetModel(cfg))
  x, ehs = jnp.zeros((1, 8, 8, 4)), jnp.zeros((1, 5, 32))
  with pytest.raises(
    ValueError, match=r"controlnet_cond has shape \(1, 8, 8, 3\), expected \(1, 16, 16, 3\)"
  ):
    net(x, 1.0, ehs, jnp.zeros((1, 8, 8, 3)))


def test_real_size_sdxl_bf16_shapes():
  """The real SDXL UNet and ControlNet at 1024 px (128×128 latents) in bfloat16, traced abstractly."""
  cfg = md_sd.VARIANTS["sdxl-base"]
  unet = nnx.eval_shape(lambda: md_sd.UNet2DConditionModel(cfg, dtype=jnp.bfloat16))
  net = nnx.eval_shape(
    lambda: md_sd.ControlNetModel(md_sd.CONTROLNET_VARIANTS["sdxl"], dtype=jnp.bfloat16)
  )
  x = jax.ShapeDtypeStruct((2, 128, 128, 4), jnp.bfloat16)
  ehs = jax.ShapeDtypeStruct((2, 77, 2048), jnp.bfloat16)
  image = jax.ShapeDtypeStruct((2, 1024, 1024, 3), jnp.bfloat16)
  added = {
    "text_embeds": jax.ShapeDtypeStruct((2, 1280), jnp.bfloat16),
    "time_ids": jax.ShapeDtypeStruct((2, 6), jnp.float32),
  }

  def run(unet, net, x, ehs, image, added):
    down, mid = net(x, 999, ehs, image, added_cond_kwargs=added)
    out = unet(
      x,
      999,
      ehs,
      added_cond_kwargs=added,
      down_block_additional_residuals=down,
      mid_block_additional_residual=mid,
    )
    return down, mid, out

  down, mid, out = jax.eval_shape(run, unet, net, x, ehs, image, added)
  assert out.shape == (2, 128, 128, 4) and out.dtype == jnp.bfloat16
  assert len(down) == unet.num_residuals == 9
  assert [d.shape[1:] for d in down[::3]] == [(128, 128, 320), (64, 64, 320), (32, 32, 640)]
  assert mid.shape == (2, 32, 32, 1280) and mid.dtype == jnp.bfloat16
