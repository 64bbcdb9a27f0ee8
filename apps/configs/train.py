"""train: md's training loop (`md_train.fit`) on a recipe, resumable from the workdir's checkpoints.

uv run apps/train --config=apps/configs/train.py:wan21-tiny --workdir=/tmp/wan21-tiny
uv run apps/train --config=apps/configs/train.py:sd15-tiny --workdir=/tmp/sd15 --config.steps=20
uv run apps/train --config=apps/configs/train.py:flux1-tiny --workdir=/tmp/flux --config.recipe_options.batch_size=4
uv run apps/train --config=apps/configs/train.py:sd15-lora-tiny --workdir=/tmp/sd15-lora --config.recipe_options.lora.rank=8
uv run apps/train --config=apps/configs/train.py:dreambooth-tiny --workdir=/tmp/db --config.recipe_options.class_dir=/tmp/db-class
uv run apps/train --help --config=apps/configs/train.py:wan21-tiny   # the variant's keys and values

uv run apps/prepare_data --config=apps/configs/prepare_data.py:tiny --workdir=/tmp/prepared
uv run apps/train --config=apps/configs/train.py:sd15-records --config.recipe_options.records=/tmp/prepared \
  --config.eval_every=2 --workdir=/tmp/sd15-records
uv run apps/prepare_data --config=apps/configs/prepare_data.py:wan --config.source_type=shapes \
  --config.shapes_count=16 --config.eval_count=4 --workdir=/tmp/clips
uv run apps/train --config=apps/configs/train.py:wan21-records --config.recipe_options.records=/tmp/clips \
  --workdir=/tmp/wan21-records

Variants: wan21-tiny, sd15-tiny, sdxl-tiny, flux1-tiny, klein-tiny, ltx-tiny: the tiny pipelines of
tests/fixtures (Wan 2.1 T2V, SD 1.5, SDXL, Flux.1 dev, Flux.2 Klein, LTX-Video T2V) trained on md_data's
shapes clips / images (`md_train.recipes`); <family>-lora-tiny (sd15, sdxl, wan21, flux1, klein, ltx):
the same with only a LoRA trained (`recipe_options.lora`: rank, alpha,
targets, init, seed, rslora, dora), exported as a PEFT file (`--config.recipe_options.lora.dora=True`: DoRA); wan22-high-tiny, wan22-low-tiny: one expert of the tiny
Wan 2.2 A14B pipeline (`recipe_options.expert`), on the timesteps it samples; wan21-i2v-tiny,
wan22-i2v-high-tiny, wan22-ti2v-tiny: image-to-video training (each clip's first frame the condition);
dreambooth-tiny, dreambooth-lora-tiny: Dreambooth with prior preservation (`md_train.recipes.dreambooth_sd`; class images generated into `class_dir`);
dreambooth-sdxl-lora-tiny, dreambooth-flux-lora-tiny, dreambooth-klein-lora-tiny: Dreambooth-LoRA on the
tiny SDXL, Flux.1 and Flux.2 Klein pipelines (`dreambooth_sd`, `dreambooth_flux`, `dreambooth_klein`);
sd15-shapes, wan21-shapes: md's default image / video model (models/shapes-sd, models/shapes-wan)
trained further on fresh shapes data by its own stage's recipe (apps/configs/default_models.py trains them
from random init);
sd15-records, wan21-records: the SD / Wan denoiser trained on the cached latents an apps/prepare_data run
wrote (MaxDiffusion's way: prepare once, train on the records): `recipe_options.records` is that run's
--workdir; train/ is read shuffled from `seed` (its position checkpointed), the eval loss (every
`eval_every` steps) is the mean over eval/'s fixed timesteps of the records' losses there, and
`recipe_options.model` empty trains the model the records were encoded with (settings.json's `model`).
The records' family, latent shape and text width must fit the model; an error names what differs.
Records written elsewhere (MaxDiffusion's cached-latent TFRecords, no settings.json) train too: give
`recipe_options.model` (the pipeline they were encoded with) and, when their latents are stored channels
last, `recipe_options.records_channels_first=False`.
`recipe` is "module.path:function"; the function takes this whole config and returns an
`md_train.Recipe`, so any config file with `get_config(variant)` and these keys runs its own recipes
through this app. Running the same command again resumes from `<workdir>/checkpoints` (the fingerprint of
the recipe must match); `--config.steps` larger than the checkpoint's continues the run.
"""

import ml_collections
from ml_collections.config_dict import placeholder

from md_core import apps as md_apps

# variant -> (recipe, its options)
VARIANTS = {
  "wan21-tiny": (
    "md_train.recipes:wan21_tiny",
    dict(
      model="tests/fixtures/wan_pipeline/t2v",
      batch_size=2,
      size=32,
      frames=5,
      max_sequence_length=64,
      learning_rate=1e-3,
      warmup_steps=2,
      max_grad_norm=1.0,
      weight_decay=1e-2,
      shift=5.0,
    ),
  ),
  "sd15-tiny": (
    "md_train.recipes:sd15_tiny",
    dict(
      model="tests/fixtures/sd_pipeline/sd",
      batch_size=2,
      size=32,
      learning_rate=1e-3,
      warmup_steps=2,
      max_grad_norm=1.0,
      weight_decay=1e-2,
      snr_gamma=0.0,
    ),
  ),
  "flux1-tiny": (
    "md_train.recipes:flux1_tiny",
    dict(
      model="tests/fixtures/flux_pipeline/dev",
      batch_size=2,
      size=32,
      learning_rate=1e-3,
      warmup_steps=2,
      max_grad_norm=1.0,
      weight_decay=1e-2,
      max_sequence_length=64,
      guidance=3.5,
    ),
  ),
}
# The tiny variants' optimizer settings.
_OPTIMIZER = dict(learning_rate=1e-3, warmup_steps=2, max_grad_norm=1.0, weight_decay=1e-2)
# SDXL (train_text_to_image_sdxl.py), Flux.2 Klein (train_dreambooth_lora_flux2_klein.py) and LTX-Video
# (LTX-Video-Trainer) on their tiny pipelines.
VARIANTS["sdxl-tiny"] = (
  "md_train.recipes:sdxl_tiny",
  dict(VARIANTS["sd15-tiny"][1], model="tests/fixtures/sd_pipeline/sdxl"),
)
VARIANTS["klein-tiny"] = (
  "md_train.recipes:klein_tiny",
  dict(
    model="tests/fixtures/flux2_pipeline/klein",
    text_encoder_out_layers="1,2,3",  # the tiny Qwen3 has 3 layers (Klein's own: 9, 18, 27)
    batch_size=2,
    size=32,
    max_sequence_length=96,  # the chat template adds ~30 tokens to a shapes caption
    **_OPTIMIZER,
  ),
)
VARIANTS["ltx-tiny"] = (
  "md_train.recipes:ltx_tiny",
  dict(
    model="tests/fixtures/ltx_pipeline/t2v",
    batch_size=2,
    size=32,
    frames=9,
    max_sequence_length=64,
    frame_rate=25.0,
    first_frame_conditioning_p=0.0,
    **_OPTIMIZER,
  ),
)
# LoRA variants: only the adapter trains (diffusers' train_text_to_image_lora.py: r 4, alpha = r, the
# attention projections; higher learning rate), exported as <workdir>/export/<component>/
# pytorch_lora_weights.safetensors, which `pipe.load_lora` and diffusers' `load_lora_weights` read.
# rslora: peft's use_rslora (alpha / sqrt(r)); dora: peft's use_dora (trained per-output magnitudes).
_LORA = dict(
  rank=4, alpha=4.0, targets="to_k,to_q,to_v,to_out.0", init="kaiming", seed=0, rslora=False,
  dora=False,
)  # fmt: skip
_FLUX_TARGETS = (
  "attn.to_k,attn.to_q,attn.to_v,attn.to_out.0,attn.add_k_proj,attn.add_q_proj,attn.add_v_proj,"
  "attn.to_add_out,ff.net.0.proj,ff.net.2,ff_context.net.0.proj,ff_context.net.2"
)  # train_dreambooth_lora_flux.py's defaults
_FAMILY_TARGETS = (
  ("sd15", None), ("sdxl", None), ("wan21", None), ("flux1", _FLUX_TARGETS), ("klein", None),
  ("ltx", None),
)  # fmt: skip
for _name, _targets in _FAMILY_TARGETS:
  _recipe, _options = VARIANTS[f"{_name}-tiny"]
  _lora = dict(_LORA, targets=_targets or _LORA["targets"])
  VARIANTS[f"{_name}-lora-tiny"] = (_recipe, dict(_options, learning_rate=1e-2, lora=_lora))

# Wan 2.2 A14B, one expert at a time (DiffSynth's way: each expert on its own timesteps, the boundary from
# the folder's model_index.json): the tiny two-expert fixture, its high-noise `transformer` or low-noise
# `transformer_2`, exported as that component.
for _expert in ("high", "low"):
  VARIANTS[f"wan22-{_expert}-tiny"] = (
    "md_train.recipes:wan21_tiny",
    dict(VARIANTS["wan21-tiny"][1], model="tests/fixtures/wan_pipeline/t2v_a14b", expert=_expert),
  )

# Image-conditioned Wan, as DiffSynth trains it: each clip's first frame is the condition. I2V (Wan 2.1 with
# its CLIP tokens; Wan 2.2 A14B, one expert) concatenates the frame mask and the first frame's latents to the
# noisy latents; TI2V (Wan 2.2 5B) keeps the first latent frame clean at timestep 0, out of the loss.
VARIANTS["wan21-i2v-tiny"] = (
  "md_train.recipes:wan21_tiny",
  dict(VARIANTS["wan21-tiny"][1], model="tests/fixtures/wan_pipeline/i2v"),
)
VARIANTS["wan22-i2v-high-tiny"] = (
  "md_train.recipes:wan21_tiny",
  dict(VARIANTS["wan21-tiny"][1], model="tests/fixtures/wan_pipeline/i2v_a14b", expert="high"),
)
VARIANTS["wan22-ti2v-tiny"] = (
  "md_train.recipes:wan21_tiny",
  dict(VARIANTS["wan21-tiny"][1], model="tests/fixtures/wan_pipeline/ti2v"),
)

# Dreambooth (train_dreambooth.py) on the tiny SD pipeline: three 32x32 instance images of a red disc,
# prior preservation with 4 class images the pipeline generates into class_dir at the first run.
VARIANTS["dreambooth-tiny"] = (
  "md_train.recipes:dreambooth_sd",
  dict(
    model="tests/fixtures/sd_pipeline/sd",
    instance_dir="tests/fixtures/train_dreambooth_step/instance",
    instance_prompt="a photo of sks disc",
    class_dir="",  # empty: <workdir>/class_images (apps/train and apps/dreambooth_train fill it in)
    class_prompt="a photo of a disc",
    with_prior_preservation=True,
    prior_loss_weight=1.0,
    num_class_images=4,
    class_steps=2,
    class_guidance=7.5,
    batch_size=1,
    size=32,
    learning_rate=5e-4,
    warmup_steps=0,
    max_grad_norm=1.0,
    weight_decay=1e-2,
    snr_gamma=0.0,
  ),
)
# train_text_encoder: the scripts' --train_text_encoder (LoRAs on the CLIP encoders too; SD, SDXL, Flux.1).
VARIANTS["dreambooth-lora-tiny"] = (
  "md_train.recipes:dreambooth_sd",
  dict(
    VARIANTS["dreambooth-tiny"][1], learning_rate=1e-2, lora=dict(_LORA), train_text_encoder=False
  ),
)
# Dreambooth-LoRA for SDXL (train_dreambooth_lora_sdxl.py) and Flux.1 (train_dreambooth_lora_flux.py) on
# their tiny pipelines, the same instance images; class images generated into their own class_dir.
VARIANTS["dreambooth-sdxl-lora-tiny"] = (
  "md_train.recipes:dreambooth_sd",
  dict(
    VARIANTS["dreambooth-lora-tiny"][1],
    model="tests/fixtures/sd_pipeline/sdxl",
  ),
)
_DB_FLUX = {k: v for k, v in VARIANTS["dreambooth-lora-tiny"][1].items() if k != "snr_gamma"}
VARIANTS["dreambooth-flux-lora-tiny"] = (
  "md_train.recipes:dreambooth_flux",
  dict(
    _DB_FLUX,
    model="tests/fixtures/flux_pipeline/dev",
    class_guidance=3.5,
    guidance=3.5,
    max_sequence_length=64,
    lora=dict(_LORA, targets=_FLUX_TARGETS),
  ),
)
# Dreambooth-LoRA for Flux.2 Klein (train_dreambooth_lora_flux2_klein.py: its default targets, the double
# blocks' attention projections and the single blocks' fused projection) on the tiny Klein pipeline.
VARIANTS["dreambooth-klein-lora-tiny"] = (
  "md_train.recipes:dreambooth_klein",
  dict(
    _DB_FLUX,
    model="tests/fixtures/flux2_pipeline/klein",
    class_guidance=4.0,
    text_encoder_out_layers="1,2,3",  # the tiny Qwen3 has 3 layers
    max_sequence_length=96,
    lora=dict(_LORA, targets="to_k,to_q,to_v,to_out.0,to_qkv_mlp_proj"),
  ),
)


# Shapes variants: md's default models (apps/configs/default_models.py, trained from random init on the
# shapes dataset) trained further by their own stages' recipes: the image model's UNet
# (md_train.shapes_sd.sd_recipe) and the video model's transformer (md_train.shapes_models.wan_recipe), from
# the shipped folders, on 256 fresh images / clips (raise num_images / num_clips for more).
def _default_models():
  import importlib.util
  import pathlib

  path = pathlib.Path(__file__).resolve().with_name("default_models.py")
  spec = importlib.util.spec_from_file_location("_md_default_models_config", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.VARIANTS


_DM = _default_models()
_MORE = dict(warmup_steps=2)  # the app's default run is 6 steps
VARIANTS["sd15-shapes"] = (
  _DM["sd"][0],
  dict(_DM["sd"][2], base="models/shapes-sd", num_images=256, **_MORE),
)
VARIANTS["wan21-shapes"] = (
  _DM["wan"][0],
  dict(_DM["wan"][2], base="models/shapes-wan", num_clips=256, **_MORE),
)

# Training on an apps/prepare_data workdir (`records`, required): the denoiser of the model the records
# were encoded with (`model` empty), or of another folder with the same VAE. Add `lora=` for a LoRA.
_RECORDS = dict(
  records="",
  model="",
  records_channels_first=True,  # only read for records without settings.json (MaxDiffusion's layout)
  batch_size=2,
  shuffle_buffer=1024,
  learning_rate=1e-4,
  warmup_steps=2,
  max_grad_norm=1.0,
  weight_decay=1e-2,
)
VARIANTS["sd15-records"] = ("md_train.recipes:sd15_tiny", dict(_RECORDS, snr_gamma=0.0))
VARIANTS["wan21-records"] = ("md_train.recipes:wan21_tiny", dict(_RECORDS, shift=5.0))


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  name = arg or "wan21-tiny"
  if name not in VARIANTS:
    raise ValueError(f"unknown variant {name!r}; choose one of {', '.join(VARIANTS)}")
  recipe, options = VARIANTS[name]
  config = ml_collections.ConfigDict(
    dict(
      variant=name,
      recipe=recipe,
      steps=6,
      seed=0,
      checkpoint_every=2,
      keep=3,
      eval_every=0,
      log_every=1,
      export=True,
      peak_flops=placeholder(float),
      # A jax.profiler trace of steps profile_start + 1 .. profile_start + profile_steps, in
      # <workdir>/profile (0 steps: none).
      profile_start=2,
      profile_steps=0,
      recipe_options=ml_collections.ConfigDict(options),
    )
  )
  md_apps.add_runtime_config(config)
  config.lock()
  return config
