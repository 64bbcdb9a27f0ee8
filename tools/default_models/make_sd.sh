#!/usr/bin/env bash
# Trains md's default image model from scratch and copies it to models/shapes-sd (see its README).
#
#   bash tools/default_models/make_sd.sh          # runs/ holds the template, both stages' workdirs
#
# The template (random init, the architecture) comes from the PyTorch reference in tools/.venv
# (bash tools/make_fixtures.sh creates it); training and export are md's own (apps/train).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
export HF_HUB_OFFLINE=1
rm -rf runs/shapes-sd-template runs/shapes-sd-vae runs/shapes-sd runs/shapes-sd-lora-purple
tools/.venv/bin/python tools/default_models/sd_template.py runs/shapes-sd-template
uv run apps/train --config=apps/configs/default_models.py:sd-vae --workdir=runs/shapes-sd-vae
uv run apps/train --config=apps/configs/default_models.py:sd --workdir=runs/shapes-sd
mkdir -p models/shapes-sd
for part in model_index.json scheduler text_encoder tokenizer unet vae; do
  rm -rf "models/shapes-sd/$part"
  cp -r "runs/shapes-sd/export/$part" models/shapes-sd/
done
uv run python bench/default_models.py --image --scores   # the quality numbers of the card
# A LoRA on the finished model: every shape drawn purple (models/shapes-sd-lora-purple).
uv run apps/train --config=apps/configs/default_models.py:sd-lora-purple --workdir=runs/shapes-sd-lora-purple
mkdir -p models/shapes-sd-lora-purple
cp runs/shapes-sd-lora-purple/export/pytorch_lora_weights.safetensors models/shapes-sd-lora-purple/
