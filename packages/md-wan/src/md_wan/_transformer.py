"""The Wan 2.1 / 2.2 video transformer (diffusers' `WanTransformer3DModel`), channels-last, blocks scanned.

Tokens are latent patches `(t, h, w)` in frame-major order. Each block modulates its norms with a learned
float32 table plus the timestep projection (AdaLN), runs self-attention with q/k RMS norms across all heads
and a 3-axis rotary embedding, cross-attention to the text (plus, for Wan 2.1 I2V, to CLIP image tokens
through separate key/value projections; a config with `image_dim` and no `added_kv_proj_dim` instead
prepends the image tokens to the text ones), and a tanh-GELU feed-forward.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import md_attention as mda
import md_core
import md_sharding as mds
from md_core import nn, stack_layers
from md_wan._config import WanConfig

_F32 = jnp.float32
_TOKENS = ("activation_batch", "activation_length", "activation_embed")


def rope_tables(cfg: WanConfig, frames: int, rows: int, cols: int) -> tuple[jax.Array, jax.Array]:
  """Rotary `(cos, sin)`, each `[frames * rows * cols, attention_head_dim]` float32.

  The head dim is split into frame, row and column parts (`cfg.rope_dims`); each part rotates adjacent
  feature pairs by its own position. The per-axis angles are computed in float64 on the host (static
  shapes) as the reference does, then broadcast over the grid on device.
  """
  for name, n in (("latent frames", frames), ("latent rows", rows), ("latent columns", cols)):
    if n > cfg.rope_max_seq_len:
      raise ValueError(
        f"{n} {name} after patching exceed rope_max_seq_len={cfg.rope_max_seq_len} of the config"
      )
  parts = []
  for n, dim in zip((frames, rows, cols), cfg.rope_dims, strict=True):
    freqs = 1.0 / (10000.0 ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
    angles = np.outer(np.arange(n, dtype=np.float64), freqs)
    parts.append(
      (
        np.repeat(np.cos(angles), 2, axis=-1).astype(np.float32),
        np.repeat(np.sin(angles), 2, axis=-1).astype(np.float32),
      )
    )

  def grid(i):
    (t, dt), (h, dh), (w, dw) = (
      (parts[0][i], cfg.rope_dims[0]),
      (parts[1][i], cfg.rope_dims[1]),
      (parts[2][i], cfg.rope_dims[2]),
    )
    shape = (frames, rows, cols)
    table = jnp.concatenate(
      [
        jnp.broadcast_to(jnp.asarray(t).reshape(frames, 1, 1, dt), shape + (dt,)),
        jnp.broadcast_to(jnp.asarray(h).reshape(1, rows, 1, dh), shape + (dh,)),
        jnp.broadcast_to(jnp.asarray(w).reshape(1, 1, cols, dw), shape + (dw,)),
      ],
      axis=-1,
    )
    return table.reshape(frames * rows * cols, cfg.attention_head_dim)

  return grid(0), grid(1)


class WanAttention(nnx.Module):
  """Multi-head attention with RMS norms over all heads' q and k; optional image key/value branch."""

  def __init__(self, cfg: WanConfig, *, cross: bool, rngs: nnx.Rngs):
    dim, eps = cfg.dim, cfg.eps
    self.cfg, self.cross = cfg, cross
    self.to_q = nn.Dense(dim, dim, axes=("embed", "heads"), rngs=rngs)
    self.to_k = nn.Dense(dim, dim, axes=("embed", "heads"), rngs=rngs)
    self.to_v = nn.Dense(dim, dim, axes=("embed", "heads"), rngs=rngs)
    self.to_out = nn.Dense(dim, dim, axes=("heads", "embed"), rngs=rngs)
    self.norm_q = nn.RMSNorm(dim, eps=eps, rngs=rngs)
    self.norm_k = nn.RMSNorm(dim, eps=eps, rngs=rngs)
    self.has_image = cross and cfg.added_kv_proj_dim is not None
    if self.has_image:
      kv = cfg.added_kv_proj_dim
      self.add_k_proj = nn.Dense(kv, dim, axes=("embed", "heads"), rngs=rngs)
      self.add_v_proj = nn.Dense(kv, dim, axes=("embed", "heads"), rngs=rngs)
      self.norm_added_k = nn.RMSNorm(dim, eps=eps, rngs=rngs)

  def _heads(self, x):
    b, s, _ = x.shape
    return x.reshape(b, s, self.cfg.num_attention_heads, self.cfg.attention_head_dim)

  def __call__(self, x, context=None, image=None, rope=None):
    """`x [B, S, D]`; `context [B, S_text, D]` for cross-attention; `image [B, S_img, D]`; `rope` tables."""
    cfg = self.cfg
    source = x if context is None else context
    q = self._heads(self.norm_q(self.to_q(x)))
    k = self._heads(self.norm_k(self.to_k(source)))
    v = self._heads(self.to_v(source))
    if rope is not None:
      q = nn.apply_rope(q, *rope)
      k = nn.apply_rope(k, *rope)
    # Under context parallelism md-attention keeps the queries sharded and replicates the short text /
    # image keys and values for cross-attention, so the same setting serves both.
    out = mda.attention(q, k, v, config=cfg.attention_settings)
    b, s = x.shape[:2]
    out = out.reshape(b, s, cfg.dim)
    if self.has_image:
      k_img = self._heads(self.norm_added_k(self.add_k_proj(image)))
      v_img = self._heads(self.add_v_proj(image))
      out_img = mda.attention(q, k_img, v_img, config=cfg.attention_settings)
      out = out + out_img.reshape(b, s, cfg.dim)
    return self.to_out(out)


class WanBlock(nnx.Module):
  """One transformer block: AdaLN self-attention, cross-attention, AdaLN feed-forward."""

  def __init__(self, cfg: WanConfig, *, rngs: nnx.Rngs):
    dim, eps = cfg.dim, cfg.eps
    self.cfg = cfg
    self.norm1 = nn.LayerNorm(dim, eps=eps, elementwise_affine=False, rngs=rngs)
    self.attn1 = WanAttention(cfg, cross=False, rngs=rngs)
    self.attn2 = WanAttention(cfg, cross=True, rngs=rngs)
    self.norm2 = nn.LayerNorm(dim, eps=eps, rngs=rngs) if cfg.cross_attn_norm else None
    self.ffn = nn.FeedForward(dim, inner_dim=cfg.ffn_dim, activation="gelu-approximate", rngs=rngs)
    self.norm3 = nn.LayerNorm(dim, eps=eps, elementwise_affine=False, rngs=rngs)
    key = md_core.param_key(rngs)
    table = jax.random.normal(key, (1, 6, dim), _F32) / math.sqrt(dim)
    self.scale_shift_table = nnx.Param(table, logical_axes=(None, None, "embed"))

  def __call__(self, h, context, image, modulation, rope):
    """`h [B, S, D]`; `modulation [B, 1 or S, 6, D]` float32 (the timestep projection)."""
    dtype = h.dtype
    table = self.scale_shift_table[...].astype(_F32)  # [1, 6, D]
    mods = table[None] + modulation  # [B, 1|S, 6, D]
    shift, scale, gate, c_shift, c_scale, c_gate = (mods[:, :, i] for i in range(6))

    x = (self.norm1(h.astype(_F32)) * (1 + scale) + shift).astype(dtype)
    h = (h.astype(_F32) + self.attn1(x, rope=rope).astype(_F32) * gate).astype(dtype)

    x = h if self.norm2 is None else self.norm2(h.astype(_F32)).astype(dtype)
    h = h + self.attn2(x, context=context, image=image).astype(dtype)

    x = (self.norm3(h.astype(_F32)) * (1 + c_scale) + c_shift).astype(dtype)
    return (h.astype(_F32) + self.ffn(x).astype(_F32) * c_gate).astype(dtype)


class _TextEmbedder(nnx.Module):
  """`linear_2(gelu_tanh(linear_1(x)))`: UMT5 states → model width."""

  def __init__(self, cfg: WanConfig, *, rngs: nnx.Rngs):
    self.linear_1 = nn.Dense(cfg.text_dim, cfg.dim, axes=("embed", "mlp"), rngs=rngs)
    self.linear_2 = nn.Dense(cfg.dim, cfg.dim, axes=("mlp", "embed"), rngs=rngs)

  def __call__(self, x):
    return self.linear_2(nn.gelu(self.linear_1(x), approximate=True))


class _ImageEmbedder(nnx.Module):
  """CLIP image tokens → model width: LayerNorm, GELU MLP, LayerNorm (all norms float32)."""

  def __init__(self, cfg: WanConfig, *, rngs: nnx.Rngs):
    self.cfg = cfg
    self.norm1 = nn.LayerNorm(cfg.image_dim, eps=1e-5, rngs=rngs)
    self.ff = nn.FeedForward(cfg.image_dim, dim_out=cfg.dim, mult=1, activation="gelu", rngs=rngs)
    self.norm2 = nn.LayerNorm(cfg.dim, eps=1e-5, rngs=rngs)
    if cfg.pos_embed_seq_len is not None:
      shape = (1, cfg.pos_embed_seq_len, cfg.image_dim)
      self.pos_embed = nnx.Param(jnp.zeros(shape, _F32), logical_axes=(None, None, "embed"))

  def __call__(self, x):
    if self.cfg.pos_embed_seq_len is not None:
      # FLF2V: the first and last frames' tokens of each video are one sequence with learned positions.
      b, s, c = x.shape
      if b % 2 or 2 * s != self.cfg.pos_embed_seq_len:
        raise ValueError(
          f"encoder_hidden_states_image {x.shape}: with pos_embed_seq_len={self.cfg.pos_embed_seq_len} "
          f"the model takes 2 images per video of {self.cfg.pos_embed_seq_len // 2} tokens each, "
          "batched as [2 * B, tokens, image_dim]"
        )
      x = x.reshape(b // 2, 2 * s, c) + self.pos_embed[...].astype(x.dtype)
    h = self.norm1(x.astype(_F32))
    h = self.ff(h.astype(x.dtype))
    return self.norm2(h.astype(_F32)).astype(x.dtype)


class WanTransformer(nnx.Module):
  """Wan 2.1 / 2.2 transformer: noisy latents, timesteps and text states → predicted flow.

  Parameters are float32 at init; the loader casts them (keeping the reference's float32 tables). The
  activations run in the dtype of the patch-embedding kernel.
  """

  def __init__(self, cfg: WanConfig, *, rngs: nnx.Rngs):
    self.cfg = cfg
    dim = cfg.dim
    self.patch_embedding = nn.Conv(
      cfg.in_channels, dim, cfg.patch_size, stride=cfg.patch_size, padding="VALID",
      axes=("conv_in", "embed"), rngs=rngs,
    )  # fmt: skip
    self.time_embedder = nn.TimestepEmbedding(cfg.freq_dim, dim, rngs=rngs)
    self.time_proj = nn.Dense(dim, 6 * dim, axes=("embed", "mlp"), rngs=rngs)
    self.text_embedder = _TextEmbedder(cfg, rngs=rngs)
    self.image_embedder = _ImageEmbedder(cfg, rngs=rngs) if cfg.image_dim is not None else None
    self.blocks = stack_layers(lambda r: WanBlock(cfg, rngs=r), cfg.num_layers, rngs)
    self.norm_out = nn.LayerNorm(dim, eps=cfg.eps, elementwise_affine=False, rngs=rngs)
    out = cfg.out_channels * math.prod(cfg.patch_size)
    self.proj_out = nn.Dense(dim, out, axes=("embed", None), rngs=rngs)
    table = jax.random.normal(md_core.param_key(rngs), (1, 2, dim), _F32) / math.sqrt(dim)
    self.scale_shift_table = nnx.Param(table, logical_axes=(None, None, "embed"))

  def _check(self, latents, timestep, text, image, layout):
    cfg = self.cfg
    if layout not in ("BCFHW", "BFHWC"):
      raise ValueError(f"layout={layout!r} must be 'BCFHW' (diffusers) or 'BFHWC' (channels-last)")
    if latents.ndim != 5:
      raise ValueError(
        f"hidden_states must be 5-d [B, C, F, H, W] or [B, F, H, W, C], got {latents.shape}"
      )
    b = latents.shape[0]
    c = latents.shape[1] if layout == "BCFHW" else latents.shape[-1]
    if c != cfg.in_channels:
      raise ValueError(
        f"hidden_states {latents.shape} ({layout}) has {c} channels; the config has in_channels="
        f"{cfg.in_channels}"
      )
    fhw = latents.shape[2:] if layout == "BCFHW" else latents.shape[1:4]
    bad = [
      f"{name}={n} % {p}" for name, n, p in zip("FHW", fhw, cfg.patch_size, strict=True) if n % p
    ]
    if bad:
      raise ValueError(
        f"latent frames/height/width {tuple(fhw)} must be multiples of patch_size={cfg.patch_size} "
        f"({', '.join(bad)} != 0)"
      )
    if text.ndim != 3 or text.shape[0] != b or text.shape[-1] != cfg.text_dim:
      raise ValueError(
        f"encoder_hidden_states must be [B={b}, S, text_dim={cfg.text_dim}] (UMT5 states), got "
        f"{text.shape}"
      )
    tokens = math.prod(n // p for n, p in zip(fhw, cfg.patch_size, strict=True))
    frames = fhw[0] // cfg.patch_size[0]
    if timestep.shape not in ((b,), (b, tokens), (b, frames)):
      raise ValueError(
        f"timestep must be [B]={(b,)}, per token [B, tokens]={(b, tokens)} or per latent frame "
        f"[B, frames]={(b, frames)}, got {timestep.shape}"
      )
    if self.image_embedder is None and image is not None:
      raise ValueError(
        "encoder_hidden_states_image was given but the config has no image branch (image_dim=None)"
      )
    if self.image_embedder is not None:
      if image is None:
        raise ValueError(
          "this transformer has the Wan 2.1 I2V image branch: pass encoder_hidden_states_image "
          f"[B, 257, {cfg.image_dim}] (CLIP penultimate-layer tokens)"
        )
      if image.ndim != 3 or image.shape[-1] != cfg.image_dim:
        raise ValueError(
          f"encoder_hidden_states_image must be [B, tokens, image_dim={cfg.image_dim}], got {image.shape}"
        )
    self._check_mesh()
    return fhw

  def _check_mesh(self):
    cfg = self.cfg
    mesh = jax.sharding.get_abstract_mesh()
    shape = {} if mesh is None or getattr(mesh, "empty", True) else dict(mesh.shape)
    heads = cfg.num_attention_heads
    work = [d for d in range(1, heads + 1) if heads % d == 0]
    tensor = shape.get("tensor", 1)
    if heads % tensor:
      raise ValueError(
        f"num_attention_heads={heads} is not divisible by the mesh's tensor parallelism {tensor}; "
        f"tensor degrees that work: {[d for d in work if d <= jax.device_count()]}"
      )
    context = shape.get(cfg.attention_settings.context_axis, 1)
    if cfg.attention == "ulysses" and (heads // tensor) % context:
      raise ValueError(
        f"attention='ulysses' splits the {heads // tensor} heads per tensor shard (num_attention_heads="
        f"{heads}, tensor={tensor}) over the context axis of size {context}, which does not divide them; "
        f"Ulysses degrees that work: {[d for d in work if (heads // tensor) % d == 0]}; or use "
        "attention='ring' / 'ulysses_ring'"
      )

  def __call__(
    self,
    hidden_states: jax.Array,
    timestep: jax.Array,
    encoder_hidden_states: jax.Array,
    encoder_hidden_states_image: jax.Array | None = None,
    *,
    layout: str = "BCFHW",
  ) -> jax.Array:
    """Predicts the flow for noisy latents.

    Args:
      hidden_states: `[B, C, F, H, W]` (diffusers' layout, `layout="BCFHW"`) or `[B, F, H, W, C]`
        (`layout="BFHWC"`) latents; F, H, W multiples of `patch_size`.
      timestep: `[B]` timesteps (0..1000), or `[B, tokens]` per-token timesteps (Wan 2.2 TI2V's
        `expand_timesteps`: tokens = F/pt * H/ph * W/pw, frame-major), or `[B, F/pt]` one per latent
        frame (md's shorthand for per-token timesteps equal within each frame: the same result, with
        the timestep embedding computed once per frame instead of once per token).
      encoder_hidden_states: `[B, S, text_dim]` text encoder states (Wan pads UMT5 states to 512).
      encoder_hidden_states_image: `[B, 257, image_dim]` CLIP tokens for Wan 2.1 I2V (`[2B, 257, ..]`
        first/last frames for FLF2V), required exactly when the config has the image branch.
      layout: the layout of `hidden_states` and of the result.

    Returns:
      The prediction, `[B, out_channels, F, H, W]` or `[B, F, H, W, out_channels]`, in the activation
      dtype.
    """
    cfg = self.cfg
    text, image = encoder_hidden_states, encoder_hidden_states_image
    fhw = self._check(hidden_states, timestep, text, image, layout)
    dtype = self.patch_embedding.weight_dtype
    x = hidden_states if layout == "BFHWC" else jnp.transpose(hidden_states, (0, 2, 3, 4, 1))
    b = x.shape[0]
    pt, ph, pw = cfg.patch_size
    frames, rows, cols = fhw[0] // pt, fhw[1] // ph, fhw[2] // pw
    tokens = frames * rows * cols

    h = self.patch_embedding(x.astype(dtype)).reshape(b, tokens, cfg.dim)  # [B, S, D]
    h = mds.with_logical_constraint(h, _TOKENS)
    rope = rope_tables(cfg, frames, rows, cols)

    # Timestep features: float32 embedder (as the reference keeps it), projection in the model dtype.
    per_token = timestep.ndim == 2
    t = timestep.reshape(-1)
    feats = nn.timestep_embedding(t, cfg.freq_dim, flip_sin_to_cos=True, downscale_freq_shift=0)
    temb = self.time_embedder(feats.astype(self.time_embedder.linear_1.weight_dtype))
    temb = temb.astype(dtype)
    modulation = self.time_proj(jax.nn.silu(temb)).astype(_F32)
    given = timestep.shape[1] if per_token else 1
    temb = temb.reshape(b, given, cfg.dim)
    modulation = modulation.reshape(b, given, 6, cfg.dim)
    if given != tokens and per_token:  # one timestep per latent frame: each frame's tokens share it
      temb = jnp.repeat(temb, rows * cols, axis=1)
      modulation = jnp.repeat(modulation, rows * cols, axis=1)
    if per_token:  # [B, S, 6, D]: shard it with the tokens it modulates
      modulation = mds.with_logical_constraint(
        modulation, ("activation_batch", "activation_length", None, "activation_embed")
      )

    context = self.text_embedder(text.astype(dtype))
    image_tokens = None
    if self.image_embedder is not None:
      image_tokens = self.image_embedder(image.astype(dtype))  # [B, S_img, D]
      if cfg.added_kv_proj_dim is None:
        # No separate image keys / values: the image tokens come first in the cross-attention context.
        context = jnp.concatenate([image_tokens, context], axis=1)
        image_tokens = None

    def body(block, h, _):
      h = block(h, context, image_tokens, modulation, rope)
      return mds.with_logical_constraint(h, _TOKENS), None

    # TeaCache measures Wan's timestep projection (its "ret_steps" mode), not the hidden states.
    h, _ = md_core.scan_layers(
      self.blocks, body, h, remat=cfg.remat, probe=lambda *_: modulation.astype(_F32)
    )

    table = self.scale_shift_table[...].astype(_F32)  # [1, 2, D]
    shift = table[:, 0][None] + temb.astype(_F32)  # [B, 1|S, D]
    scale = table[:, 1][None] + temb.astype(_F32)
    h = (self.norm_out(h.astype(_F32)) * (1 + scale) + shift).astype(dtype)
    out = self.proj_out(h)  # [B, S, pt * ph * pw * C]

    c = cfg.out_channels
    out = out.reshape(b, frames, rows, cols, pt, ph, pw, c)
    out = out.transpose(0, 1, 4, 2, 5, 3, 6, 7).reshape(b, frames * pt, rows * ph, cols * pw, c)
    return out if layout == "BFHWC" else jnp.transpose(out, (0, 4, 1, 2, 3))
