"""The fixtures stay small: a budget on their total size (tests/fixtures/README.md says how to stay in it)."""

import hashlib
import pathlib

from md_core.testing import repo_root

MB = 1_000_000
# The design budget is 25 MB; this is the level reached without regenerating any fixture (identical components
# shared, key manifests gzipped, .npz compressed, recorded videos cut to the frames the tests compare). Most
# of the rest is the tiny models' weights: ~37 MB of random float32 safetensors (incompressible), one model per
# parity set (e.g. unet/sd1 and controlnet/sd/unet are two UNets of one config, with different draws).
# Reaching 25 MB means smaller tiny configs or one shared model per config, both of which change the
# reference outputs: regenerating those sets. Lower this as fixtures shrink; share components and trim
# recorded outputs before raising it for a new set.
BUDGET_MB = 51


def _fixture_files() -> list[pathlib.Path]:
  root = repo_root()
  folders = [root / "tests" / "fixtures", *sorted(root.glob("packages/*/tests/fixtures"))]
  return [p for folder in folders for p in folder.rglob("*") if p.is_file()]


def test_fixtures_within_budget():
  root = repo_root()
  files = _fixture_files()
  total = sum(p.stat().st_size for p in files)
  largest = sorted(files, key=lambda p: p.stat().st_size, reverse=True)[:15]
  listing = "\n".join(f"  {p.stat().st_size / MB:6.2f} MB  {p.relative_to(root)}" for p in largest)
  assert total <= BUDGET_MB * MB, (
    f"the fixtures take {total / MB:.1f} MB in {len(files)} files, over the {BUDGET_MB} MB budget; "
    f"share identical components (tests/fixtures/components) and store only the values a test compares. "
    f"The largest files:\n{listing}"
  )


def test_no_large_file_stored_twice():
  """A component or recorded output stored twice is shared instead (tests/fixtures/README.md): no file of
  16 kB or more is byte-identical to another (small configs and tokenizers may repeat)."""
  root = repo_root()
  seen, copies = {}, []
  for path in sorted(_fixture_files()):
    if path.stat().st_size < 16_000:
      continue
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    if digest in seen:
      copies.append(f"  {path.relative_to(root)} = {seen[digest].relative_to(root)}")
    seen.setdefault(digest, path)
  assert not copies, "byte-identical fixture files (share them):\n" + "\n".join(copies)
