"""The Flux.2 transformer (Klein 4B / 9B, and dev's architecture), with the reference-token KV cache.

Differences from Flux.1: modulation vectors come from three projections shared by all blocks
(`double_stream_modulation_img/txt`, `single_stream_modulation`) instead of one per block; no pooled
text input; SwiGLU feed-forwards (gate first); bias-free projections; single blocks fuse q, k, v and
the MLP input into one projection (`to_qkv_mlp_proj`) and the outputs into one (`to_out`); 4-axis
RoPE with theta 2000.

Reference-image editing (diffusers `Flux2KleinKVPipeline`): the first step runs with the reference
tokens in front of the image tokens (`num_ref_tokens=R`): they are modulated at a fixed timestep,
attend only to themselves, and their post-RoPE keys and values are returned per block (`BlockKV`);
later steps pass that cache back (`kv_cache=`) and run on the image tokens alone, attending over
`[text; cached reference; image]` keys.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

import md_core
from md_core import nn
from md_flux import _common as cm
from md_flux._config import Flux2Config
from md_flux._flux1 import BlockKV, _per_sample


def _dense(d_in: int, d_out: int, rngs: nnx.Rngs, axes=("embed", "heads")) -> nn.Dense:
  return nn.Dense(d_in, d_out, use_bias=False, axes=axes, rngs=rngs)


class _SwiGLU(nnx.Module):
  """`linear_out(silu(gate) * value)` with `linear_in` giving `[gate, value]` (diffusers
  `Flux2FeedForward`; md_core's FeedForward puts the gate second)."""

  def __init__(self, dim: int, inner: int, *, rngs: nnx.Rngs):
    self.linear_in = _dense(dim, 2 * inner, rngs, axes=("embed", "mlp"))
    self.linear_out = _dense(inner, dim, rngs, axes=("mlp", "embed"))

  def __call__(self, x: jax.Array) -> jax.Array:
    g, v = jnp.split(self.linear_in(x), 2, axis=-1)
    return self.linear_out(jax.nn.silu(g) * v)


class _Modulation(nnx.Module):
  """`linear(silu(temb))`: `3 * sets` modulation vectors (shift, scale, gate per set), shared by blocks."""

  def __init__(self, dim: int, sets: int, *, rngs: nnx.Rngs):
    self.linear = _dense(dim, 3 * sets * dim, rngs, axes=("embed", "mlp"))

  def __call__(self, temb: jax.Array) -> jax.Array:
    return self.linear(jax.nn.silu(temb))


def _kv_attend(q, k, v, attention, n_txt: int, ref: int, cached):
  """Joint attention with the reference-token rules; returns `[B, S_q, H*D]` and the ref `(k, v)`.

  `ref > 0` (extract): q/k/v hold `[text; ref; image]`; text and image attend to everything, the
  reference tokens only to themselves. `cached=(k_ref, v_ref)`: q/k/v hold `[text; image]` and the
  keys gain the cached reference block between the two.
  """
  if cached is not None:
    k_ref, v_ref = cached
    k = jnp.concatenate([k[:, :n_txt], k_ref.astype(k.dtype), k[:, n_txt:]], axis=1)
    v = jnp.concatenate([v[:, :n_txt], v_ref.astype(v.dtype), v[:, n_txt:]], axis=1)
    return cm.attend(q, k, v, attention), None
  if ref == 0:
    return cm.attend(q, k, v, attention), None
  lo, hi = n_txt, n_txt + ref
  k_ref, v_ref = k[:, lo:hi], v[:, lo:hi]
  q_rest = jnp.concatenate([q[:, :lo], q[:, hi:]], axis=1)
  rest = cm.attend(q_rest, k, v, attention)
  own = cm.attend(q[:, lo:hi], k_ref, v_ref, attention)
  return jnp.concatenate([rest[:, :lo], own, rest[:, lo:]], axis=1), (k_ref, v_ref)


class _JointAttention(nnx.Module):
  def __init__(self, dim: int, head_dim: int, eps: float, *, rngs: nnx.Rngs):
    self.head_dim = head_dim
    self.to_q, self.to_k, self.to_v = (_dense(dim, dim, rngs) for _ in range(3))
    self.add_q_proj, self.add_k_proj, self.add_v_proj = (_dense(dim, dim, rngs) for _ in range(3))
    norm = lambda: nn.RMSNorm(head_dim, eps=eps, rngs=rngs)  # noqa: E731
    self.norm_q, self.norm_k, self.norm_added_q, self.norm_added_k = norm(), norm(), norm(), norm()
    self.to_out = _dense(dim, dim, rngs, axes=("heads", "embed"))
    self.to_add_out = _dense(dim, dim, rngs, axes=("heads", "embed"))


class Flux2DoubleBlock(nnx.Module):
  """One double-stream block (diffusers `Flux2TransformerBlock`); modulation comes from outside."""

  def __init__(self, cfg: Flux2Config, *, rngs: nnx.Rngs):
    dim = cfg.inner_dim
    ln = lambda: nn.LayerNorm(dim, eps=cfg.eps, elementwise_affine=False)  # noqa: E731
    self.norm1, self.norm1_context, self.norm2, self.norm2_context = ln(), ln(), ln(), ln()
    self.attn = _JointAttention(dim, cfg.attention_head_dim, cfg.eps, rngs=rngs)
    self.ff = _SwiGLU(dim, cfg.mlp_hidden_dim, rngs=rngs)
    self.ff_context = _SwiGLU(dim, cfg.mlp_hidden_dim, rngs=rngs)

  def modulated_input(self, img, mod_img):
    """The image stream's normalised, modulated input to attention (TeaCache's measure on Flux.2)."""
    shift, scale = jnp.split(mod_img, 6, axis=-1)[:2]
    return cm.modulate(self.norm1(img), shift, scale)

  def __call__(self, img, txt, mod_img, mod_txt, rope, attention, ref=0, cached=None):
    """`img [B, S_img, D]`, `txt [B, S_txt, D]`, `mod_* [B, 6D]` (or per token `[B, S, 6D]`)."""
    a, hd = self.attn, self.attn.head_dim
    shift, scale, g_msa, shift_mlp, scale_mlp, g_mlp = jnp.split(mod_img, 6, axis=-1)
    c_shift, c_scale, c_g_msa, c_shift_mlp, c_scale_mlp, c_g_mlp = jnp.split(mod_txt, 6, axis=-1)
    x = cm.modulate(self.norm1(img), shift, scale)
    c = cm.modulate(self.norm1_context(txt), c_shift, c_scale)
    q = jnp.concatenate(
      [a.norm_added_q(cm.heads(a.add_q_proj(c), hd)), a.norm_q(cm.heads(a.to_q(x), hd))], axis=1
    )
    k = jnp.concatenate(
      [a.norm_added_k(cm.heads(a.add_k_proj(c), hd)), a.norm_k(cm.heads(a.to_k(x), hd))], axis=1
    )
    v = jnp.concatenate([cm.heads(a.add_v_proj(c), hd), cm.heads(a.to_v(x), hd)], axis=1)
    q, k = cm.apply_rope(q, rope), cm.apply_rope(k, rope)
    s_txt = txt.shape[1]
    out, ref_kv = _kv_attend(q, k, v, attention, s_txt, ref, cached)
    img = img + cm.gate(g_msa, a.to_out(out[:, s_txt:]))
    img = img + cm.gate(g_mlp, self.ff(cm.modulate(self.norm2(img), shift_mlp, scale_mlp)))
    txt = txt + cm.gate(c_g_msa, a.to_add_out(out[:, :s_txt]))
    txt = txt + cm.gate(
      c_g_mlp, self.ff_context(cm.modulate(self.norm2_context(txt), c_shift_mlp, c_scale_mlp))
    )
    return img, txt, (k, v), ref_kv


class _ParallelAttention(nnx.Module):
  def __init__(self, cfg: Flux2Config, *, rngs: nnx.Rngs):
    dim, mlp = cfg.inner_dim, cfg.mlp_hidden_dim
    self.to_qkv_mlp_proj = _dense(dim, 3 * dim + 2 * mlp, rngs, axes=("embed", "mlp"))
    self.norm_q = nn.RMSNorm(cfg.attention_head_dim, eps=cfg.eps, rngs=rngs)
    self.norm_k = nn.RMSNorm(cfg.attention_head_dim, eps=cfg.eps, rngs=rngs)
    self.to_out = _dense(dim + mlp, dim, rngs, axes=("mlp", "embed"))


class Flux2SingleBlock(nnx.Module):
  """One single-stream block (diffusers `Flux2SingleTransformerBlock`): fused attention + SwiGLU MLP."""

  def __init__(self, cfg: Flux2Config, *, rngs: nnx.Rngs):
    self.dim, self.head_dim = cfg.inner_dim, cfg.attention_head_dim
    self.norm = nn.LayerNorm(cfg.inner_dim, eps=cfg.eps, elementwise_affine=False)
    self.attn = _ParallelAttention(cfg, rngs=rngs)

  def __call__(self, h, mod, rope, attention, n_txt, ref=0, cached=None):
    """`h [B, S_txt + S_img, D]`, `mod [B, 3D]` (or `[B, S, 3D]`) → new `h`, `(k, v)`, ref `(k, v)`."""
    a, hd, dim = self.attn, self.head_dim, self.dim
    shift, scale, g = jnp.split(mod, 3, axis=-1)
    x = cm.modulate(self.norm(h), shift, scale)
    proj = a.to_qkv_mlp_proj(x)
    q, k, v = (proj[..., i * dim : (i + 1) * dim] for i in range(3))
    gate_in, value = jnp.split(proj[..., 3 * dim :], 2, axis=-1)
    q = cm.apply_rope(a.norm_q(cm.heads(q, hd)), rope)
    k = cm.apply_rope(a.norm_k(cm.heads(k, hd)), rope)
    v = cm.heads(v, hd)
    out, ref_kv = _kv_attend(q, k, v, attention, n_txt, ref, cached)
    h = h + cm.gate(g, a.to_out(jnp.concatenate([out, jax.nn.silu(gate_in) * value], axis=-1)))
    return h, (k, v), ref_kv


class _TimeMlp(nnx.Module):
  """`linear_2(silu(linear_1(x)))` without biases (md_core's TimestepEmbedding always has them)."""

  def __init__(self, d_in: int, dim: int, *, rngs: nnx.Rngs):
    self.linear_1 = _dense(d_in, dim, rngs, axes=(None, "mlp"))
    self.linear_2 = _dense(dim, dim, rngs, axes=("mlp", "embed"))

  def __call__(self, x):
    return self.linear_2(jax.nn.silu(self.linear_1(x)))


class _TimeGuidanceEmbed(nnx.Module):
  def __init__(self, cfg: Flux2Config, *, rngs: nnx.Rngs):
    self.channels = cfg.timestep_guidance_channels
    self.timestep_embedder = _TimeMlp(self.channels, cfg.inner_dim, rngs=rngs)
    self.guidance_embedder = (
      _TimeMlp(self.channels, cfg.inner_dim, rngs=rngs) if cfg.guidance_embeds else None
    )

  def __call__(self, timestep, guidance):
    def embed(mlp, t):
      proj = nn.timestep_embedding(t, self.channels, flip_sin_to_cos=True, downscale_freq_shift=0)
      return mlp(proj.astype(t.dtype))

    temb = embed(self.timestep_embedder, timestep)
    if guidance is not None and self.guidance_embedder is not None:
      temb = temb + embed(self.guidance_embedder, guidance)
    return temb


def _per_token(normal: jax.Array, ref: jax.Array, start: int, count: int, total: int) -> jax.Array:
  """`[B, total, F]` modulation: `ref [B, F]` for tokens `start..start+count`, `normal [B, F]` elsewhere."""
  pos = jnp.arange(total)
  is_ref = ((pos >= start) & (pos < start + count))[None, :, None]
  return jnp.where(is_ref, ref[:, None, :], normal[:, None, :])


class Flux2Transformer(nnx.Module):
  """The Flux.2 transformer (diffusers `Flux2Transformer2DModel`) over packed latents.

  Args:
    cfg: sizes (`Flux2Config`, e.g. `FLUX2_VARIANTS["klein-4b"]` or `Flux2Config.from_json(...)`) and
      the attention implementation (`cfg.attention`).
    rngs: random init (use `md_flux.load_flux2` for real weights).
  """

  def __init__(self, cfg: Flux2Config, *, rngs: nnx.Rngs):
    self.cfg = cfg
    dim = cfg.inner_dim
    self.time_guidance_embed = _TimeGuidanceEmbed(cfg, rngs=rngs)
    self.double_stream_modulation_img = _Modulation(dim, 2, rngs=rngs)
    self.double_stream_modulation_txt = _Modulation(dim, 2, rngs=rngs)
    self.single_stream_modulation = _Modulation(dim, 1, rngs=rngs)
    self.x_embedder = _dense(cfg.in_channels, dim, rngs, axes=(None, "embed"))
    self.context_embedder = _dense(cfg.joint_attention_dim, dim, rngs, axes=(None, "embed"))
    self.transformer_blocks = cm.stack_blocks(
      lambda r: Flux2DoubleBlock(cfg, rngs=r), cfg.num_layers, rngs
    )
    self.single_transformer_blocks = cm.stack_blocks(
      lambda r: Flux2SingleBlock(cfg, rngs=r), cfg.num_single_layers, rngs
    )
    self.norm_out = cm.AdaNormOut(dim, eps=cfg.eps, use_bias=False, rngs=rngs)
    self.proj_out = _dense(dim, cfg.out_dim, rngs, axes=("embed", None))

  def __call__(
    self,
    hidden_states: jax.Array,
    encoder_hidden_states: jax.Array,
    timestep: jax.Array,
    img_ids: jax.Array,
    txt_ids: jax.Array,
    guidance: jax.Array | None = None,
    *,
    num_ref_tokens: int = 0,
    ref_fixed_timestep: float = 0.0,
    kv_cache: BlockKV | None = None,
    return_kv: bool = False,
  ) -> jax.Array | tuple[jax.Array, BlockKV]:
    """Predicts the flow for packed latents.

    Args:
      hidden_states: `[B, S, in_channels]` packed latents; with `num_ref_tokens=R` the first `R`
        tokens are the reference images' latents.
      encoder_hidden_states: `[B, S_txt, joint_attention_dim]` text embeddings (stacked Qwen3 layers).
      timestep: `[B]` or scalar in [0, 1] (scaled by 1000 inside, as the reference does).
      img_ids: `[S, 4]` or `[B, S, 4]` position ids of the tokens of `hidden_states`.
      txt_ids: `[S_txt, 4]` or `[B, S_txt, 4]` position ids of the text tokens.
      guidance: `[B]` or scalar guidance; used only by models with a guidance embedder (as the
        reference, it is ignored when None).
      num_ref_tokens: extract mode: how many leading tokens are reference tokens (static). Returns
        `(out, cache)` with the cache of their post-RoPE keys/values per block (`BlockKV`,
        `[layers, B, R, H, D]`); `out` covers the image tokens only.
      ref_fixed_timestep: the timestep the reference tokens are modulated at in extract mode.
      kv_cache: cached mode: the `BlockKV` an extract step returned; `hidden_states` then holds the
        image tokens only.
      return_kv: (without reference tokens) also return every block's keys/values of all tokens.

    Returns:
      `[B, S_img, out_channels]` in the dtype of `hidden_states`, and a `BlockKV` in extract mode or
      with `return_kv`.

    Raises:
      ValueError: wrong channels, ids that do not match the token counts, a cache of another shape,
        guidance for a model without a guidance embedder, or both `num_ref_tokens` and `kv_cache`.
    """
    cfg = self.cfg
    for name, x, want in (
      ("hidden_states", hidden_states, cfg.in_channels),
      ("encoder_hidden_states", encoder_hidden_states, cfg.joint_attention_dim),
    ):
      if x.ndim != 3 or x.shape[-1] != want:
        raise ValueError(f"{name} must be [B, S, {want}], got shape {x.shape}")
    b, s_all, _ = hidden_states.shape
    s_txt = encoder_hidden_states.shape[1]
    if encoder_hidden_states.shape[0] != b:
      raise ValueError(
        f"encoder_hidden_states has batch {encoder_hidden_states.shape[0]}, hidden_states {b}"
      )
    axes = len(cfg.axes_dims_rope)
    cm.check_ids("img_ids", img_ids, s_all, axes, b)
    cm.check_ids("txt_ids", txt_ids, s_txt, axes, b)
    if guidance is not None and not cfg.guidance_embeds:
      raise ValueError(
        "this model has no guidance embedder (guidance_embeds=False, e.g. Klein): pass guidance=None"
      )
    ref = int(num_ref_tokens)
    if ref < 0 or ref >= s_all:
      raise ValueError(
        f"num_ref_tokens={num_ref_tokens} must be in [0, {s_all}) (hidden_states holds {s_all} "
        "tokens, reference tokens first)"
      )
    if ref and kv_cache is not None:
      raise ValueError("pass num_ref_tokens (extract step) or kv_cache (cached steps), not both")
    if ref and return_kv:
      raise ValueError("the extract step (num_ref_tokens > 0) already returns the reference cache")
    if kv_cache is not None:
      heads, hd = cfg.num_attention_heads, cfg.attention_head_dim
      for name, arr, layers in (
        ("double_k", kv_cache.double_k, cfg.num_layers),
        ("double_v", kv_cache.double_v, cfg.num_layers),
        ("single_k", kv_cache.single_k, cfg.num_single_layers),
        ("single_v", kv_cache.single_v, cfg.num_single_layers),
      ):
        if arr.ndim != 5 or arr.shape[:2] != (layers, b) or arr.shape[3:] != (heads, hd):
          raise ValueError(
            f"kv_cache.{name} must be [{layers}, {b}, R, {heads}, {hd}], got shape {arr.shape}"
          )

    dtype = hidden_states.dtype
    t = _per_sample("timestep", timestep, b, dtype) * 1000
    g = None if guidance is None else _per_sample("guidance", guidance, b, dtype) * 1000
    temb = self.time_guidance_embed(t, g)
    mod_img = self.double_stream_modulation_img(temb)
    mod_txt = self.double_stream_modulation_txt(temb)
    mod_single = self.single_stream_modulation(temb)
    if ref:
      ref_temb = self.time_guidance_embed(jnp.full_like(t, ref_fixed_timestep * 1000), g)
      mod_img = _per_token(mod_img, self.double_stream_modulation_img(ref_temb), 0, ref, s_all)
      ref_single = self.single_stream_modulation(ref_temb)
      mod_single = _per_token(mod_single, ref_single, s_txt, ref, s_txt + s_all)

    x = cm.constrain(self.x_embedder(hidden_states))
    c = cm.constrain(self.context_embedder(encoder_hidden_states.astype(dtype)))
    rope = cm.rope_tables(cm.join_ids(txt_ids, img_ids, b), cfg.axes_dims_rope, cfg.rope_theta)
    attention = cfg.attention
    keep = return_kv

    def double(block, carry, layer_cache, mod_img, mod_txt, rope):
      img, txt = carry
      img, txt, kv, ref_kv = block(img, txt, mod_img, mod_txt, rope, attention, ref, layer_cache)
      return (cm.constrain(img), cm.constrain(txt)), (kv if keep else ref_kv)

    def single(block, h, layer_cache, mod, rope):
      h, kv, ref_kv = block(h, mod, rope, attention, s_txt, ref, layer_cache)
      return cm.constrain(h), (kv if keep else ref_kv)

    cache_d = cache_s = None
    if kv_cache is not None:
      cache_d = (kv_cache.double_k, kv_cache.double_v)
      cache_s = (kv_cache.single_k, kv_cache.single_v)
    # A block hook may take over the stacks unless they return per-block keys and values (the
    # extract step, `return_kv`); the cached steps are hookable.
    hookable = not (ref or keep)
    (x, c), kv_d = md_core.scan_layers(
      self.transformer_blocks, double, (x, c), mod_img, mod_txt, rope,
      per_layer=cache_d, remat=cfg.remat, hookable=hookable,
      probe=lambda block, carry, _, mod, *shared: block.modulated_input(carry[0], mod),
    )  # fmt: skip
    h = jnp.concatenate([c, x], axis=1)
    h, kv_s = md_core.scan_layers(
      self.single_transformer_blocks, single, h, mod_single, rope,
      per_layer=cache_s, remat=cfg.remat, hookable=hookable,
    )  # fmt: skip
    out = self.proj_out(self.norm_out(h[:, s_txt + ref :], temb))
    if ref or keep:
      return out, BlockKV(*kv_d, *kv_s)
    return out
