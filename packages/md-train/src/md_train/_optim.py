"""The optimizer: global-norm clipping, AdamW on a warm-up + cosine / constant schedule, gradient
accumulation and an EMA of the parameters, as one optax chain."""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

SCHEDULES = ("constant", "cosine")


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
  """AdamW settings; the defaults are those of diffusers' training scripts (train_text_to_image.py).

  Attributes:
    learning_rate: the peak learning rate.
    schedule: `constant` or `cosine` (half a cosine from the peak to `end_learning_rate` over
      `total_steps`, counted from step 0 and including the warm-up, as diffusers' and optax's are).
    warmup_steps: linear warm-up from 0 over this many optimizer steps (0: none).
    total_steps: optimizer steps of the run; needed by `cosine`.
    end_learning_rate: where `cosine` ends.
    b1, b2, eps, weight_decay: AdamW's (decoupled weight decay, applied to every parameter as
      `torch.optim.AdamW` does).
    max_grad_norm: clip gradients to this global norm (None: no clipping).
    gradient_accumulation_steps: micro-batches summed (averaged) into one optimizer step.
    ema_decay: keep an exponential moving average of the parameters with this decay (None: none).
  """

  learning_rate: float = 1e-4
  schedule: str = "constant"
  warmup_steps: int = 0
  total_steps: int | None = None
  end_learning_rate: float = 0.0
  b1: float = 0.9
  b2: float = 0.999
  eps: float = 1e-8
  weight_decay: float = 1e-2
  max_grad_norm: float | None = 1.0
  gradient_accumulation_steps: int = 1
  ema_decay: float | None = None

  def __post_init__(self):
    if self.schedule not in SCHEDULES:
      raise ValueError(f"schedule={self.schedule!r}; expected one of {SCHEDULES}")
    if self.schedule == "cosine" and self.total_steps is None:
      raise ValueError("schedule='cosine' needs total_steps (the run's optimizer steps)")
    if self.total_steps is not None and self.total_steps <= self.warmup_steps:
      raise ValueError(
        f"total_steps={self.total_steps} must exceed warmup_steps={self.warmup_steps}"
      )
    if self.warmup_steps < 0:
      raise ValueError(f"warmup_steps={self.warmup_steps} must be >= 0")
    if self.gradient_accumulation_steps < 1:
      raise ValueError(
        f"gradient_accumulation_steps={self.gradient_accumulation_steps} must be >= 1"
      )
    if self.max_grad_norm is not None and self.max_grad_norm <= 0:
      raise ValueError(f"max_grad_norm={self.max_grad_norm} must be > 0 (or None: no clipping)")
    if self.ema_decay is not None and not 0.0 <= self.ema_decay < 1.0:
      raise ValueError(f"ema_decay={self.ema_decay} must be in [0, 1) (or None: no EMA)")


class Optimizer(NamedTuple):
  """An optax transformation with the schedule it follows.

  Attributes:
    tx: the optax chain (wrapped in `optax.MultiSteps` when accumulating).
    learning_rate: the schedule, a function of the optimizer step.
    accumulation: micro-batches per optimizer step (`tx` applies an update every this many calls).
  """

  tx: optax.GradientTransformation
  learning_rate: optax.Schedule
  accumulation: int = 1

  def learning_rate_at(self, micro_step: jax.Array) -> jax.Array:
    """The learning rate of the optimizer step that micro-batch `micro_step` (0-based) belongs to."""
    return self.learning_rate(micro_step // self.accumulation)


def learning_rate_schedule(config: OptimizerConfig) -> optax.Schedule:
  """Linear warm-up from 0, then constant or a half cosine (`config.schedule`)."""
  c = config
  if c.schedule == "cosine":
    return optax.warmup_cosine_decay_schedule(
      init_value=0.0,
      peak_value=c.learning_rate,
      warmup_steps=c.warmup_steps,
      decay_steps=c.total_steps,
      end_value=c.end_learning_rate,
    )
  if c.warmup_steps == 0:
    return optax.constant_schedule(c.learning_rate)
  return optax.join_schedules(
    [
      optax.linear_schedule(0.0, c.learning_rate, c.warmup_steps),
      optax.constant_schedule(c.learning_rate),
    ],
    [c.warmup_steps],
  )


class EmaState(NamedTuple):
  """State of `ema_params`."""

  count: jax.Array  # (), int32: updates seen
  ema: Any  # the parameters' pytree, float32


def ema_params(decay: float) -> optax.GradientTransformation:
  """Leaves updates unchanged and keeps `decay * ema + (1 - decay) * (params + updates)`: an EMA of the
  parameters after each step. Put it last in a chain (it needs the final updates and `params`)."""

  def init(params):
    # A copy: the EMA must not share buffers with the parameters (train_step donates both).
    ema = jax.tree.map(lambda p: jnp.array(p, jnp.float32, copy=True), params)
    return EmaState(jnp.zeros((), jnp.int32), ema)

  def update(updates, state, params=None):
    if params is None:
      raise ValueError("ema_params needs params: call update(grads, state, params)")
    new = optax.apply_updates(params, updates)
    ema = jax.tree.map(lambda e, p: decay * e + (1 - decay) * p.astype(jnp.float32), state.ema, new)
    return updates, EmaState(state.count + 1, ema)

  return optax.GradientTransformation(init, update)


def ema_of(opt_state: Any) -> Any:
  """The EMA parameters held in an optimizer state from `make_optimizer(ema_decay=…)`.

  Raises:
    ValueError: the state holds no EMA.
  """
  found = [
    s for s in jax.tree.leaves(opt_state, is_leaf=lambda s: isinstance(s, EmaState))
    if isinstance(s, EmaState)
  ]  # fmt: skip
  if not found:
    raise ValueError(
      "this optimizer state holds no EMA: build it with OptimizerConfig(ema_decay=…)"
    )
  return found[0].ema


def make_optimizer(config: OptimizerConfig | None = None, **overrides: Any) -> Optimizer:
  """The optax chain for `config` (fields may be overridden by keyword).

  clip_by_global_norm(max_grad_norm) → AdamW(schedule) → [EMA of the parameters], inside
  `optax.MultiSteps` when `gradient_accumulation_steps > 1` (gradients averaged over the micro-batches;
  the inner chain, schedule and EMA advance once per optimizer step).

  >>> opt = make_optimizer(learning_rate=1e-3, warmup_steps=10)
  >>> round(float(opt.learning_rate(5)), 6)
  0.0005
  """
  config = dataclasses.replace(config or OptimizerConfig(), **overrides)
  schedule = learning_rate_schedule(config)
  parts = []
  if config.max_grad_norm is not None:
    parts.append(optax.clip_by_global_norm(config.max_grad_norm))
  parts.append(
    optax.adamw(
      schedule, b1=config.b1, b2=config.b2, eps=config.eps, weight_decay=config.weight_decay
    )
  )
  if config.ema_decay is not None:
    parts.append(ema_params(config.ema_decay))
  tx = optax.chain(*parts)
  k = config.gradient_accumulation_steps
  if k > 1:
    tx = optax.MultiSteps(tx, every_k_schedule=k).gradient_transformation()
  return Optimizer(tx, schedule, k)
