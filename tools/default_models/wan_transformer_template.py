"""A copy of a Wan pipeline folder whose transformer is a fresh random init of another size (for
tools/default_models/sweep_wan.py's `base`).

    tools/.venv/bin/python tools/default_models/wan_transformer_template.py SRC OUT '{"num_layers": 6}'

SRC is the wan-vae-still stage's export (the template with the trained VAE); OUT gets its other components
and a `WanTransformer3DModel` with tools/default_models/wan_template.py's sizes updated by the JSON
overrides, drawn from torch seed 0 alone (so not the draws of the shipped template's transformer).
"""

import json
import pathlib
import shutil
import sys

import torch
from diffusers import WanTransformer3DModel

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import wan_template  # noqa: E402


def main(src: pathlib.Path, out: pathlib.Path, overrides: dict) -> None:
  if out.exists():
    shutil.rmtree(out)
  shutil.copytree(src, out)
  shutil.rmtree(out / "transformer")
  torch.manual_seed(0)
  model = WanTransformer3DModel(**(wan_template.TRANSFORMER | overrides)).eval()
  model.save_pretrained(out / "transformer")
  print(f"wrote {out}: {sum(p.numel() for p in model.parameters())} transformer parameters")


if __name__ == "__main__":
  main(pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2]), json.loads(sys.argv[3]))
