"""One set of LoRA weights in every layout (tests/fixtures/lora_formats, tools/fixtures/lora_formats.py):
each layout's canonical adapter equals the PEFT file's, and the merged model matches the reference's output
with that file loaded by diffusers (or, for the text encoders, `W + (alpha/r)·B·A` merged in torch)."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import md_core
import md_flux
import md_lora
import md_ltx
import md_sd
import md_text
import md_wan
from md_core.testing import fixture_path, load_arrays

ATOL = 1e-4  # md vs torch, as the families' own parity tests
SAME = 1e-6  # one adapter read from two layouts
# The Flux LoRA drives the tiny transformer's output to ~10 (from ~2): md_flux's f32 forward is then 4.7e-4
# from the float64 reference (torch's f32: 1.6e-5), with md's merged weights equal to diffusers'
# `fuse_lora` weights within 1e-6 (checked by hand); the mapping errors this test exists for are O(1).
ATOL_FLUX = 1e-3


def _file(name):
  return fixture_path("lora_formats") / f"{name}.safetensors"


@pytest.fixture(scope="module")
def ref():
  return load_arrays(fixture_path("lora_formats") / "outputs.npz")


def _same_adapter(got, want, sites=None):
  """`got`'s deltas equal `want`'s on `sites` (default: all of `want`'s), and `got` adapts nothing else."""
  sites = set(want.weights) if sites is None else sites
  assert set(got.weights) == sites, sorted(map(str, set(got.weights) ^ sites))[:6]
  for site in sites:
    np.testing.assert_allclose(
      got.weights[site].delta(), want.weights[site].delta(), atol=SAME, err_msg=str(site)
    )


@jax.jit(static_argnums=0)
def _apply(graphdef, state, kw):
  return nnx.merge(graphdef, state)(**kw)


def _run(model, kw):
  graphdef, state = nnx.split(model)
  return np.asarray(_apply(graphdef, state, kw))


def test_flux_layouts(ref):
  model = md_flux.load_flux(fixture_path("flux_transformer") / "dev")
  io = load_arrays(fixture_path("flux_transformer") / "io.npz")
  names = ("hidden_states", "encoder_hidden_states", "pooled_projections", "timestep", "img_ids")
  kw = {k: jnp.asarray(io[k]) for k in names + ("txt_ids", "guidance")}
  peft = md_lora.load_lora(_file("flux_peft"), md_flux.convert_key, model)
  assert peft.format == "peft" and len(peft.weights) == 51  # 2 x 14 + 2 x 6 block sites, 11 top
  for layout, fmt in [
    ("aitoolkit", "peft"),
    ("comfyui", "comfyui"),
    ("kohya", "kohya"),
    ("xlabs", "xlabs"),
  ]:
    adapter = md_lora.load_lora(_file(f"flux_{layout}"), md_flux.convert_key, model)
    assert adapter.format == fmt
    if layout == "xlabs":  # XLabs adapts the attention's q/k/v and output projections only
      attn = (
        "to_q",
        "to_k",
        "to_v",
        "add_q_proj",
        "add_k_proj",
        "add_v_proj",
        "to_out",
        "to_add_out",
      )
      _same_adapter(adapter, peft, {s for s in peft.weights if s.path[-2] in attn})
      xlabs = adapter
    else:  # equal deltas: the merged model is the PEFT one's
      _same_adapter(adapter, peft)
  want = _run(md_lora.merge(model, [(peft, 1.0)]), kw)
  chex.assert_trees_all_close(want, ref["flux/peft_model"], atol=ATOL_FLUX, rtol=0)
  for layout in ("peft", "aitoolkit"):  # diffusers' reading of the files
    chex.assert_trees_all_close(want, ref[f"flux/{layout}"], atol=ATOL_FLUX, rtol=0)
  got = _run(md_lora.merge(model, [(xlabs, 1.0)]), kw)
  chex.assert_trees_all_close(got, ref["flux/xlabs"], atol=ATOL, rtol=0)
  assert np.abs(ref["flux/peft_model"] - ref["flux/base"]).max() > 0.1  # the LoRA matters


def test_kohya_with_diffusers_transformer_names(tmp_path):
  """kohya files of diffusers-trained Flux LoRAs (`lora_transformer_single_transformer_blocks_0_attn_to_q`):
  the PEFT file's tensors renamed, alpha 4 per module, read back to the PEFT file's adapter."""
  model = md_flux.load_flux(fixture_path("flux_transformer") / "dev")
  source = md_core.SafetensorsFile(_file("flux_peft"))
  tensors = {}
  for key in source:
    module, _, rest = key.removeprefix("transformer.").partition(".lora_")
    name = "lora_transformer_" + module.replace(".", "_")
    slot = {"A.weight": "lora_down.weight", "B.weight": "lora_up.weight"}[rest]
    tensors[f"{name}.{slot}"] = np.asarray(source[key])
    tensors[f"{name}.alpha"] = np.asarray(4.0, np.float32)
  md_core.save_safetensors(tmp_path / "kohya.safetensors", tensors)
  kohya = md_lora.load_lora(tmp_path / "kohya.safetensors", md_flux.convert_key, model)
  assert kohya.format == "kohya"
  _same_adapter(kohya, md_lora.load_lora(_file("flux_peft"), md_flux.convert_key, model))


def test_wan_layouts(ref):
  model = md_wan.load_transformer(fixture_path("wan_transformer") / "t2v")
  io = load_arrays(fixture_path("wan_transformer") / "t2v.npz")
  args = [jnp.asarray(io[k]) for k in ("hidden_states", "timestep", "encoder_hidden_states")]
  graphdef = nnx.graphdef(model)
  run = jax.jit(lambda state: nnx.merge(graphdef, state)(*args, None))
  peft = md_lora.load_lora(_file("wan_peft"), md_wan.convert_key, model)
  bias = {s for s in peft.weights if s.path[-1] == "bias"}
  assert len(bias) == len(peft.weights) // 2 and peft.format == "peft"  # lora_B.bias everywhere
  light = md_lora.load_lora(_file("wan_lightx2v"), md_wan.convert_key, model)
  assert light.format == "comfyui"
  _same_adapter(light, peft)
  musubi = md_lora.load_lora(_file("wan_musubi"), md_wan.convert_key, model)
  assert musubi.format == "kohya"
  kernels = {s for s in peft.weights if s.path[0] == "blocks" and s.path[-1] == "kernel"}
  _same_adapter(musubi, peft, kernels)

  out = {name: np.asarray(run(nnx.state(md_lora.merge(model, [(a, 1.0)])))) for name, a in [
    ("peft", peft), ("musubi", musubi)
  ]}  # fmt: skip
  chex.assert_trees_all_close(out["peft"], ref["wan/peft_model"], atol=ATOL, rtol=0)
  chex.assert_trees_all_close(out["peft"], ref["wan/lightx2v"], atol=ATOL, rtol=0)
  chex.assert_trees_all_close(out["musubi"], ref["wan/musubi"], atol=ATOL, rtol=0)


def test_wan_loha(ref):
  """LyCORIS LoHa read as an exact rank r1·r2 LoRA: merged, the peft LoHa model's output."""
  model = md_wan.load_transformer(fixture_path("wan_transformer") / "t2v")
  io = load_arrays(fixture_path("wan_transformer") / "t2v.npz")
  args = [jnp.asarray(io[k]) for k in ("hidden_states", "timestep", "encoder_hidden_states")]
  adapter = md_lora.load_lora(_file("wan_loha"), md_wan.convert_key, model)
  assert adapter.format == "kohya" and len(adapter.weights) == 2 * 10  # 2 blocks x (8 attn + 2 ffn)
  assert {w.rank for w in adapter.weights.values()} == {4}  # r1 * r2 = 2 * 2
  merged = md_lora.merge(model, [(adapter, 1.0)])
  graphdef, state = nnx.split(merged)
  out = jax.jit(lambda s: nnx.merge(graphdef, s)(*args, None))(state)
  chex.assert_trees_all_close(np.asarray(out), ref["wan/loha_model"], atol=ATOL, rtol=0)


def test_sdxl_unet_kohya_sgm_names(ref):
  folder = fixture_path("unet") / "sdxl"
  unet = md_sd.load_unet(folder, subfolder=None, progress=False)
  key_map = md_sd.unet_key_map(unet.cfg)
  peft = md_lora.load_lora(_file("sdxl_peft"), key_map, unet)
  kohya = md_lora.load_lora(_file("sdxl_kohya"), key_map, unet)
  assert kohya.format == "kohya" and len(peft.weights) > 20
  _same_adapter(kohya, peft)
  # diffusers' readings of the two files give the PEFT model's UNet output (tools/fixtures/lora_formats.py);
  # md's merge of PEFT UNet LoRAs is checked against diffusers in test_lora_pipelines / test_lora.
  chex.assert_trees_all_close(ref["sdxl/kohya"], ref["sdxl/peft_model"], atol=SAME, rtol=0)


@pytest.mark.parametrize(
  "subfolder, peft_prefix, kohya_prefix",
  [
    ("text_encoder", "text_encoder.", "lora_te1_"),
    ("text_encoder_2", "text_encoder_2.", "lora_te2_"),
  ],
)
def test_text_encoder_lora(ref, subfolder, peft_prefix, kohya_prefix):
  """SD / SDXL text-encoder LoRAs on md-text's CLIP: PEFT (`text_encoder.text_model.…`) and kohya
  (`lora_te1_text_model_…`) against the encoder with `W + (alpha/r)·B·A` merged in torch."""
  model = md_text.load_clip_text(fixture_path("clip"), subfolder=subfolder, progress=False)
  key_map = md_text.clip_text_convert_key
  peft = md_lora.load_lora(_file("sdxl_peft"), key_map, model, prefix=peft_prefix)
  kohya = md_lora.load_lora(_file("sdxl_kohya"), key_map, model, prefix=kohya_prefix)
  assert len(peft.weights) == 6 * 3  # q, k, v, out, fc1, fc2 of the 3 layers
  _same_adapter(kohya, peft)
  merged = md_lora.merge(model, [(kohya, 1.0)])
  graphdef, state = nnx.split(merged)
  out = jax.jit(lambda s, ids: nnx.merge(graphdef, s)(ids))(state, jnp.asarray(ref["te1/ids"]))
  te = "te1" if subfolder == "text_encoder" else "te2"
  chex.assert_trees_all_close(out.last_hidden_state, ref[f"{te}/last"], atol=ATOL, rtol=0)
  if te == "te2":
    chex.assert_trees_all_close(out.text_embeds, ref["te2/embeds"], atol=ATOL, rtol=0)


def test_ltx2_comfyui_original_names():
  cfg = md_ltx.LTX2Config.from_json(
    fixture_path("ltx2_transformer") / "transformer" / "config.json"
  )
  model = nnx.eval_shape(lambda: md_ltx.LTX2Transformer(cfg, rngs=nnx.Rngs(0)))
  peft = md_lora.load_lora(_file("ltx2_peft"), md_ltx.ltx2_convert_key, model)
  comfy = md_lora.load_lora(_file("ltx2_comfyui"), md_ltx.ltx2_convert_key, model)
  assert comfy.format == "comfyui" and len(peft.weights) > 20
  assert any(name.startswith("proj_in") for name in comfy.names.values())  # was `patchify_proj`
  _same_adapter(comfy, peft)
