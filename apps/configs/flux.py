"""flux_generate: Flux.1 (dev, schnell) and Flux.2 Klein images with md-flux.

uv run apps/flux_generate --config=apps/configs/flux.py:flux1-dev --config.prompt="a cat surfing"
uv run apps/flux_generate --config=apps/configs/flux.py:flux1-schnell --config.seed=3
uv run apps/flux_generate --config=apps/configs/flux.py:flux2-klein-4b --config.prompt="a red fox"
uv run apps/flux_generate --config=apps/configs/flux.py:flux2-klein-9b-kv-edit --config.images=a.png,b.png
uv run apps/flux_generate --config=apps/configs/flux.py:tiny --workdir=/tmp/flux   # the bundled tiny pipeline

Variants: flux1-dev, flux1-schnell, flux2-klein-4b, flux2-klein-9b (text), flux2-klein-4b-edit,
flux2-klein-9b-edit (reference images), flux2-klein-9b-kv-edit (reference K/V cached after the first step),
and tiny, tiny-schnell (tests/fixtures/flux_pipeline). Defaults follow the reference pipelines and model
cards (steps, guidance, max_sequence_length). Hub ids need the hub cache (or network); offline they fail
with a message that says how to get them. The Flux.2 Klein variants name their checkpoints; md-flux's
Klein pipeline still needs prompt embeddings and reference latents (no Qwen3 encoder or Flux.2 VAE wired in
yet), so from this app they stop with that message.
"""

import ml_collections

_FIXTURES = "tests/fixtures/flux_pipeline"
_TINY = dict(height=32, width=48, steps=3, max_sequence_length=8)

# variant -> settings that differ from the defaults below
VARIANTS = {
  "flux1-dev": dict(model="black-forest-labs/FLUX.1-dev", steps=50, guidance_scale=3.5),
  "flux1-schnell": dict(
    model="black-forest-labs/FLUX.1-schnell", steps=4, guidance_scale=0.0, max_sequence_length=256
  ),
  "flux2-klein-4b": dict(model="black-forest-labs/FLUX.2-klein-4B", steps=4, guidance_scale=1.0),
  "flux2-klein-9b": dict(model="black-forest-labs/FLUX.2-klein-9B", steps=4, guidance_scale=1.0),
  "flux2-klein-4b-edit": dict(
    model="black-forest-labs/FLUX.2-klein-4B", steps=4, guidance_scale=1.0, edit=True
  ),
  "flux2-klein-9b-edit": dict(
    model="black-forest-labs/FLUX.2-klein-9B", steps=4, guidance_scale=1.0, edit=True
  ),
  # The KV pipeline has no guidance or negative prompt (diffusers' Flux2KleinKVPipeline).
  "flux2-klein-9b-kv-edit": dict(
    model="black-forest-labs/FLUX.2-klein-9b-kv",
    steps=4,
    guidance_scale=1.0,
    edit=True,
    kv_cache=True,
  ),
  "tiny": dict(model=f"{_FIXTURES}/dev", guidance_scale=3.5, **_TINY),
  "tiny-schnell": dict(model=f"{_FIXTURES}/schnell", guidance_scale=0.0, **_TINY),
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
  c.negative_prompt = ""  # Flux.1: used with true_cfg_scale > 1
  c.true_cfg_scale = 1.0
  c.num_images_per_prompt = 1
  c.height = 1024
  c.width = 1024
  c.steps = 28
  c.guidance_scale = 3.5
  c.max_sequence_length = 512
  c.seed = 0
  # Flux.2 Klein editing: reference images (comma-separated files, at most 4) and the KV cache.
  c.edit = False
  c.images = ""
  c.kv_cache = False
  # Attention implementation ("" = automatic; "ulysses" / "ring" for context parallelism).
  c.attention = ""
  c.mesh = ml_collections.ConfigDict(
    dict(
      ici_data_parallelism=1,
      ici_fsdp_parallelism=-1,
      ici_context_parallelism=1,
      ici_tensor_parallelism=1,
      dcn_data_parallelism=1,
      dcn_fsdp_parallelism=1,
      dcn_context_parallelism=1,
      dcn_tensor_parallelism=1,
    )
  )
  c.distributed = ml_collections.ConfigDict(
    dict(coordinator_address="", num_processes=-1, process_id=-1)
  )
  c.compilation_cache = True
  c.update(VARIANTS[name])
  c.lock()
  return c
