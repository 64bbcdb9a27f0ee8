"""flux_generate: Flux.1 (dev, schnell) and Flux.2 Klein images with md-flux.

uv run apps/flux_generate --config=apps/configs/flux.py:flux1-dev --config.prompt="a cat surfing"
uv run apps/flux_generate --config=apps/configs/flux.py:flux1-schnell --config.seed=3
uv run apps/flux_generate --config=apps/configs/flux.py:flux1-dev --config.quantization=int8   # int8 weights
uv run apps/flux_generate --config=apps/configs/flux.py:flux2-klein-4b --config.prompt="a red fox"
uv run apps/flux_generate --config=apps/configs/flux.py:flux2-klein-9b-kv-edit --config.images=a.png,b.png
uv run apps/flux_generate --config=apps/configs/flux.py:tiny --workdir=/tmp/flux   # the bundled tiny pipeline
uv run apps/flux_generate --help --config=apps/configs/flux.py:tiny   # the variant's keys and values

Variants: flux1-dev, flux1-schnell, flux2-klein-4b, flux2-klein-9b (text), flux2-klein-4b-edit,
flux2-klein-9b-edit (up to 4 reference images), flux2-klein-9b-kv-edit (reference K/V cached after the
first step), flux2-klein-base-4b, flux2-klein-base-9b (undistilled: guidance, 50 steps), and the bundled tiny pipelines: tiny, tiny-schnell (tests/fixtures/flux_pipeline), tiny-klein,
tiny-klein-edit, tiny-klein-kv-edit (tests/fixtures/flux2_pipeline, with its two reference PNGs). Defaults
follow the reference pipelines and model cards (steps, guidance, max_sequence_length). Edit variants take
the output size from the first reference image when height and width are None. Hub ids need the hub cache
(or network); offline they fail with a message that says how to get them.
"""

import ml_collections
from ml_collections.config_dict import placeholder

from md_cache import settings as cache_settings
from md_core import apps as md_apps
from md_lora import settings as lora_settings

_FIXTURES = "tests/fixtures/flux_pipeline"
_KLEIN_FIXTURES = "tests/fixtures/flux2_pipeline"
_TINY = dict(height=32, width=48, num_inference_steps=3, max_sequence_length=8)
# The tiny Qwen3 has 3 layers: its hidden states 1, 2, 3 stand in for the real 9, 18, 27.
_TINY_KLEIN = dict(num_inference_steps=3, max_sequence_length=40, text_layers="1,2,3")
_TINY_REFS = f"{_KLEIN_FIXTURES}/ref_0.png,{_KLEIN_FIXTURES}/ref_1.png"
_EDIT = dict(edit=True, height=None, width=None)  # the output size of the first reference image

# variant -> settings that differ from the defaults below
VARIANTS = {
  "flux1-dev": dict(
    model="black-forest-labs/FLUX.1-dev", num_inference_steps=50, guidance_scale=3.5
  ),
  "flux1-schnell": dict(
    model="black-forest-labs/FLUX.1-schnell",
    num_inference_steps=4,
    guidance_scale=0.0,
    max_sequence_length=256,
  ),
  "flux2-klein-4b": dict(
    model="black-forest-labs/FLUX.2-klein-4B", num_inference_steps=4, guidance_scale=1.0
  ),
  "flux2-klein-9b": dict(
    model="black-forest-labs/FLUX.2-klein-9B", num_inference_steps=4, guidance_scale=1.0
  ),
  "flux2-klein-4b-edit": dict(
    model="black-forest-labs/FLUX.2-klein-4B", num_inference_steps=4, guidance_scale=1.0, **_EDIT
  ),
  "flux2-klein-9b-edit": dict(
    model="black-forest-labs/FLUX.2-klein-9B", num_inference_steps=4, guidance_scale=1.0, **_EDIT
  ),
  # The undistilled base models: classifier-free guidance with the negative prompt, 50 steps.
  "flux2-klein-base-4b": dict(
    model="black-forest-labs/FLUX.2-klein-base-4B", num_inference_steps=50, guidance_scale=4.0
  ),
  "flux2-klein-base-9b": dict(
    model="black-forest-labs/FLUX.2-klein-base-9B", num_inference_steps=50, guidance_scale=4.0
  ),
  # The KV pipeline has no guidance or negative prompt (diffusers' Flux2KleinKVPipeline).
  "flux2-klein-9b-kv-edit": dict(
    model="black-forest-labs/FLUX.2-klein-9b-kv",
    num_inference_steps=4,
    guidance_scale=1.0,
    kv_cache=True,
    **_EDIT,
  ),
  "tiny": dict(model=f"{_FIXTURES}/dev", guidance_scale=3.5, **_TINY),
  "tiny-schnell": dict(model=f"{_FIXTURES}/schnell", guidance_scale=0.0, **_TINY),
  "tiny-klein": dict(
    model=f"{_KLEIN_FIXTURES}/klein", guidance_scale=4.0, height=32, width=48, **_TINY_KLEIN
  ),
  "tiny-klein-edit": dict(
    model=f"{_KLEIN_FIXTURES}/klein", guidance_scale=4.0, images=_TINY_REFS, **_EDIT, **_TINY_KLEIN
  ),
  "tiny-klein-kv-edit": dict(
    model=f"{_KLEIN_FIXTURES}/klein_kv",
    guidance_scale=1.0,
    images=_TINY_REFS,
    kv_cache=True,
    **_EDIT,
    **_TINY_KLEIN,
  ),
}


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  name = arg or "flux1-dev"
  if name not in VARIANTS:
    raise ValueError(
      f"apps/configs/flux.py: unknown variant {name!r}; choose one of {sorted(VARIANTS)}"
    )
  c = ml_collections.ConfigDict()
  c.variant = name
  # The pipeline: a diffusers folder or hub id; the transformer's and T5's parameter dtypes.
  c.model = ""
  c.dtype = "float32"
  c.text_dtype = "float32"
  # What to generate.
  c.prompt = "a photo of an astronaut riding a horse on the moon"
  c.negative_prompt = (
    ""  # Flux.1: used with true_cfg_scale > 1; Klein: with guidance ("" by default)
  )
  c.true_cfg_scale = 1.0
  c.num_images_per_prompt = 1
  c.height = placeholder(int)
  c.width = placeholder(int)
  c.height = 1024
  c.width = 1024
  c.num_inference_steps = 28
  c.guidance_scale = 3.5
  c.max_sequence_length = 512
  # Flux.2 Klein: the Qwen3 hidden states stacked into the prompt embeddings.
  c.text_layers = "9,18,27"
  c.seed = 0
  # Flux.2 Klein editing: reference images (comma-separated files, at most 4) and the KV cache (always
  # on for Flux2KleinKVPipeline checkpoints).
  c.edit = False
  c.images = ""
  c.kv_cache = False
  # Attention implementation ("" = automatic; "ulysses" / "ring" for context parallelism).
  c.attention = ""
  md_apps.add_runtime_config(c)  # mesh, distributed, compilation_cache
  cache_settings.add_cache_config(c)  # cache, cache_options (md-cache)
  md_apps.add_quantization_config(c)  # quantization: int8, int8-dynamic or fp8
  lora_settings.add_lora_config(c)  # loras: "file[:scale][@component],…" (md-lora, at run time)
  c.update(VARIANTS[name])
  c.lock()
  return c
