"""Flux.2 Klein LoRA files outside diffusers' format (tests/fixtures/lora_flux2_formats,
tools/fixtures/lora_flux2_formats.py) on the tiny Klein transformer: ai-toolkit / ComfyUI files in BFL names
(`diffusion_model.double_blocks.0.img_attn.qkv.lora_A.weight`, fused q/k/v split into diffusers' parts, the
shared modulations) and their LoKr (`.lokr_w1`, on the fused q/k/v too), kohya's (`lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight`, alpha) against
diffusers' own conversions (`Flux2KleinPipeline.lora_state_dict`), and LyCORIS' wrapper LoKr file in
diffusers' names against the wrapper's forward; merged and at run time."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import md_core
import md_flux
import md_lora
from md_core import testing

ATOL = 1e-4
# file -> the format md detects
FILES = {"aitoolkit": "comfyui", "aitoolkit_lokr": "comfyui", "kohya": "kohya", "lokr": "kohya"}
INPUTS = ("hidden_states", "timestep", "img_ids", "encoder_hidden_states", "txt_ids")


@functools.partial(jax.jit, static_argnums=0)
def _apply(graphdef, state, inputs):
  return nnx.merge(graphdef, state)(**inputs)


@functools.cache
def _setup():
  model = md_flux.load_flux2(testing.fixture_path("flux2_transformer") / "klein")
  io = testing.load_arrays(testing.fixture_path("flux2_transformer") / "io.npz")
  inputs = {k: jnp.asarray(io[k]) for k in INPUTS}
  root = testing.fixture_path("lora_flux2_formats")
  adapters = {
    name: md_lora.load_lora(root / f"{name}.safetensors", md_flux.convert_key_flux2, model)
    for name in FILES
  }
  return model, inputs, adapters, testing.load_arrays(root / "outputs.npz")


def test_every_key_is_read_in_its_format():
  model, _, adapters, _ = _setup()
  for name, fmt in FILES.items():
    adapter = adapters[name]
    assert adapter.format == fmt and not adapter.skipped, (name, adapter.format, adapter.skipped)
  sites = {str(s) for s in adapters["aitoolkit"].weights}
  # img_attn.qkv split into to_q / to_k / to_v of the stacked double blocks, the shared modulations
  for part in ("attn/to_q/kernel[1]", "attn/to_v/kernel[0]", "attn/add_k_proj/kernel[1]"):
    assert f"transformer_blocks/{part}" in sites, part
  for top in ("double_stream_modulation_img", "single_stream_modulation", "time_guidance_embed"):
    assert any(s.startswith(top) for s in sites), top
  assert any("to_qkv_mlp_proj" in str(s) for s in adapters["kohya"].weights)
  assert any("ff_context/linear_in" in str(s) for s in adapters["lokr"].weights)


@pytest.mark.parametrize("name", sorted(FILES))
def test_merged_matches_the_reference(name):
  model, inputs, adapters, want = _setup()
  graphdef, state = nnx.split(model)
  chex.assert_trees_all_close(_apply(graphdef, state, inputs), want["base"], atol=ATOL, rtol=0)
  got = _apply(graphdef, md_lora.merge(state, [(adapters[name], 1.0)]), inputs)
  err = float(jnp.abs(got - want[name]).max())
  print(
    f"{name} merged: max abs {err:.1e} (moves the output by {np.abs(want[name] - want['base']).max():.2f})"
  )
  chex.assert_trees_all_close(got, want[name], atol=ATOL, rtol=0)


def test_runtime_matches_the_reference():
  """The three files swapped through one slotted program."""
  model, inputs, adapters, want = _setup()
  slotted = nnx.clone(model)
  md_core.add_lora_slots(slotted, 32)  # LoKr: exact LoRAs of rank r1·r2
  graphdef, state = nnx.split(slotted)
  compiled = None
  for name in FILES:
    got = _apply(graphdef, md_lora.apply_runtime(state, [(adapters[name], 1.0)]), inputs)
    chex.assert_trees_all_close(got, want[name], atol=ATOL, rtol=0)
    compiled = compiled or _apply._cache_size()
  assert _apply._cache_size() == compiled


def test_final_layer_modulation_swaps_shift_and_scale(tmp_path):
  """`final_layer.adaLN_modulation.1` rows are BFL's [shift; scale]: md puts the delta's first half on
  `norm_out.shift` and its second on `norm_out.scale`, as diffusers' checkpoint conversion moves the weight."""
  model, _, _, _ = _setup()
  rng = np.random.default_rng(0)
  a = rng.standard_normal((4, 32)).astype(np.float32)
  b = rng.standard_normal((64, 4)).astype(np.float32)
  path = tmp_path / "final.safetensors"
  md_core.save_safetensors(
    path,
    {
      "diffusion_model.final_layer.adaLN_modulation.1.lora_A.weight": a,
      "diffusion_model.final_layer.adaLN_modulation.1.lora_B.weight": b,
      "diffusion_model.final_layer.linear.lora_A.weight": a[:, :32],
      "diffusion_model.final_layer.linear.lora_B.weight": b[:16],
    },
  )
  adapter = md_lora.load_lora(path, md_flux.convert_key_flux2, model)
  before = {tuple(p): np.asarray(v.get_value()) for p, v in nnx.to_flat_state(nnx.state(model))}
  merged = md_lora.merge(nnx.state(model), [(adapter, 1.0)])
  after = {tuple(p): np.asarray(v.get_value()) for p, v in nnx.to_flat_state(merged)}
  delta = (b @ a).T  # md layout (in, out), BFL rows [shift; scale]
  shift = after[("norm_out", "shift", "kernel")] - before[("norm_out", "shift", "kernel")]
  scale = after[("norm_out", "scale", "kernel")] - before[("norm_out", "scale", "kernel")]
  np.testing.assert_allclose(shift, delta[:, :32], atol=1e-5, rtol=0)
  np.testing.assert_allclose(scale, delta[:, 32:], atol=1e-5, rtol=0)


def test_a_flux1_bfl_file_for_klein_is_named(tmp_path):
  """A Flux.1 BFL file (per-block `img_mod.lin`, which Flux.2 does not have) read for Klein: the keys that
  map to nothing are named."""
  model, _, _, _ = _setup()
  rng = np.random.default_rng(0)
  tensors = {}
  for i in range(2):
    for mod, out in (
      (f"double_blocks.{i}.img_mod.lin", 192),
      (f"double_blocks.{i}.txt_mod.lin", 192),
    ):
      tensors[f"diffusion_model.{mod}.lora_A.weight"] = rng.standard_normal((4, 32)).astype(
        np.float32
      )
      tensors[f"diffusion_model.{mod}.lora_B.weight"] = rng.standard_normal((out, 4)).astype(
        np.float32
      )
  md_core.save_safetensors(tmp_path / "flux1.safetensors", tensors)
  with pytest.raises(md_lora.LoRAFileError, match=r"double_blocks\.0\.img_mod\.lin"):
    md_lora.load_lora(tmp_path / "flux1.safetensors", md_flux.convert_key_flux2, model)
