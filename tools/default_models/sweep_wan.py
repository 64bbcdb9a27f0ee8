"""Trains the default video model's transformer stage under several settings in one process and scores each.

    uv run python tools/default_models/sweep_wan.py --base=runs/shapes-wan-vae-still/export \
        --out=runs/sweep --runs='[{"name": "shipped", "steps": 3000}, {"name": "ema", "steps": 3000, "ema_decay": 0.999}]'

Each run is the `wan` variant of apps/configs/default_models.py (`md_train.shapes_models.wan_recipe`) with
the run's keys as `recipe_options` overrides (`steps` and `seed` are the run's own; `base` may name another
starting folder, e.g. a wider transformer's template). It trains, exports to `<out>/<name>`, and scores the
export with `md_train.shapes_models.video_scores` (the model card's 72 videos). One JSON line per run goes to
`<out>/results.jsonl` and to stdout. A run's `guidance` (a list, default [3]) scores the export at each
of those guidance scales (the groups of scales other than 3 are keyed `group@scale`). The settings this
explored and what they scored are in models/shapes-wan/README.md; it runs on any JAX backend (the card's sweeps ran on a TPU, the shipped
model's recipe on the CPU).
"""

import argparse
import json
import pathlib
import time

import jax

import md_wan
from md_core import testing
from md_train import shapes_models as sm


def _config(run: dict, base: str):
  config = testing.app_config("default_models.py:wan")  # the app's own config loader
  run = dict(run)
  config.steps = int(run.pop("steps"))
  config.seed = int(run.pop("seed", 0))
  run.pop("name")
  run.pop("guidance", None)
  options = config.recipe_options.to_dict() | {"base": base} | run
  config.recipe_options = options
  return config


def train_and_score(run: dict, *, base: str, out: pathlib.Path, log_every: int) -> dict:
  config = _config(run, run.get("base", base))
  start = time.perf_counter()
  recipe = sm.wan_recipe(config)
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
  pipe = md_wan.load_pipeline(folder)
  row = dict(run=run, setup_s=round(ready - start, 1), train_s=round(trained - ready, 1))
  for guidance in run.get("guidance", [3.0]):
    scores = sm.video_scores(pipe, guidance_scale=float(guidance))
    key = "" if guidance == 3.0 else f"@{guidance:g}"
    for group, s in scores.items():
      row[group + key] = {
        k: round(getattr(s, k), 3) for k in ("colour", "shape", "direction", "background")
      }
  row["score_s"] = round(time.perf_counter() - trained, 1)
  row["losses"] = losses
  return row


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--base", required=True, help="the wan-vae-still stage's export")
  parser.add_argument("--out", required=True)
  parser.add_argument("--runs", required=True, help="a JSON list of runs (see the docstring)")
  parser.add_argument("--log_every", type=int, default=500)
  args = parser.parse_args()
  runs = json.loads(args.runs)
  names = [r.get("name") for r in runs]
  if None in names or len(set(names)) != len(names) or any("steps" not in r for r in runs):
    raise SystemExit("--runs: every run needs a unique 'name' and its 'steps'")
  for r in runs:
    g = r.get("guidance", [3.0])
    if not isinstance(g, list) or not g or not all(isinstance(x, (int, float)) for x in g):
      raise SystemExit(f"--runs: run {r['name']!r} has guidance={g!r}; expected a list of numbers")
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
