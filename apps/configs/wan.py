"""wan_generate: Wan 2.1 / 2.2 text-to-video and image-to-video with md-wan.

uv run apps/wan_generate --config=apps/configs/wan.py:2.1-t2v-1.3b --config.prompt="a cat surfing"
uv run apps/wan_generate --config=apps/configs/wan.py:2.1-t2v-14b --config.prompt="a cat surfing"
uv run apps/wan_generate --config=apps/configs/wan.py:2.1-i2v-14b-480p --config.image=cat.png
uv run apps/wan_generate --config=apps/configs/wan.py:2.1-flf2v-14b-720p --config.image=first.png \
  --config.last_image=last.png
uv run apps/wan_generate --config=apps/configs/wan.py:2.2-t2v-a14b --config.mesh.ici_context_parallelism=4
uv run apps/wan_generate --config=apps/configs/wan.py:2.2-ti2v-5b --config.image=cat.png   # or no image
uv run apps/wan_generate --config=apps/configs/wan.py:tiny --workdir=/tmp/wan   # the bundled tiny pipeline
uv run apps/wan_generate --help --config=apps/configs/wan.py:tiny   # the variant's keys and values

Variants: 2.1-t2v-1.3b, 2.1-t2v-14b, 2.1-i2v-14b-480p, 2.1-i2v-14b-720p, 2.1-flf2v-14b-720p,
2.2-t2v-a14b, 2.2-i2v-a14b, 2.2-ti2v-5b, and tiny, tiny-a14b, tiny-ti2v, tiny-flf2v
(tests/fixtures/wan_pipeline). Defaults follow the Wan authors' settings as diffusers' docs use them (steps,
guidance, flow_shift: 3.0 at 480p, 5.0 at 720p, 16 for FLF2V; 16 fps, 24 for TI2V-5B). Hub ids need the hub cache (or network). `attention` picks md-attention's implementation;
"ring", "ulysses" or "ulysses_ring" split the video tokens over the mesh's `context` axis.
"""

import pathlib

import ml_collections
from ml_collections.config_dict import placeholder

from md_cache import settings as cache_settings
from md_core import apps as md_apps
from md_lora import settings as lora_settings

_FIXTURES = "tests/fixtures/wan_pipeline"
# md's shapes model, found from this file so the default runs from any directory.
_SHAPES_MODEL = str(pathlib.Path(__file__).resolve().parents[2] / "models" / "shapes-wan")

# variant -> settings that differ from the defaults below
VARIANTS = {
  "2.1-t2v-1.3b": dict(model="Wan-AI/Wan2.1-T2V-1.3B-Diffusers", flow_shift=3.0),
  "2.1-t2v-14b": dict(
    model="Wan-AI/Wan2.1-T2V-14B-Diffusers", height=720, width=1280, flow_shift=5.0
  ),
  "2.1-i2v-14b-480p": dict(
    model="Wan-AI/Wan2.1-I2V-14B-480P-Diffusers", flow_shift=3.0, needs_image=True
  ),
  "2.1-i2v-14b-720p": dict(
    model="Wan-AI/Wan2.1-I2V-14B-720P-Diffusers",
    height=720,
    width=1280,
    flow_shift=5.0,
    needs_image=True,
  ),
  # First/last-frame to video; the Wan authors sample it with shift 16 (their generate.py) at 720p.
  "2.1-flf2v-14b-720p": dict(
    model="Wan-AI/Wan2.1-FLF2V-14B-720P-Diffusers",
    height=720,
    width=1280,
    flow_shift=16.0,
    needs_image=True,
    needs_last_image=True,
  ),
  "2.2-t2v-a14b": dict(
    model="Wan-AI/Wan2.2-T2V-A14B-Diffusers",
    height=720,
    width=1280,
    num_inference_steps=40,
    guidance_scale=4.0,
    guidance_scale_2=3.0,
    flow_shift=12.0,
  ),
  "2.2-i2v-a14b": dict(
    model="Wan-AI/Wan2.2-I2V-A14B-Diffusers",
    height=720,
    width=1280,
    num_inference_steps=40,
    guidance_scale=3.5,
    guidance_scale_2=3.5,
    flow_shift=5.0,
    needs_image=True,
  ),
  "2.2-ti2v-5b": dict(
    model="Wan-AI/Wan2.2-TI2V-5B-Diffusers",
    height=704,
    width=1280,
    num_frames=121,
    frame_rate=24,
    flow_shift=5.0,
  ),
  # md's own shapes model (models/shapes-wan, trained by apps/configs/default_models.py): what
  # `uv run apps/wan_generate --config.prompt="a green triangle moving up on a black background"` runs without --config.
  "default": dict(
    model=_SHAPES_MODEL,
    prompt="a green triangle moving up on a black background",
    negative_prompt="",
    height=64,
    width=64,
    num_frames=9,
    frame_rate=8,
    num_inference_steps=20,
    guidance_scale=3.0,
    max_sequence_length=16,
  ),
  "tiny": dict(model=f"{_FIXTURES}/t2v", height=32, width=32, num_frames=9, num_inference_steps=3),
  "tiny-a14b": dict(
    model=f"{_FIXTURES}/t2v_a14b",
    height=32,
    width=32,
    num_frames=5,
    num_inference_steps=3,
    guidance_scale=4.0,
    guidance_scale_2=3.0,
  ),
  "tiny-flf2v": dict(
    model=f"{_FIXTURES}/flf2v",
    height=32,
    width=32,
    num_frames=9,
    num_inference_steps=3,
    needs_image=True,
    needs_last_image=True,
  ),
  "tiny-ti2v": dict(
    model=f"{_FIXTURES}/ti2v",
    height=32,
    width=64,
    num_frames=5,
    num_inference_steps=3,
    frame_rate=24,
  ),
}

# The Wan authors' negative prompt (English, as in diffusers' Wan examples).
NEGATIVE_PROMPT = (
  "Bright tones, overexposed, static, blurred details, subtitles, style, works, paintings, images, "
  "static, overall gray, worst quality, low quality, JPEG compression residue, ugly, incomplete, extra "
  "fingers, poorly drawn hands, poorly drawn faces, deformed, disfigured, misshapen limbs, fused "
  "fingers, still picture, messy background, three legs, many people in the background, walking "
  "backwards"
)


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  name = arg or "2.1-t2v-1.3b"
  if name not in VARIANTS:
    raise ValueError(
      f"apps/configs/wan.py: unknown variant {name!r}; choose one of {sorted(VARIANTS)}"
    )
  c = ml_collections.ConfigDict()
  c.variant = name
  # The pipeline: a diffusers folder or hub id; parameter dtype of the transformers and UMT5.
  c.model = placeholder(str)
  c.dtype = "float32"
  # Attention implementation ("auto", "dot_product", "blockwise", "ring", "ulysses", "ulysses_ring", ...)
  # and the blocks' rematerialisation ("none" for inference).
  c.attention = "auto"
  c.remat = "none"
  # What to generate.
  c.prompt = "A cat walks on the grass, realistic"
  c.negative_prompt = NEGATIVE_PROMPT
  c.num_videos_per_prompt = 1
  c.height = 480
  c.width = 832
  c.num_frames = 81
  c.frame_rate = 16
  # UMT5 tokens per prompt (512 as the Wan authors; md's shapes model was trained with 16).
  c.max_sequence_length = 512
  c.num_inference_steps = 50
  c.guidance_scale = 5.0
  # The low-noise expert's guidance (Wan 2.2 A14B); None uses guidance_scale.
  c.guidance_scale_2 = placeholder(float)
  # UniPC's flow_shift; None keeps the checkpoint's scheduler_config.json value.
  c.flow_shift = placeholder(float)
  c.seed = 0
  # Image-to-video: the first frame (and optionally the last), resized to height x width.
  c.image = placeholder(str)
  c.last_image = placeholder(str)
  c.needs_image = False
  c.needs_last_image = False
  md_apps.add_runtime_config(c)  # mesh, distributed, compilation_cache
  cache_settings.add_cache_config(c)  # cache, cache_options (md-cache)
  md_apps.add_quantization_config(c)  # quantization: int8, int8-dynamic or fp8
  lora_settings.add_lora_config(c)  # loras: "file[:scale][@component],…" (md-lora, at run time)
  c.update(VARIANTS[name])
  c.lock()
  return c
