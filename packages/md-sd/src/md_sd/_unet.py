"""The SD 1.x / 2.x / XL denoiser: diffusers' `UNet2DConditionModel`, channels-last."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

import md_attention as mda
import md_core
from md_core import nn
from md_sd._config import UNetConfig
from md_sd._unet_blocks import DownBlock, MidBlock, UpBlock


def _nchw_to_nhwc(x: jax.Array) -> jax.Array:
  return jnp.transpose(x, (0, 2, 3, 1))


def _nhwc_to_nchw(x: jax.Array) -> jax.Array:
  return jnp.transpose(x, (0, 3, 1, 2))


def broadcast_timesteps(timestep: jax.Array | float, batch: int) -> jax.Array:
  """A scalar, `[1]` or `[B]` timestep as `[B]` (the reference broadcasts one timestep over the batch)."""
  t = jnp.asarray(timestep)
  if t.ndim == 0:
    t = t[None]
  if t.ndim != 1 or t.shape[0] not in (1, batch):
    raise ValueError(f"timestep must be a scalar, [1] or [B={batch}], got shape {t.shape}")
  return jnp.broadcast_to(t, (batch,))


class TimeConditioning(nnx.Module):
  """The time embedding and, for SDXL (`addition_embed_type="text_time"`), the added embedding of the
  pooled text embedding and the six size/crop numbers (`time_ids`)."""

  def __init__(self, cfg: UNetConfig, *, dtype: Any = None, rngs: nnx.Rngs | None = None):
    self.cfg, self.dtype = cfg, dtype
    c0, temb = cfg.block_out_channels[0], cfg.time_embed_dim
    self.time_embedding = nn.TimestepEmbedding(c0, temb, act=cfg.act_fn, dtype=dtype, rngs=rngs)
    self.add_embedding = (
      nn.TimestepEmbedding(cfg.projection_class_embeddings_input_dim, temb, dtype=dtype, rngs=rngs)
      if cfg.addition_embed_type == "text_time"
      else None
    )

  def __call__(
    self, timesteps: jax.Array, dtype: Any, added_cond_kwargs: Mapping[str, jax.Array] | None
  ) -> jax.Array:
    cfg = self.cfg
    if self.add_embedding is not None:
      text_embeds, time_ids = self.check_added(added_cond_kwargs)
    t = nn.timestep_embedding(
      timesteps,
      cfg.block_out_channels[0],
      flip_sin_to_cos=cfg.flip_sin_to_cos,
      downscale_freq_shift=cfg.freq_shift,
    )
    emb = self.time_embedding(t.astype(dtype))  # [B, T]
    if self.add_embedding is None:
      return emb
    b = text_embeds.shape[0]
    time_embeds = nn.timestep_embedding(
      time_ids.reshape(-1),
      cfg.addition_time_embed_dim,
      flip_sin_to_cos=cfg.flip_sin_to_cos,
      downscale_freq_shift=cfg.freq_shift,
    ).reshape(b, -1)  # [B, n·addition_time_embed_dim]
    add = jnp.concatenate([text_embeds.astype(time_embeds.dtype), time_embeds], axis=-1)
    return emb + self.add_embedding(add.astype(emb.dtype))

  def check_added(self, added_cond_kwargs) -> tuple[jax.Array, jax.Array]:
    """SDXL's `(text_embeds [B, D], time_ids [B, n])`, checked against the config (static shapes only)."""
    cfg = self.cfg
    added = dict(added_cond_kwargs or {})
    missing = [k for k in ("text_embeds", "time_ids") if k not in added]
    if missing:
      raise ValueError(
        f"this UNet has addition_embed_type='text_time' (SDXL): added_cond_kwargs needs {missing} "
        "(text_embeds [B, pooled_dim], time_ids [B, 6])"
      )
    text_embeds, time_ids = jnp.asarray(added["text_embeds"]), jnp.asarray(added["time_ids"])
    b = text_embeds.shape[0]
    if text_embeds.ndim != 2 or time_ids.ndim != 2 or time_ids.shape[0] != b:
      raise ValueError(
        f"text_embeds must be [B, D] and time_ids [B, n], got {text_embeds.shape} and {time_ids.shape}"
      )
    got = text_embeds.shape[1] + time_ids.shape[1] * cfg.addition_time_embed_dim
    want = cfg.projection_class_embeddings_input_dim
    if got != want:
      raise ValueError(
        f"text_embeds {text_embeds.shape} and time_ids {time_ids.shape} give {got} features "
        f"(text dim + n·{cfg.addition_time_embed_dim}); the UNet expects "
        f"projection_class_embeddings_input_dim={want}"
      )
    return text_embeds, time_ids


def check_inputs(
  cfg: UNetConfig, sample: jax.Array, encoder_hidden_states: jax.Array, what: str = "UNet"
) -> None:
  """Static shape checks with errors that say what would work."""
  if sample.ndim != 4:
    raise ValueError(
      f"{what}: sample must be [B, H, W, C] (channels-last), got shape {sample.shape}"
    )
  b, h, w, c = sample.shape
  if c != cfg.in_channels:
    raise ValueError(
      f"{what}: sample has {c} channels, the model takes in_channels={cfg.in_channels} (md is "
      "channels-last: [B, H, W, C]; use the *_nchw call for [B, C, H, W])"
    )
  f = cfg.downsample_factor
  if h % f or w % f:
    raise ValueError(
      f"{what}: sample height and width ({h}, {w}) must be multiples of {f} (the UNet halves them "
      f"{len(cfg.block_out_channels) - 1} times); e.g. ({-(-h // f) * f}, {-(-w // f) * f})"
    )
  if encoder_hidden_states.ndim != 3 or encoder_hidden_states.shape[0] != b:
    raise ValueError(
      f"{what}: encoder_hidden_states must be [B={b}, S, D], got shape {encoder_hidden_states.shape}"
    )
  widths = set(cfg.cross_attention_dim)
  if encoder_hidden_states.shape[-1] not in widths:
    raise ValueError(
      f"{what}: encoder_hidden_states have width {encoder_hidden_states.shape[-1]}, the model's "
      f"cross-attention takes cross_attention_dim={sorted(widths)[0]}"
    )


def build_down_path(owner: nnx.Module, cfg: UNetConfig, attention, dtype, rngs) -> None:
  """Adds `conv_in`, the time conditioning, the down blocks and the mid block to `owner` (shared by the
  UNet and the ControlNet, whose encoder is a copy of the UNet's)."""
  chans, temb = cfg.block_out_channels, cfg.time_embed_dim
  kw = dict(attention=attention, dtype=dtype, rngs=rngs)
  common = dict(
    groups=cfg.norm_num_groups,
    eps=cfg.norm_eps,
    act=cfg.act_fn,
    linear_projection=cfg.use_linear_projection,
  )
  owner.conv_in = nn.Conv(
    cfg.in_channels,
    chans[0],
    (cfg.conv_in_kernel,) * 2,
    padding=(cfg.conv_in_kernel - 1) // 2,
    dtype=dtype,
    rngs=rngs,
  )
  owner.time = TimeConditioning(cfg, dtype=dtype, rngs=rngs)
  blocks = []
  out = chans[0]
  for i, kind in enumerate(cfg.down_block_types):
    cin, out = out, chans[i]
    blocks.append(
      DownBlock(
        cin,
        out,
        temb,
        num_layers=cfg.layers_per_block[i],
        cross_attention=kind == "CrossAttnDownBlock2D",
        transformer_layers=cfg.transformer_layers_per_block[i],
        heads=cfg.num_attention_heads[i],
        context_dim=cfg.cross_attention_dim[i],
        add_downsample=i < len(chans) - 1,
        downsample_padding=cfg.downsample_padding,
        **common,
        **kw,
      )
    )
  owner.down_blocks = nnx.List(blocks)
  owner.mid_block = MidBlock(
    chans[-1],
    temb,
    transformer_layers=cfg.transformer_layers_per_block[-1],
    heads=cfg.num_attention_heads[-1],
    context_dim=cfg.cross_attention_dim[-1],
    output_scale_factor=cfg.mid_block_scale_factor,
    **common,
    **kw,
  )


def run_down_path(owner, cfg, x, emb, context, mask) -> tuple[jax.Array, tuple[jax.Array, ...]]:
  """Down blocks over `x` (after conv_in): the bottom sample and every skip, conv_in's output first."""
  skips = (x,)
  for block in owner.down_blocks:
    x, s = block(x, emb, context, mask)
    skips = skips + s
  return x, skips


class UNet2DConditionModel(nnx.Module):
  """The Stable Diffusion UNet (1.x, 2.x, XL), channels-last.

  Call with `sample [B, H, W, C]`, `timestep` (scalar or `[B]`), `encoder_hidden_states [B, S, D]`; SDXL also
  takes `added_cond_kwargs={"text_embeds": [B, 1280], "time_ids": [B, 6]}`. ControlNet residuals
  (channels-last) are added to the skips and the mid-block output. `call_nchw` takes and returns the
  reference's `[B, C, H, W]` layout.
  """

  def __init__(
    self,
    cfg: UNetConfig,
    *,
    rngs: nnx.Rngs | None = None,
    dtype: Any = None,
    attention: mda.AttentionConfig | None = None,
  ):
    self.cfg, self.dtype = cfg, dtype
    build_down_path(self, cfg, attention, dtype, rngs)
    chans, temb = cfg.block_out_channels, cfg.time_embed_dim
    rev_chans = tuple(reversed(chans))
    rev_layers = tuple(reversed(cfg.layers_per_block))
    rev_heads = tuple(reversed(cfg.num_attention_heads))
    rev_ctx = tuple(reversed(cfg.cross_attention_dim))
    rev_tlayers = cfg.reverse_transformer_layers_per_block or tuple(
      reversed(cfg.transformer_layers_per_block)
    )
    blocks = []
    out = rev_chans[0]
    for i, kind in enumerate(cfg.up_block_types):
      prev, out = out, rev_chans[i]
      cin = rev_chans[min(i + 1, len(chans) - 1)]
      blocks.append(
        UpBlock(
          cin,
          prev,
          out,
          temb,
          num_layers=rev_layers[i] + 1,
          cross_attention=kind == "CrossAttnUpBlock2D",
          transformer_layers=rev_tlayers[i],
          heads=rev_heads[i],
          context_dim=rev_ctx[i],
          add_upsample=i < len(chans) - 1,
          groups=cfg.norm_num_groups,
          eps=cfg.norm_eps,
          act=cfg.act_fn,
          linear_projection=cfg.use_linear_projection,
          attention=attention,
          dtype=dtype,
          rngs=rngs,
        )
      )
    self.up_blocks = nnx.List(blocks)
    self.conv_norm_out = nn.GroupNorm(cfg.norm_num_groups, chans[0], eps=cfg.norm_eps, rngs=rngs)
    self.conv_out = nn.Conv(
      chans[0],
      cfg.out_channels,
      (cfg.conv_out_kernel,) * 2,
      padding=(cfg.conv_out_kernel - 1) // 2,
      dtype=dtype,
      rngs=rngs,
    )

  @property
  def num_residuals(self) -> int:
    """How many down-block residuals a ControlNet gives this UNet."""
    return 1 + sum(len(b.resnets) + (b.downsampler is not None) for b in self.down_blocks)

  def __call__(
    self,
    sample: jax.Array,
    timestep: jax.Array | float,
    encoder_hidden_states: jax.Array,
    *,
    added_cond_kwargs: Mapping[str, jax.Array] | None = None,
    down_block_additional_residuals: Sequence[jax.Array] | None = None,
    mid_block_additional_residual: jax.Array | None = None,
    encoder_attention_mask: jax.Array | None = None,
  ) -> jax.Array:
    """Predicts the noise (or v) for `sample [B, H, W, C]`; returns `[B, H, W, out_channels]`.

    Args:
      sample: noisy latents, channels-last; H and W multiples of `cfg.downsample_factor`.
      timestep: scalar or `[B]` (integer or fractional).
      encoder_hidden_states: `[B, S, cross_attention_dim]` text states.
      added_cond_kwargs: SDXL's `text_embeds [B, D]` and `time_ids [B, 6]`.
      down_block_additional_residuals: ControlNet residuals `[B, h, w, c]`, one per skip
        (`num_residuals`), added to the skips.
      mid_block_additional_residual: ControlNet residual added to the mid block's output.
      encoder_attention_mask: `[B, S]`, True (or 1) for text tokens to attend to.
    """
    cfg = self.cfg
    check_inputs(cfg, sample, encoder_hidden_states)
    dtype = self.dtype or sample.dtype
    x = sample.astype(dtype)
    if cfg.center_input_sample:
      x = 2 * x - 1.0
    context = encoder_hidden_states.astype(dtype)
    mask = None if encoder_attention_mask is None else jnp.asarray(encoder_attention_mask) > 0
    timesteps = broadcast_timesteps(timestep, x.shape[0])
    if down_block_additional_residuals is not None:
      residuals = tuple(down_block_additional_residuals)
      if len(residuals) != self.num_residuals:
        raise ValueError(
          f"down_block_additional_residuals has {len(residuals)} tensors, the UNet has "
          f"{self.num_residuals} skips"
        )
    emb = self.time(timesteps, dtype, added_cond_kwargs)

    def add_residuals(skips, offset):
      if down_block_additional_residuals is None:
        return skips
      for i, s in enumerate(skips):
        r = residuals[offset + i]
        if r.shape != s.shape:
          raise ValueError(
            f"down_block_additional_residuals[{offset + i}] has shape {r.shape}, the skip is "
            f"{s.shape} (channels-last)"
          )
      return tuple(s + residuals[offset + i].astype(s.dtype) for i, s in enumerate(skips))

    def middle(x):
      x = self.mid_block(x, emb, context, mask)
      if mid_block_additional_residual is not None:
        if mid_block_additional_residual.shape != x.shape:
          raise ValueError(
            f"mid_block_additional_residual has shape {mid_block_additional_residual.shape}, the "
            f"mid block's output is {x.shape} (channels-last)"
          )
        x = x + mid_block_additional_residual.astype(x.dtype)
      return x

    def up(x, skips, blocks):
      for block in blocks:
        n = len(block.resnets)
        x = block(x, skips[-n:], emb, context, mask)
        skips = skips[:-n]
      return x

    x = self.conv_in(x)
    first = len(
      self.up_blocks[-1].resnets
    )  # the skips the last up block takes: conv_in's, block 0's
    d0 = self.down_blocks[0]
    if len(self.down_blocks) > 1 and first == 1 + len(d0.resnets) and d0.downsampler is not None:
      # The shallow branch (conv_in, down block 0, the last up block) runs every call; the deep one
      # (down block 0's downsampled output → the input of the last up block) is hookable (DeepCache).
      x_in = x
      x, s = d0(x, emb, context, mask)
      skips0 = (s[-1],)  # the downsampled output: the deep branch's input and first skip

      def deep(x):
        skips = skips0
        for block in self.down_blocks[1:]:
          x, s_ = block(x, emb, context, mask)
          skips = skips + s_
        return up(middle(x), add_residuals(skips, first), self.up_blocks[:-1])

      head = add_residuals((x_in,) + s[:-1], 0)
      x = md_core.deep_branch(deep, x)
      x = up(x, head, self.up_blocks[-1:])
    else:
      x, skips = run_down_path(self, cfg, x, emb, context, mask)
      x = up(middle(x), add_residuals(skips, 0), self.up_blocks)
    x = nn.activation(cfg.act_fn)(self.conv_norm_out(x))
    return self.conv_out(x)

  def call_nchw(
    self,
    sample: jax.Array,
    timestep: jax.Array | float,
    encoder_hidden_states: jax.Array,
    *,
    down_block_additional_residuals: Sequence[jax.Array] | None = None,
    mid_block_additional_residual: jax.Array | None = None,
    **kwargs,
  ) -> jax.Array:
    """`__call__` in the reference's layout: sample, residuals and output are `[B, C, H, W]`."""
    down = down_block_additional_residuals
    if down is not None:
      down = [_nchw_to_nhwc(r) for r in down]
    mid = mid_block_additional_residual
    if mid is not None:
      mid = _nchw_to_nhwc(mid)
    out = self(
      _nchw_to_nhwc(sample),
      timestep,
      encoder_hidden_states,
      down_block_additional_residuals=down,
      mid_block_additional_residual=mid,
      **kwargs,
    )
    return _nhwc_to_nchw(out)
