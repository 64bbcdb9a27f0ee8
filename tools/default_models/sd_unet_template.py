"""A copy of an SD pipeline folder whose UNet is a fresh random init of another size (for
tools/default_models/sweep_sd.py's `base`).

    tools/.venv/bin/python tools/default_models/sd_unet_template.py SRC OUT '{"block_out_channels": [64, 128]}'

SRC is a folder with the trained VAE (the sd-vae stage's export, or models/shapes-sd); OUT gets its other
components and a `UNet2DConditionModel` with tools/default_models/sd_template.py's sizes updated by the
JSON overrides. The UNet is drawn from torch seed 0 after the template's VAE and text encoder draws, as
sd_template.py draws it, so `{}` gives the template's own UNet.
"""

import json
import pathlib
import shutil
import sys

import torch
import transformers as tf
from diffusers import AutoencoderKL, UNet2DConditionModel

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import sd_template  # noqa: E402


def main(src: pathlib.Path, out: pathlib.Path, overrides: dict) -> None:
  if out.exists():
    shutil.rmtree(out)
  shutil.copytree(src, out)
  shutil.rmtree(out / "unet")
  text = tf.CLIPTextConfig.from_pretrained(src / "text_encoder")
  torch.manual_seed(0)
  AutoencoderKL(**sd_template.VAE)  # the template's draws before its UNet's
  tf.CLIPTextModel(text)
  sizes = sd_template.UNET | {
    k: tuple(v) if isinstance(v, list) else v for k, v in overrides.items()
  }
  model = UNet2DConditionModel(**sizes).eval()
  model.save_pretrained(out / "unet")
  print(f"wrote {out}: {sum(p.numel() for p in model.parameters())} UNet parameters")


if __name__ == "__main__":
  main(pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2]), json.loads(sys.argv[3]))
