"""md-train: train state, optax optimizers, diffusion losses and timestep samplers for md.

The family losses (SD UNet, Flux.1, Wan 2.1) are in `md_train.families` and the tiny training recipes in
`md_train.recipes` (both import the family packages).
"""

from md_train._checkpoint import Checkpointer, CheckpointError, Restored
from md_train._eval import eval_loss
from md_train._loop import CHECKPOINTS_DIR, Recipe, batch_sharding, fit
from md_train._losses import (
  FLOW_SAMPLERS,
  PREDICTION_TYPES,
  FlowTable,
  NoisedBatch,
  diffusion_inputs,
  diffusion_loss,
  flow_sigmas,
  flow_training_table,
  min_snr_weights,
  table_lookup,
  uniform_timesteps,
)
from md_train._metrics import (
  METRICS_FILE,
  TENSORBOARD_DIR,
  MetricsWriter,
  compiled_flops,
  peak_flops_per_second,
  read_metrics,
)
from md_train._optim import (
  SCHEDULES,
  EmaState,
  Optimizer,
  OptimizerConfig,
  ema_of,
  ema_params,
  learning_rate_schedule,
  make_optimizer,
)
from md_train._step import (
  Frozen,
  LossFn,
  TrainState,
  init_state,
  loss_and_grads,
  make_train_step,
  split_trainable,
  state_shardings,
  train_step,
  with_master_weights,
)

__all__ = [
  "CHECKPOINTS_DIR",
  "FLOW_SAMPLERS",
  "METRICS_FILE",
  "PREDICTION_TYPES",
  "SCHEDULES",
  "TENSORBOARD_DIR",
  "CheckpointError",
  "Checkpointer",
  "EmaState",
  "FlowTable",
  "Frozen",
  "LossFn",
  "MetricsWriter",
  "NoisedBatch",
  "Optimizer",
  "OptimizerConfig",
  "Recipe",
  "Restored",
  "TrainState",
  "batch_sharding",
  "compiled_flops",
  "diffusion_inputs",
  "diffusion_loss",
  "ema_of",
  "ema_params",
  "eval_loss",
  "fit",
  "flow_sigmas",
  "flow_training_table",
  "init_state",
  "learning_rate_schedule",
  "loss_and_grads",
  "make_optimizer",
  "make_train_step",
  "min_snr_weights",
  "peak_flops_per_second",
  "read_metrics",
  "split_trainable",
  "state_shardings",
  "table_lookup",
  "train_step",
  "uniform_timesteps",
  "with_master_weights",
]
