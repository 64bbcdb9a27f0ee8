"""Trains the default image model's UNet stage under several settings in one process and scores each.

    uv run python tools/default_models/sweep_sd.py --base=models/shapes-sd --out=runs/sweep-sd \
        --runs='[{"name": "shipped", "steps": 4000}, {"name": "w64", "steps": 4000, "base": "runs/sdt/w64"}]'

Each run is the `sd` variant of apps/configs/default_models.py (`md_train.shapes_sd.sd_recipe`) with the
run's keys as `recipe_options` overrides (`steps` and `seed` are the run's own; `base` may name another
starting folder, e.g. one with a UNet of other sizes from tools/default_models/sd_unet_template.py). It
trains, exports to `<out>/<name>`, and scores the export with `md_train.shapes_sd.image_scores` (the model
card's 80 images). One JSON line per run goes to `<out>/results.jsonl` and to stdout. It runs on any JAX
backend (sweeps on a TPU; the shipped model's recipe runs on the CPU).
"""

import argparse
import json
import pathlib
import time

import jax

import md_sd
from md_core import testing
from md_train import shapes_sd as ss


def _config(run: dict, base: str):
  config = testing.app_config("default_models.py:sd")  # the app's own config loader
  run = dict(run)
  config.steps = int(run.pop("steps"))
  config.seed = int(run.pop("seed", 0))
  run.pop("name")
  config.recipe_options = config.recipe_options.to_dict() | {"base": base} | run
  return config


def train_and_score(run: dict, *, base: str, out: pathlib.Path, log_every: int) -> dict:
  config = _config(run, run.get("base", base))
  start = time.perf_counter()
  recipe = ss.sd_recipe(config)
  ready = time.perf_counter()
  state, losses = recipe.state, []
  for i in range(config.steps):
    state, metrics = recipe.step(state, next(recipe.batches))
    if (i + 1) % log_every == 0:
      losses.append(round(float(metrics["loss"]), 4))
  jax.block_until_ready(state.params)
  trained = time.perf_counter()
  folder = out / run["name"]
  recipe.export(state, folder)
  scores = ss.image_scores(md_sd.load_pipeline(folder))
  row = dict(run=run, setup_s=round(ready - start, 1), train_s=round(trained - ready, 1))
  for group, s in scores.items():
    row[group] = {k: round(getattr(s, k), 3) for k in ("colour", "shape", "position", "background")}
  row["score_s"] = round(time.perf_counter() - trained, 1)
  row["losses"] = losses
  return row


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument(
    "--base", required=True, help="a folder with the trained VAE (the sd-vae export)"
  )
  parser.add_argument("--out", required=True)
  parser.add_argument("--runs", required=True, help="a JSON list of runs (see the docstring)")
  parser.add_argument("--log_every", type=int, default=500)
  args = parser.parse_args()
  runs = json.loads(args.runs)
  names = [r.get("name") for r in runs]
  if None in names or len(set(names)) != len(names) or any("steps" not in r for r in runs):
    raise SystemExit("--runs: every run needs a unique 'name' and its 'steps'")
  out = pathlib.Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  print(f"backend {jax.default_backend()}: {jax.devices()}", flush=True)
  for run in runs:
    row = train_and_score(run, base=args.base, out=out, log_every=args.log_every)
    with open(out / "results.jsonl", "a") as f:
      f.write(json.dumps(row) + "\n")
    print(json.dumps(row), flush=True)


if __name__ == "__main__":
  main()
