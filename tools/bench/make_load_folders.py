"""Full-size random-init reference models saved by diffusers, for bench/load.py (never committed).

Run with the tools virtualenv; nothing is downloaded (the configs are tools/configs/ copies of the hub ones):

  tools/.venv/bin/python tools/bench/make_load_folders.py --out /tmp/md_load_bench [--only wan|sd]

Writes `<out>/wan2.1-1.3b/transformer/` (WanTransformer3DModel) and `<out>/sd1.5/unet/`
(UNet2DConditionModel), float32, sharded safetensors (diffusers' default 10 GB shards are made smaller with
`max_shard_size` so the folders have an index, as the hub ones do).
"""

import argparse
import json
import pathlib
import time

import torch

CONFIGS = pathlib.Path(__file__).resolve().parents[1] / "configs"


def _make(name: str, out: pathlib.Path) -> None:
  import diffusers

  if name == "wan":
    cls, cfg, folder = (
      diffusers.WanTransformer3DModel,
      CONFIGS / "wan" / "wan2.1_t2v_1.3b_transformer.json",
      out / "wan2.1-1.3b" / "transformer",
    )
  else:
    cls, cfg, folder = (
      diffusers.UNet2DConditionModel,
      CONFIGS / "sd" / "unet_sd15.json",
      out / "sd1.5" / "unet",
    )
  if (folder / "config.json").is_file():
    print(f"{folder}: already there")
    return
  config = {k: v for k, v in json.loads(cfg.read_text()).items() if not k.startswith("_")}
  start = time.perf_counter()
  torch.manual_seed(0)
  model = cls.from_config(config)
  model.save_pretrained(folder, safe_serialization=True, max_shard_size="2GB")
  params = sum(p.numel() for p in model.parameters())
  print(f"{folder}: {params / 1e9:.3f}B parameters in {time.perf_counter() - start:.0f} s")


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", required=True, type=pathlib.Path)
  parser.add_argument("--only", choices=("wan", "sd"), default=None)
  args = parser.parse_args()
  torch.set_num_threads(2)
  for name in ("wan", "sd") if args.only is None else (args.only,):
    _make(name, args.out)


if __name__ == "__main__":
  main()
