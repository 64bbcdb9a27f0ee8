"""Writes a key manifest: the tensor names, shapes and dtypes a reference model class has for a real config.

The model is built on torch's meta device, so no memory is allocated and no weights are needed; the JSON
(gzipped when the output name ends in .json.gz, as tests/fixtures/manifests stores them) is small and lets md's tests prove that a key map covers a real checkpoint (md_core.coverage).

  tools/.venv/bin/python tools/key_manifest.py diffusers:UNet2DConditionModel unet_config.json out.json
  tools/.venv/bin/python tools/key_manifest.py transformers:CLIPTextModel clip_config.json out.json \
      --prefix text_model.=text_model.

(`bash tools/make_fixtures.sh` creates tools/.venv.) `--prefix OLD=NEW` renames name prefixes, for hub files
whose names differ from what the current library saves (see DESIGN.md §6); `--dtype` records the dtype the
real files store.
"""

import argparse
import importlib
import json
import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from fixtures._common import save_manifest  # noqa: E402


def build_meta(spec: str, config: dict) -> torch.nn.Module:
  """Builds `module:Class` from a config dict on the meta device (diffusers `from_config`, else transformers)."""
  module_name, _, class_name = spec.partition(":")
  if not class_name:
    raise SystemExit(f"model class must look like 'diffusers:UNet2DConditionModel', got {spec!r}")
  cls = getattr(importlib.import_module(module_name), class_name)
  config = {k: v for k, v in config.items() if not k.startswith("_")}
  with torch.device("meta"):
    if hasattr(cls, "from_config") and not hasattr(cls, "config_class"):
      return cls.from_config(config)
    return cls(cls.config_class(**config))


def manifest(
  model: torch.nn.Module, *, source: str, prefixes: list[tuple[str, str]], dtype: str | None
) -> dict:
  tensors = {}
  for name, value in model.state_dict().items():
    for old, new in prefixes:
      if name.startswith(old):
        name = new + name[len(old) :]
        break
    tensors[name] = {
      "shape": list(value.shape),
      "dtype": dtype or str(value.dtype).removeprefix("torch."),
    }
  return {"source": source, "num_tensors": len(tensors), "tensors": dict(sorted(tensors.items()))}


def main(argv: list[str]) -> int:
  parser = argparse.ArgumentParser(
    description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
  )
  parser.add_argument("model_class", help="module:Class, e.g. diffusers:WanTransformer3DModel")
  parser.add_argument("config", type=pathlib.Path, help="the real model's config.json")
  parser.add_argument(
    "out",
    type=pathlib.Path,
    help="where to write the manifest JSON (gzipped if it ends in .json.gz)",
  )
  parser.add_argument("--prefix", action="append", default=[], help="OLD=NEW name prefix rename")
  parser.add_argument("--dtype", default=None, help="dtype to record (e.g. bfloat16)")
  parser.add_argument("--source", default=None, help="where the config came from (hub id)")
  args = parser.parse_args(argv)
  prefixes = [tuple(p.split("=", 1)) for p in args.prefix]
  model = build_meta(args.model_class, json.loads(args.config.read_text()))
  data = manifest(
    model, source=args.source or str(args.config), prefixes=prefixes, dtype=args.dtype
  )
  args.out.parent.mkdir(parents=True, exist_ok=True)
  save_manifest(args.out, data)
  print(f"{args.out}: {data['num_tensors']} tensors")
  return 0


if __name__ == "__main__":
  raise SystemExit(main(sys.argv[1:]))
