"""Writes md's rank-4 extraction of the lora_extract fixture's finetune, for the diffusers check.

    uv run python tools/lora_extract_export.py        # main workspace (JAX); then
    bash tools/make_fixtures.sh lora_extract          # diffusers loads the file and compares

Loads tests/fixtures/lora_extract/base and tuned with md_sd.load_unet, runs md_lora.extract_lora(base,
tuned, rank=4) and md_lora.save_peft (md_sd's UNet key map, the base checkpoint's names, prefix `unet`) into
tests/fixtures/lora_extract/extracted.safetensors, and prints the energy each site keeps.
packages/md-lora/tests/test_extract_diffusers.py checks that md still writes these tensors.
"""

import pathlib

import md_core
import md_lora
import md_sd

ROOT = pathlib.Path(__file__).resolve().parents[1]
FIX = ROOT / "tests" / "fixtures" / "lora_extract"
RANK = 4


def extract(folder: pathlib.Path) -> tuple[md_lora.Extraction, md_sd.UNet2DConditionModel]:
  """md's extraction of `folder`/tuned against `folder`/base, and the base UNet."""
  base = md_sd.load_unet(folder / "base", subfolder=None, progress=False)
  tuned = md_sd.load_unet(folder / "tuned", subfolder=None, progress=False)
  return md_lora.extract_lora(base, tuned, RANK), base


def save(extraction: md_lora.Extraction, base, folder: pathlib.Path, path: pathlib.Path) -> None:
  """Saves the extracted adapter as a diffusers / PEFT file named after the base checkpoint."""
  names = list(md_core.open_checkpoint(folder / "base"))
  md_lora.save_peft(extraction.adapter, path, md_sd.unet_key_map(base.cfg), names, prefix="unet")


def main() -> None:
  extraction, base = extract(FIX)
  path = FIX / "extracted.safetensors"
  save(extraction, base, FIX, path)
  energy = extraction.energy
  print(
    f"wrote {path.relative_to(ROOT)} ({path.stat().st_size} bytes): {len(energy)} sites, kept energy "
    f"min {min(energy.values()):.9f}, max {max(energy.values()):.9f}"
  )


if __name__ == "__main__":
  main()
