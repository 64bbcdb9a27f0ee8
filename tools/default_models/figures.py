"""The model card's figures: loss curves (PNG, drawn with PIL from the runs' metrics.jsonl) and a sample grid.

uv run python tools/default_models/figures.py runs/shapes-wan-vae-still runs/shapes-wan models/shapes-wan

A stage may be given as a PNG panel instead of its run folder (e.g. models/shapes-wan/loss-vae.png, the
2026-12-03 VAE stage's curve, whose run folder only existed where that stage was trained); it is pasted as is.

Writes models/shapes-wan/loss.png (each stage's training loss against its step, log scale) and
models/shapes-wan/samples.png (one row per prompt: the 9 frames of a 20-step, guidance-3 video, seed 0).
"""

import json
import math
import pathlib
import sys

import numpy as np
from PIL import Image, ImageDraw

PROMPTS = (
  "a green triangle moving up on a black background",
  "a red circle moving right on a black background",
  "a blue square moving left on a white background",
  "a yellow star moving down on a gray background",
  "a purple diamond moving right on a black background",
  "a red star moving up on a white background",  # a held-out colour x shape pair
)


def loss_plot(runs: list[pathlib.Path], out: pathlib.Path) -> None:
  w, h, pad = 640, 360, 48
  img = Image.new("RGB", (w, h * len(runs)), "white")
  draw = ImageDraw.Draw(img)
  for r, run in enumerate(runs):
    # A stage's panel drawn earlier (its run folder is gone): pasted as it is.
    if run.suffix == ".png":
      img.paste(Image.open(run).convert("RGB").crop((0, 0, w, h)), (0, r * h))
      continue
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line]
    rows = [x for x in rows if "loss" in x]
    steps = np.array([x["step"] for x in rows], float)
    loss = np.log10(np.array([x["loss"] for x in rows], float))
    top = r * h
    lo, hi = math.floor(loss.min() * 4) / 4, math.ceil(loss.max() * 4) / 4 + 1e-9
    last = max(float(steps.max()), 1.0)

    def xy(s, v, top=top, lo=lo, hi=hi, last=last):
      return (
        pad + (w - 2 * pad) * s / last,
        top + h - pad - (h - 2 * pad) * (v - lo) / (hi - lo),
      )

    draw.rectangle([pad, top + pad, w - pad, top + h - pad], outline="black")
    draw.line([xy(s, v) for s, v in zip(steps, loss)], fill=(200, 30, 30), width=2)
    for v in np.arange(lo, hi, 0.25):
      draw.text((4, xy(0, v)[1] - 6), f"{10**v:.3g}", fill="black")
    draw.text((pad, top + 8), f"{run.name}: training loss (log scale) vs step", fill="black")
    draw.text((w - pad - 30, top + h - pad + 6), f"{int(steps.max())}", fill="black")
  img.save(out)


def sample_grid(model: pathlib.Path, out: pathlib.Path) -> None:
  import md_wan

  pipe = md_wan.load_pipeline(model)
  videos = np.asarray(
    pipe(list(PROMPTS), "", height=64, width=64, num_frames=9, num_inference_steps=20,
         guidance_scale=3.0, max_sequence_length=16, seed=0, progress=False)
  )  # fmt: skip
  rows = [np.concatenate(list(v), axis=1) for v in videos]
  grid = (np.concatenate(rows, axis=0) * 255).round().astype(np.uint8)
  Image.fromarray(grid).save(out)


if __name__ == "__main__":
  *runs, model = map(pathlib.Path, sys.argv[1:])
  loss_plot(runs, model / "loss.png")
  sample_grid(model, model / "samples.png")
  print(f"wrote {model / 'loss.png'} and {model / 'samples.png'}")
