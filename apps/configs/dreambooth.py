"""dreambooth_train: Dreambooth (and Dreambooth-LoRA) fine-tuning through md's training loop.

uv run apps/dreambooth_train --workdir=/tmp/db     # sd15-lora-tiny: the tiny SD pipeline, 3 instance images
uv run apps/dreambooth_train --config=apps/configs/dreambooth.py:flux1-lora-tiny --workdir=/tmp/db-flux
uv run apps/dreambooth_train --config=apps/configs/dreambooth.py:sd15-lora-tiny --workdir=/tmp/db-dog \
  --config.recipe_options.model=/path/to/sd-folder --config.recipe_options.instance_dir=/path/to/photos \
  --config.recipe_options.instance_prompt="a photo of sks dog" \
  --config.recipe_options.class_prompt="a photo of a dog" --config.recipe_options.class_dir=/tmp/dog-class \
  --config.recipe_options.size=512 --config.recipe_options.num_class_images=100 --config.steps=400
uv run apps/dreambooth_train --help --config=apps/configs/dreambooth.py:sdxl-lora-tiny   # keys and values

Variants: sd15-tiny (the whole UNet, diffusers' train_dreambooth.py), sd15-lora-tiny (a LoRA only,
train_dreambooth_lora.py), sdxl-lora-tiny (train_dreambooth_lora_sdxl.py), flux1-lora-tiny
(train_dreambooth_lora_flux.py), klein-lora-tiny (train_dreambooth_lora_flux2_klein.py), each on the tiny pipeline of tests/fixtures with the three instance
images of tests/fixtures/train_dreambooth_step/instance; the same recipes as apps/train's dreambooth-*
variants (`md_train.recipes.dreambooth_sd` / `dreambooth_flux` / `dreambooth_klein`). `recipe_options`: `model` (a diffusers
pipeline folder), `instance_dir` (the subject's images, center-cropped and resized to `size`),
`instance_prompt` (with the identifier, e.g. "a photo of sks dog"), `with_prior_preservation`,
`class_dir` (default: `<workdir>/class_images`) / `class_prompt` / `num_class_images` (the class images; the missing ones are generated into
`class_dir` by md's own pipeline first: `class_steps` steps at `class_guidance`), `prior_loss_weight`,
`batch_size` (examples per half), `learning_rate`, `lora` (rank, alpha, targets, init, seed, rslora, dora),
`train_text_encoder` (with a `lora`: LoRAs on the CLIP text encoders too (SDXL's both, Flux.1's CLIP), all in the export). The run
resumes from `<workdir>/checkpoints`; the model (or the LoRA, a PEFT file diffusers'
`load_lora_weights` reads) is exported to `<workdir>/export`.
"""

import importlib.util
import pathlib

import ml_collections


def _train_variants() -> dict:
  path = pathlib.Path(__file__).resolve().with_name("train.py")
  spec = importlib.util.spec_from_file_location("_md_train_config", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


_TRAIN = _train_variants()
# variant -> apps/configs/train.py's variant
VARIANTS = {
  "sd15-tiny": "dreambooth-tiny",
  "sd15-lora-tiny": "dreambooth-lora-tiny",
  "sdxl-lora-tiny": "dreambooth-sdxl-lora-tiny",
  "flux1-lora-tiny": "dreambooth-flux-lora-tiny",
  "klein-lora-tiny": "dreambooth-klein-lora-tiny",
}


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  name = arg or "sd15-lora-tiny"
  if name not in VARIANTS:
    raise ValueError(f"unknown variant {name!r}; choose one of {', '.join(VARIANTS)}")
  config = _TRAIN.get_config(VARIANTS[name])
  with config.unlocked():
    config.variant = name
  return config
