"""The SDXL, Flux.2 Klein and LTX-Video recipes of apps/configs/train.py (`sdxl-tiny`, `klein-tiny`,
`ltx-tiny`, and their `-lora-tiny` variants): ten steps lower the held-out eval loss, the export is a
diffusers-layout folder the family's loader reads back with the trained values, a LoRA export is a PEFT
file the family's pipeline loads into its slots; bad options name themselves."""

import importlib.util

import jax
import ml_collections
import numpy as np
import pytest
from flax import nnx

import md_core
import md_flux
import md_ltx
import md_sd
import md_train as mdt
import md_wan
from md_core.testing import fixture_path, repo_root
from md_train import recipes

# variant -> (the denoiser's loader for an exported component folder, the pipeline loader)
CASES = {
  "sdxl-tiny": (lambda p: md_sd.load_unet(p, subfolder=None, progress=False), md_sd.load_pipeline),
  "klein-tiny": (md_flux.load_flux2, md_flux.load_pipeline),
  "ltx-tiny": (lambda p: md_ltx.load_transformer(p, subfolder=None), md_ltx.load_pipeline),
}


def _variant(name: str, **overrides):
  path = repo_root() / "apps" / "configs" / "train.py"
  spec = importlib.util.spec_from_file_location("_train_config", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  fn, options = module.VARIANTS[name]
  config = ml_collections.ConfigDict(dict(seed=0, recipe_options=dict(options, **overrides)))
  return recipes.import_recipe(fn), config


def _leaves(tree):
  return [np.asarray(x) for x in jax.tree.leaves(tree)]


@pytest.mark.parametrize("variant", list(CASES))
def test_ten_steps_lower_the_eval_loss_and_the_export_reads_back(variant, tmp_path):
  """Measured (seed 0): SDXL 1.010 → 0.918, Klein 1.193 → 1.088, LTX-Video 5.73 → 1.38."""
  load, _ = CASES[variant]
  fn, config = _variant(variant)
  recipe = fn(config)
  before = recipe.eval(recipe.state)["eval/loss"]
  state = mdt.fit(recipe, steps=10, progress=False)
  after = recipe.eval(state)["eval/loss"]
  assert after < 0.95 * before, (before, after)
  out = recipe.export(state, tmp_path)
  _, loaded = mdt.split_trainable(load(out))
  for a, b in zip(_leaves(state.params), _leaves(loaded), strict=True):
    np.testing.assert_array_equal(a, b)


def _flat(module):
  return {tuple(p): np.asarray(v.get_value()) for p, v in nnx.to_flat_state(nnx.state(module))}


@pytest.mark.parametrize("variant", list(CASES))
def test_lora_variant_exports_a_file_the_pipeline_loads(variant, tmp_path):
  """Two steps of `<family>-lora-tiny` train only the slots; the exported PEFT file (prefix `unet.` /
  `transformer.`) loads into the pipeline's slots with the trained values (b scaled by alpha / r = 1)."""
  _, load_pipeline = CASES[variant]
  name = variant.replace("-tiny", "-lora-tiny")
  fn, config = _variant(name)
  recipe = fn(config)
  assert sorted({p[-1] for p in _flat_paths(recipe.state.params)}) == ["lora_a", "lora_b"]
  state = mdt.fit(recipe, steps=2, progress=False)
  trained = _flat_paths(state.params)
  assert max(float(np.abs(v).max()) for p, v in trained.items() if p[-1] == "lora_b") > 0
  file = recipe.export(state, tmp_path)
  component = file.parent.name
  keys = list(md_core.SafetensorsFile(file))
  prefix = "unet." if component == "unet" else "transformer."
  assert keys and all(k.startswith(prefix) and ".lora_" in k for k in keys)
  pipe = load_pipeline(fixture_path("") / config.recipe_options.model.split("fixtures/")[1])
  pipe.load_lora(file, name="trained", max_rank=4, targets=("to_q", "to_k", "to_v", "to_out"))
  slots = _flat(getattr(pipe, component))
  for p, v in trained.items():
    np.testing.assert_allclose(slots[p], v, atol=1e-7, rtol=0, err_msg=str(p))


def _flat_paths(params):
  return {
    tuple(p): np.asarray(v[...] if isinstance(v, nnx.Variable) else v)
    for p, v in nnx.to_flat_state(params)
  }


def test_klein_recipe_refuses_a_flux1_folder():
  fn, config = _variant("klein-tiny", model=str(fixture_path("flux_pipeline") / "dev"))
  with pytest.raises(
    ValueError, match="is a FluxPipeline folder; klein_tiny trains a Flux.2 Klein"
  ):
    fn(config)


def test_ltx_recipe_names_a_bad_clip_size():
  fn, config = _variant("ltx-tiny", frames=6)
  with pytest.raises(ValueError, match="recipe_options.size=32 / frames=6: .*frames"):
    fn(config)


# variant -> the loss inputs its batches carry besides latents and text states
I2V = {
  "wan21-i2v-tiny": {"condition", "encoder_hidden_states_image"},
  "wan22-i2v-high-tiny": {"condition"},
  "wan22-ti2v-tiny": set(),
}


@pytest.mark.parametrize("variant", list(I2V))
def test_image_conditioned_wan_recipes_train_and_export(variant, tmp_path):
  """The first frame conditions each clip: I2V batches carry the frame mask (1 on the first latent
  frame) and the first frame's latents (+ Wan 2.1's CLIP tokens); TI2V trains on the plain latents with
  the clean first frame. Two steps move the parameters; the export reads back."""
  fn, config = _variant(variant)
  recipe = fn(config)
  batch = next(recipe.batches)
  assert set(batch) == {"latents", "encoder_hidden_states", *I2V[variant]}
  if "condition" in batch:
    b, f, h, w, _ = batch["latents"].shape
    cond = np.asarray(batch["condition"])
    assert cond.shape[:4] == (b, f, h, w) and cond.shape[-1] == 4 + batch["latents"].shape[-1]
    np.testing.assert_array_equal(cond[:, 0, ..., :4], 1.0)
    np.testing.assert_array_equal(cond[:, 1:, ..., :4], 0.0)
  start = _leaves(recipe.state.params)
  state = mdt.fit(recipe, steps=2, progress=False)
  assert any(not np.array_equal(a, b) for a, b in zip(start, _leaves(state.params)))
  out = recipe.export(state, tmp_path)
  _, loaded = mdt.split_trainable(md_wan.load_transformer(out, subfolder=None))
  for a, b in zip(_leaves(state.params), _leaves(loaded), strict=True):
    np.testing.assert_array_equal(a, b)
