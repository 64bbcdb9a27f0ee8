"""ltx_generate: LTX-Video text-to-video, image-to-video, keyframes and multi-scale with md-ltx.

uv run apps/ltx_generate --config=apps/configs/ltx.py:2b-0.9.1 --config.prompt="a cat surfing"
uv run apps/ltx_generate --config=apps/configs/ltx.py:2b-0.9.5-i2v --config.image=cat.png
uv run apps/ltx_generate --config=apps/configs/ltx.py:13b-0.9.7-dev --config.mesh.ici_tensor_parallelism=4
uv run apps/ltx_generate --config=apps/configs/ltx.py:13b-0.9.7-dev-multiscale --config.image=cat.png
uv run apps/ltx_generate --config=apps/configs/ltx.py:13b-0.9.8-distilled \
  --config.transformer=ltxv-13b-0.9.8-distilled.safetensors
uv run apps/ltx_generate --config=apps/configs/ltx.py:tiny --workdir=/tmp/ltx   # the bundled tiny pipeline
uv run apps/ltx_generate --help --config=apps/configs/ltx.py:tiny   # the variant's keys and values

Variants: 2b-0.9.0, 2b-0.9.1, 2b-0.9.5, 2b-0.9.5-i2v, 13b-0.9.7-dev, 13b-0.9.7-dev-i2v,
13b-0.9.7-dev-multiscale, 13b-0.9.7-distilled, 13b-0.9.8-dev, 13b-0.9.8-distilled, and tiny, tiny-i2v,
tiny-keyframes, tiny-multiscale (tests/fixtures/ltx_pipeline, tests/fixtures/ltx_upsampler). LTX-2 has its own app and config (apps/configs/ltx2.py).

Defaults follow diffusers' LTX-Video documentation (0.42): 25 fps, decode_timestep 0.03 / 0.05 with
decode_noise_scale 0.025 for the timestep-conditioned VAEs (0.9.1+), 0.9.5+ checkpoints run with
LTXConditionPipeline semantics (`condition`), the distilled 13B ones with guidance 1 and their published
timesteps. The 0.9.8 13B transformers are published as original single files only: give the file with
`--config.transformer=` (the VAE and T5 come from the 0.9.7 diffusers repository).

Multi-scale (`upsampler` set): a first pass at `downscale_factor` of the size (rounded down to what the VAE
takes), the latent upsampler (x2, AdaIN against the first pass with `adain_factor`), a second pass
refining the upsampled latents with `second_pass_denoise_strength` over `second_pass_num_inference_steps`, and the frames
resized to `height` x `width`; as diffusers' LTX-Video 0.9.7 multi-scale example.

Hub ids need the hub cache (or network). `attention` picks md-attention's implementation.
"""

import ml_collections
from ml_collections.config_dict import placeholder

from md_cache import settings as cache_settings
from md_core import apps as md_apps
from md_lora import settings as lora_settings

_FIXTURES = "tests/fixtures/ltx_pipeline"
_UPSAMPLER_FIXTURE = "tests/fixtures/ltx_upsampler/ltx_video"
_DISTILLED_TIMESTEPS = "1000,993,987,981,975,909,725,0.03"
_13B = dict(height=480, width=704, num_frames=121, condition=True, decode_timestep=0.05)
_13B_DEV = dict(_13B, num_inference_steps=30, guidance_scale=5.0, guidance_rescale=0.7)
_13B_DISTILLED = dict(_13B, guidance_scale=1.0, timesteps=_DISTILLED_TIMESTEPS)
_TINY = dict(height=32, width=32, num_frames=9, num_inference_steps=3, decode_timestep=0.05)
# variant -> settings that differ from the defaults below
VARIANTS = {
  "2b-0.9.0": dict(model="Lightricks/LTX-Video", decode_timestep=0.0, decode_noise_scale=None),
  "2b-0.9.1": dict(model="Lightricks/LTX-Video-0.9.1", decode_timestep=0.03),
  "2b-0.9.5": dict(
    model="Lightricks/LTX-Video-0.9.5", width=768, num_inference_steps=40, condition=True, decode_timestep=0.05
  ),
  "2b-0.9.5-i2v": dict(
    model="Lightricks/LTX-Video-0.9.5", width=768, num_inference_steps=40, condition=True, decode_timestep=0.05,
    needs_image=True,
  ),
  "13b-0.9.7-dev": dict(_13B_DEV, model="Lightricks/LTX-Video-0.9.7-dev"),
  "13b-0.9.7-dev-i2v": dict(_13B_DEV, model="Lightricks/LTX-Video-0.9.7-dev", needs_image=True),
  "13b-0.9.7-dev-multiscale": dict(
    _13B_DEV, model="Lightricks/LTX-Video-0.9.7-dev",
    upsampler="Lightricks/ltxv-spatial-upscaler-0.9.7",
  ),
  "13b-0.9.7-distilled": dict(_13B_DISTILLED, model="Lightricks/LTX-Video-0.9.7-distilled"),
  "13b-0.9.8-dev": dict(_13B_DEV, model="Lightricks/LTX-Video-0.9.7-dev", needs_transformer=True),
  "13b-0.9.8-distilled": dict(
    _13B_DISTILLED, model="Lightricks/LTX-Video-0.9.7-distilled", needs_transformer=True
  ),
  "tiny": dict(_TINY, model=f"{_FIXTURES}/t2v"),
  "tiny-i2v": dict(_TINY, model=f"{_FIXTURES}/cond", condition=True, needs_image=True),
  "tiny-keyframes": dict(_TINY, model=f"{_FIXTURES}/cond", condition=True, needs_image=True),
  "tiny-multiscale": dict(
    _TINY, model=f"{_FIXTURES}/cond", condition=True, height=64, width=64,
    upsampler=_UPSAMPLER_FIXTURE, second_pass_num_inference_steps=3,
  ),
}  # fmt: skip

# The negative prompt of diffusers' LTX-Video examples.
NEGATIVE_PROMPT = "worst quality, inconsistent motion, blurry, jittery, distorted"


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  name = arg or "2b-0.9.1"
  if name not in VARIANTS:
    raise ValueError(
      f"apps/configs/ltx.py: unknown variant {name!r}; choose one of {sorted(VARIANTS)}"
    )
  c = ml_collections.ConfigDict()
  c.variant = name
  # The pipeline: a diffusers folder or hub id; an optional transformer (diffusers folder or original
  # single file) replacing its own; parameter dtype of the transformer and T5.
  c.model = ""
  c.transformer = ""
  c.needs_transformer = False
  c.dtype = "float32"
  # Attention implementation ("auto", "dot_product", "blockwise", "ring", "ulysses", ...) and the blocks'
  # rematerialisation ("none" for inference).
  c.attention = "auto"
  c.remat = "none"
  # LTXConditionPipeline semantics (0.9.5+: linear-quadratic schedule, explicit coordinates) even
  # without images; images always use them.
  c.condition = False
  # What to generate.
  c.prompt = "A woman with long brown hair smiles at the camera in warm evening light, realistic"
  c.negative_prompt = NEGATIVE_PROMPT
  c.num_videos_per_prompt = 1
  c.height = 480
  c.width = 704
  c.num_frames = 161
  c.frame_rate = 25
  c.num_inference_steps = 50
  # Custom timesteps "t1,t2,..." (conditioning mode; the distilled checkpoints'); empty: the schedule.
  c.timesteps = ""
  c.guidance_scale = 3.0
  c.guidance_rescale = 0.0
  # The official repository's guidance extras: spatio-temporal guidance (a pass with the self-attention
  # of `stg_blocks` "b1,b2" skipped, `stg_mode` attention_values / attention_skip), its std rescaling
  # (1: off) and CFG-star. Scales are one number here; the Python API takes per-step lists too.
  c.stg_scale = 0.0
  c.stg_blocks = ""
  c.stg_mode = "attention_values"
  c.stg_rescale = 1.0
  c.cfg_star = False
  c.decode_timestep = 0.03
  # None: the reference's default (decode_timestep).
  c.decode_noise_scale = placeholder(float)
  c.decode_noise_scale = 0.025
  c.image_cond_noise_scale = 0.15
  c.seed = 0
  # Conditioning: an image at frame 0 (image-to-video) with its strength, and keyframe images as
  # "file@frame_index,file@frame_index" (strength 1).
  c.image = ""
  c.image_strength = 1.0
  c.keyframes = ""
  c.needs_image = False
  # Multi-scale: the latent upsampler (diffusers folder / hub id / single file); empty: one pass.
  c.upsampler = ""
  c.downscale_factor = 2 / 3
  c.adain_factor = 1.0
  c.second_pass_num_inference_steps = 10
  c.second_pass_denoise_strength = 0.4
  c.second_pass_image_cond_noise_scale = 0.025
  md_apps.add_runtime_config(c)  # mesh, distributed, compilation_cache
  cache_settings.add_cache_config(c)  # cache, cache_options (md-cache)
  md_apps.add_quantization_config(c)  # quantization: int8, int8-dynamic or fp8
  lora_settings.add_lora_config(c)  # loras: "file[:scale][@component],…" (md-lora, at run time)
  c.update(VARIANTS[name])
  c.lock()
  return c
