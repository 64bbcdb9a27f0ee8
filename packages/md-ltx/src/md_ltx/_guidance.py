"""LTX-Video's guidance over the steps: the official repository's guidance windows, the spatio-temporal
guidance block masks, per-step scales padded for the steps a refining run skips, and the conditioning
mode's per-step noise draw."""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

import md_schedulers as mdsch

_F32 = jnp.float32


def guidance_windows(guidance_timesteps: Sequence[float], timesteps: Sequence[float]) -> list[int]:
  """The official repository's `guidance_timesteps` mapping: for each step's timestep (in [0, 1]), the
  first window whose start `guidance_timesteps[j] <= t` (the last window when none is)."""
  out = []
  for t in timesteps:
    hits = [j for j, g in enumerate(guidance_timesteps) if g <= t]
    out.append(hits[0] if hits else len(guidance_timesteps) - 1)
  return out


def skip_keep(total: int, layers: int, blocks, windows=None) -> np.ndarray:
  """The perturbed pass's block mask `[total, layers]` (1 keep, 0 skip) from `stg_blocks`: one list of
  block indices, one per step, or with `windows` (one window index per step) one per window."""
  blocks = list(blocks)
  lists = blocks if blocks and not np.isscalar(blocks[0]) else [blocks] * total
  if windows is not None and lists is blocks:
    if max(windows) >= len(blocks):
      raise ValueError(
        f"stg_blocks has {len(blocks)} lists for {max(windows) + 1} guidance windows"
      )
    lists = [blocks[j] for j in windows]
  if len(lists) != total:
    raise ValueError(f"stg_blocks has {len(lists)} lists; give one list, or one per step ({total})")
  keep = np.ones((total, layers), np.float32)
  for i, chosen in enumerate(lists):
    for j in chosen:
      if not 0 <= int(j) < layers:
        raise ValueError(f"stg_blocks: block {j} is not one of the {layers} blocks")
      keep[i, int(j)] = 0.0
  return keep


def draw_steps(total: int, shape: tuple[int, ...]):
  """A jitted draw of `total` standard-normal arrays, step `i`'s from `fold_in(key, i)`."""

  def draw(key):
    one = lambda i: jax.random.normal(jax.random.fold_in(key, i), shape, _F32)  # noqa: E731
    return jax.vmap(one)(jnp.arange(total))

  return jax.jit(draw)


def pad_steps(a: np.ndarray, start: int) -> np.ndarray:
  """Per-step rows for the steps run, preceded by `start` rows of zeros for the steps skipped (the loop
  indexes them by the schedule's step)."""
  return np.concatenate([np.zeros((start, *a.shape[1:]), a.dtype), a]) if start else a


def guidance_plan(total, begin, timesteps, *, layers, cfg_on, stg_on, guidance_scale, guidance_rescale,
              cfg_star, stg_scale, stg_rescale, stg_blocks, guidance_timesteps):  # fmt: skip
  """Which guidance terms run (static), their per-step scales and STG's per-step block mask (traced;
  rows for skipped steps first, as the loop indexes them by the schedule's step)."""
  guide = mdsch.guidance.Guidance(
    cfg=cfg_on, rescale=cfg_on and guidance_rescale > 0, cfg_star=cfg_on and bool(cfg_star),
    gate=cfg_on, stg=stg_on, stg_rescale=stg_on and bool(np.any(np.asarray(stg_rescale) != 1.0)),
    one_call=True,  # diffusers' LTXPipeline runs [negative, positive] as one transformer call
  )  # fmt: skip
  windows = None
  if guidance_timesteps is not None:
    windows = guidance_windows(list(guidance_timesteps), (timesteps / np.float32(1000)).tolist())
  named = dict(
    guidance=("guidance_scale", guidance_scale), rescale=("guidance_rescale", guidance_rescale),
    stg=("stg_scale", stg_scale), stg_rescale=("stg_rescale", stg_rescale),
  )  # fmt: skip
  arrays = mdsch.guidance.per_step(total, dict(named.values()), windows=windows)
  scales = {k: pad_steps(arrays[arg], begin) for k, (arg, _) in named.items()}
  scales = {k: jnp.asarray(v) for k, v in scales.items() if k in guide.scale_names}
  keep = pad_steps(skip_keep(total, layers, stg_blocks, windows), begin)
  return guide, scales, jnp.asarray(keep) if guide.stg else None
