"""Wan's size rules from a checkpoint's configs alone (before any weight loads)."""

from __future__ import annotations

import os

from md_core import apps


def check_wan_size(
  source: str | os.PathLike, height: int, width: int, num_frames: int
) -> list[str]:
  """What is wrong with a Wan video size for the checkpoint at `source`: height and width must be
  positive multiples of the VAE's spatial factor x the transformer's patch, and `num_frames` of the form
  `tk + 1` (t: the VAE's temporal factor). One line per problem, naming the nearest valid values; reads
  `vae/config.json` and `transformer/config.json` only. `WanVideoPipeline.check_size` enforces the
  same rules on a loaded pipeline."""
  try:
    vae = apps.source_config(str(source), "vae")
    transformer = apps.source_config(str(source), "transformer")
  except (FileNotFoundError, ValueError) as e:
    return [f"model: {e}"]
  spatial = int(vae.get("scale_factor_spatial") or 8)
  temporal = int(vae.get("scale_factor_temporal") or 4)
  _, ph, pw = transformer.get("patch_size", (1, 2, 2))
  lines = []
  for key, value, multiple in (("height", height, spatial * ph), ("width", width, spatial * pw)):
    if value <= 0 or value % multiple:
      low = max(multiple, value // multiple * multiple)
      near = f"{low} or {low + multiple}" if low < value else str(low)
      lines.append(f"{key}={value} must be a positive multiple of {multiple} → {near}")
  if num_frames < 1 or (num_frames - 1) % temporal:
    low = max(1, (num_frames - 1) // temporal * temporal + 1)
    lines.append(f"num_frames={num_frames} must be {temporal}k + 1 → {low} or {low + temporal}")
  return lines
