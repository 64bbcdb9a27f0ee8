"""The image model card's figures: loss curves (figures.py's plot) and a sample grid.

uv run python tools/default_models/figures_sd.py runs/shapes-sd-vae runs/shapes-sd models/shapes-sd

Writes models/shapes-sd/loss.png (each stage's training loss against its step, log scale) and
models/shapes-sd/samples.png (one row per prompt, seeds 0-5 across; 20 steps, guidance 3; the last two rows
are held-out colour x shape pairs).
"""

import pathlib
import sys

import numpy as np
from PIL import Image

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from figures import loss_plot  # noqa: E402

PROMPTS = (
  "a red circle in the top left on a white background",
  "a green triangle at the bottom on a black background",
  "a blue square in the center on a gray background",
  "a yellow star on the right on a black background",
  "a purple diamond at the top on a white background",
  "a red star in the center on a gray background",  # held out
  "a blue triangle in the bottom right on a white background",  # held out
)
SEEDS = range(6)


def sample_grid(model: pathlib.Path, out: pathlib.Path) -> None:
  import md_sd

  pipe = md_sd.load_pipeline(model)
  kw = dict(height=64, width=64, num_inference_steps=20, guidance_scale=3.0, progress=False)
  images = np.stack([np.asarray(pipe(list(PROMPTS), "", seed=s, **kw)) for s in SEEDS], axis=1)
  rows = [np.concatenate(list(r), axis=1) for r in images]  # [prompts][H, seeds * W, 3]
  grid = (np.concatenate(rows, axis=0) * 255).round().astype(np.uint8)
  Image.fromarray(grid).resize((grid.shape[1] * 2, grid.shape[0] * 2), Image.NEAREST).save(out)


if __name__ == "__main__":
  *runs, model = map(pathlib.Path, sys.argv[1:])
  loss_plot(runs, model / "loss.png")
  sample_grid(model, model / "samples.png")
  print(f"wrote {model / 'loss.png'} and {model / 'samples.png'}")
