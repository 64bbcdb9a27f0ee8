"""The LTX-2 audio+video transformer (diffusers' `LTX2VideoTransformer3DModel`), blocks scanned.

Two token streams run side by side through every block: packed video latents `[B, S_v, C]` and packed audio
latents `[B, S_a, C_a]`. Each block gives each stream modulated self-attention (rotary positions from pixel
time/space coordinates for video, seconds for audio), cross-attention to its own text states (under the text
mask), then audio-to-video and video-to-audio cross-attention (queries and keys rotated by their time
positions only, modulated by their own timestep tables), then a modulated tanh-GELU feed-forward. Each
stream has its own adaLN-single timestep embeddings; the audio<->video attentions have two more (scale/shift
and gate) per stream.

Options of later checkpoints (LTX-2.3) are implemented from the same config keys: per-head attention gates
(`gated_attn`), modulated text cross-attention (`cross_attn_mod`, with the `sigma` adaLN-single), text states
projected outside the transformer (`use_prompt_embeddings=False`), skippable self-attention for
spatio-temporal guidance (`perturbed_attn`), bias-free feed-forwards and the keyframe embedding.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import md_attention as mda
import md_core
import md_sharding as mds
from md_core import nn, stack_layers
from md_ltx._ltx2_config import LTX2Config

_F32 = jnp.float32
_TOKENS = ("activation_batch", "activation_length", "activation_embed")

# 2*pi in three float32 pieces of 12 significant bits (the last the remainder): k * piece is exact for the
# |k| < 2**12 turns the rotary angles reach, so the reduction below loses nothing before cos/sin.
_TWO_PI_1 = np.float32(round(2 * math.pi * 2**9) / 2**9)
_TWO_PI_2 = np.float32(round((2 * math.pi - float(_TWO_PI_1)) * 2**21) / 2**21)
_TWO_PI_3 = np.float32(2 * math.pi - float(_TWO_PI_1) - float(_TWO_PI_2))


# ---------------------------------------------------------------------------------------------------------
# Rotary positions


def ltx2_rope_frequencies(cfg: LTX2Config, dim: int, num_pos_dims: int) -> np.ndarray:
  """The `dim // (2 * num_pos_dims)` rotary frequencies `theta**linspace(0, 1) * pi / 2`, float32.

  With `rope_double_precision` they are computed in float64 and rounded once, as the reference does.
  Otherwise as torch computes them in float32: torch's float32 linspace, the pow rounded once to float32
  (NumPy's float32 pow is often 1 ulp off), then each product rounded to float32.
  """
  k = dim // (2 * num_pos_dims)
  if k < 1:
    raise ValueError(f"rotary width {dim} is too small for {num_pos_dims} position axes")
  if cfg.rope_double_precision:
    steps = np.linspace(0.0, 1.0, k, dtype=np.float64)
    return (np.power(np.float64(cfg.rope_theta), steps) * math.pi / 2.0).astype(np.float32)
  steps = md_core.torch_linspace_f32(0.0, 1.0, k).astype(np.float64)
  powers = np.power(np.float64(cfg.rope_theta), steps).astype(np.float32)
  return (powers * np.float32(math.pi)) / np.float32(2.0)


def ltx2_video_coords(
  cfg: LTX2Config, num_frames: int, height: int, width: int, fps: float = 24.0
) -> np.ndarray:
  """Video patch boundaries in pixel units (time in seconds): `[1, 3, N, 2]` float32, `N` frame-major.

  Axis 1 is (time, row, column); the last axis is the `[start, end)` of each patch. Latent positions are
  scaled by `vae_scale_factors`, the causal first frame shifted (`+ causal_offset - 8`, clamped at 0) and
  time divided by `fps`, in float32 in the reference's order.
  """
  for name, n in (("num_frames", num_frames), ("height", height), ("width", width)):
    if not isinstance(n, int | np.integer) or n < 1:
      raise ValueError(f"{name}={n!r} must be a positive int (latent grid size, static)")
  f32 = np.float32
  patch = (cfg.patch_size_t, cfg.patch_size, cfg.patch_size)
  axes = [np.arange(0, n, p, dtype=f32) for n, p in zip((num_frames, height, width), patch)]
  grid = np.stack(np.meshgrid(*axes, indexing="ij"), axis=0)  # [3, F, H, W]
  ends = grid + np.asarray(patch, f32).reshape(3, 1, 1, 1)
  coords = np.stack([grid, ends], axis=-1).reshape(3, -1, 2)  # [3, N, 2]
  pixels = coords * np.asarray(cfg.vae_scale_factors, f32).reshape(3, 1, 1)
  t = (pixels[0] + f32(cfg.causal_offset)) - f32(cfg.vae_scale_factors[0])
  pixels[0] = np.maximum(t, f32(0)) / f32(fps)
  return pixels[None]


def ltx2_audio_coords(cfg: LTX2Config, num_frames: int, shift: int = 0) -> np.ndarray:
  """Audio latent frame boundaries in seconds: `[1, 1, N, 2]` float32 (the reference's float32 order).

  Latent frame `i` covers mel frames `[4 i, 4 (i + 1))` shifted by the causal offset (clamped at 0), times
  `hop_length / sampling_rate`. `shift` offsets the latent indices (overlapping windows).
  """
  if not isinstance(num_frames, int | np.integer) or num_frames < 1:
    raise ValueError(f"audio_num_frames={num_frames!r} must be a positive int (static)")
  f32 = np.float32
  scale = f32(cfg.audio_scale_factor)
  grid = np.arange(shift, num_frames + shift, cfg.audio_patch_size_t, dtype=f32)

  def seconds(mel):
    mel = np.maximum((mel + f32(cfg.causal_offset)) - scale, f32(0))
    return (mel * f32(cfg.audio_hop_length)) / f32(cfg.audio_sampling_rate)

  start = seconds(grid * scale)
  end = seconds((grid + f32(cfg.audio_patch_size_t)) * scale)
  return np.stack([start, end], axis=-1)[None, None]


def _cos_sin(angles: jax.Array) -> tuple[jax.Array, jax.Array]:
  """cos and sin of float32 angles (up to ~1.6e4 here), reduced modulo 2*pi first so that every backend's
  float32 cos/sin sees |x| <= pi."""
  turns = jnp.round(angles * np.float32(1 / (2 * math.pi)))
  r = ((angles - turns * _TWO_PI_1) - turns * _TWO_PI_2) - turns * _TWO_PI_3
  return jnp.cos(r), jnp.sin(r)


class LTX2Rope(NamedTuple):
  """Rotary tables of one attention input. `split`: `[B, N, H, D/(2H)]` per head group (first half of each
  group pairs with its second half); interleaved: `[B, N, D]` (adjacent features pair)."""

  cos: jax.Array
  sin: jax.Array


def ltx2_rope_tables(
  cfg: LTX2Config,
  coords: jax.Array,
  *,
  dim: int,
  heads: int,
  max_positions: Sequence[float],
) -> LTX2Rope:
  """Rotary tables from patch coordinates, as diffusers' `LTX2AudioVideoRotaryPosEmbed` computes them.

  Args:
    cfg: the model config (rope type, theta, precision).
    coords: `[B, P, N, 2]` patch boundaries (their midpoints are the positions) or `[B, P, N]` positions.
    dim: the width the tables rotate.
    heads: head groups of a split table.
    max_positions: the normalisation of each of the `P` position axes.

  Returns:
    `LTX2Rope` (float32 cos and sin).
  """
  coords = jnp.asarray(coords, _F32)
  if coords.ndim == 4:
    coords = (coords[..., 0] + coords[..., 1]) / np.float32(2.0)
  p = coords.shape[1]
  grid = jnp.stack([coords[:, i] / np.float32(max_positions[i]) for i in range(p)], -1)  # [B, N, P]
  freqs = jnp.asarray(ltx2_rope_frequencies(cfg, dim, p)).reshape(1, 1, 1, -1)  # [K]
  angles = (grid[..., None] * np.float32(2) - np.float32(1)) * freqs  # [B, N, P, K]
  b, n = angles.shape[:2]
  angles = jnp.swapaxes(angles, -1, -2).reshape(b, n, -1)  # [B, N, K * P]: frequency-major
  cos, sin = _cos_sin(angles)
  if cfg.rope_type == "interleaved":
    cos, sin = jnp.repeat(cos, 2, axis=-1), jnp.repeat(sin, 2, axis=-1)
    pad = dim - cos.shape[-1]
  else:
    pad = dim // 2 - cos.shape[-1]
  if pad:
    cos = jnp.concatenate([jnp.ones((b, n, pad), _F32), cos], -1)
    sin = jnp.concatenate([jnp.zeros((b, n, pad), _F32), sin], -1)
  if cfg.rope_type == "split":
    cos, sin = cos.reshape(b, n, heads, -1), sin.reshape(b, n, heads, -1)
  return LTX2Rope(cos, sin)


def ltx2_apply_rope(x: jax.Array, rope: LTX2Rope) -> jax.Array:
  """Rotates `x [B, N, D]` (all heads, before the split into heads) in float32; returns x's dtype."""
  h = x.astype(_F32)
  b, n, d = h.shape
  if rope.cos.ndim == 4:  # split: per head group, feature i pairs with feature i + r
    groups = rope.cos.shape[2]
    h = h.reshape(b, n, groups, 2, d // (2 * groups))
    first, second = h[:, :, :, 0], h[:, :, :, 1]
    cos, sin = rope.cos, rope.sin
    out = jnp.stack([first * cos - sin * second, second * cos + sin * first], axis=3)
    return out.reshape(b, n, d).astype(x.dtype)
  pairs = h.reshape(b, n, d // 2, 2)
  rotated = jnp.stack([-pairs[..., 1], pairs[..., 0]], axis=-1).reshape(b, n, d)
  return (h * rope.cos + rotated * rope.sin).astype(x.dtype)


# ---------------------------------------------------------------------------------------------------------
# Modules


class LTX2Attention(nnx.Module):
  """Attention with RMS norms of q and k across all heads, optional rotary q/k (separate tables for
  audio<->video), optional per-head gates, and the skippable form spatio-temporal guidance uses."""

  def __init__(
    self,
    cfg: LTX2Config,
    query_dim: int,
    kv_dim: int,
    heads: int,
    head_dim: int,
    *,
    gated: bool,
    rngs: nnx.Rngs,
  ):
    self.cfg, self.heads, self.head_dim = cfg, heads, head_dim
    inner = heads * head_dim
    bias = dict(use_bias=cfg.attention_bias, rngs=rngs)
    self.to_q = nn.Dense(query_dim, inner, axes=("embed", "heads"), **bias)
    self.to_k = nn.Dense(kv_dim, inner, axes=("embed", "heads"), **bias)
    self.to_v = nn.Dense(kv_dim, inner, axes=("embed", "heads"), **bias)
    self.to_out = nn.Dense(
      inner, query_dim, axes=("heads", "embed"), use_bias=cfg.attention_out_bias, rngs=rngs
    )
    # torch.nn.RMSNorm with LTX2Attention's default eps (the blocks do not pass norm_eps).
    self.norm_q = nn.RMSNorm(inner, eps=1e-6, rngs=rngs)
    self.norm_k = nn.RMSNorm(inner, eps=1e-6, rngs=rngs)
    self.to_gate_logits = (
      nn.Dense(query_dim, heads, axes=("embed", None), rngs=rngs) if gated else None
    )

  def __call__(self, x, context=None, mask=None, q_rope=None, k_rope=None, perturb=None):
    """`x [B, S, query_dim]`; `context [B, S_kv, kv_dim]` (None: self-attention); `mask [B, S_kv]` bool;
    `perturb [B, 1, 1]`: blend of attention (1) and plain values (0) for spatio-temporal guidance."""
    source = x if context is None else context
    b, s = x.shape[:2]
    s_kv = source.shape[1]
    value = self.to_v(source)
    q = self.norm_q(self.to_q(x))
    k = self.norm_k(self.to_k(source))
    if q_rope is not None:
      q = ltx2_apply_rope(q, q_rope)
      k = ltx2_apply_rope(k, q_rope if k_rope is None else k_rope)
    heads, hd = self.heads, self.head_dim
    out = mda.attention(
      q.reshape(b, s, heads, hd),
      k.reshape(b, s_kv, heads, hd),
      value.reshape(b, s_kv, heads, hd),
      mask=mask,
      config=self.cfg.attention_settings,
    ).reshape(b, s, heads * hd)
    if perturb is not None:
      # torch.lerp(value, out, w), in its two-sided form (exact at w = 0 and w = 1).
      w = perturb.astype(out.dtype)
      out = jnp.where(w < 0.5, value + w * (out - value), out - (out - value) * (1 - w))
    if self.to_gate_logits is not None:
      gates = 2.0 * jax.nn.sigmoid(self.to_gate_logits(x))  # [B, S, H]
      out = (out.reshape(b, s, heads, hd) * gates[..., None]).reshape(b, s, heads * hd)
    return self.to_out(out)


class LTX2AdaLNSingle(nnx.Module):
  """adaLN-single: sinusoidal timestep features → MLP (`embedded_timestep`) → `num_params` vectors."""

  def __init__(self, dim: int, num_params: int, *, rngs: nnx.Rngs):
    self.dim, self.num_params = dim, num_params
    self.timestep_embedder = nn.TimestepEmbedding(256, dim, rngs=rngs)
    self.linear = nn.Dense(dim, num_params * dim, axes=("embed", "mlp"), rngs=rngs)

  def __call__(self, t: jax.Array, batch: int, dtype) -> tuple[jax.Array, jax.Array]:
    """`t [B * T]` → (modulation `[B, T, num_params, dim]` float32, embedding `[B, T, dim]`)."""
    feats = nn.timestep_embedding(t, 256, flip_sin_to_cos=True, downscale_freq_shift=0)
    emb = self.timestep_embedder(feats.astype(dtype))
    mod = self.linear(jax.nn.silu(emb)).astype(_F32)
    return mod.reshape(batch, -1, self.num_params, self.dim), emb.reshape(batch, -1, self.dim)


def _table(rngs: nnx.Rngs, rows: int, dim: int, scale: float) -> nnx.Param:
  value = jax.random.normal(md_core.param_key(rngs), (rows, dim), _F32) * scale
  return nnx.Param(value, logical_axes=(None, "embed"))


class _Inputs(NamedTuple):
  """What every block reads besides its two token streams (modulations float32 `[B, T, n, D]`)."""

  text: jax.Array
  audio_text: jax.Array
  mask: jax.Array | None
  audio_mask: jax.Array | None
  temb: jax.Array
  audio_temb: jax.Array
  ca_scale_shift: jax.Array
  audio_ca_scale_shift: jax.Array
  ca_gate: jax.Array
  audio_ca_gate: jax.Array
  prompt_temb: jax.Array | None
  audio_prompt_temb: jax.Array | None
  rope: LTX2Rope
  audio_rope: LTX2Rope
  ca_rope: LTX2Rope
  audio_ca_rope: LTX2Rope
  perturb: jax.Array | None  # [B, 1, 1] float32, or None without spatio-temporal guidance


class LTX2Block(nnx.Module):
  """One block: self-attention, text cross-attention, audio<->video cross-attention and feed-forward for the
  video and the audio stream, each modulated by its stream's timestep tables."""

  def __init__(self, cfg: LTX2Config, *, rngs: nnx.Rngs):
    self.cfg = cfg
    dim, adim = cfg.dim, cfg.audio_dim
    heads, hd = cfg.num_attention_heads, cfg.attention_head_dim
    aheads, ahd = cfg.audio_num_attention_heads, cfg.audio_attention_head_dim
    vg, ag = cfg.gated_attn, cfg.audio_gated_attn
    norm = dict(eps=cfg.norm_eps, elementwise_affine=cfg.norm_elementwise_affine, rngs=rngs)

    def attn(q, kv, h, d, gated):
      return LTX2Attention(cfg, q, kv, h, d, gated=gated, rngs=rngs)

    self.norm1 = nn.RMSNorm(dim, **norm)
    self.attn1 = attn(dim, dim, heads, hd, vg)
    self.audio_norm1 = nn.RMSNorm(adim, **norm)
    self.audio_attn1 = attn(adim, adim, aheads, ahd, ag)
    self.norm2 = nn.RMSNorm(dim, **norm)
    self.attn2 = attn(dim, cfg.cross_attention_dim, heads, hd, vg)
    self.audio_norm2 = nn.RMSNorm(adim, **norm)
    self.audio_attn2 = attn(adim, cfg.audio_cross_attention_dim, aheads, ahd, ag)
    # Audio-to-video: video queries, audio keys/values; video-to-audio the reverse. Both use audio heads.
    self.audio_to_video_norm = nn.RMSNorm(dim, **norm)
    self.audio_to_video_attn = attn(dim, adim, aheads, ahd, vg)
    self.video_to_audio_norm = nn.RMSNorm(adim, **norm)
    self.video_to_audio_attn = attn(adim, dim, aheads, ahd, ag)
    self.norm3 = nn.RMSNorm(dim, **norm)
    self.ff = nn.FeedForward(
      dim, mult=4, activation="gelu-approximate", use_bias=cfg.ff_bias, rngs=rngs
    )
    self.audio_norm3 = nn.RMSNorm(adim, **norm)
    self.audio_ff = nn.FeedForward(
      adim, mult=4, activation="gelu-approximate", use_bias=cfg.audio_ff_bias, rngs=rngs
    )
    self.scale_shift_table = _table(rngs, 9 if cfg.cross_attn_mod else 6, dim, dim**-0.5)
    self.audio_scale_shift_table = _table(
      rngs, 9 if cfg.audio_cross_attn_mod else 6, adim, adim**-0.5
    )
    if cfg.prompt_modulation:
      self.prompt_scale_shift_table = _table(rngs, 2, dim, 1.0)
      self.audio_prompt_scale_shift_table = _table(rngs, 2, adim, 1.0)
    else:
      self.prompt_scale_shift_table = self.audio_prompt_scale_shift_table = None
    self.video_a2v_cross_attn_scale_shift_table = _table(rngs, 5, dim, 1.0)
    self.audio_a2v_cross_attn_scale_shift_table = _table(rngs, 5, adim, 1.0)

  @staticmethod
  def _mod(table: nnx.Param, temb: jax.Array, dtype) -> list[jax.Array]:
    """Per-block table `[n, D]` + the shared timestep projection `[B, T, n, D]` → n vectors `[B, T, D]`."""
    ada = table[...].astype(_F32)[None, None] + temb
    return [ada[:, :, i].astype(dtype) for i in range(ada.shape[2])]

  def modulated_input(self, v, temb):
    """The video stream's normalised, modulated input to self-attention (TeaCache's measure on
    LTX-2); `temb [B, T, n, D]` float32, the video timestep projection."""
    shift_msa, scale_msa = self._mod(self.scale_shift_table[:2], temb[:, :, :2], v.dtype)
    return self.norm1(v) * (1 + scale_msa) + shift_msa

  def __call__(self, v, a, inputs: _Inputs, *, cross_modal: bool):
    """`v [B, S_v, D]`, `a [B, S_a, D_a]` → both updated."""
    cfg, ins = self.cfg, inputs
    dtype = v.dtype

    # 1. Self-attention.
    mods = self._mod(self.scale_shift_table, ins.temb, dtype)
    shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = mods[:6]
    h = self.norm1(v) * (1 + scale_msa) + shift_msa
    v = v + self.attn1(h, q_rope=ins.rope, perturb=ins.perturb) * gate_msa

    amods = self._mod(self.audio_scale_shift_table, ins.audio_temb, dtype)
    a_shift_msa, a_scale_msa, a_gate_msa, a_shift_mlp, a_scale_mlp, a_gate_mlp = amods[:6]
    h = self.audio_norm1(a) * (1 + a_scale_msa) + a_shift_msa
    a = a + self.audio_attn1(h, q_rope=ins.audio_rope, perturb=ins.perturb) * a_gate_msa

    # 2. Text cross-attention.
    text, audio_text = ins.text, ins.audio_text
    if cfg.prompt_modulation:
      if ins.prompt_temb is not None:
        shift_kv, scale_kv = self._mod(self.prompt_scale_shift_table, ins.prompt_temb, dtype)
        a_shift_kv, a_scale_kv = self._mod(
          self.audio_prompt_scale_shift_table, ins.audio_prompt_temb, dtype
        )
      else:  # timestep-independent: the static tables alone
        shift_kv, scale_kv = self.prompt_scale_shift_table[...].astype(dtype)[:, None, None]
        a_shift_kv, a_scale_kv = self.audio_prompt_scale_shift_table[...].astype(dtype)[
          :, None, None
        ]
      text = text * (1 + scale_kv) + shift_kv
      audio_text = audio_text * (1 + a_scale_kv) + a_shift_kv

    h = self.norm2(v)
    if cfg.cross_attn_mod:
      shift_q, scale_q, gate_q = mods[6:9]
      h = h * (1 + scale_q) + shift_q
    out = self.attn2(h, text, ins.mask)
    v = v + (out * gate_q if cfg.cross_attn_mod else out)

    h = self.audio_norm2(a)
    if cfg.audio_cross_attn_mod:
      a_shift_q, a_scale_q, a_gate_q = amods[6:9]
      h = h * (1 + a_scale_q) + a_shift_q
    out = self.audio_attn2(h, audio_text, ins.audio_mask)
    a = a + (out * a_gate_q if cfg.audio_cross_attn_mod else out)

    # 3. Audio-to-video and video-to-audio cross-attention.
    if cross_modal:
      hv = self.audio_to_video_norm(v)
      ha = self.video_to_audio_norm(a)
      table = self.video_a2v_cross_attn_scale_shift_table
      a2v_scale, a2v_shift, v2a_scale, v2a_shift = self._mod(table[:4], ins.ca_scale_shift, dtype)
      (a2v_gate,) = self._mod(table[4:], ins.ca_gate, dtype)
      atable = self.audio_a2v_cross_attn_scale_shift_table
      a_a2v_scale, a_a2v_shift, a_v2a_scale, a_v2a_shift = self._mod(
        atable[:4], ins.audio_ca_scale_shift, dtype
      )
      (v2a_gate,) = self._mod(atable[4:], ins.audio_ca_gate, dtype)

      q = hv * (1 + a2v_scale) + a2v_shift
      kv = ha * (1 + a_a2v_scale) + a_a2v_shift
      out = self.audio_to_video_attn(q, kv, q_rope=ins.ca_rope, k_rope=ins.audio_ca_rope)
      v = v + a2v_gate * out

      q = ha * (1 + a_v2a_scale) + a_v2a_shift
      kv = hv * (1 + v2a_scale) + v2a_shift
      out = self.video_to_audio_attn(q, kv, q_rope=ins.audio_ca_rope, k_rope=ins.ca_rope)
      a = a + v2a_gate * out

    # 4. Feed-forward.
    h = self.norm3(v) * (1 + scale_mlp) + shift_mlp
    v = v + self.ff(h) * gate_mlp
    h = self.audio_norm3(a) * (1 + a_scale_mlp) + a_shift_mlp
    a = a + self.audio_ff(h) * a_gate_mlp
    return v, a


def _text_mask(mask, name, text):
  if mask is None:
    return None
  mask = jnp.asarray(mask)
  if mask.shape != text.shape[:2]:
    raise ValueError(f"{name} must be [B, S_text]={text.shape[:2]} (1 = keep), got {mask.shape}")
  keep = mask != 0
  # The reference adds a -10000 bias to masked keys: a fully masked caption is attended to as if unmasked.
  return keep | ~jnp.any(keep, axis=-1, keepdims=True)


class LTX2Transformer(nnx.Module):
  """LTX-2 transformer: packed video and audio latent tokens, timesteps and text states → both velocities.

  Parameters are float32 at init; the loader casts them (keeping the modulation tables float32).
  Activations run in the dtype of the `proj_in` kernel. See `__call__` for the inputs.
  """

  def __init__(self, cfg: LTX2Config, *, rngs: nnx.Rngs):
    self.cfg = cfg
    dim, adim = cfg.dim, cfg.audio_dim
    self.proj_in = nn.Dense(cfg.in_channels, dim, axes=(None, "embed"), rngs=rngs)
    self.audio_proj_in = nn.Dense(cfg.audio_in_channels, adim, axes=(None, "embed"), rngs=rngs)
    if cfg.use_keyframes_abs_pos_embedding:
      self.keyframes_abs_pos_embedding = nnx.Param(
        jnp.zeros((1, dim), _F32), logical_axes=(None, "embed")
      )
    else:
      self.keyframes_abs_pos_embedding = None
    if cfg.use_prompt_embeddings:
      proj = dict(activation="gelu-approximate", rngs=rngs)
      self.caption_projection = nn.FeedForward(
        cfg.caption_channels, inner_dim=dim, dim_out=dim, **proj
      )
      self.audio_caption_projection = nn.FeedForward(
        cfg.caption_channels, inner_dim=adim, dim_out=adim, **proj
      )
    else:
      self.caption_projection = self.audio_caption_projection = None
    self.time_embed = LTX2AdaLNSingle(dim, 9 if cfg.cross_attn_mod else 6, rngs=rngs)
    self.audio_time_embed = LTX2AdaLNSingle(adim, 9 if cfg.audio_cross_attn_mod else 6, rngs=rngs)
    self.av_cross_attn_video_scale_shift = LTX2AdaLNSingle(dim, 4, rngs=rngs)
    self.av_cross_attn_audio_scale_shift = LTX2AdaLNSingle(adim, 4, rngs=rngs)
    self.av_cross_attn_video_a2v_gate = LTX2AdaLNSingle(dim, 1, rngs=rngs)
    self.av_cross_attn_audio_v2a_gate = LTX2AdaLNSingle(adim, 1, rngs=rngs)
    if cfg.prompt_modulation and cfg.use_prompt_adaln_single:
      self.prompt_adaln = LTX2AdaLNSingle(dim, 2, rngs=rngs)
      self.audio_prompt_adaln = LTX2AdaLNSingle(adim, 2, rngs=rngs)
    else:
      self.prompt_adaln = self.audio_prompt_adaln = None
    self.blocks = stack_layers(lambda r: LTX2Block(cfg, rngs=r), cfg.num_layers, rngs)
    self.scale_shift_table = _table(rngs, 2, dim, dim**-0.5)
    self.audio_scale_shift_table = _table(rngs, 2, adim, adim**-0.5)
    self.norm_out = nn.LayerNorm(dim, eps=1e-6, elementwise_affine=False, rngs=rngs)
    self.proj_out = nn.Dense(dim, cfg.out_channels, axes=("embed", None), rngs=rngs)
    self.audio_norm_out = nn.LayerNorm(adim, eps=1e-6, elementwise_affine=False, rngs=rngs)
    self.audio_proj_out = nn.Dense(adim, cfg.audio_out_channels, axes=("embed", None), rngs=rngs)

  # -------------------------------------------------------------------------------------------------------
  def _check_tokens(self, x, audio, text, audio_text):
    cfg = self.cfg
    if x.ndim != 3 or x.shape[-1] != cfg.in_channels:
      raise ValueError(
        f"hidden_states must be packed video latent tokens [B, S_v, in_channels={cfg.in_channels}], "
        f"got {x.shape}"
      )
    b = x.shape[0]
    if audio.ndim != 3 or audio.shape[0] != b or audio.shape[-1] != cfg.audio_in_channels:
      raise ValueError(
        f"audio_hidden_states must be packed audio latent tokens [B={b}, S_a, audio_in_channels="
        f"{cfg.audio_in_channels}], got {audio.shape}"
      )
    width = cfg.caption_channels if cfg.use_prompt_embeddings else cfg.cross_attention_dim
    awidth = cfg.caption_channels if cfg.use_prompt_embeddings else cfg.audio_cross_attention_dim
    for name, t, w in (
      ("encoder_hidden_states", text, width),
      ("audio_encoder_hidden_states", audio_text, awidth),
    ):
      if t.ndim != 3 or t.shape[0] != b or t.shape[-1] != w:
        raise ValueError(
          f"{name} must be [B={b}, S_text, {w}] (text connector states), got {t.shape}"
        )
    mesh = jax.sharding.get_abstract_mesh()
    shape = {} if mesh is None or getattr(mesh, "empty", True) else dict(mesh.shape)
    tensor = shape.get("tensor", 1)
    for name in ("num_attention_heads", "audio_num_attention_heads"):
      if getattr(cfg, name) % tensor:
        raise ValueError(
          f"{name}={getattr(cfg, name)} is not divisible by the mesh's tensor parallelism {tensor}"
        )

  @staticmethod
  def _timesteps(t, name, b, s):
    t = jnp.asarray(t)
    if t.shape not in ((b,), (b, 1), (b, s)):
      raise ValueError(f"{name} must be [B]={(b,)} or per token [B, S]={(b, s)}, got {t.shape}")
    return t.reshape(-1)

  def _coords(self, coords, name, want_axes, b, s, build):
    if coords is None:
      coords = build()
    coords = jnp.asarray(coords, _F32)
    if (
      coords.ndim not in (3, 4)
      or coords.shape[0] not in (1, b)
      or coords.shape[1] != want_axes
      or coords.shape[2] != s
      or (coords.ndim == 4 and coords.shape[3] != 2)
    ):
      raise ValueError(
        f"{name} must be [B={b}, {want_axes}, S={s}, 2] patch boundaries (or [B, {want_axes}, S] "
        f"positions), got {coords.shape}"
      )
    return coords  # batch 1 or B: the rotary tables broadcast over the batch

  def __call__(
    self,
    hidden_states: jax.Array,
    audio_hidden_states: jax.Array,
    encoder_hidden_states: jax.Array,
    audio_encoder_hidden_states: jax.Array,
    timestep: jax.Array,
    audio_timestep: jax.Array | None = None,
    sigma: jax.Array | None = None,
    audio_sigma: jax.Array | None = None,
    encoder_attention_mask: jax.Array | None = None,
    audio_encoder_attention_mask: jax.Array | None = None,
    *,
    num_frames: int | None = None,
    height: int | None = None,
    width: int | None = None,
    fps: float = 24.0,
    audio_num_frames: int | None = None,
    video_coords: jax.Array | None = None,
    audio_coords: jax.Array | None = None,
    isolate_modalities: bool = False,
    spatio_temporal_guidance_blocks: Sequence[int] = (),
    perturbation_mask: jax.Array | None = None,
    use_cross_timestep: bool = False,
    video_keyframes_mask: jax.Array | None = None,
  ) -> tuple[jax.Array, jax.Array]:
    """Predicts the velocities of packed video and audio latent tokens (diffusers' forward, same names).

    Positions come from `video_coords` / `audio_coords` when given (what diffusers' LTX2Pipeline passes,
    e.g. `ltx2_video_coords(cfg, F, H, W, fps)` repeated over the batch), else they
    are built from the static grid sizes `num_frames, height, width, fps` and `audio_num_frames`.

    Args:
      hidden_states: `[B, S_v, in_channels]` packed video latents, frame-major over the latent grid.
      audio_hidden_states: `[B, S_a, audio_in_channels]` packed audio latents (one token per latent frame).
      encoder_hidden_states: `[B, S_text, caption_channels]` video text states from the connector
        (`[B, S_text, cross_attention_dim]` when `use_prompt_embeddings` is False).
      audio_encoder_hidden_states: the audio text states, likewise.
      timestep: `[B]` or per-token `[B, S_v]` video timesteps, already scaled (sigma * 1000).
      audio_timestep: `[B]` or `[B, S_a]` audio timesteps (None: `timestep`).
      sigma: `[B]` timesteps of the text-state modulation (LTX-2.3) and of `use_cross_timestep`; the
        pipeline passes `timestep` here.
      audio_sigma: the audio one (None: `sigma`).
      encoder_attention_mask: `[B, S_text]`, 1 for text tokens to attend to (None: all). A fully masked
        row is attended to as if unmasked, as in the reference.
      audio_encoder_attention_mask: the audio text mask, likewise.
      num_frames: latent frames of the video grid (static; only without `video_coords`).
      height: latent rows (static).
      width: latent columns (static).
      fps: frame rate of the video positions (static; only without `video_coords`).
      audio_num_frames: audio latent frames (static; only without `audio_coords`).
      video_coords: `[B, 3, S_v, 2]` video patch boundaries (pixels, seconds for time).
      audio_coords: `[B, 1, S_a, 2]` audio patch boundaries (seconds).
      isolate_modalities: skip the audio<->video cross-attentions (modality guidance; static).
      spatio_temporal_guidance_blocks: block indices whose self-attentions are replaced by their values
        (static). As in the reference, only models built with `perturbed_attn` do this; others ignore it.
      perturbation_mask: `[B]` weights of those blocks' attention (0: values only, the default for all
        samples; 1: unperturbed).
      use_cross_timestep: the audio<->video modulation of each stream follows the other stream's sigma
        (LTX-2.3+ pipelines) instead of its own timestep (LTX-2.0; static).
      video_keyframes_mask: `[B, S_v, 1]`, nonzero on tokens that get the keyframe embedding (only with
        `use_keyframes_abs_pos_embedding`).

    Returns:
      `(video [B, S_v, out_channels], audio [B, S_a, audio_out_channels])` in the activation dtype.
    """
    cfg = self.cfg
    x, audio = jnp.asarray(hidden_states), jnp.asarray(audio_hidden_states)
    text, audio_text = jnp.asarray(encoder_hidden_states), jnp.asarray(audio_encoder_hidden_states)
    self._check_tokens(x, audio, text, audio_text)
    dtype = self.proj_in.weight_dtype
    b, s_v = x.shape[:2]
    s_a = audio.shape[1]

    # Timesteps.
    audio_timestep = timestep if audio_timestep is None else audio_timestep
    audio_sigma = sigma if audio_sigma is None else audio_sigma
    t = self._timesteps(timestep, "timestep", b, s_v)
    at = self._timesteps(audio_timestep, "audio_timestep", b, s_a)
    needs_sigma = use_cross_timestep or (cfg.prompt_modulation and cfg.use_prompt_adaln_single)
    if needs_sigma and sigma is None:
      raise ValueError(
        "sigma is required with use_cross_timestep or a model with prompt modulation "
        "(cross_attn_mod); the pipeline passes its timestep [B]"
      )
    if needs_sigma:
      sig = self._timesteps(sigma, "sigma", b, s_v)
      asig = self._timesteps(audio_sigma, "audio_sigma", b, s_a)

    # Positions.
    def build_video():
      if num_frames is None or height is None or width is None:
        raise ValueError("pass video_coords or the static num_frames, height and width")
      return ltx2_video_coords(cfg, num_frames, height, width, fps)

    def build_audio():
      if audio_num_frames is None:
        raise ValueError("pass audio_coords or the static audio_num_frames")
      return ltx2_audio_coords(cfg, audio_num_frames)

    vc = self._coords(video_coords, "video_coords", 3, b, s_v, build_video)
    ac = self._coords(audio_coords, "audio_coords", 1, b, s_a, build_audio)
    base = (cfg.pos_embed_max_pos, cfg.base_height, cfg.base_width)
    cross_base = (max(cfg.pos_embed_max_pos, cfg.audio_pos_embed_max_pos),)
    heads, aheads = cfg.num_attention_heads, cfg.audio_num_attention_heads
    rope = ltx2_rope_tables(cfg, vc, dim=cfg.dim, heads=heads, max_positions=base)
    audio_rope = ltx2_rope_tables(
      cfg, ac, dim=cfg.audio_dim, heads=aheads, max_positions=(cfg.audio_pos_embed_max_pos,)
    )
    # The audio<->video tables rotate the audio width by time alone; the video one is grouped by the
    # video head count, as the reference builds it.
    ca_rope = ltx2_rope_tables(
      cfg, vc[:, :1], dim=cfg.audio_cross_attention_dim, heads=heads, max_positions=cross_base
    )
    audio_ca_rope = ltx2_rope_tables(
      cfg, ac, dim=cfg.audio_cross_attention_dim, heads=aheads, max_positions=cross_base
    )

    # Input projections.
    h = self.proj_in(x.astype(dtype))
    if self.keyframes_abs_pos_embedding is not None and video_keyframes_mask is not None:
      marker = (jnp.asarray(video_keyframes_mask) > 0).astype(dtype)
      if marker.shape != (b, s_v, 1):
        raise ValueError(
          f"video_keyframes_mask must be [B, S_v, 1]={(b, s_v, 1)}, got {marker.shape}"
        )
      h = h + marker * self.keyframes_abs_pos_embedding[...].astype(dtype)[None]
    ha = self.audio_proj_in(audio.astype(dtype))
    h = mds.with_logical_constraint(h, _TOKENS)
    ha = mds.with_logical_constraint(ha, _TOKENS)

    # Timestep modulations.
    temb, emb = self.time_embed(t, b, dtype)
    audio_temb, audio_emb = self.audio_time_embed(at, b, dtype)
    prompt_temb = audio_prompt_temb = None
    if self.prompt_adaln is not None:
      prompt_temb, _ = self.prompt_adaln(sig, b, dtype)
      audio_prompt_temb, _ = self.audio_prompt_adaln(asig, b, dtype)
    gate_factor = np.float32(
      cfg.cross_attn_timestep_scale_multiplier / cfg.timestep_scale_multiplier
    )
    video_ca_t = asig if use_cross_timestep else t
    audio_ca_t = sig if use_cross_timestep else at
    ca_scale_shift, _ = self.av_cross_attn_video_scale_shift(video_ca_t, b, dtype)
    ca_gate, _ = self.av_cross_attn_video_a2v_gate(video_ca_t.astype(_F32) * gate_factor, b, dtype)
    audio_ca_scale_shift, _ = self.av_cross_attn_audio_scale_shift(audio_ca_t, b, dtype)
    audio_ca_gate, _ = self.av_cross_attn_audio_v2a_gate(
      audio_ca_t.astype(_F32) * gate_factor, b, dtype
    )

    # Text states.
    if self.caption_projection is not None:
      text = self.caption_projection(text.astype(dtype))
      audio_text = self.audio_caption_projection(audio_text.astype(dtype))
    else:
      text, audio_text = text.astype(dtype), audio_text.astype(dtype)
    mask = _text_mask(encoder_attention_mask, "encoder_attention_mask", text)
    audio_mask = _text_mask(
      audio_encoder_attention_mask, "audio_encoder_attention_mask", audio_text
    )

    # Spatio-temporal guidance: per-layer blend weights of the self-attentions.
    stg = sorted(set(int(i) for i in spatio_temporal_guidance_blocks))
    for i in stg:
      if not 0 <= i < cfg.num_layers:
        raise ValueError(
          f"spatio_temporal_guidance_blocks has block {i}; the model has {cfg.num_layers} blocks"
        )
    use_stg = cfg.perturbed_attn and bool(stg)
    perturb = None
    if use_stg:
      if perturbation_mask is None:
        perturbation_mask = jnp.zeros((b,), _F32)
      perturbation_mask = jnp.asarray(perturbation_mask, _F32)
      if perturbation_mask.size != b:
        raise ValueError(f"perturbation_mask must be [B]={(b,)}, got {perturbation_mask.shape}")
      perturb = perturbation_mask.reshape(b, 1, 1)
    stg_flags = jnp.asarray(np.isin(np.arange(cfg.num_layers), stg))

    inputs = _Inputs(
      text, audio_text, mask, audio_mask, temb, audio_temb, ca_scale_shift, audio_ca_scale_shift,
      ca_gate, audio_ca_gate, prompt_temb, audio_prompt_temb, rope, audio_rope, ca_rope,
      audio_ca_rope, perturb,
    )  # fmt: skip

    def body(block, carry, flag):
      v, a = carry
      ins = inputs
      if use_stg:
        ins = inputs._replace(
          perturb=jnp.where(flag, inputs.perturb, jnp.ones_like(inputs.perturb))
        )
      v, a = block(v, a, ins, cross_modal=not isolate_modalities)
      v = mds.with_logical_constraint(v, _TOKENS)
      a = mds.with_logical_constraint(a, _TOKENS)
      return (v, a), None

    (h, ha), _ = md_core.scan_layers(
      self.blocks, body, (h, ha), per_layer=stg_flags, remat=cfg.remat,
      probe=lambda block, carry, _: block.modulated_input(carry[0], temb),
    )  # fmt: skip

    def head(hidden, table, embedded, norm, proj):
      table = table[...].astype(_F32)  # [2, D]
      shift = (table[0][None, None] + embedded.astype(_F32)).astype(dtype)  # [B, 1|S, D]
      scale = (table[1][None, None] + embedded.astype(_F32)).astype(dtype)
      return proj(norm(hidden) * (1 + scale) + shift)

    video = head(h, self.scale_shift_table, emb, self.norm_out, self.proj_out)
    audio = head(
      ha, self.audio_scale_shift_table, audio_emb, self.audio_norm_out, self.audio_proj_out
    )
    return video, audio
