"""ControlNet (diffusers' `ControlNetModel`) for SD 1.x/2.x and SDXL, and several ControlNets at once."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

import md_attention as mda
import md_core
from md_core import nn
from md_sd._config import ControlNetConfig
from md_sd._unet import (
  _nchw_to_nhwc,
  _nhwc_to_nchw,
  broadcast_timesteps,
  build_down_path,
  check_inputs,
  run_down_path,
)

Residuals = tuple[tuple[jax.Array, ...], jax.Array]
"""`(down_block_residuals, mid_block_residual)`, channels-last, ready for the UNet."""


def _zero_conv(channels: int, *, dtype, rngs) -> nn.Conv:
  # Zero-initialised in the reference; the loader fills real values, and a fresh model should add nothing.
  conv = nn.Conv(channels, channels, (1, 1), dtype=dtype, rngs=rngs)
  # New variables rather than in-place writes: cheaper to trace under nnx.eval_shape.
  for name in ("kernel", "bias"):
    var = getattr(conv, name)
    setattr(conv, name, nnx.Param(jnp.zeros_like(var[...]), logical_axes=md_core.logical_axes(var)))
  return conv


class ControlNetConditioningEmbedding(nnx.Module):
  """The small conv stack that encodes the conditioning image `[B, H·f, W·f, 3]` to `[B, H, W, C0]`:
  conv_in, then pairs of (3×3 conv, stride-2 3×3 conv), SiLU after each, and a final conv."""

  def __init__(
    self,
    in_channels: int,
    out_channels: int,
    widths: tuple[int, ...],
    *,
    dtype=None,
    rngs: nnx.Rngs | None = None,
  ):
    kw = dict(dtype=dtype, rngs=rngs)
    self.conv_in = nn.Conv(in_channels, widths[0], (3, 3), padding=1, **kw)
    blocks = []
    for cin, cout in zip(widths[:-1], widths[1:]):
      blocks.append(nn.Conv(cin, cin, (3, 3), padding=1, **kw))
      blocks.append(nn.Conv(cin, cout, (3, 3), stride=2, padding=1, **kw))
    self.blocks = nnx.List(blocks)
    self.conv_out = nn.Conv(widths[-1], out_channels, (3, 3), padding=1, **kw)

  def __call__(self, x: jax.Array) -> jax.Array:
    x = jax.nn.silu(self.conv_in(x))
    for conv in self.blocks:
      x = jax.nn.silu(conv(x))
    return self.conv_out(x)


class ControlNetModel(nnx.Module):
  """A ControlNet: the UNet's encoder (conv_in, down blocks, mid block) fed with the latents plus the encoded
  conditioning image, and a zero-initialised 1×1 conv per skip and after the mid block.

  Returns residuals for `UNet2DConditionModel(down_block_additional_residuals=...,
  mid_block_additional_residual=...)`, scaled by `conditioning_scale`.
  """

  def __init__(
    self,
    cfg: ControlNetConfig,
    *,
    rngs: nnx.Rngs | None = None,
    dtype: Any = None,
    attention: mda.AttentionConfig | None = None,
  ):
    self.cfg, self.dtype = cfg, dtype
    ucfg = cfg.unet
    build_down_path(self, ucfg, attention, dtype, rngs)
    chans = ucfg.block_out_channels
    self.controlnet_cond_embedding = ControlNetConditioningEmbedding(
      cfg.conditioning_channels,
      chans[0],
      cfg.conditioning_embedding_out_channels,
      dtype=dtype,
      rngs=rngs,
    )
    zero = dict(dtype=dtype, rngs=rngs)
    convs = [_zero_conv(chans[0], **zero)]
    for i, block in enumerate(self.down_blocks):
      convs += [_zero_conv(chans[i], **zero) for _ in block.resnets]
      if block.downsampler is not None:
        convs.append(_zero_conv(chans[i], **zero))
    self.controlnet_down_blocks = nnx.List(convs)
    self.controlnet_mid_block = _zero_conv(chans[-1], **zero)

  def __call__(
    self,
    sample: jax.Array,
    timestep: jax.Array | float,
    encoder_hidden_states: jax.Array,
    controlnet_cond: jax.Array,
    *,
    conditioning_scale: float | jax.Array = 1.0,
    guess_mode: bool = False,
    added_cond_kwargs: Mapping[str, jax.Array] | None = None,
    encoder_attention_mask: jax.Array | None = None,
  ) -> Residuals:
    """Residuals for the UNet from `sample [B, H, W, C]` and `controlnet_cond [B, H·f, W·f, 3]`.

    Args:
      sample: noisy latents, channels-last.
      timestep: scalar or `[B]`.
      encoder_hidden_states: `[B, S, cross_attention_dim]`.
      controlnet_cond: the conditioning image, channels-last, `f = cfg.image_downsample_factor` (8) times
        the latents' size, in the value range the ControlNet was trained on (SD pipelines: [0, 1]).
      conditioning_scale: multiplies every residual (a traced scalar does not recompile).
      guess_mode: scale the residuals from 0.1 (first skip) to 1.0 (mid block), log-spaced, as the
        reference's guess mode does.
      added_cond_kwargs: SDXL's `text_embeds` and `time_ids`.
      encoder_attention_mask: `[B, S]`, True for text tokens to attend to.

    Returns:
      `(down_block_residuals, mid_block_residual)`, channels-last.
    """
    cfg = self.cfg.unet
    check_inputs(cfg, sample, encoder_hidden_states, what="ControlNet")
    b, h, w, _ = sample.shape
    f = self.cfg.image_downsample_factor
    want = (b, h * f, w * f, self.cfg.conditioning_channels)
    if controlnet_cond.shape != want:
      raise ValueError(
        f"ControlNet: controlnet_cond has shape {controlnet_cond.shape}, expected {want} "
        f"([B, H, W, C] channels-last, {f}× the latents' height and width)"
      )
    dtype = self.dtype or sample.dtype
    cond = controlnet_cond.astype(dtype)
    if self.cfg.controlnet_conditioning_channel_order == "bgr":
      cond = cond[..., ::-1]
    context = encoder_hidden_states.astype(dtype)
    mask = None if encoder_attention_mask is None else jnp.asarray(encoder_attention_mask) > 0
    emb = self.time(broadcast_timesteps(timestep, b), dtype, added_cond_kwargs)

    x = self.conv_in(sample.astype(dtype)) + self.controlnet_cond_embedding(cond)
    x, skips = run_down_path(self, cfg, x, emb, context, mask)
    x = self.mid_block(x, emb, context, mask)

    down = [conv(s) for conv, s in zip(self.controlnet_down_blocks, skips)]
    mid = self.controlnet_mid_block(x)
    if guess_mode:
      scales = jnp.logspace(-1.0, 0.0, len(down) + 1, dtype=jnp.float32) * conditioning_scale
      down = [d * scales[i].astype(d.dtype) for i, d in enumerate(down)]
      mid = mid * scales[-1].astype(mid.dtype)
    else:
      scale = jnp.asarray(conditioning_scale)
      down = [d * scale.astype(d.dtype) for d in down]
      mid = mid * scale.astype(mid.dtype)
    return tuple(down), mid

  def call_nchw(
    self,
    sample: jax.Array,
    timestep: jax.Array | float,
    encoder_hidden_states: jax.Array,
    controlnet_cond: jax.Array,
    **kwargs,
  ) -> Residuals:
    """`__call__` in the reference's layout: sample, image and residuals are `[B, C, H, W]`."""
    down, mid = self(
      _nchw_to_nhwc(sample),
      timestep,
      encoder_hidden_states,
      _nchw_to_nhwc(controlnet_cond),
      **kwargs,
    )
    return tuple(_nhwc_to_nchw(d) for d in down), _nhwc_to_nchw(mid)


class MultiControlNetModel(nnx.Module):
  """Several ControlNets on one UNet: their residuals, each with its own image and scale, summed (the
  reference's `MultiControlNetModel`)."""

  def __init__(self, controlnets: Sequence[ControlNetModel]):
    if not controlnets:
      raise ValueError("MultiControlNetModel needs at least one ControlNet")
    self.nets = nnx.List(list(controlnets))

  def __call__(
    self,
    sample: jax.Array,
    timestep: jax.Array | float,
    encoder_hidden_states: jax.Array,
    controlnet_cond: Sequence[jax.Array],
    *,
    conditioning_scale: Sequence[float | jax.Array] | None = None,
    guess_mode: bool = False,
    added_cond_kwargs: Mapping[str, jax.Array] | None = None,
    encoder_attention_mask: jax.Array | None = None,
  ) -> Residuals:
    """Sum of each ControlNet's residuals; `controlnet_cond` and `conditioning_scale` give one entry per
    ControlNet (scales default to 1)."""
    n = len(self.nets)
    scales = [1.0] * n if conditioning_scale is None else list(conditioning_scale)
    if len(controlnet_cond) != n or len(scales) != n:
      raise ValueError(
        f"{n} ControlNets need {n} conditioning images and scales, got {len(controlnet_cond)} images "
        f"and {len(scales)} scales"
      )
    total = None
    for net, cond, scale in zip(self.nets, controlnet_cond, scales):
      down, mid = net(
        sample,
        timestep,
        encoder_hidden_states,
        cond,
        conditioning_scale=scale,
        guess_mode=guess_mode,
        added_cond_kwargs=added_cond_kwargs,
        encoder_attention_mask=encoder_attention_mask,
      )
      if total is None:
        total = (down, mid)
      else:
        total = (tuple(a + b for a, b in zip(total[0], down)), total[1] + mid)
    return total
