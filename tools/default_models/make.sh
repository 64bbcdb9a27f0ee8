#!/usr/bin/env bash
# Trains md's default video model from scratch and copies it to models/shapes-wan (see its README).
#
#   bash tools/default_models/make.sh          # runs/ holds the template, both stages' workdirs
#
# The template (random init, the architecture) comes from the PyTorch reference in tools/.venv
# (bash tools/make_fixtures.sh creates it); training and export are md's own (apps/train).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
export HF_HUB_OFFLINE=1
# glibc returns the scratch buffer XLA allocates for every run of the training step (about 115 MB per device
# for the transformer stage, above malloc's 32 MB mmap ceiling) to the kernel after each step and faults it
# in again on the next: 56 k page faults a step. Huge pages for malloc's mappings (with mmap off and no
# trimming) cut that to about 800 and the step's CPU time by about 10%; the arithmetic is untouched (the
# losses and weights are bitwise those of a run without it). bench/README.md, "Training steps".
export GLIBC_TUNABLES="${GLIBC_TUNABLES:-glibc.malloc.hugetlb=1:glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=68719476736}"
rm -rf runs/shapes-wan-template runs/shapes-wan-vae-still runs/shapes-wan
tools/.venv/bin/python tools/default_models/wan_template.py runs/shapes-wan-template
uv run apps/train --config=apps/configs/default_models.py:wan-vae-still --workdir=runs/shapes-wan-vae-still
# The transformer on stage 1's latents. (The `wan-vae` variant, the decoder side fine-tuned on 9-frame
# clips, is not part of the shipped model: measured, it lowered the clip reconstructions' shape rate from
# 94% to 50%; models/shapes-wan/README.md.)
uv run apps/train --config=apps/configs/default_models.py:wan --workdir=runs/shapes-wan
mkdir -p models/shapes-wan
for part in model_index.json scheduler text_encoder tokenizer transformer vae; do
  rm -rf "models/shapes-wan/$part"
  cp -r "runs/shapes-wan/export/$part" models/shapes-wan/
done
uv run python bench/default_models.py --scores models/shapes-wan   # the quality numbers of the card
