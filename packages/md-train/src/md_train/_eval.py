"""Evaluation loss at fixed noise levels (MaxDiffusion reports its eval loss bucketed by timestep).

The same batches, the same noise (drawn from a fixed key per batch) and one noise level per bucket for
the whole batch: the numbers of two checkpoints compare directly, level by level.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from md_train._step import LossFn


def eval_loss(
  loss_fn: LossFn,
  params: Any,
  batches: Iterable[dict[str, Any]],
  timesteps: Sequence[float],
  *,
  key: str = "timesteps",
  scale: float = 1.0,
  seed: int = 0,
) -> dict[float, float]:
  """The mean loss over `batches` at each of `timesteps`.

  Args:
    loss_fn: `loss_fn(params, batch, key) -> (loss, aux)` (e.g. `md_train.families.wan_loss(...)`).
    params: the trainable parameters.
    batches: the evaluation batches (a list: it is read once per timestep).
    timesteps: the noise levels, one bucket each.
    key: the batch entry the loss reads the level from: `timesteps` (SD's integer timesteps) or
      `sigmas` (the flow losses).
    scale: multiplies each timestep into the batch's value (`1e-3`: timestep 500 → sigma 0.5).
    seed: the noise of batch `i` is drawn from `fold_in(key(seed), i)`, the same for every level.

  Returns:
    `{timestep: mean loss}` in the order given.

  Raises:
    ValueError: no batches, or no timesteps.
  """
  batches = list(batches)
  if not batches:
    raise ValueError("eval_loss: the evaluation data gave no batches")
  if not len(timesteps):
    raise ValueError("eval_loss: timesteps is empty; give the levels to evaluate at")
  dtype = jnp.int32 if key == "timesteps" else jnp.float32
  base = jax.random.key(seed)
  out = {}
  for t in timesteps:
    losses = []
    for i, batch in enumerate(batches):
      b = (batch["latents"] if "latents" in batch else jax.tree.leaves(batch)[0]).shape[0]
      level = jnp.full((b,), t * scale, dtype)
      losses.append(_loss(loss_fn, params, {**batch, key: level}, jax.random.fold_in(base, i)))
    out[t] = float(np.mean([float(x) for x in losses]))
  return out


@functools.partial(jax.jit, static_argnames=("loss_fn",))
def _loss(loss_fn, params, batch, key):
  return loss_fn(params, batch, key)[0]
