"""md's default models (models/shapes-wan, models/shapes-sd): quality on the held-out prompt set and speed.

uv run python bench/default_models.py            # the video model: quality + speed (in-process and the README command)
uv run python bench/default_models.py --scores   # quality only
uv run python bench/default_models.py --image    # the image model (shapes-sd): quality + speed
uv run python bench/default_models.py --image --scores
uv run python bench/default_models.py --scores runs/shapes-wan/export   # quality of another folder

Quality: md_data's analyser on `md_train.shapes_models.quality_prompts()` x 2 seeds (20 steps, guidance 3),
rates of the right colour, shape, direction and background, for the held-out colour x shape pairs and the
trained ones. Speed: one video after compilation (in process), and the README's command
`uv run apps/wan_generate --config.prompt=...` as a fresh process: cold (no persistent compilation cache) and
warm (the second run with the default cache).

The image model: md_data's analyser on `md_train.shapes_sd.quality_prompts()` x 2 seeds (20 steps, guidance
3), rates of the right colour, shape, position and background; one 64x64 image after compilation, and
`uv run apps/sd_generate --config.prompt=...` as a fresh process, cold and warm.
"""

import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _table(pipe, score_fn, keys: tuple[str, ...], unit: str) -> dict:
  """`score_fn(pipe)`'s `Scores` per group as plain rates (`keys`) and counts (`unit`), and the seconds."""
  start = time.perf_counter()
  result = score_fn(pipe)
  out = {
    group: {k: getattr(s, k) for k in keys} | {unit: s.counts["colour"]}
    for group, s in result.items()
  }
  out["seconds"] = round(time.perf_counter() - start, 1)
  return out


def _folder(default: str) -> pathlib.Path:
  """The model folder: the first argument that is not a flag, else models/<default>."""
  given = [a for a in sys.argv[1:] if not a.startswith("--")]
  return pathlib.Path(given[0]) if given else ROOT / "models" / default


def scores() -> dict:
  import md_wan
  from md_train import shapes_models as sm

  pipe = md_wan.load_pipeline(_folder("shapes-wan"))
  return _table(pipe, sm.video_scores, ("colour", "shape", "direction", "background"), "videos")


def speed() -> dict:
  import md_wan

  pipe = md_wan.load_pipeline(ROOT / "models" / "shapes-wan")
  kw = dict(height=64, width=64, num_frames=9, num_inference_steps=20, guidance_scale=3.0)
  kw |= dict(max_sequence_length=16, progress=False)
  pipe("a red circle moving right", "", **kw)  # compile
  times = []
  for seed in range(3):
    t = time.perf_counter()
    pipe("a green triangle moving up on a black background", "", seed=seed, **kw)
    times.append(time.perf_counter() - t)
  out = {"video_after_compile_s": round(min(times), 2)}
  return out | _readme_command("wan_generate", "a green triangle moving up on a black background")


def _readme_command(app: str, prompt: str) -> dict:
  """Seconds of `uv run apps/<app> --config.prompt=...` as a fresh process: cold (no persistent
  compilation cache) and warm (the second of two runs with the default cache)."""
  out = {}
  with tempfile.TemporaryDirectory() as tmp:
    env = dict(os.environ, MD_PROGRESS="0", HF_HUB_OFFLINE="1")
    for run, cache in (("cold", "False"), ("fill", "True"), ("warm", "True")):
      t = time.perf_counter()
      subprocess.run(
        [
          "uv", "run", "--no-sync", f"apps/{app}", f"--config.prompt={prompt}",
          f"--workdir={tmp}/{run}", f"--config.compilation_cache={cache}",
        ],
        cwd=ROOT, env=env, check=True, capture_output=True,
      )  # fmt: skip
      if run != "fill":
        out[f"readme_command_{run}_s"] = round(time.perf_counter() - t, 1)
  return out


def image_scores() -> dict:
  import md_sd
  from md_train import shapes_sd as ss

  pipe = md_sd.load_pipeline(_folder("shapes-sd"))
  return _table(pipe, ss.image_scores, ("colour", "shape", "position", "background"), "images")


def image_speed() -> dict:
  import md_sd

  pipe = md_sd.load_pipeline(ROOT / "models" / "shapes-sd")
  kw = dict(height=64, width=64, num_inference_steps=20, guidance_scale=3.0, progress=False)
  pipe("a red circle in the top left", "", **kw).block_until_ready()  # compile
  times = []
  for seed in range(3):
    t = time.perf_counter()
    pipe("a green triangle at the bottom", "", seed=seed, **kw).block_until_ready()
    times.append(time.perf_counter() - t)
  out = {"image_after_compile_s": round(min(times), 3)}
  return out | _readme_command("sd_generate", "a red circle in the top left")


if __name__ == "__main__":
  if "--image" in sys.argv:
    report = {"scores": image_scores()}
    if "--scores" not in sys.argv:
      report["speed"] = image_speed()
  else:
    report = {"scores": scores()}
    if "--scores" not in sys.argv:
      report["speed"] = speed()
  print(json.dumps(report, indent=2))
