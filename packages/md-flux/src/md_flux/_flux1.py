"""The Flux.1 transformer (dev, schnell): double-stream then single-stream blocks over [text; image].

Parameter paths follow diffusers' `FluxTransformer2DModel` so its key map is a rename, except that the
19 double and 38 single blocks are stacked (`transformer_blocks/...`, `single_transformer_blocks/...`
with a leading `layers` axis) and run by one `md_core.scan_layers` each, and the output norm keeps its scale
and shift projections apart (`norm_out/scale`, `norm_out/shift`).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

import md_core
from md_core import nn
from md_flux import _common as cm
from md_flux._config import FluxConfig

_TIME_CHANNELS = 256


class BlockKV(NamedTuple):
  """Post-RoPE keys and values of every block, for callers that cache or edit them.

  `double_k`/`double_v`: `[num_layers, B, S_txt + S_img, H, D]`; `single_k`/`single_v`:
  `[num_single_layers, B, S_txt + S_img, H, D]`. Tokens are in the order the blocks attend over
  them: text first, then image.
  """

  double_k: jax.Array
  double_v: jax.Array
  single_k: jax.Array
  single_v: jax.Array


class _AdaNormZero(nnx.Module):
  """`linear(silu(temb))` → `sets` modulation vectors `[B, D]` each, and a parameter-free LayerNorm."""

  def __init__(self, dim: int, sets: int, *, rngs: nnx.Rngs):
    self.sets = sets
    self.linear = nn.Dense(dim, sets * dim, axes=("embed", "mlp"), rngs=rngs)
    self.norm = nn.LayerNorm(dim, eps=1e-6, elementwise_affine=False)

  def __call__(self, temb: jax.Array) -> list[jax.Array]:
    return jnp.split(self.linear(jax.nn.silu(temb)), self.sets, axis=-1)


def _proj(dim_in: int, dim_out: int, rngs: nnx.Rngs, axes=("embed", "heads")) -> nn.Dense:
  return nn.Dense(dim_in, dim_out, axes=axes, rngs=rngs)


class _JointAttention(nnx.Module):
  """Image (to_*) and text (add_*_proj) projections with q/k RMSNorm, attended jointly as [text; image]."""

  def __init__(self, dim: int, head_dim: int, *, rngs: nnx.Rngs):
    self.head_dim = head_dim
    self.to_q, self.to_k, self.to_v = (_proj(dim, dim, rngs) for _ in range(3))
    self.add_q_proj, self.add_k_proj, self.add_v_proj = (_proj(dim, dim, rngs) for _ in range(3))
    norm = lambda: nn.RMSNorm(head_dim, eps=1e-6, rngs=rngs)  # noqa: E731
    self.norm_q, self.norm_k, self.norm_added_q, self.norm_added_k = norm(), norm(), norm(), norm()
    self.to_out = _proj(dim, dim, rngs, axes=("heads", "embed"))
    self.to_add_out = _proj(dim, dim, rngs, axes=("heads", "embed"))


class FluxDoubleBlock(nnx.Module):
  """One double-stream block (diffusers `FluxTransformerBlock`): separate weights for text and image,
  joint attention, separate GELU-tanh feed-forwards."""

  def __init__(self, cfg: FluxConfig, *, rngs: nnx.Rngs):
    dim = cfg.inner_dim
    self.norm1 = _AdaNormZero(dim, 6, rngs=rngs)
    self.norm1_context = _AdaNormZero(dim, 6, rngs=rngs)
    self.attn = _JointAttention(dim, cfg.attention_head_dim, rngs=rngs)
    self.norm2 = nn.LayerNorm(dim, eps=1e-6, elementwise_affine=False)
    self.norm2_context = nn.LayerNorm(dim, eps=1e-6, elementwise_affine=False)
    kw = dict(activation="gelu-approximate", mult=4, rngs=rngs)
    self.ff = nn.FeedForward(dim, **kw)
    self.ff_context = nn.FeedForward(dim, **kw)

  def modulated_input(self, img, temb):
    """The image stream's normalised, modulated input to attention (TeaCache's measure on Flux)."""
    shift, scale = self.norm1(temb)[:2]
    return cm.modulate(self.norm1.norm(img), shift, scale)

  def __call__(self, img, txt, temb, rope, attention):
    """`img [B, S_img, D]`, `txt [B, S_txt, D]`, `temb [B, D]` → new `(img, txt)` and `(k, v)`."""
    a = self.attn
    shift, scale, g_msa, shift_mlp, scale_mlp, g_mlp = self.norm1(temb)
    c_shift, c_scale, c_g_msa, c_shift_mlp, c_scale_mlp, c_g_mlp = self.norm1_context(temb)
    x = cm.modulate(self.norm1.norm(img), shift, scale)
    c = cm.modulate(self.norm1_context.norm(txt), c_shift, c_scale)
    hd = a.head_dim
    q = jnp.concatenate(
      [a.norm_added_q(cm.heads(a.add_q_proj(c), hd)), a.norm_q(cm.heads(a.to_q(x), hd))], axis=1
    )
    k = jnp.concatenate(
      [a.norm_added_k(cm.heads(a.add_k_proj(c), hd)), a.norm_k(cm.heads(a.to_k(x), hd))], axis=1
    )
    v = jnp.concatenate([cm.heads(a.add_v_proj(c), hd), cm.heads(a.to_v(x), hd)], axis=1)
    q, k = cm.apply_rope(q, rope), cm.apply_rope(k, rope)
    out = cm.attend(q, k, v, attention)  # [B, S_txt + S_img, D]
    s_txt = txt.shape[1]
    img = img + cm.gate(g_msa, a.to_out(out[:, s_txt:]))
    img = img + cm.gate(g_mlp, self.ff(cm.modulate(self.norm2(img), shift_mlp, scale_mlp)))
    txt = txt + cm.gate(c_g_msa, a.to_add_out(out[:, :s_txt]))
    txt = txt + cm.gate(
      c_g_mlp, self.ff_context(cm.modulate(self.norm2_context(txt), c_shift_mlp, c_scale_mlp))
    )
    return img, txt, (k, v)


class _SingleAttention(nnx.Module):
  def __init__(self, dim: int, head_dim: int, *, rngs: nnx.Rngs):
    self.to_q, self.to_k, self.to_v = (_proj(dim, dim, rngs) for _ in range(3))
    self.norm_q = nn.RMSNorm(head_dim, eps=1e-6, rngs=rngs)
    self.norm_k = nn.RMSNorm(head_dim, eps=1e-6, rngs=rngs)


class FluxSingleBlock(nnx.Module):
  """One single-stream block (diffusers `FluxSingleTransformerBlock`): attention and a GELU-tanh MLP
  side by side over the joint sequence, one output projection over both."""

  def __init__(self, cfg: FluxConfig, *, rngs: nnx.Rngs):
    dim, mlp = cfg.inner_dim, cfg.mlp_hidden_dim
    self.head_dim = cfg.attention_head_dim
    self.norm = _AdaNormZero(dim, 3, rngs=rngs)
    self.proj_mlp = nn.Dense(dim, mlp, axes=("embed", "mlp"), rngs=rngs)
    self.attn = _SingleAttention(dim, cfg.attention_head_dim, rngs=rngs)
    self.proj_out = nn.Dense(dim + mlp, dim, axes=("mlp", "embed"), rngs=rngs)

  def __call__(self, h, temb, rope, attention):
    """`h [B, S_txt + S_img, D]` → new `h` and `(k, v)`."""
    a, hd = self.attn, self.head_dim
    shift, scale, g = self.norm(temb)
    x = cm.modulate(self.norm.norm(h), shift, scale)
    mlp = nn.gelu(self.proj_mlp(x), approximate=True)
    q = cm.apply_rope(a.norm_q(cm.heads(a.to_q(x), hd)), rope)
    k = cm.apply_rope(a.norm_k(cm.heads(a.to_k(x), hd)), rope)
    v = cm.heads(a.to_v(x), hd)
    out = cm.attend(q, k, v, attention)
    h = h + cm.gate(g, self.proj_out(jnp.concatenate([out, mlp], axis=-1)))
    return h, (k, v)


class _TimeTextEmbed(nnx.Module):
  """Timestep (+ guidance) sinusoidal MLPs plus the pooled-text projection (diffusers
  `CombinedTimestep[Guidance]TextProjEmbeddings`)."""

  def __init__(self, cfg: FluxConfig, *, rngs: nnx.Rngs):
    dim = cfg.inner_dim
    self.timestep_embedder = nn.TimestepEmbedding(_TIME_CHANNELS, dim, rngs=rngs)
    self.guidance_embedder = (
      nn.TimestepEmbedding(_TIME_CHANNELS, dim, rngs=rngs) if cfg.guidance_embeds else None
    )
    self.text_embedder = nn.TimestepEmbedding(cfg.pooled_projection_dim, dim, act="silu", rngs=rngs)

  def __call__(self, timestep, guidance, pooled):
    def embed(mlp, t):
      proj = nn.timestep_embedding(t, _TIME_CHANNELS, flip_sin_to_cos=True, downscale_freq_shift=0)
      return mlp(proj.astype(pooled.dtype))

    temb = embed(self.timestep_embedder, timestep)
    if self.guidance_embedder is not None:
      temb = temb + embed(self.guidance_embedder, guidance)
    return temb + self.text_embedder(pooled)


def _per_sample(name: str, value, batch: int, dtype) -> jax.Array:
  value = jnp.asarray(value)
  if value.ndim == 0:
    value = jnp.broadcast_to(value, (batch,))
  if value.shape != (batch,):
    raise ValueError(f"{name} must be a scalar or [B] = [{batch}], got shape {value.shape}")
  return value.astype(dtype)


class FluxTransformer(nnx.Module):
  """The Flux.1 transformer (diffusers `FluxTransformer2DModel`) over packed latents.

  Args:
    cfg: sizes (`FluxConfig`, e.g. `FLUX_VARIANTS["dev"]` or `FluxConfig.from_json(...)`) and the
      attention implementation (`cfg.attention`).
    rngs: random init (use `md_flux.load_flux` for real weights).
  """

  def __init__(self, cfg: FluxConfig, *, rngs: nnx.Rngs):
    self.cfg = cfg
    dim = cfg.inner_dim
    self.x_embedder = nn.Dense(cfg.in_channels, dim, axes=(None, "embed"), rngs=rngs)
    self.context_embedder = nn.Dense(cfg.joint_attention_dim, dim, axes=(None, "embed"), rngs=rngs)
    self.time_text_embed = _TimeTextEmbed(cfg, rngs=rngs)
    self.transformer_blocks = cm.stack_blocks(
      lambda r: FluxDoubleBlock(cfg, rngs=r), cfg.num_layers, rngs
    )
    self.single_transformer_blocks = cm.stack_blocks(
      lambda r: FluxSingleBlock(cfg, rngs=r), cfg.num_single_layers, rngs
    )
    self.norm_out = cm.AdaNormOut(dim, eps=1e-6, use_bias=True, rngs=rngs)
    self.proj_out = nn.Dense(dim, cfg.out_dim, axes=("embed", None), rngs=rngs)

  def __call__(
    self,
    hidden_states: jax.Array,
    encoder_hidden_states: jax.Array,
    pooled_projections: jax.Array,
    timestep: jax.Array,
    img_ids: jax.Array,
    txt_ids: jax.Array,
    guidance: jax.Array | None = None,
    *,
    return_kv: bool = False,
  ) -> jax.Array | tuple[jax.Array, BlockKV]:
    """Predicts the flow for packed latents.

    Args:
      hidden_states: `[B, S_img, in_channels]` packed (2x2 patchified) latents.
      encoder_hidden_states: `[B, S_txt, joint_attention_dim]` T5 embeddings.
      pooled_projections: `[B, pooled_projection_dim]` pooled CLIP embedding.
      timestep: `[B]` or scalar, in [0, 1] (scaled by 1000 inside, as the reference does).
      img_ids: `[S_img, 3]` (or per sample `[B, S_img, 3]`) position ids of the image tokens.
      txt_ids: `[S_txt, 3]` (or `[B, S_txt, 3]`) position ids of the text tokens.
      guidance: `[B]` or scalar guidance scale; required by guidance-distilled models (dev) and
        refused by the others (schnell).
      return_kv: also return every block's post-RoPE keys and values (`BlockKV`).

    Returns:
      `[B, S_img, out_channels]` in the dtype of `hidden_states` (and `BlockKV` with `return_kv`).

    Raises:
      ValueError: wrong channels, ids that do not match the token counts, a missing or unexpected
        guidance, or inputs of the wrong rank.
    """
    cfg = self.cfg
    for name, x, want in (
      ("hidden_states", hidden_states, cfg.in_channels),
      ("encoder_hidden_states", encoder_hidden_states, cfg.joint_attention_dim),
    ):
      if x.ndim != 3 or x.shape[-1] != want:
        raise ValueError(f"{name} must be [B, S, {want}], got shape {x.shape}")
    b, s_img, _ = hidden_states.shape
    s_txt = encoder_hidden_states.shape[1]
    if encoder_hidden_states.shape[0] != b:
      raise ValueError(
        f"encoder_hidden_states has batch {encoder_hidden_states.shape[0]}, hidden_states {b}"
      )
    if pooled_projections.shape != (b, cfg.pooled_projection_dim):
      raise ValueError(
        f"pooled_projections must be [B, {cfg.pooled_projection_dim}] = "
        f"{(b, cfg.pooled_projection_dim)}, got shape {pooled_projections.shape}"
      )
    cm.check_ids("img_ids", img_ids, s_img, 3, b)
    cm.check_ids("txt_ids", txt_ids, s_txt, 3, b)
    if cfg.guidance_embeds and guidance is None:
      raise ValueError("this model is guidance-distilled (guidance_embeds=True): pass guidance=...")
    if not cfg.guidance_embeds and guidance is not None:
      raise ValueError(
        "this model has no guidance embedder (guidance_embeds=False, e.g. schnell): pass guidance=None"
      )

    dtype = hidden_states.dtype
    x = cm.constrain(self.x_embedder(hidden_states))
    t = _per_sample("timestep", timestep, b, dtype) * 1000
    g = None if guidance is None else _per_sample("guidance", guidance, b, dtype) * 1000
    temb = self.time_text_embed(t, g, pooled_projections.astype(dtype))
    c = cm.constrain(self.context_embedder(encoder_hidden_states.astype(dtype)))
    rope = cm.rope_tables(cm.join_ids(txt_ids, img_ids, b), cfg.axes_dims_rope, cfg.rope_theta)
    attention = cfg.attention

    def double(block, carry, _, temb, rope):
      img, txt = carry
      img, txt, kv = block(img, txt, temb, rope, attention)
      return (cm.constrain(img), cm.constrain(txt)), (kv if return_kv else None)

    # A block hook may take over the stacks unless their per-block keys and values are returned.
    hookable = not return_kv
    (x, c), double_kv = md_core.scan_layers(
      self.transformer_blocks, double, (x, c), temb, rope, remat=cfg.remat, hookable=hookable,
      probe=lambda block, carry, _, temb, rope: block.modulated_input(carry[0], temb),
    )  # fmt: skip

    def single(block, h, _, temb, rope):
      h, kv = block(h, temb, rope, attention)
      return cm.constrain(h), (kv if return_kv else None)

    h = jnp.concatenate([c, x], axis=1)
    h, single_kv = md_core.scan_layers(
      self.single_transformer_blocks, single, h, temb, rope, remat=cfg.remat, hookable=hookable
    )
    out = self.proj_out(self.norm_out(h[:, s_txt:], temb))
    if return_kv:
      return out, BlockKV(*double_kv, *single_kv)
    return out
