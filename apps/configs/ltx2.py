"""ltx2_generate: LTX-2 video with sound (text-to-video, image-to-video) with md-ltx.

uv run apps/ltx2_generate --config=apps/configs/ltx2.py:ltx2-t2v --config.prompt="a cat playing a piano"
uv run apps/ltx2_generate --config=apps/configs/ltx2.py:ltx2-i2v --config.image=cat.png
uv run apps/ltx2_generate --config=apps/configs/ltx2.py:ltx2-distilled \
  --config.transformer=ltx-2-19b-distilled.safetensors
uv run apps/ltx2_generate --config=apps/configs/ltx2.py:tiny --workdir=/tmp/ltx2   # tiny LTX-2, with sound
uv run apps/ltx2_generate --help --config=apps/configs/ltx2.py:tiny   # the variant's keys and values

Variants: ltx2-t2v, ltx2-i2v, ltx2-distilled, and tiny, tiny-i2v (tests/fixtures/ltx2_pipeline).

Defaults follow diffusers' LTX2Pipeline / LTX2ImageToVideoPipeline (0.42): 512x768, 121 frames at 24 fps,
30 steps, guidance 3 (audio 7), spatio-temporal guidance 1 (audio 1) skipping block 28, modality guidance 3
(audio 3), rescale 0.7 (audio 0.7), 1024 Gemma tokens, the cross-modal timestep; image-to-video
re-compresses the image at `image_crf` 33 as the model was trained. The distilled variant runs the
published 8 sigmas (`sigmas="distilled"`) without guidance; its transformer is the original single file
(`--config.transformer=`), the rest from Lightricks/LTX-2. The MP4 carries the generated sound (AAC);
settings.json records its sample rate and duration. Sizes: height and width multiples of 32 and
num_frames = 1 + 8k (md_ltx.check_ltx2_size reads them from the checkpoint). Hub ids need the hub cache (or
network). `attention` picks md-attention's implementation.
"""

import ml_collections
from ml_collections.config_dict import placeholder

from md_cache import settings as cache_settings
from md_core import apps as md_apps
from md_lora import settings as lora_settings

_FIXTURES = "tests/fixtures/ltx2_pipeline"
# No guidance at all: CFG, STG and modality scales 1 / 0 (one transformer call per step).
_DISTILLED = dict(
  num_inference_steps=8,
  sigmas="distilled",
  guidance_scale=1.0,
  audio_guidance_scale=1.0,
  stg_scale=0.0,
  audio_stg_scale=0.0,
  modality_scale=1.0,
  audio_modality_scale=1.0,
  guidance_rescale=0.0,
  audio_guidance_rescale=0.0,
  needs_transformer=True,
)
# The tiny LTX-2 pipeline: 2 blocks, 16 Gemma tokens, a VAE taking multiples of 32 and 1 + 8k frames.
_TINY = dict(
  model=f"{_FIXTURES}/pipe",
  prompt="a cat playing a piano",  # prompts that fit the tiny pipeline's 16 Gemma tokens
  negative_prompt="blurry",  # fits the tiny Gemma's 16 tokens (no truncation warning)
  height=32,
  width=64,
  num_frames=9,
  num_inference_steps=3,
  stg_blocks="1",
  max_sequence_length=16,
  decode_timestep=0.05,
  decode_noise_scale=0.025,
)

# variant -> settings that differ from the defaults below
VARIANTS = {
  "ltx2-t2v": dict(),
  "ltx2-i2v": dict(needs_image=True),
  "ltx2-distilled": dict(_DISTILLED),
  "tiny": dict(_TINY),
  "tiny-i2v": dict(_TINY, needs_image=True),
}

# The negative prompt of diffusers' LTX examples.
NEGATIVE_PROMPT = "worst quality, inconsistent motion, blurry, jittery, distorted"


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  name = arg or "ltx2-t2v"
  if name not in VARIANTS:
    raise ValueError(
      f"apps/configs/ltx2.py: unknown variant {name!r}; choose one of {sorted(VARIANTS)}"
    )
  c = ml_collections.ConfigDict()
  c.variant = name
  # The pipeline: a diffusers folder or hub id; an optional transformer (the original single file)
  # replacing its own; parameter dtype of the transformer and Gemma.
  c.model = "Lightricks/LTX-2"
  c.transformer = placeholder(str)
  c.needs_transformer = False
  c.dtype = "float32"
  # Attention implementation ("auto", "dot_product", "blockwise", "ring", "ulysses", ...) and the blocks'
  # rematerialisation ("none" for inference).
  c.attention = "auto"
  c.remat = "none"
  # What to generate.
  c.prompt = "A woman with long brown hair smiles at the camera in warm evening light, realistic"
  c.negative_prompt = NEGATIVE_PROMPT
  c.num_videos_per_prompt = 1
  c.height = 512
  c.width = 768
  c.num_frames = 121
  c.frame_rate = 24
  c.num_inference_steps = 30
  # Custom sigmas "s1,s2,..." or "distilled" (md_schedulers.LTX2_DISTILLED_SIGMAS); None: the schedule.
  c.sigmas = placeholder(str)
  # Guidance: CFG, spatio-temporal guidance (a pass skipping the self-attention of `stg_blocks` "b1,b2"),
  # modality guidance (the pass without the other stream) and rescale, for the video and the audio stream
  # (an audio value of None takes the video's).
  c.guidance_scale = 3.0
  c.stg_scale = 1.0
  c.stg_blocks = "28"
  c.modality_scale = 3.0
  c.guidance_rescale = 0.7
  c.audio_guidance_scale = placeholder(float)
  c.audio_guidance_scale = 7.0
  c.audio_stg_scale = placeholder(float)
  c.audio_stg_scale = 1.0
  c.audio_modality_scale = placeholder(float)
  c.audio_modality_scale = 3.0
  c.audio_guidance_rescale = placeholder(float)
  c.audio_guidance_rescale = 0.7
  c.max_sequence_length = 1024
  # The audio<->video modulation follows the other stream's timestep.
  c.use_cross_timestep = True
  c.decode_timestep = 0.0
  # None: the reference's default (decode_timestep).
  c.decode_noise_scale = placeholder(float)
  c.seed = 0
  # Image-to-video: the first frame, re-compressed at H.264 quality `image_crf` (0: none) as in training;
  # `motion_speed` divides the frame rate of the positions.
  c.image = placeholder(str)
  c.image_crf = 33
  c.motion_speed = 1.0
  c.needs_image = False
  md_apps.add_runtime_config(c)  # mesh, distributed, compilation_cache
  cache_settings.add_cache_config(c)  # cache, cache_options (md-cache)
  md_apps.add_quantization_config(c)  # quantization: int8, int8-dynamic or fp8
  lora_settings.add_lora_config(c)  # loras: "file[:scale][@component],…" (md-lora, at run time)
  c.update(VARIANTS[name])
  c.lock()
  return c
