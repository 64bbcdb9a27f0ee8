"""Writes md-trained tiny SD 1.5 and Flux.1 denoisers in the diffusers layout, for the diffusers check.

    uv run python tools/train_export.py            # main workspace (JAX); then
    bash tools/make_fixtures.sh train_export       # diffusers loads these folders and compares

Trains the `sd15-tiny` and `flux1-tiny` recipes of apps/configs/train.py (the tiny pipelines of
tests/fixtures on md_data's shapes images) for 3 steps each, exports each denoiser with the recipe's
exporter (`md_train.recipes.export_denoiser`: config.json + safetensors under the reference's names) into
tests/fixtures/train_export/{sd/unet, flux/transformer}/, and writes md's own output of each exported
model (loaded back by md's loader) on fixed inputs to tests/fixtures/train_export/md_outputs.npz.
tests/test_train_export.py checks that md reads the folders back to those outputs and that diffusers'
outputs (written by the second command) agree within 1e-4.
"""

import importlib.util
import pathlib

import jax.numpy as jnp
import ml_collections
import numpy as np

import md_flux
import md_sd
import md_train as mdt
from md_train import recipes

ROOT = pathlib.Path(__file__).resolve().parents[1]
OUT = ROOT / "tests" / "fixtures" / "train_export"


def inputs() -> dict[str, np.ndarray]:
  """The fixed inputs both sides run (diffusers' layouts: NCHW latents, packed Flux tokens)."""
  rng = np.random.default_rng(0)
  f32 = np.float32
  return {
    "sd/sample": rng.normal(size=(2, 4, 4, 4)).astype(f32),
    "sd/timestep": np.asarray([120, 870], np.int64),
    "sd/encoder_hidden_states": rng.normal(size=(2, 16, 16)).astype(f32),
    "flux/hidden_states": rng.normal(size=(2, 4, 16)).astype(f32),
    "flux/encoder_hidden_states": rng.normal(size=(2, 8, 24)).astype(f32),
    "flux/pooled_projections": rng.normal(size=(2, 16)).astype(f32),
    "flux/timestep": np.asarray([0.3, 0.8], f32),
    "flux/guidance": np.asarray([3.5, 3.5], f32),
    "flux/img_ids": np.asarray(md_flux.image_ids(2, 2), f32),
    "flux/txt_ids": np.zeros((8, 3), f32),
  }


def md_outputs(x: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
  """md's outputs of the exported folders on `x`."""
  unet = md_sd.load_unet(OUT / "sd" / "unet", subfolder=None, progress=False)
  sample = jnp.asarray(x["sd/sample"]).transpose(0, 2, 3, 1)
  sd = unet(sample, jnp.asarray(x["sd/timestep"]), jnp.asarray(x["sd/encoder_hidden_states"]))
  flux = md_flux.load_flux(OUT / "flux" / "transformer")
  out = flux(
    jnp.asarray(x["flux/hidden_states"]), jnp.asarray(x["flux/encoder_hidden_states"]),
    jnp.asarray(x["flux/pooled_projections"]), jnp.asarray(x["flux/timestep"]),
    jnp.asarray(x["flux/img_ids"]), jnp.asarray(x["flux/txt_ids"]), jnp.asarray(x["flux/guidance"]),
  )  # fmt: skip
  return {"sd": np.asarray(sd).transpose(0, 3, 1, 2), "flux": np.asarray(out)}


def main() -> None:
  spec = importlib.util.spec_from_file_location("_train_config", ROOT / "apps/configs/train.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  for name, variant, sub in (("sd", "sd15-tiny", "unet"), ("flux", "flux1-tiny", "transformer")):
    fn, options = module.VARIANTS[variant]
    recipe = recipes.import_recipe(fn)(
      ml_collections.ConfigDict(dict(seed=0, recipe_options=options))
    )
    state = mdt.fit(recipe, steps=3, progress=False)
    folder = recipe.export(state, OUT / name)
    assert folder == OUT / name / sub, folder
  x = inputs()
  np.savez_compressed(
    OUT / "md_outputs.npz", **x, **{f"out/{k}": v for k, v in md_outputs(x).items()}
  )
  print(f"wrote {OUT}")


if __name__ == "__main__":
  main()
