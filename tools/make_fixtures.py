"""Builds parity fixtures from the PyTorch reference.

Each module `tools/fixtures/<name>.py` defines `generate(out: pathlib.Path) -> None`, writing into
`tests/fixtures/<name>/`; modules may also define `manifests(out: pathlib.Path) -> None`, writing key manifests
into `tests/fixtures/manifests/`. Run through `bash tools/make_fixtures.sh [names…] [--manifests]`.
"""

import argparse
import importlib
import pathlib
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures"


def _generators() -> list[str]:
  return sorted(
    p.stem for p in (ROOT / "tools" / "fixtures").glob("*.py") if not p.stem.startswith("_")
  )


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument(
    "names", nargs="*", help=f"generators to run (default: all of {_generators()})"
  )
  parser.add_argument(
    "--manifests", action="store_true", help="write key manifests instead of fixtures"
  )
  args = parser.parse_args()
  sys.path.insert(0, str(ROOT / "tools"))
  names = args.names or _generators()
  unknown = sorted(set(names) - set(_generators()))
  if unknown:
    parser.error(f"unknown generators {unknown}; known: {_generators()}")
  for name in names:
    module = importlib.import_module(f"fixtures.{name}")
    start = time.perf_counter()
    if args.manifests:
      if not hasattr(module, "manifests"):
        continue
      out = FIXTURES / "manifests"
      out.mkdir(parents=True, exist_ok=True)
      module.manifests(out)
    else:
      out = FIXTURES / name
      out.mkdir(parents=True, exist_ok=True)
      module.generate(out)
    print(f"{name}: wrote {out.relative_to(ROOT)} in {time.perf_counter() - start:.1f}s")
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
