"""The LTX-Video transformer (diffusers' `LTXVideoTransformer3DModel`), tokens in, blocks scanned.

Inputs are packed latent tokens `[B, S, C]` (frame-major over a `num_frames x height x width` grid). The
timestep goes through adaLN-single (one sinusoidal embedding and MLP, one projection to six modulation
vectors shared by every block, each block adding its own float32 table). Each block runs self-attention with
RMS norms of q and k across all heads and a 3-axis rotary embedding over the full model width, then
cross-attention to the projected T5 captions under the caption mask, then a tanh-GELU feed-forward.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import md_attention as mda
import md_core
import md_sharding as mds
from md_core import nn, stack_layers
from md_ltx import _config
from md_ltx._config import LTXConfig

_F32 = jnp.float32
_TOKENS = ("activation_batch", "activation_length", "activation_embed")
SKIP_LAYER_STRATEGIES = ("attention_values", "attention_skip")


def _axis_angles(
  n: int, scale: float | None, patch: int, base: int, freqs: np.ndarray
) -> np.ndarray:
  """Rotary angles `[n, K]` of one axis in float32, by the reference's float32 operations in its order."""
  grid = np.arange(n, dtype=np.float32)
  if scale is not None:
    grid = (grid * np.float32(scale)) * np.float32(patch) / np.float32(base)
  return freqs[None, :] * (grid[:, None] * np.float32(2) - np.float32(1))


def _frequencies(k: int) -> np.ndarray:
  """`10000**linspace(0, 1, k) * pi / 2` in float32, as the reference computes them."""
  # torch.linspace(0, 1, k) in float32: the first half from the start, the second from the end.
  step = np.float32(1.0) / np.float32(max(k - 1, 1))
  idx = np.arange(k)
  lin = np.where(
    idx < k // 2,
    idx.astype(np.float32) * step,
    np.float32(1.0) - (k - 1 - idx).astype(np.float32) * step,
  ).astype(np.float32)
  freqs = np.power(np.float32(_config.ROPE_THETA), lin, dtype=np.float32)
  return (freqs * np.float32(math.pi)) / np.float32(2.0)


def rope_tables_from_coords(cfg: LTXConfig, video_coords) -> tuple[jax.Array, jax.Array]:
  """Rotary `(cos, sin)` `[B, S, dim]` float32 from explicit token coordinates `video_coords [B, 3, S]`.

  The coordinates are (time in seconds-like units, pixel row, pixel column) as LTXConditionPipeline builds
  them (0.9.5+): each axis is divided by its base (20, 2048, 2048), mapped to `2p - 1` and multiplied by the
  frequencies, with the feature layout of `rope_tables`. A NumPy array is turned into tables on the host
  (cosines and sines of the float32 angles taken in float64, as `rope_tables` does); a JAX array on device in
  float32.
  """
  host = isinstance(video_coords, np.ndarray)
  xp = np if host else jnp
  coords = xp.asarray(video_coords).astype(np.float32)
  if coords.ndim != 3 or coords.shape[1] != 3:
    raise ValueError(f"video_coords must be [B, 3, S] (frame, row, column), got {coords.shape}")
  k = cfg.dim // 6
  freqs = _frequencies(k)
  bases = (_config.ROPE_BASE_NUM_FRAMES, _config.ROPE_BASE_HEIGHT, _config.ROPE_BASE_WIDTH)
  grid = xp.stack([coords[:, a] / np.float32(base) for a, base in enumerate(bases)], axis=-1)
  angles = freqs.reshape(1, 1, 1, k) * (
    grid[..., None] * np.float32(2) - np.float32(1)
  )  # [B, S, 3, K]
  b, s = angles.shape[:2]
  angles = xp.swapaxes(angles, -1, -2).reshape(b, s, 3 * k)  # feature 3k + a
  pad = cfg.dim % 6

  def table(fn, fill):
    if host:
      t = jnp.asarray(fn(angles.astype(np.float64)).astype(np.float32))
    else:
      t = fn(angles)
    t = jnp.repeat(t, 2, axis=-1)
    if pad:
      t = jnp.concatenate([jnp.full((b, s, pad), fill, _F32), t], axis=-1)
    return t

  return table(np.cos if host else jnp.cos, 1.0), table(np.sin if host else jnp.sin, 0.0)


def rope_tables(
  cfg: LTXConfig,
  num_frames: int,
  height: int,
  width: int,
  rope_interpolation_scale: Sequence[float] | None = None,
) -> tuple[jax.Array, jax.Array]:
  """Rotary `(cos, sin)`, each `[num_frames * height * width, dim]` float32, as diffusers builds them.

  Positions `(f, h, w)` are scaled to `f * s_t * patch_size_t / 20`, `h * s_h * patch_size / 2048`,
  `w * s_w * patch_size / 2048` for `rope_interpolation_scale = (s_t, s_h, s_w)` (left as integers when it is
  None), mapped to `2p - 1` and multiplied by `K = dim // 6` frequencies `10000**linspace(0, 1, K) * pi/2`.
  Feature `2 * (3k + a) + j` (j = 0, 1: a rotated pair) holds frequency k of axis a; the first `dim % 6`
  features are not rotated (cos 1, sin 0). The per-axis angles are float32 products as in the reference;
  their cosines and sines are taken in float64 on the host (the arguments reach ~1.6e4, where float32
  libraries differ), then broadcast over the grid on device.
  """
  k = cfg.dim // 6
  freqs = _frequencies(k)
  scales = (None, None, None) if rope_interpolation_scale is None else rope_interpolation_scale
  if len(scales) != 3:
    raise ValueError(
      f"rope_interpolation_scale={rope_interpolation_scale} must be three numbers (frames, height, width)"
    )
  axes = (
    (num_frames, scales[0], cfg.patch_size_t, _config.ROPE_BASE_NUM_FRAMES),
    (height, scales[1], cfg.patch_size, _config.ROPE_BASE_HEIGHT),
    (width, scales[2], cfg.patch_size, _config.ROPE_BASE_WIDTH),
  )
  angles = [_axis_angles(n, None if s is None else float(s), p, b, freqs) for n, s, p, b in axes]
  shape = (num_frames, height, width, k, 3, 2)
  pad = cfg.dim % 6
  tokens = num_frames * height * width

  def table(fn, fill):
    parts = [jnp.asarray(fn(a.astype(np.float64)).astype(np.float32)) for a in angles]
    grid = jnp.stack(
      [
        jnp.broadcast_to(parts[0].reshape(num_frames, 1, 1, k), shape[:4]),
        jnp.broadcast_to(parts[1].reshape(1, height, 1, k), shape[:4]),
        jnp.broadcast_to(parts[2].reshape(1, 1, width, k), shape[:4]),
      ],
      axis=-1,
    )  # [F, H, W, K, 3]
    grid = jnp.broadcast_to(grid[..., None], shape).reshape(tokens, 6 * k)
    if pad:
      grid = jnp.concatenate([jnp.full((tokens, pad), fill, _F32), grid], axis=-1)
    return grid

  return table(np.cos, 1.0), table(np.sin, 0.0)


class LTXAttention(nnx.Module):
  """Multi-head attention with RMS norms of q and k across all heads (self- or cross-attention)."""

  def __init__(self, cfg: LTXConfig, *, rngs: nnx.Rngs):
    dim = cfg.dim
    self.cfg = cfg
    bias = dict(use_bias=cfg.attention_bias, rngs=rngs)
    self.to_q = nn.Dense(dim, dim, axes=("embed", "heads"), **bias)
    self.to_k = nn.Dense(cfg.cross_attention_dim, dim, axes=("embed", "heads"), **bias)
    self.to_v = nn.Dense(cfg.cross_attention_dim, dim, axes=("embed", "heads"), **bias)
    self.to_out = nn.Dense(
      dim, dim, axes=("heads", "embed"), use_bias=cfg.attention_out_bias, rngs=rngs
    )
    # diffusers hard-codes eps 1e-5 here (torch.nn.RMSNorm), unlike the blocks' norm_eps.
    self.norm_q = nn.RMSNorm(dim, eps=1e-5, rngs=rngs)
    self.norm_k = nn.RMSNorm(dim, eps=1e-5, rngs=rngs)

  def __call__(self, x, context=None, mask=None, rope=None, skip=None, skip_strategy=None):
    """`x [B, S, D]`; `context [B, S_text, D]` for cross-attention; `mask [B, S_text]` bool; `rope`.

    `skip [B]` (1 keep, 0 skip) with `skip_strategy` replaces the attention result of the skipped batch
    entries before the output projection, as the official LTX-Video repository's spatio-temporal
    guidance: "attention_values" by the value projection, "attention_skip" by the input `x`.
    """
    cfg = self.cfg
    source = x if context is None else context
    q, k, v = self.norm_q(self.to_q(x)), self.norm_k(self.to_k(source)), self.to_v(source)
    if rope is not None:
      # The rotation spans the full width (before the split into heads), pairs of adjacent features.
      q = nn.apply_rope(q[:, :, None], *rope)[:, :, 0]
      k = nn.apply_rope(k[:, :, None], *rope)[:, :, 0]
    b, s = x.shape[:2]
    heads, hd = cfg.num_attention_heads, cfg.attention_head_dim
    out = mda.attention(
      q.reshape(b, s, heads, hd),
      k.reshape(b, source.shape[1], heads, hd),
      v.reshape(b, source.shape[1], heads, hd),
      mask=mask,
      config=cfg.attention_settings,
    ).reshape(b, s, cfg.dim)
    if skip is not None:
      keep = skip.astype(out.dtype)[:, None, None]
      other = v if skip_strategy == "attention_values" else x
      out = out * keep + other.astype(out.dtype) * (1 - keep)
    return self.to_out(out)


class LTXBlock(nnx.Module):
  """One block: modulated self-attention, cross-attention to the captions, modulated feed-forward."""

  def __init__(self, cfg: LTXConfig, *, rngs: nnx.Rngs):
    dim = cfg.dim
    norm = dict(eps=cfg.norm_eps, elementwise_affine=cfg.norm_elementwise_affine, rngs=rngs)
    self.norm1 = nn.RMSNorm(dim, **norm)
    self.attn1 = LTXAttention(cfg, rngs=rngs)
    self.norm2 = nn.RMSNorm(dim, **norm)
    self.attn2 = LTXAttention(cfg, rngs=rngs)
    self.ff = nn.FeedForward(dim, mult=4, activation="gelu-approximate", rngs=rngs)
    table = jax.random.normal(md_core.param_key(rngs), (6, dim), _F32) / math.sqrt(dim)
    self.scale_shift_table = nnx.Param(table, logical_axes=(None, "embed"))

  def modulated_input(self, x, temb):
    """The normalised, modulated input to self-attention (TeaCache's measure on LTX-Video)."""
    ada = self.scale_shift_table[...].astype(_F32)[None, None] + temb
    return self.norm1(x) * (1 + ada[:, :, 1].astype(x.dtype)) + ada[:, :, 0].astype(x.dtype)

  def __call__(self, x, context, mask, temb, rope, skip=None, skip_strategy=None):
    """`x [B, S, D]`; `temb [B, 1|S, 6, D]` float32 (the shared timestep projection)."""
    dtype = x.dtype
    ada = self.scale_shift_table[...].astype(_F32)[None, None] + temb  # [B, 1|S, 6, D]
    shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = (
      ada[:, :, i].astype(dtype) for i in range(6)
    )
    h = self.norm1(x) * (1 + scale_msa) + shift_msa
    x = x + self.attn1(h, rope=rope, skip=skip, skip_strategy=skip_strategy) * gate_msa
    x = x + self.attn2(x, context, mask)
    h = self.norm2(x) * (1 + scale_mlp) + shift_mlp
    return x + self.ff(h) * gate_mlp


class LTXTransformer(nnx.Module):
  """LTX-Video transformer: packed noisy latent tokens, timesteps and T5 states → predicted velocity.

  Parameters are float32 at init; the loader casts them (keeping the modulation tables float32). Activations
  run in the dtype of the `proj_in` kernel.
  """

  def __init__(self, cfg: LTXConfig, *, rngs: nnx.Rngs):
    self.cfg = cfg
    dim = cfg.dim
    self.proj_in = nn.Dense(cfg.in_channels, dim, axes=(None, "embed"), rngs=rngs)
    # adaLN-single: sinusoidal features → MLP (`embedded_timestep`) → six modulation vectors.
    self.time_embedder = nn.TimestepEmbedding(256, dim, rngs=rngs)
    self.time_proj = nn.Dense(dim, 6 * dim, axes=("embed", "mlp"), rngs=rngs)
    self.caption_projection = nn.FeedForward(
      cfg.caption_channels, inner_dim=dim, dim_out=dim, activation="gelu-approximate", rngs=rngs
    )
    self.blocks = stack_layers(lambda r: LTXBlock(cfg, rngs=r), cfg.num_layers, rngs)
    self.norm_out = nn.LayerNorm(dim, eps=1e-6, elementwise_affine=False, rngs=rngs)
    self.proj_out = nn.Dense(dim, cfg.out_channels, axes=("embed", None), rngs=rngs)
    table = jax.random.normal(md_core.param_key(rngs), (2, dim), _F32) / math.sqrt(dim)
    self.scale_shift_table = nnx.Param(table, logical_axes=(None, "embed"))

  def _check(self, x, text, timestep, mask, num_frames, height, width, grid=True):
    cfg = self.cfg
    if x.ndim != 3 or x.shape[-1] != cfg.in_channels:
      raise ValueError(
        f"hidden_states must be packed latent tokens [B, S, in_channels={cfg.in_channels}], got "
        f"{x.shape}"
      )
    b, s = x.shape[:2]
    for name, n in (("num_frames", num_frames), ("height", height), ("width", width)):
      if not grid and n is None:
        continue
      if not isinstance(n, int | np.integer) or n < 1:
        raise ValueError(f"{name}={n!r} must be a positive int (latent grid size, static)")
    if grid and s != num_frames * height * width:
      raise ValueError(
        f"hidden_states has {s} tokens but num_frames x height x width = {num_frames} x {height} x "
        f"{width} = {num_frames * height * width}; pass the latent grid the tokens were packed from"
      )
    if text.ndim != 3 or text.shape[0] != b or text.shape[-1] != cfg.caption_channels:
      raise ValueError(
        f"encoder_hidden_states must be [B={b}, S_text, caption_channels={cfg.caption_channels}] "
        f"(T5 states), got {text.shape}"
      )
    if timestep.shape not in ((b,), (b, 1), (b, s)):
      raise ValueError(
        f"timestep must be [B]={(b,)} or per token [B, S]={(b, s)}, got {timestep.shape}"
      )
    if mask is not None and mask.shape != text.shape[:2]:
      raise ValueError(
        f"encoder_attention_mask must be [B, S_text]={text.shape[:2]} (1 = keep), got {mask.shape}"
      )
    heads = cfg.num_attention_heads
    mesh = jax.sharding.get_abstract_mesh()
    shape = {} if mesh is None or getattr(mesh, "empty", True) else dict(mesh.shape)
    tensor = shape.get("tensor", 1)
    if heads % tensor:
      raise ValueError(
        f"num_attention_heads={heads} is not divisible by the mesh's tensor parallelism {tensor}"
      )

  def __call__(
    self,
    hidden_states: jax.Array,
    encoder_hidden_states: jax.Array,
    timestep: jax.Array,
    encoder_attention_mask: jax.Array | None = None,
    *,
    num_frames: int | None = None,
    height: int | None = None,
    width: int | None = None,
    rope_interpolation_scale: Sequence[float] | None = None,
    video_coords: jax.Array | np.ndarray | None = None,
    rope: tuple[jax.Array, jax.Array] | None = None,
    skip_layer_mask: jax.Array | None = None,
    skip_layer_strategy: str = "attention_values",
  ) -> jax.Array:
    """Predicts the velocity of packed latent tokens.

    Args:
      hidden_states: `[B, S, in_channels]` packed latents, `S = num_frames * height * width`, frame-major.
      encoder_hidden_states: `[B, S_text, caption_channels]` T5 states.
      timestep: `[B]` timesteps (0..1000), or `[B, S]` per-token timesteps (conditioned frames).
      encoder_attention_mask: `[B, S_text]`, 1 for caption tokens to attend to (None: all). As in the
        reference, a caption whose mask is all zeros is attended to uniformly.
      num_frames: latent frames of the grid (static).
      height: latent rows (static).
      width: latent columns (static).
      rope_interpolation_scale: `(temporal, spatial, spatial)` position scales, as the pipeline passes
        `(vae_temporal_compression / frame_rate, 32, 32)` (static Python numbers); None keeps integer
        positions.
      video_coords: `[B or 1, 3, S]` explicit token coordinates (LTXConditionPipeline, 0.9.5+: frame
        coordinates already divided by the frame rate, pixel rows and columns); replaces the grid and
        `rope_interpolation_scale`, and `num_frames`/`height`/`width` may then be omitted (the tokens need
        not form one grid, e.g. keyframe tokens appended). See `rope_tables_from_coords`.
      rope: precomputed `(cos, sin)` tables (`rope_tables` / `rope_tables_from_coords`), replacing both.
      skip_layer_mask: `[num_layers, B]`, 0 where a block's self-attention is skipped for a batch entry
        (spatio-temporal guidance's perturbed pass; None: no skipping).
      skip_layer_strategy: "attention_values" (the skipped attention returns its value projection) or
        "attention_skip" (it returns its input), as the official LTX-Video repository's `stg_mode`.

    Returns:
      `[B, S, out_channels]` in the activation dtype.
    """
    cfg = self.cfg
    x, text, mask = hidden_states, encoder_hidden_states, encoder_attention_mask
    grid = rope is None and video_coords is None
    self._check(x, text, timestep, mask, num_frames, height, width, grid)
    dtype = self.proj_in.weight_dtype
    b, s = x.shape[:2]

    if rope is None:
      if video_coords is not None:
        if video_coords.shape[0] not in (1, b) or video_coords.shape[2:] != (s,):
          raise ValueError(
            f"video_coords must be [B={b} or 1, 3, S={s}], got {tuple(video_coords.shape)}"
          )
        rope = rope_tables_from_coords(cfg, video_coords)
      else:
        rope = rope_tables(cfg, num_frames, height, width, rope_interpolation_scale)
    if mask is not None:
      keep = jnp.asarray(mask) != 0
      # The reference adds a -10000 bias to masked keys: a fully masked caption becomes uniform attention.
      mask = keep | ~jnp.any(keep, axis=-1, keepdims=True)

    h = self.proj_in(x.astype(dtype))  # [B, S, D]
    h = mds.with_logical_constraint(h, _TOKENS)

    t = timestep.reshape(-1)
    feats = nn.timestep_embedding(t, 256, flip_sin_to_cos=True, downscale_freq_shift=0)
    emb = self.time_embedder(feats.astype(dtype))  # [B * (1|S), D]: `embedded_timestep`
    temb = self.time_proj(jax.nn.silu(emb)).astype(_F32)
    per = t.shape[0] // b
    temb = temb.reshape(b, per, 6, cfg.dim)
    emb = emb.reshape(b, per, cfg.dim)

    context = self.caption_projection(text.astype(dtype))  # [B, S_text, D]

    if skip_layer_mask is not None:
      if skip_layer_strategy not in SKIP_LAYER_STRATEGIES:
        raise ValueError(
          f"skip_layer_strategy={skip_layer_strategy!r} must be one of {SKIP_LAYER_STRATEGIES}"
        )
      if skip_layer_mask.shape != (cfg.num_layers, b):
        raise ValueError(
          f"skip_layer_mask must be [num_layers, B] = {(cfg.num_layers, b)}, got "
          f"{skip_layer_mask.shape}"
        )

    def body(block, h, skip):
      h = block(h, context, mask, temb, rope, skip, skip_layer_strategy)
      return mds.with_logical_constraint(h, _TOKENS), None

    h, _ = md_core.scan_layers(
      self.blocks, body, h, per_layer=skip_layer_mask, remat=cfg.remat,
      probe=lambda block, h, _: block.modulated_input(h, temb),
    )  # fmt: skip

    table = self.scale_shift_table[...].astype(_F32)  # [2, D]
    shift = (table[0][None, None] + emb.astype(_F32)).astype(dtype)  # [B, 1|S, D]
    scale = (table[1][None, None] + emb.astype(_F32)).astype(dtype)
    h = self.norm_out(h) * (1 + scale) + shift
    return self.proj_out(h)
