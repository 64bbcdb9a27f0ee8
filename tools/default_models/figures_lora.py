"""The purple LoRA's card figures: its loss curve (figures.py's plot) and a before / after grid.

uv run python tools/default_models/figures_lora.py runs/shapes-sd-lora-purple models/shapes-sd-lora-purple

Writes <card>/loss.png and <card>/samples.png: for each of six prompts naming other colours (seed 0, 20
steps, guidance 3), the image of models/shapes-sd without the LoRA above the image with it.
"""

import pathlib
import sys

import numpy as np
from PIL import Image

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from figures import loss_plot  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[2]
PROMPTS = (
  "a red circle in the top left on a white background",
  "a green square in the center on a black background",
  "a blue triangle at the bottom on a gray background",
  "a yellow star in the top right on a black background",
  "a red diamond on the left on a gray background",
  "a green triangle in the bottom right on a white background",
)


def before_after(card: pathlib.Path, out: pathlib.Path) -> None:
  import md_sd

  pipe = md_sd.load_pipeline(ROOT / "models" / "shapes-sd")
  kw = dict(height=64, width=64, num_inference_steps=20, guidance_scale=3.0, seed=0, progress=False)
  before = np.asarray(pipe(list(PROMPTS), "", **kw))
  pipe.load_lora(card / "pytorch_lora_weights.safetensors", name="purple")
  after = np.asarray(pipe(list(PROMPTS), "", **kw))
  grid = np.concatenate([np.concatenate(list(before), 1), np.concatenate(list(after), 1)], 0)
  Image.fromarray((grid * 255).round().astype(np.uint8)).save(out)


if __name__ == "__main__":
  run, card = map(pathlib.Path, sys.argv[1:])
  loss_plot([run], card / "loss.png")
  before_after(card, card / "samples.png")
  print(f"wrote {card / 'loss.png'} and {card / 'samples.png'}")
