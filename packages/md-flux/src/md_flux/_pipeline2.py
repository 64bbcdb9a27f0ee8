"""The Flux.2 Klein denoising pipeline (diffusers' `Flux2KleinPipeline`) from prompt embeddings.

md does not yet have the Qwen3 text encoder wired in nor the Flux.2 VAE, so this pipeline takes
`prompt_embeds` (the Qwen3 hidden states the reference stacks) and returns the reference's
`output_type="latent"` result: latents denormalised by the VAE's batch-norm statistics and unpatchified,
channels-last `[B, H/8, W/8, C]`. Reference images enter as already encoded, normalised, patchified
latents (`image_latents`): they are packed, appended after the target tokens with their own time
offsets in the ids (10, 20, …), and left unchanged by the update (only the target tokens' prediction
is used).

Behaviour follows the reference: 4-axis ids `(t, row, col, 0)` for image tokens and `(0, 0, 0, l)`
for text, sigmas `linspace(1, 1/n, n)` shifted with Flux.2's empirical `mu`, and classifier-free
guidance (`neg + s * (pos - neg)`) when `guidance_scale > 1` and the model is not distilled.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import md_core
import md_schedulers as mdsch
from md_core import progress as md_progress
from md_flux._flux2 import Flux2Transformer
from md_flux._pipeline import _place, _Split, _using, check_size, image_ids, unpack_latents

MAX_REFERENCE_IMAGES = 4


def text_ids(length: int) -> np.ndarray:
  """Flux.2's text position ids `[length, 4]`: `(0, 0, 0, l)`."""
  ids = np.zeros((length, 4), np.float32)
  ids[:, 3] = np.arange(length, dtype=np.float32)
  return ids


class Flux2KleinPipeline:
  """A loaded Flux.2 Klein pipeline (see `load_pipeline`) that denoises from prompt embeddings.

  Attributes:
    transformer: the md `Flux2Transformer`.
    scheduler_config: the checkpoint's `scheduler_config.json` dict.
    is_distilled: guidance-distilled checkpoints never run classifier-free guidance.
    use_kv_cache: the default of `kv_cache` (True for `Flux2KleinKVPipeline` checkpoints).
    bn_mean, bn_std: the VAE's batch-norm statistics over patchified channels `[4C]`.
  """

  def __init__(
    self,
    *,
    transformer: Flux2Transformer,
    scheduler_config: Mapping[str, Any],
    bn_mean: np.ndarray,
    bn_std: np.ndarray,
    is_distilled: bool = False,
    use_kv_cache: bool = False,
    vae_scale_factor: int = 8,
    mesh: jax.sharding.Mesh | None = None,
    source: str = "",
  ):
    self.transformer = transformer
    self.scheduler_config = dict(scheduler_config)
    self.bn_mean = np.asarray(bn_mean, np.float32)
    self.bn_std = np.asarray(bn_std, np.float32)
    self.is_distilled = bool(is_distilled)
    self.use_kv_cache = bool(use_kv_cache)
    self.vae_scale_factor = int(vae_scale_factor)
    self.mesh, self.source = mesh, source
    self._tr = _Split.of(transformer)
    self._compiled: dict[Any, Any] = {}

  def _loop_fn(self, sched, *, steps: int, cfg: bool, kv: bool, s_img: int, show: bool):
    tr = self._tr
    mean, std = jnp.asarray(self.bn_mean)[None, None], jnp.asarray(self.bn_std)[None, None]

    def loop(state, x, refs, sched_state, ctx, img_ids, ref_ids, txt, scale):
      model = tr.merge(state)
      tick = md_progress.make_step_callback(steps, desc="denoising") if show else None
      b = x.shape[0]
      start, carry, cache = 0, (x, sched_state), None
      if kv and refs is not None:
        # Flux2KleinKVPipeline: the first step runs [references; target] and returns the references'
        # keys/values (modulated at the fixed reference timestep); later steps see the target only.
        x, st = carry
        t = jnp.full((b,), mdsch.current_timestep(st) / 1000)
        ids = jnp.concatenate([ref_ids, img_ids])
        v, cache = model(
          jnp.concatenate([refs, x], axis=1), ctx, t, ids, txt, num_ref_tokens=refs.shape[1]
        )
        carry = sched.step(st, v.astype(jnp.float32), x)
        if tick is not None:
          tick(0)
        start = 1
      ids = img_ids if refs is None or kv else jnp.concatenate([img_ids, ref_ids])

      def body(i, carry):
        x, st = carry
        t = mdsch.current_timestep(st) / 1000
        if cache is not None:
          v = model(x, ctx, jnp.full((b,), t), img_ids, txt, kv_cache=cache)
        else:
          xin = x if refs is None else jnp.concatenate([x, refs], axis=1)
          if cfg:
            xin = jnp.concatenate([xin, xin], axis=0)
          v = model(xin, ctx, jnp.full((xin.shape[0],), t), ids, txt)[:, :s_img]
        v = v.astype(jnp.float32)
        if cfg:
          v = v[b:] + scale * (v[:b] - v[b:])
        x, st = sched.step(st, v, x)
        if tick is not None:
          tick(i)
        return x, st

      x = jax.lax.fori_loop(start, steps, body, carry)[0]
      return x * std + mean  # the VAE's batch-norm, undone

    return jax.jit(loop)

  def __call__(
    self,
    prompt: str | Sequence[str] | None = None,
    *,
    height: int | None = None,
    width: int | None = None,
    num_inference_steps: int = 50,
    guidance_scale: float = 4.0,
    num_images_per_prompt: int = 1,
    seed: int = 0,
    latents: Any = None,
    prompt_embeds: Any = None,
    negative_prompt_embeds: Any = None,
    image_latents: Sequence[Any] | None = None,
    kv_cache: bool | None = None,
    sigmas: Sequence[float] | None = None,
    progress: bool = True,
  ) -> jax.Array:
    """Denoises latents for prompt embeddings, optionally conditioned on reference latents.

    Args:
      prompt: not supported yet (the Qwen3 encoder is not wired in): pass `prompt_embeds`.
      height, width: pixels, multiples of 16 (default 1024).
      num_inference_steps: denoising steps.
      guidance_scale: classifier-free guidance when > 1 and the model is not distilled.
      num_images_per_prompt: outputs per prompt embedding.
      seed: the noise seed.
      latents: initial noise in the reference's layout `[B, 4C, H/16, W/16]` (patchified, NCHW).
      prompt_embeds: `[B, S, joint_attention_dim]` (the reference's stacked Qwen3 hidden states).
      negative_prompt_embeds: for guidance (the reference encodes "" by default).
      image_latents: up to 4 reference latents, each normalised and patchified channels-last
        `[1 or B, h_r, w_r, 4C]`.
      kv_cache: compute the references' keys/values once at the first step and reuse them
        (diffusers' `Flux2KleinKVPipeline`; no guidance). Default: on for KV checkpoints.
      sigmas: custom sigmas (default `linspace(1, 1/n, n)`).
      progress: show a progress bar.

    Returns:
      Latents `[B, H/8, W/8, C]` (the reference's `output_type="latent"`, channels-last).

    Raises:
      ValueError: sizes that do not pack, more than 4 reference images, missing embeddings, inputs of
        the wrong shape.
    """
    if prompt is not None:
      raise ValueError(
        "Flux2KleinPipeline: text prompts need the Qwen3 encoder, which md-flux does not wire in yet; "
        "pass prompt_embeds [B, S, D] (and negative_prompt_embeds for guidance)"
      )
    if prompt_embeds is None:
      raise ValueError("Flux2KleinPipeline: pass prompt_embeds [B, S, joint_attention_dim]")
    size = 128 * self.vae_scale_factor
    height, width = height or size, width or size
    check_size(height, width, 2 * self.vae_scale_factor)
    cfg_on = guidance_scale > 1 and not self.is_distilled
    kv = self.use_kv_cache if kv_cache is None else bool(kv_cache)
    if kv and cfg_on:
      raise ValueError(
        f"the KV-cache mode runs without guidance (as Flux2KleinKVPipeline); got guidance_scale="
        f"{guidance_scale} on a non-distilled model: pass guidance_scale=1 or kv_cache=False"
      )
    reps = int(num_images_per_prompt)
    embeds = jnp.repeat(jnp.asarray(prompt_embeds, jnp.float32), reps, axis=0)
    ctx = embeds
    if cfg_on:
      if negative_prompt_embeds is None:
        raise ValueError(
          f"guidance_scale={guidance_scale} > 1 runs classifier-free guidance: pass "
          "negative_prompt_embeds (the reference encodes the empty prompt), or guidance_scale=1"
        )
      neg = jnp.repeat(jnp.asarray(negative_prompt_embeds, jnp.float32), reps, axis=0)
      if neg.shape != embeds.shape:
        raise ValueError(
          f"negative_prompt_embeds have shape {neg.shape}; prompt_embeds {embeds.shape}; they must match"
        )
      ctx = jnp.concatenate([embeds, neg], axis=0)
    batch = embeds.shape[0]
    f = self.vae_scale_factor
    rows, cols = height // (2 * f), width // (2 * f)
    ch = self.transformer.cfg.in_channels
    if latents is None:
      noise = jax.random.normal(jax.random.key(int(seed)), (batch, rows, cols, ch), jnp.float32)
    else:
      noise = jnp.asarray(latents, jnp.float32)
      if noise.shape != (batch, ch, rows, cols):
        raise ValueError(
          f"latents have shape {noise.shape}; expected [B, 4C, H/16, W/16] = "
          f"{(batch, ch, rows, cols)} for this batch, height={height}, width={width}"
        )
      noise = noise.transpose(0, 2, 3, 1)
    x = noise.reshape(batch, rows * cols, ch)

    ids = []
    refs = None
    if image_latents is not None:
      image_latents = list(image_latents)
      if len(image_latents) > MAX_REFERENCE_IMAGES:
        raise ValueError(
          f"{len(image_latents)} reference images given; Flux.2 Klein takes at most "
          f"{MAX_REFERENCE_IMAGES}"
        )
      packed = []
      for i, ref in enumerate(image_latents):
        ref = jnp.asarray(ref, jnp.float32)
        if ref.ndim != 4 or ref.shape[-1] != ch or ref.shape[0] not in (1, batch):
          raise ValueError(
            f"image_latents[{i}] has shape {ref.shape}; expected [1 or {batch}, h, w, {ch}] "
            "(normalised, patchified, channels-last)"
          )
        _, h_r, w_r, _ = ref.shape
        packed.append(jnp.broadcast_to(ref, (batch, h_r, w_r, ch)).reshape(batch, h_r * w_r, ch))
        ids.append(image_ids(h_r, w_r, time=10.0 * (i + 1), axes=4))
      refs = jnp.concatenate(packed, axis=1)
    n = int(num_inference_steps)
    sched = mdsch.from_config(self.scheduler_config)
    mu = mdsch.flux2_empirical_mu(rows * cols, n)
    if sigmas is None:
      sigmas = np.linspace(1.0, 1.0 / n, n)
    st = sched.init(n, sigmas=sigmas, mu=mu)
    steps = len(st.timesteps)
    show = bool(progress) and md_progress.progress_enabled()
    key = ("loop", repr(sorted(sched.config.items())), steps, cfg_on, kv, rows * cols, show)
    loop = self._compiled.get(key)
    if loop is None:
      loop = self._compiled[key] = self._loop_fn(
        sched, steps=steps, cfg=cfg_on, kv=kv, s_img=rows * cols, show=show
      )
    place = lambda a: _place(self.mesh, a)  # noqa: E731
    with _using(self.mesh):
      z = loop(
        self._tr.state,
        place(x),
        None if refs is None else place(refs),
        st,
        place(ctx),
        jnp.asarray(image_ids(rows, cols, axes=4)),
        jnp.asarray(np.concatenate(ids)) if ids else None,
        jnp.asarray(text_ids(ctx.shape[1])),
        jnp.float32(guidance_scale),
      )
    return unpack_latents(z, 2 * rows, 2 * cols)


def load_klein(
  root: os.PathLike,
  index: Mapping[str, Any],
  *,
  mesh=None,
  dtype=None,
  rules=None,
  attention=None,
  progress=False,
  source="",
) -> Flux2KleinPipeline:
  """Loads the transformer, scheduler and VAE batch-norm statistics of a Flux.2 Klein folder."""
  from md_flux._pipeline import _component
  from md_flux._weights2 import load_flux2

  kv = index.get("_class_name") == "Flux2KleinKVPipeline"
  folders = {n: _component(root, n, index) for n in ("transformer", "vae", "scheduler")}
  transformer = load_flux2(
    folders["transformer"],
    dtype=dtype,
    attention=attention,
    mesh=mesh,
    rules=rules,
    progress=progress,
  )
  vae_cfg = md_core.read_json(folders["vae"] / "config.json")
  ckpt = md_core.open_checkpoint(folders["vae"])
  missing = [k for k in ("bn.running_mean", "bn.running_var") if k not in ckpt]
  if missing:
    raise ValueError(
      f"{folders['vae']}: the Flux.2 VAE file lacks {missing} (batch-norm statistics)"
    )
  eps = float(vae_cfg.get("batch_norm_eps", 1e-4))
  mean = np.asarray(ckpt["bn.running_mean"], np.float32)
  std = np.sqrt(np.asarray(ckpt["bn.running_var"], np.float32) + eps)
  blocks = vae_cfg.get("block_out_channels", [128, 256, 512, 512])
  sched_cfg = mdsch.read_config(folders["scheduler"])
  mdsch.from_config(sched_cfg)
  return Flux2KleinPipeline(
    transformer=transformer,
    scheduler_config=sched_cfg,
    bn_mean=mean,
    bn_std=std,
    is_distilled=bool(index.get("is_distilled", kv)),
    use_kv_cache=kv,
    vae_scale_factor=2 ** (len(blocks) - 1),
    mesh=mesh,
    source=source,
  )
