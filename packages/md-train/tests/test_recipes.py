"""md_train.recipes: the diffusers-layout export of each family's denoiser reads back with md's loader
(SD UNet, Flux.1 and Wan 2.1 transformers from tests/fixtures, parameters changed first so the export is
not the source file), the recipe import string and the data-parallel batch check."""

import pathlib

import jax
import ml_collections
import numpy as np
import pytest

import md_flux
import md_sd
import md_train as mdt
import md_wan
from md_core.testing import fixture_path
from md_train import recipes

FAMILIES = {
  "sd": (
    lambda p, **k: md_sd.load_unet(p, subfolder=None, **k),
    md_sd.convert_unet_key,
    "sd_pipeline/sd/unet",
  ),
  "flux": (
    lambda p, **k: md_flux.load_flux(p, **k),  # a folder with config.json is the component
    md_flux.convert_key,
    "flux_pipeline/dev/transformer",
  ),
  "wan": (
    lambda p, **k: md_wan.load_transformer(p, subfolder=None, **k),
    md_wan.convert_key,
    "wan_pipeline/t2v/transformer",
  ),
}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_export_reads_back_with_the_md_loader(family, tmp_path):
  load, convert_key, rel = FAMILIES[family]
  source = pathlib.Path(fixture_path(rel.split("/")[0])).joinpath(*rel.split("/")[1:])
  frozen, params = mdt.split_trainable(load(source))
  leaves, treedef = jax.tree.flatten(params)
  rng = np.random.default_rng(0)
  changed = [np.asarray(a) + rng.normal(0, 0.01, a.shape).astype(a.dtype) for a in leaves]
  params = jax.tree.unflatten(treedef, changed)
  folder = recipes.export_denoiser(frozen, params, source, tmp_path / "out", convert_key)
  assert (folder / "config.json").read_text() == (source / "config.json").read_text()
  _, loaded = mdt.split_trainable(load(folder))
  loaded = jax.tree.leaves(loaded)
  assert len(loaded) == len(changed)
  for a, b in zip(changed, loaded):
    np.testing.assert_array_equal(a, np.asarray(b))


@pytest.mark.parametrize(
  "spec, message",
  [
    ("md_train.recipes:wan99_tiny", "has no function 'wan99_tiny'; did you mean "),
    ("md_nothing.recipes:x", "cannot import 'md_nothing.recipes'"),
    ("md_train.recipes", "must be 'module.path:function'"),
    (":wan21_tiny", "must be 'module.path:function'"),
  ],
)
def test_import_recipe_errors(spec, message):
  with pytest.raises(ValueError, match=message):
    recipes.import_recipe(spec)
  assert recipes.import_recipe("md_train.recipes:wan21_tiny") is recipes.wan21_tiny


def test_batch_size_not_divisible_by_the_data_parallel_devices():
  """Refused before any weights load, naming the mesh axes and the sizes that work."""
  config = ml_collections.ConfigDict(
    dict(
      seed=0,
      steps=2,
      recipe_options=dict(batch_size=3),
      mesh=dict(ici_data_parallelism=2, ici_fsdp_parallelism=4),
    )
  )
  with pytest.raises(ValueError, match=r"batch_size=3 must .* count 8 \(mesh data=2 x fsdp=4\)"):
    recipes.wan21_tiny(config)


def test_missing_model_folder():
  config = ml_collections.ConfigDict(
    dict(seed=0, steps=2, recipe_options=dict(batch_size=2, model="no/such/folder"))
  )
  with pytest.raises(FileNotFoundError, match="no model_index.json"):
    recipes.sd15_tiny(config)


def _wan22_config(**options):
  opts = dict(
    model=str(fixture_path("wan_pipeline") / "t2v_a14b"), batch_size=2, size=32, frames=5,
    max_sequence_length=16, learning_rate=1e-3, warmup_steps=1, shift=5.0,
  )  # fmt: skip
  return ml_collections.ConfigDict(dict(seed=0, steps=1, recipe_options=dict(opts, **options)))


def test_wan22_low_noise_expert_trains_and_exports_transformer_2(tmp_path):
  """`expert="low"`: the trainable parameters are transformer_2's, two steps change them, and the export
  is a transformer_2 folder md's loader reads back with the trained values."""
  folder = fixture_path("wan_pipeline") / "t2v_a14b"
  recipe = recipes.wan21_tiny(_wan22_config(expert="low"))
  start = [np.asarray(x) for x in jax.tree.leaves(recipe.state.params)]
  _, low = mdt.split_trainable(md_wan.load_transformer(folder, subfolder="transformer_2"))
  for a, b in zip(start, jax.tree.leaves(low), strict=True):
    np.testing.assert_array_equal(a, np.asarray(b))
  state = recipe.state
  for _ in range(2):  # the first step's learning rate is warm-up's 0
    state, metrics = recipe.step(state, next(recipe.batches))
    assert np.isfinite(float(metrics["loss"]))
  out = recipe.export(state, tmp_path / "export")
  assert out == tmp_path / "export" / "transformer_2"
  _, loaded = mdt.split_trainable(md_wan.load_transformer(out, subfolder=None))
  trained = jax.tree.leaves(state.params)
  assert any(not np.array_equal(a, np.asarray(b)) for a, b in zip(start, trained))
  for a, b in zip(trained, jax.tree.leaves(loaded), strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_wan22_expert_option_errors():
  with pytest.raises(ValueError, match=r"expert='middle'; expected one of \('high', 'low'\)"):
    recipes.wan21_tiny(_wan22_config(expert="middle"))
  one = str(fixture_path("wan_pipeline") / "t2v")
  with pytest.raises(ValueError, match=r"expert='high': .*t2v has one transformer"):
    recipes.wan21_tiny(_wan22_config(expert="high", model=one))
