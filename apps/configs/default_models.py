"""md's default models: a tiny Wan 2.1 text-to-video model trained on md_data's moving shapes (models/shapes-wan).

tools/.venv/bin/python tools/default_models/wan_template.py runs/shapes-wan-template   # the random start
uv run apps/train --config=apps/configs/default_models.py:wan-vae-still --workdir=runs/shapes-wan-vae-still
uv run apps/train --config=apps/configs/default_models.py:wan --workdir=runs/shapes-wan
cp -r runs/shapes-wan/export/. models/shapes-wan/   # (bash tools/default_models/make.sh does all four)

Variants: wan-vae-still (stage 1: the causal Wan VAE from its random init, on still images as one-frame
clips; exports the template folder with that VAE inflated to a clip VAE, `md_vae.inflate_wan_vae`, and its
latent statistics), wan (stage 2: the transformer on those latents; exports the whole pipeline), and
wan-vae (optional, not in the shipped model: the VAE's decoder side fine-tuned on 9-frame clips, the
encoder and so the latents kept; measured, it made the clip reconstructions' shapes worse). Recipes:
`md_train.shapes_models`. The UMT5 text encoder stays at its random init (frozen, its residual branches
scaled down by the template).
"""

import ml_collections

from md_core import apps as md_apps

VARIANTS = {
  "wan-vae-still": (
    "md_train.shapes_models:wan_vae_recipe",
    dict(steps=3000, checkpoint_every=500),
    dict(
      template="runs/shapes-wan-template",
      size=64,
      frames=9,
      train_frames=1,
      crop=32,
      batch_size=16,
      learning_rate=2e-3,
      warmup_steps=20,
      kl_weight=1e-4,
      foreground_weight=10.0,
      crop_on_shape=True,
      schedule_steps=0,
      stats_count=64,
      inflate_export=True,
      train_encoder=True,
      # One device: the shipped VAE. `data_devices=2` with `cpu_devices=2` is faster (588 s against about
      # 720 s) but gave another VAE, on which the transformer stage scored shape 64%, direction 75%.
      data_devices=1,
    ),
  ),
  "wan-vae": (
    "md_train.shapes_models:wan_vae_recipe",
    dict(steps=600, checkpoint_every=100),
    dict(
      template="runs/shapes-wan-vae-still/export",
      size=64,
      frames=9,
      train_frames=9,
      crop=32,
      batch_size=2,
      learning_rate=1e-3,
      warmup_steps=20,
      kl_weight=1e-4,
      foreground_weight=10.0,
      crop_on_shape=True,
      schedule_steps=0,
      stats_count=64,
      inflate_export=False,
      train_encoder=False,
    ),
  ),
  "wan": (
    "md_train.shapes_models:wan_recipe",
    # Two CPU devices, each batch split over them (`data_devices`): both cores busier than with one.
    # Seed 2 with caption dropout 0.05: the best of the TPU draws on this VAE (models/shapes-wan/EXPERIMENTS.md);
    # on the 2-core Xeon it gave the shipped model (seed 0 with dropout 0.1 gave direction 72% there).
    dict(steps=8000, checkpoint_every=500, log_every=10, cpu_devices=2, seed=2),
    dict(
      base="runs/shapes-wan-vae-still/export",
      size=64,
      frames=9,
      # Shapes of 17-19 px (md_data's default 12-17 px): their outlines train sooner.
      extent=[0.8, 0.9],
      start="shared",  # the first frame does not tell the direction (md_data's default start does)
      num_clips=1024,
      batch_size=8,  # more, smaller steps: at the same CPU time batch 8 draws the shape more often than 16
      learning_rate=2e-3,
      warmup_steps=20,
      shift=1.0,
      drop_caption=0.05,
      max_sequence_length=16,
      foreground_weight=4.0,
      frame_noise=0.5,  # half the clips noised frame by frame (wan_loss): what teaches the direction
      # Unset: export the trained weights; e.g. --config.recipe_options.ema_decay=0.999 exports an EMA.
      ema_decay=ml_collections.config_dict.placeholder(float),
      remat="dots",  # the same arithmetic; on a CPU 26% faster a step (no stacked attention probs)
      data_devices=2,
      export_dtype="bfloat16",  # the 3.3 M-parameter transformer in 6.6 MB (13 MB as float32)
    ),
  ),
  # md's default image model (models/shapes-sd): a tiny SD 1.5 pipeline, recipes in md_train.shapes_sd.
  "sd-vae": (
    "md_train.shapes_sd:sd_vae_recipe",
    dict(steps=2400, checkpoint_every=600, log_every=10),
    dict(
      template="runs/shapes-sd-template",
      size=64,
      crop=32,
      crop_on_shape=True,
      schedule_steps=0,
      batch_size=16,
      learning_rate=2e-3,
      warmup_steps=20,
      kl_weight=1e-6,
      fg_weight=10.0,
      stats_count=256,
    ),
  ),
  "sd": (
    "md_train.shapes_sd:sd_recipe",
    dict(steps=4000, checkpoint_every=1000, log_every=10, cpu_devices=2),
    dict(
      base="runs/shapes-sd-vae/export",
      size=64,
      num_images=4096,
      batch_size=16,
      learning_rate=1.5e-3,
      warmup_steps=30,
      drop_caption=0.1,
      snr_gamma=5.0,
      noise_offset=0.1,
      schedule_steps=0,
      data_devices=2,  # each batch split over two CPU devices (0.49 -> 0.41 s a step)
      export_dtype="bfloat16",  # the 3.1 M-parameter UNet in 6.3 MB (12.5 MB as float32)
    ),
  ),
}
# A LoRA on the shipped image model (models/shapes-sd-lora-purple): every shape drawn purple; the UNet
# stage's options, on the finished model, with a LoRA's learning rate and no caption dropout.
VARIANTS["sd-lora-purple"] = (
  "md_train.shapes_sd:sd_lora_recipe",
  dict(steps=300, checkpoint_every=100, log_every=10),
  dict(
    VARIANTS["sd"][2],
    base="models/shapes-sd",
    colour="purple",
    num_images=1024,
    learning_rate=5e-3,
    warmup_steps=10,
    drop_caption=0.0,
    lora=dict(rank=4, alpha=4.0),
  ),  # fmt: skip
)


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  name = arg or "wan"
  if name not in VARIANTS:
    raise ValueError(f"unknown variant {name!r}; choose one of {', '.join(VARIANTS)}")
  recipe, run, options = VARIANTS[name]
  config = ml_collections.ConfigDict(
    dict(
      variant=name,
      recipe=recipe,
      steps=run["steps"],
      seed=run.get("seed", 0),
      checkpoint_every=run["checkpoint_every"],
      keep=2,
      eval_every=0,
      log_every=run.get("log_every", 10),
      export=True,
      peak_flops=ml_collections.config_dict.placeholder(float),
      recipe_options=ml_collections.ConfigDict(options),
    )
  )
  md_apps.add_runtime_config(config)
  if run.get("cpu_devices"):
    config.cpu_devices = run["cpu_devices"]  # md_core.apps.start: JAX's CPU device count
  config.lock()
  return config
