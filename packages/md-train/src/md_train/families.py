"""Training losses of the model families: the same model calls the pipelines' denoisers make, on given (or
drawn) noise and timesteps.

Each factory takes the frozen part of a split model (`split_trainable`) and returns
`loss_fn(params, batch, key) -> (loss, aux)` for `train_step`. A batch holds the clean latents and the text
conditioning; `noise` and the noise level (`timesteps` / `sigmas`) are drawn from `key` when absent, so
the same loss serves training (drawn) and checks against a reference (given).

    import md_train as mdt
    import md_train.families as mtf
    frozen, params = mdt.split_trainable(unet)
    loss_fn = mtf.sd_loss(frozen, alphas_cumprod=scheduler.alphas_cumprod)
    state = mdt.init_state(params, mdt.make_optimizer(learning_rate=1e-5))
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp

import md_flux
import md_ltx
import md_wan
from md_train._losses import (
  FLOW_SAMPLERS,
  FlowTable,
  batch_bell_weights,
  diffusion_inputs,
  diffusion_loss,
  flow_sigmas,
  min_snr_weights,
  table_lookup,
  uniform_timesteps,
)
from md_train._step import Frozen, LossFn

WAN_WEIGHTINGS = (None, "batch_bell")


def _noise(batch: Mapping[str, Any], key: jax.Array) -> jax.Array:
  latents = batch["latents"]
  if "noise" in batch:
    if batch["noise"].shape != latents.shape:
      raise ValueError(f"noise has shape {batch['noise'].shape}, latents {latents.shape}")
    return batch["noise"]
  return jax.random.normal(key, latents.shape, jnp.float32).astype(latents.dtype)


def offset_noise(key: jax.Array, noise: jax.Array, scale: float) -> jax.Array:
  """`noise` (channels last, `[B, ..., C]`) plus `scale` times one normal draw per example and channel,
  the same at every position: diffusers' `--noise_offset`."""
  shape = (noise.shape[0],) + (1,) * (noise.ndim - 2) + (noise.shape[-1],)
  offset = jax.random.normal(key, shape, jnp.float32)
  return noise + jnp.asarray(scale * offset, noise.dtype)


def sd_loss(
  unet: Frozen,
  *,
  alphas_cumprod,
  prediction_type: str = "epsilon",
  snr_gamma: float | None = None,
  num_train_timesteps: int | None = None,
  prior_loss_weight: float | None = None,
  noise_offset: float = 0.0,
) -> LossFn:
  """The SD 1.x / 2.x / XL UNet loss of diffusers' train_text_to_image.py.

  Batch: `latents [B, h, w, C]` (channels-last, already scaled by the VAE's scaling factor),
  `encoder_hidden_states [B, S, D]`, optional `noise [B, h, w, C]`, `timesteps [B]` int and, for SDXL,
  `added_cond_kwargs` (`text_embeds [B, D2]`, `time_ids [B, 6]`) or those two keys at the batch's top
  (as the recipes' batches carry them, every array with the batch axis first).

  Args:
    unet: the UNet's frozen part.
    alphas_cumprod: the training schedule (`md_schedulers.ddpm(...).alphas_cumprod`).
    prediction_type: `epsilon` or `v_prediction` (the target).
    snr_gamma: Min-SNR-γ weighting (None: the plain MSE).
    num_train_timesteps: the range timesteps are drawn from (default: the schedule's length).
    prior_loss_weight: Dreambooth's prior preservation (train_dreambooth.py): the batch's first half
      holds the instance examples, its second half the class examples; the loss is the instance
      half's (Min-SNR-weighted when `snr_gamma`) plus `prior_loss_weight` times the class half's plain
      MSE, reported in aux as `instance_loss` and `prior_loss`. None: one loss over the batch.
    noise_offset: the scripts' `--noise_offset`: the noise gains `noise_offset` times one normal draw per
      example and channel (constant over the image), so the model learns to change an image's mean
      (flat black or white backgrounds), which plain noise keeps near the data's average. 0: off.
  """
  if prediction_type not in ("epsilon", "v_prediction"):
    raise ValueError(f"prediction_type={prediction_type!r}; expected 'epsilon' or 'v_prediction'")
  acp = jnp.asarray(alphas_cumprod, jnp.float32)
  n = int(num_train_timesteps or acp.shape[0])

  def loss_fn(params, batch, key):
    k_noise, k_t = jax.random.split(key)
    latents = batch["latents"]
    noise = _noise(batch, k_noise)
    if noise_offset:
      noise = offset_noise(jax.random.fold_in(k_noise, 1), noise, noise_offset)
    t = batch["timesteps"] if "timesteps" in batch else uniform_timesteps(k_t, latents.shape[0], n)
    noisy, target = diffusion_inputs(prediction_type, latents, noise, t, alphas_cumprod=acp)
    model = unet.merge(params)
    added = batch.get("added_cond_kwargs")
    if added is None and "text_embeds" in batch:
      added = {"text_embeds": batch["text_embeds"], "time_ids": batch["time_ids"]}
    pred = model(noisy, t, batch["encoder_hidden_states"], added_cond_kwargs=added)
    weights = None
    if snr_gamma is not None:
      weights = min_snr_weights(acp, t, snr_gamma, prediction_type)
    return _prior_preserving(pred, target, weights, prior_loss_weight)

  return loss_fn


def _prior_preserving(pred, target, weights, prior_loss_weight: float | None):
  """`(loss, aux)`: the plain (weighted) loss, or Dreambooth's with prior preservation: the batch's
  first half (instance examples) weighted, plus `prior_loss_weight` times the second half's (class
  examples) plain MSE, as train_dreambooth.py / train_dreambooth_flux.py split `model_pred`."""
  if prior_loss_weight is None:
    return diffusion_loss(pred, target, weights), {}
  b = pred.shape[0]
  if b % 2:
    raise ValueError(
      f"prior_loss_weight={prior_loss_weight}: the batch of {b} must be instance + class halves "
      "(an even size)"
    )
  h = b // 2
  instance = diffusion_loss(pred[:h], target[:h], None if weights is None else weights[:h])
  prior = diffusion_loss(pred[h:], target[h:])
  loss = instance + jnp.float32(prior_loss_weight) * prior
  return loss, {"instance_loss": instance, "prior_loss": prior}


def flux_loss(
  transformer: Frozen,
  *,
  guidance: float | None = None,
  sampler: str = "logit_normal",
  prior_loss_weight: float | None = None,
  **sampler_options: Any,
) -> LossFn:
  """The Flux.1 flow-matching loss of diffusers' train_dreambooth_flux.py (weighting `none`).

  Batch: `latents [B, h, w, C]` (channels-last, VAE-normalised, h and w even), `encoder_hidden_states
  [B, S, D]`, `pooled_projections [B, P]`, optional `txt_ids [S, 3]` or `[B, S, 3]` (default: zeros, as
  the pipeline's), `noise [B, h, w, C]` and `sigmas [B]` in (0, 1]. The noisy latents are packed 2x2 as
  the pipeline packs them; the model sees timestep σ (×1000 inside) and, for guidance-distilled (dev)
  models, `guidance` per example.

  Args:
    transformer: the transformer's frozen part.
    guidance: the embedded guidance scale for dev-style models (None for schnell-style ones).
    sampler, sampler_options: how σ is drawn when absent (`flow_sigmas`).
    prior_loss_weight: Dreambooth's prior preservation (`--with_prior_preservation`): the batch's first
      half instance, second half class examples; the loss is the instance half's plus this times the
      class half's (aux: `instance_loss`, `prior_loss`). None: one loss over the batch.
  """

  def loss_fn(params, batch, key):
    k_noise, k_t = jax.random.split(key)
    latents = batch["latents"]
    b, h, w, _ = latents.shape
    if h % 2 or w % 2:
      raise ValueError(f"Flux latents need even height and width, got {latents.shape}")
    noise = _noise(batch, k_noise)
    sigmas = (
      batch["sigmas"]
      if "sigmas" in batch
      else flow_sigmas(k_t, b, sampler=sampler, **sampler_options)
    )
    noisy, target = diffusion_inputs("flow", latents, noise, sigmas)
    inputs = md_flux.flux1_model_inputs(
      md_flux.pack_latents(noisy), sigmas, batch["encoder_hidden_states"],
      batch["pooled_projections"], img_ids=jnp.asarray(md_flux.image_ids(h // 2, w // 2)),
      txt_ids=batch.get("txt_ids"), guidance=guidance,
    )  # fmt: skip
    pred = transformer.merge(params)(*inputs)
    pred = md_flux.unpack_latents(pred, h, w)
    return _prior_preserving(pred, target, None, prior_loss_weight)

  return loss_fn


def _frame_noise(patch, latents, noise, per_group):
  """Per-frame timesteps `[B, F / pt]` (the transformer gives each frame's tokens its frame's) and noisy
  latents for one σ per latent frame group (`per_group [B, F / pt]`)."""
  pt = patch[0]
  s = jnp.repeat(per_group, pt, axis=1)[:, :, None, None, None]  # [B, F, 1, 1, 1]
  noisy = (1 - s) * latents + s * noise
  return per_group * 1000, noisy.astype(latents.dtype)


def wan_loss(
  transformer: Frozen,
  *,
  sampler: str = "shifted",
  shift: float = 5.0,
  table: FlowTable | None = None,
  table_range: tuple[int, int] | None = None,
  weighting: str | None = None,
  num_train_timesteps: int = 1000,
  clean_first_frame: bool = False,
  frame_noise: float = 0.0,
  **sampler_options: Any,
) -> LossFn:
  """The Wan 2.1 text-to-video flow-matching loss (and either Wan 2.2 expert's, with `table_range`), and
  the image-conditioned ones as DiffSynth-Studio trains them.

  Batch: `latents [B, F, H, W, C]` (channels-last, VAE-normalised), `encoder_hidden_states [B, S, D]`,
  optional `noise` like the latents, `sigmas [B]` and `loss_map [B, F, H, W, 1]` (weights of the latent
  pixels' squared errors, `diffusion_loss`'s `element_weights`). The model sees timestep 1000 σ.
  Image to video (Wan 2.1 I2V, Wan 2.2 I2V A14B): `condition [B, F, H, W, Cy]` (the pipelines' `y`: the
  frame mask and the image's latents) is concatenated after the noisy latents on the channels, and
  `encoder_hidden_states_image [B, T, D_img]` (Wan 2.1 I2V's CLIP tokens) goes to the image branch; the
  loss covers every frame.

  Args:
    transformer: the transformer's frozen part.
    sampler, shift, sampler_options: how σ is drawn when absent and `table` is None (`flow_sigmas`;
      Wan trains with shifted uniform sampling, shift 5); the loss is then the plain MSE.
    table: train as DiffSynth / MaxDiffusion train Wan (`flow_training_table`): σ is a uniformly drawn
      entry of the table, and each example's squared error is weighted by its entry's bell weight
      (given sigmas take the weight of the nearest entry).
    table_range: draw only the table's entries `[lo, hi)`: a Wan 2.2 expert's timesteps
      (`expert_range`; DiffSynth trains each expert so). Needs `table`.
    weighting: `"batch_bell"`: newer MaxDiffusion's Wan loss weights, relative to the batch
      (`batch_bell_weights` of the timesteps 1000 σ over `num_train_timesteps`: the bell less the
      batch's minimum, summing to `num_train_timesteps` over the batch; all 1 for a batch of 1 or
      equal timesteps). Not with `table`, whose weights are absolute. None: the table's weights, else
      the plain MSE.
    num_train_timesteps: the N of `weighting="batch_bell"`.
    clean_first_frame: Wan 2.2 TI2V (`expand_timesteps` models, DiffSynth's
      `fuse_vae_embedding_in_latents`): the first latent frame enters clean (its latents, not noised),
      its tokens get timestep 0 (per-token timesteps), and the loss covers the frames after it.
    frame_noise: the fraction of examples whose latent frames (each `patch_size[0]` frames) are noised
      at independently drawn σ (the same sampler), the tokens of each at its own timestep (diffusion
      forcing's per-frame noise levels; the transformer takes per-frame timesteps). The rest share one
      σ, as at sampling. A partly clean clip makes the caption's motion the thing to predict from the
      cleaner frames. A batch's `frame_sigmas [B, F / pt]` sets every example's per-frame σ instead.
      Neither combines with `table`, `weighting` or `clean_first_frame`.
  """
  if not 0.0 <= frame_noise <= 1.0:
    raise ValueError(f"wan_loss: frame_noise={frame_noise} is not a fraction in [0, 1]")
  per_frame_ok = table is None and weighting is None and not clean_first_frame
  if frame_noise and not per_frame_ok:
    raise ValueError(
      "wan_loss: frame_noise draws its own per-frame sigmas with the sampler; it does not combine with "
      "a table, a weighting or clean_first_frame"
    )
  if weighting not in WAN_WEIGHTINGS:
    raise ValueError(f"wan_loss: weighting={weighting!r}; expected one of {WAN_WEIGHTINGS}")
  if table_range is not None:
    if table is None:
      raise ValueError("wan_loss: table_range needs a table (flow_training_table) to draw from")
    lo, hi = (int(x) for x in table_range)
    if not 0 <= lo < hi <= table.sigmas.shape[0]:
      raise ValueError(
        f"wan_loss: table_range={tuple(table_range)} is not a non-empty range of the table's "
        f"{table.sigmas.shape[0]} entries"
      )
  else:
    lo, hi = 0, None if table is None else table.sigmas.shape[0]
  if weighting is not None and table is not None:
    raise ValueError(
      f"wan_loss: weighting={weighting!r} and a table: the table's bell weights and the batch-relative"
      " ones exclude each other; pass one"
    )

  def loss_fn(params, batch, key):
    k_noise, k_t = jax.random.split(key)
    latents = batch["latents"]
    b = latents.shape[0]
    noise = _noise(batch, k_noise)
    weights = None
    if "sigmas" in batch:
      sigmas = batch["sigmas"]
      if table is not None:
        _, weights = table_lookup(table, sigmas * 1000)
    elif table is not None:
      idx = jax.random.randint(k_t, (b,), lo, hi)
      sigmas, weights = table.sigmas[idx], table.weights[idx]
    else:
      sigmas = flow_sigmas(k_t, b, sampler=sampler, shift=shift, **sampler_options)
    if weighting == "batch_bell":
      weights = batch_bell_weights(sigmas * 1000, num_train_timesteps)
    noisy, target = diffusion_inputs("flow", latents, noise, sigmas)
    model = transformer.merge(params)
    timestep = sigmas * 1000
    if "frame_sigmas" in batch or frame_noise:
      if not per_frame_ok:
        raise ValueError(
          "wan_loss: per-frame sigmas do not combine with a table, a weighting or clean_first_frame"
        )
      groups = latents.shape[1] // model.cfg.patch_size[0]
      if "frame_sigmas" in batch:
        per_group = batch["frame_sigmas"]
        if per_group.shape != (b, groups):
          raise ValueError(
            f"frame_sigmas has shape {per_group.shape}; expected one σ per latent frame group "
            f"{(b, groups)}"
          )
      else:
        k_own, k_pick = jax.random.split(jax.random.fold_in(k_t, 1))
        own = flow_sigmas(k_own, b * groups, sampler=sampler, shift=shift, **sampler_options)
        pick = jax.random.uniform(k_pick, (b,)) < frame_noise
        per_group = jnp.where(pick[:, None], own.reshape(b, groups), sigmas[:, None])
      timestep, noisy = _frame_noise(model.cfg.patch_size, latents, noise, per_group)
    loss_map = batch.get("loss_map")
    condition = batch.get("condition")
    frame_mask, patch = None, None
    if clean_first_frame:
      if condition is not None:
        raise ValueError(
          "clean_first_frame (Wan 2.2 TI2V) conditions on the clean first frame; the batch's "
          "condition channels are for the image-to-video checkpoints: pass one or the other"
        )
      if latents.shape[1] < 2:
        raise ValueError(
          f"clean_first_frame: latents {latents.shape} have one frame; nothing would be left to learn"
        )
      # TI2V: the clean first frame is the condition the pipeline blends in, at timestep 0.
      condition = latents[:, :1]
      frame_mask = jnp.asarray(md_wan.first_frame_mask(latents.shape, clean_first=True))
      patch = model.cfg.patch_size
    elif condition is not None and condition.shape[:4] != latents.shape[:4]:
      raise ValueError(
        f"condition has shape {condition.shape}; it must match the latents {latents.shape} on every "
        "axis but the channels"
      )
    inputs = md_wan.model_inputs(
      noisy, timestep, batch["encoder_hidden_states"], condition=condition, frame_mask=frame_mask,
      image_tokens=batch.get("encoder_hidden_states_image"), patch_size=patch,
    )  # fmt: skip
    pred = model(*inputs, layout="BFHWC")
    if clean_first_frame:
      pred, target = pred[:, 1:], target[:, 1:]
      loss_map = None if loss_map is None else loss_map[:, 1:]
    return diffusion_loss(pred, target, weights, loss_map), {}

  return loss_fn


def klein_loss(
  transformer: Frozen,
  *,
  guidance: float | None = None,
  sampler: str = "logit_normal",
  prior_loss_weight: float | None = None,
  **sampler_options: Any,
) -> LossFn:
  """The Flux.2 Klein flow-matching loss of diffusers' train_dreambooth_lora_flux2_klein.py (weighting
  `none`).

  Batch: `latents [B, h, w, C]` (channels-last: the pipeline's patchified, normalised token grid, C the
  transformer's `in_channels`), `encoder_hidden_states [B, S, D]` (stacked Qwen3 layers), optional
  `noise [B, h, w, C]` and `sigmas [B]` in (0, 1]. The noisy grid is packed row-major into `[B, h w, C]`
  tokens with Flux.2's position ids (`md_flux.image_ids(h, w, axes=4)`, `md_flux.text_ids(S)`); the model
  sees timestep σ (×1000 inside) and `guidance` only when it has a guidance embedder.

  Args:
    transformer: the `Flux2Transformer`'s frozen part.
    guidance: the embedded guidance scale for guidance-distilled models (None for Klein).
    sampler, sampler_options: how σ is drawn when absent (`flow_sigmas`).
    prior_loss_weight: Dreambooth's prior preservation, as in `flux_loss` (the batch's first half
      instance, second half class examples; aux `instance_loss`, `prior_loss`). None: one loss.
  """

  def loss_fn(params, batch, key):
    k_noise, k_t = jax.random.split(key)
    latents = batch["latents"]
    if latents.ndim != 4:
      raise ValueError(f"Klein latents must be [B, h, w, C], got shape {latents.shape}")
    b, h, w, c = latents.shape
    noise = _noise(batch, k_noise)
    sigmas = (
      batch["sigmas"]
      if "sigmas" in batch
      else flow_sigmas(k_t, b, sampler=sampler, **sampler_options)
    )
    noisy, target = diffusion_inputs("flow", latents, noise, sigmas)
    ctx = batch["encoder_hidden_states"]
    inputs = md_flux.flux2_model_inputs(
      noisy.reshape(b, h * w, c), sigmas, ctx, img_ids=jnp.asarray(md_flux.image_ids(h, w, axes=4)),
      txt_ids=jnp.asarray(md_flux.text_ids(ctx.shape[1])), guidance=guidance,
    )  # fmt: skip
    pred = transformer.merge(params)(*inputs)
    return _prior_preserving(pred.reshape(b, h, w, -1), target, None, prior_loss_weight)

  return loss_fn


LTX_SAMPLERS = ("shifted_logit_normal", *FLOW_SAMPLERS)
# Sigma of the conditioned first frame's tokens in LTX-Video-Trainer's first-frame conditioning.
LTX_FIRST_FRAME_SIGMA = 1e-5


def ltx_sigma_shift(
  tokens: int,
  min_tokens: int = 1024,
  max_tokens: int = 4096,
  min_shift: float = 0.95,
  max_shift: float = 2.05,
) -> float:
  """The mean of LTX-Video-Trainer's shifted logit-normal sampler for a sequence of `tokens` latent
  tokens: the straight line through `(min_tokens, min_shift)` and `(max_tokens, max_shift)` (not
  clipped: shorter sequences get a smaller, possibly negative, mean) — `md_schedulers.calculate_shift`
  with LTX's endpoints."""
  import md_schedulers as mdsch

  return float(mdsch.calculate_shift(tokens, min_tokens, max_tokens, min_shift, max_shift))


def ltx_loss(
  transformer: Frozen,
  *,
  frame_rate: float = 24.0,
  temporal_compression: int = 8,
  spatial_compression: int = 32,
  first_frame_conditioning_p: float = 0.0,
  sampler: str = "shifted_logit_normal",
  logit_std: float = 1.0,
  **sampler_options: Any,
) -> LossFn:
  """The LTX-Video text-to-video flow-matching loss of Lightricks' LTX-Video-Trainer.

  Batch: `latents [B, F, H, W, C]` (channels-last, VAE-normalised), `encoder_hidden_states [B, S, D]`,
  optional `encoder_attention_mask [B, S]` (1 for caption tokens), `noise` like the latents, `sigmas [B]`
  in (0, 1] and `first_frame` (a boolean scalar: condition on the first frame in this batch, instead of
  the draw with probability `first_frame_conditioning_p`). The latents are packed into tokens
  (`md_ltx.pack_tokens`), noised as `(1 - σ) x + σ noise` towards the target `noise - x`; the model sees
  the integer timesteps `round(1000 σ)`, the caption mask and the rotary positions scaled by
  `(temporal_compression / frame_rate, spatial_compression, spatial_compression)`. With first-frame
  conditioning the first latent frame's tokens are noised to σ = 1e-5 only and leave the loss (their
  timesteps stay the batch's, as in the trainer); the loss is the squared error times that mask over the
  mask's mean. A one-frame clip is never conditioned (nothing would be left to learn).

  Args:
    transformer: the `LTXTransformer`'s frozen part.
    frame_rate, temporal_compression, spatial_compression: the rotary scales (the trainer's
      `fps / 8` latent frame rate and 32 pixels per latent).
    first_frame_conditioning_p: the probability that a batch is first-frame conditioned (image-to-video
      training); 0 is pure text-to-video.
    sampler: how σ is drawn when absent: `shifted_logit_normal` (the trainer's default: sigmoid of
      N(`ltx_sigma_shift(tokens)`, `logit_std`²)) or one of `flow_sigmas`' samplers.
    logit_std, sampler_options: the sampler's options.
  """
  if sampler not in LTX_SAMPLERS:
    raise ValueError(f"ltx_loss: sampler={sampler!r}; expected one of {LTX_SAMPLERS}")
  if not 0.0 <= float(first_frame_conditioning_p) <= 1.0:
    raise ValueError(
      f"ltx_loss: first_frame_conditioning_p={first_frame_conditioning_p} is not a probability in [0, 1]"
    )
  scale = (
    float(temporal_compression) / float(frame_rate),
    spatial_compression,
    spatial_compression,
  )

  def loss_fn(params, batch, key):
    k_noise, k_t, k_first = jax.random.split(key, 3)
    latents = batch["latents"]
    if latents.ndim != 5:
      raise ValueError(f"LTX-Video latents must be [B, F, H, W, C], got shape {latents.shape}")
    model = transformer.merge(params)
    p, pt = model.cfg.patch_size, model.cfg.patch_size_t
    b, f, h, w, _ = latents.shape
    if f % pt or h % p or w % p:
      raise ValueError(
        f"LTX-Video latents {latents.shape}: frames must divide by patch_size_t={pt}, height and width "
        f"by patch_size={p}"
      )
    grid = (f // pt, h // p, w // p)
    x = md_ltx.pack_tokens(latents, p, pt)
    noise = md_ltx.pack_tokens(_noise(batch, k_noise), p, pt)
    tokens = x.shape[1]
    if "sigmas" in batch:
      sigmas = batch["sigmas"]
    elif sampler == "shifted_logit_normal":
      mean = ltx_sigma_shift(tokens)
      sigmas = flow_sigmas(k_t, b, sampler="logit_normal", logit_mean=mean, logit_std=logit_std)
    else:
      sigmas = flow_sigmas(k_t, b, sampler=sampler, logit_std=logit_std, **sampler_options)
    timesteps = jnp.round(sigmas.astype(jnp.float32) * 1000.0)
    sig = jnp.broadcast_to(sigmas.astype(jnp.float32)[:, None, None], (b, tokens, 1))
    mask = None
    first = grid[1] * grid[2]
    if first < tokens and ("first_frame" in batch or first_frame_conditioning_p > 0):
      on = (
        jnp.asarray(batch["first_frame"], bool)
        if "first_frame" in batch
        else jax.random.bernoulli(k_first, float(first_frame_conditioning_p))
      )
      head = (jnp.arange(tokens) < first)[None, :, None] & on
      sig = jnp.where(head, jnp.float32(LTX_FIRST_FRAME_SIGMA), sig)
      mask = jnp.broadcast_to(jnp.where(head, 0.0, 1.0), (b, tokens, 1))
      mask = mask / mask.mean()
    noisy, target = (1 - sig) * x + sig * noise, noise - x
    pred = model(
      noisy.astype(x.dtype), batch["encoder_hidden_states"], timesteps,
      batch.get("encoder_attention_mask"), num_frames=grid[0], height=grid[1], width=grid[2],
      rope_interpolation_scale=scale,
    )  # fmt: skip
    return diffusion_loss(pred, target, None, mask), {}

  return loss_fn
