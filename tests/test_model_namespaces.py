"""One spelling per model: each model's namespace exposes the same names (`Config`, `VARIANTS`,
`convert_key`, `load_transformer`, `load_pipeline`, `Pipeline`), each the family's own object."""

import pytest
from flax import nnx

import md_flux
import md_ltx
import md_sd
import md_wan
from md_core.pipeline import Pipeline
from md_flux import flux1, flux2
from md_ltx import ltx, ltx2

NAMESPACES = {
  "flux1": (flux1, md_flux.FluxConfig, md_flux.FluxPipeline, md_flux.convert_key),
  "flux2": (flux2, md_flux.Flux2Config, md_flux.Flux2KleinPipeline, md_flux.convert_key_flux2),
  "ltx": (ltx, md_ltx.LTXConfig, md_ltx.LTXVideoPipeline, md_ltx.convert_key),
  "ltx2": (ltx2, md_ltx.LTX2Config, md_ltx.LTX2VideoPipeline, md_ltx.ltx2_convert_key),
  "wan": (md_wan, md_wan.WanConfig, md_wan.WanVideoPipeline, md_wan.convert_key),
}


@pytest.mark.parametrize("name", sorted(NAMESPACES))
def test_namespace_names_the_family_objects(name):
  ns, config, pipeline, convert_key = NAMESPACES[name]
  assert ns.Config is config and ns.Pipeline is pipeline and ns.convert_key is convert_key
  assert issubclass(ns.Pipeline, Pipeline)
  assert ns.VARIANTS and all(isinstance(c, ns.Config) for c in ns.VARIANTS.values())
  assert issubclass(ns.Transformer, nnx.Module)
  assert callable(ns.load_transformer) and callable(ns.load_pipeline)
  # The key map is the transformer's: a diffusers name of its first projection maps to a parameter.
  target = ns.convert_key("proj_out.weight")
  assert target is not None and target.path[-1] in ("kernel", "weight")


def test_sd_namespace():
  assert md_sd.Config is md_sd.UNetConfig and md_sd.Pipeline is md_sd.StableDiffusionPipeline
  assert md_sd.convert_key is md_sd.convert_unet_key
  assert md_sd.convert_key("conv_out.weight").path[-1] == "kernel"
