"""Real LoRA files' key manifests (tests/fixtures/manifests/lora_*.json, tools/fixtures/lora_manifests.py)
read for md's abstract full-size models (`nnx.eval_shape`, no weights): every key maps, with the right
shape, and a file for another model says so.

The manifests hold names and shapes only; the tensors here are zero-stride stand-ins of those shapes."""

import re

import numpy as np
import pytest
from flax import nnx

import md_flux
import md_lora
import md_sd
import md_text
import md_wan
from md_core.testing import load_manifest


class _StandIns(dict):
  """A manifest's tensors as zero-stride arrays of their shapes (no memory), named after the file."""

  def __init__(self, name):
    data = load_manifest(name)
    zero = np.zeros((), np.float32)
    super().__init__({k: np.broadcast_to(zero, v["shape"]) for k, v in data["tensors"].items()})
    self.name, self.data = f"{name}.json", data


def _abstract(factory):
  return nnx.eval_shape(factory)


_LAYOUT = {"linear": (1, 0), "conv2d": (2, 3, 1, 0), "identity": None}


@pytest.fixture(scope="module")
def sdxl():
  """SDXL's UNet as `{md path: shape}`: its base manifest through md_sd's key map.

  Tracing the unscanned full-size UNet with `nnx.eval_shape` takes 30-100 s on the 2-core test machine;
  these are the same shapes (md-sd's test_real_unet_manifests_are_covered checks this map against the
  abstract model). The other models here are built abstractly.
  """
  cfg = md_sd.VARIANTS["sdxl-base"]
  base = load_manifest("unet_sdxl_base")["tensors"]
  key_map, shapes = md_sd.unet_key_map(cfg), {}
  for name, info in base.items():
    target = key_map(name)
    perm = _LAYOUT[target.layout]
    shape = info["shape"] if perm is None else [info["shape"][i] for i in perm]
    shapes[tuple(target.path)] = tuple(shape)
  return cfg, shapes


def _modules(tensors, suffixes=(".lora_down.weight", ".down.weight")):
  return {k.rsplit(".", 2)[0] for k in tensors if k.endswith(suffixes)}


@pytest.mark.parametrize(
  "name", ["lora_kohya_sdxl", "lora_hyper_sdxl_8steps", "lora_sdxl_lightning_4step"]
)
def test_sdxl_unet_loras(sdxl, name):
  cfg, unet = sdxl
  tensors = _StandIns(name)
  adapter = md_lora.load_lora(tensors, md_sd.unet_key_map(cfg), unet)
  assert adapter.format == "kohya"
  unet_modules = {m for m in _modules(tensors) if m.startswith("lora_unet_")}
  assert len(adapter.weights) == len(unet_modules) > 700  # one site per module, none left
  assert set(adapter.skipped) == {k for k in tensors if not k.startswith("lora_unet_")}
  if name == "lora_kohya_sdxl":  # SGM names: input_blocks.7.1 is down_blocks.2.attentions.0
    name_of = {str(s): m for s, m in adapter.names.items()}
    site = "down_blocks/2/attentions/0/transformer_blocks/9/attn2/to_k/kernel"
    assert name_of[site] == "down_blocks.2.attentions.0.transformer_blocks.9.attn2.to_k"


@pytest.mark.parametrize(
  "prefix, cls, variant, layers",
  [
    ("lora_te1_", md_text.CLIPTextModel, "clip-l", 12),
    ("lora_te2_", md_text.CLIPTextModelWithProjection, "openclip-bigg", 32),
  ],
)
def test_kohya_sdxl_text_encoders(prefix, cls, variant, layers):
  model = _abstract(lambda: cls(md_text.CLIP_TEXT_VARIANTS[variant], rngs=nnx.Rngs(0)))
  adapter = md_lora.load_lora(
    _StandIns("lora_kohya_sdxl"), md_text.clip_text_convert_key, model, prefix=prefix
  )
  assert len(adapter.weights) == 6 * layers
  assert {s.layer for s in adapter.weights} == set(range(layers))


def test_lightx2v_wan_14b_and_not_1_3b():
  tensors = _StandIns("lora_lightx2v_wan21_t2v_14b")
  big = _abstract(lambda: md_wan.WanTransformer(md_wan.VARIANTS["2.1-t2v-14b"], rngs=nnx.Rngs(0)))
  adapter = md_lora.load_lora(tensors, md_wan.convert_key, big)
  assert adapter.format == "comfyui" and adapter.skipped == ()
  lora = len(_modules(tensors))
  diffs = sum(k.endswith((".diff", ".diff_b")) for k in tensors)
  assert len(adapter.weights) == lora + diffs  # every module and every full delta has its site
  sites = {str(s) for s in adapter.weights}
  assert {"blocks/norm2/scale[39]", "blocks/norm2/bias[0]", "blocks/attn1/norm_q/scale[3]"} <= sites
  assert {"proj_out/kernel", "proj_out/bias", "time_proj/kernel"} <= sites

  small = _abstract(
    lambda: md_wan.WanTransformer(md_wan.VARIANTS["2.1-t2v-1.3b"], rngs=nnx.Rngs(0))
  )
  with pytest.raises(
    md_lora.LoRAFileError,
    match=r"lora_lightx2v_wan21_t2v_14b.json: this LoRA is for another model .*do not fit the shapes",
  ) as e:
    md_lora.load_lora(tensors, md_wan.convert_key, small)
  assert "'blocks/attn1/to_q/kernel[0]' is (1536, 1536)" in str(e.value)


def test_xlabs_flux_and_other_families(sdxl):
  tensors = _StandIns("lora_xlabs_flux_realism")
  flux = _abstract(lambda: md_flux.FluxTransformer(md_flux.FLUX_VARIANTS["dev"], rngs=nnx.Rngs(0)))
  adapter = md_lora.load_lora(tensors, md_flux.convert_key, flux)
  assert adapter.format == "xlabs"
  assert (
    len(adapter.weights) == 19 * 8
  )  # q, k, v (image, text), to_out, to_add_out per double block
  assert {w.scale for w in adapter.weights.values()} == {1.0}  # XLabs: no alpha
  cfg, unet = sdxl
  with pytest.raises(
    md_lora.LoRAFileError,
    match=r"for another model \(its names are those of Flux.1 \(BFL names\)\): 76 of its 76 modules "
    "match nothing in the given parameters",
  ):
    md_lora.load_lora(tensors, md_sd.unet_key_map(cfg), unet)
  with pytest.raises(
    md_lora.LoRAFileError, match=r"those of an SDXL UNet \(SGM names\)\): 722 of its 722 modules"
  ):
    md_lora.load_lora(_StandIns("lora_kohya_sdxl"), md_flux.convert_key, flux)
  with pytest.raises(md_lora.LoRAFileError, match=r"those of an SDXL UNet \(diffusers names\)\)"):
    md_lora.load_lora(_StandIns("lora_hyper_sdxl_8steps"), md_flux.convert_key, flux)


@pytest.mark.parametrize(
  "width, blocks, model",
  [
    (768, "down_blocks_0_attentions_0_transformer_blocks_0", "an SD 1.x UNet (diffusers names)"),
    (1024, "down_blocks_0_attentions_0_transformer_blocks_0", "an SD 2.x UNet (diffusers names)"),
    (2048, "down_blocks_2_attentions_0_transformer_blocks_5", "an SDXL UNet (diffusers names)"),
    (768, "input_blocks_1_1_transformer_blocks_0", "an SD 1.x UNet (SGM names)"),
    (2048, "input_blocks_7_1_transformer_blocks_3", "an SDXL UNet (SGM names)"),
  ],
)
def test_another_sd_unet_is_named(sdxl, width, blocks, model):
  """A UNet LoRA read for another model names the SD version its keys belong to: the cross-attention width
  `attn2.to_k` reads (SD 1.x 768, SD 2.x 1024, SDXL 2048), else blocks only one version has."""
  zero = np.zeros((), np.float32)
  tensors = {}
  for proj, inputs in (("attn1_to_q", 320), ("attn2_to_k", width), ("attn2_to_v", width)):
    name = f"lora_unet_{blocks}_{proj}"
    tensors[f"{name}.lora_down.weight"] = np.broadcast_to(zero, (4, inputs))
    tensors[f"{name}.lora_up.weight"] = np.broadcast_to(zero, (320, 4))
  flux = _abstract(lambda: md_flux.FluxTransformer(md_flux.FLUX_VARIANTS["dev"], rngs=nnx.Rngs(0)))
  with pytest.raises(md_lora.LoRAFileError, match=f"its names are those of {re.escape(model)}\\):"):
    md_lora.load_lora(tensors, md_flux.convert_key, flux)
  # Without the cross-attention modules the blocks still tell SDXL (several transformer blocks).
  names = {k: v for k, v in tensors.items() if "attn1" in k}
  if blocks.endswith("_0"):
    return
  with pytest.raises(md_lora.LoRAFileError, match=r"those of an SDXL UNet"):
    md_lora.load_lora(names, md_flux.convert_key, flux)
