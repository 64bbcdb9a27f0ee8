"""Real-size (and tiny) denoiser calls on abstract inputs, shared by bench/plans.py and bench/gpu.py."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

BF16 = jnp.bfloat16


@dataclasses.dataclass
class Plan:
  name: str
  build: object  # () -> nnx.Module
  inputs: dict  # name -> ShapeDtypeStruct
  call: object  # (model, **inputs) -> output
  experts: int = 1  # Wan 2.2 A14B keeps two same-sized experts


def _sds(shape, dtype=BF16):
  return jax.ShapeDtypeStruct(tuple(shape), dtype)


def flux_plan(tiny: bool) -> Plan:
  import md_flux

  cfg = md_flux.FLUX_VARIANTS["tiny" if tiny else "dev"]
  side = 64 if tiny else 1024  # pixels; latents are 8x smaller, packed 2x2
  tokens, text = (side // 16) ** 2, 8 if tiny else 512
  inputs = dict(
    hidden_states=_sds((1, tokens, cfg.in_channels)),
    encoder_hidden_states=_sds((1, text, cfg.joint_attention_dim)),
    pooled_projections=_sds((1, cfg.pooled_projection_dim)),
    timestep=_sds((1,), jnp.float32),
    img_ids=_sds((tokens, 3), jnp.float32),
    txt_ids=_sds((text, 3), jnp.float32),
    guidance=_sds((1,), jnp.float32),
  )
  return Plan(
    f"Flux.1-dev {side}x{side}",
    lambda: md_flux.FluxTransformer(cfg, rngs=nnx.Rngs(0)),
    inputs,
    lambda m, **kw: m(**kw),
  )


def wan_plan(variant: str, tiny: bool) -> Plan:
  import md_wan

  cfg = md_wan.VARIANTS["tiny" if tiny else variant]
  f, h, w = (3, 8, 8) if tiny else (21, 90, 160)  # 81 frames of 720x1280: 4x temporal, 8x spatial
  text = 8 if tiny else 512
  inputs = dict(
    hidden_states=_sds((2, f, h, w, cfg.in_channels)),  # CFG: negative and positive rows
    timestep=_sds((2,), jnp.float32),
    encoder_hidden_states=_sds((2, text, cfg.text_dim)),
  )
  label = {"2.1-t2v-14b": "Wan 2.1 14B", "2.2-t2v-a14b": "Wan 2.2 A14B (2 experts)"}[variant]
  return Plan(
    f"{label} {'tiny' if tiny else '720p x 81'}",
    lambda: md_wan.WanTransformer(cfg, rngs=nnx.Rngs(0)),
    inputs,
    lambda m, **kw: m(**kw, layout="BFHWC"),
    experts=2 if variant.startswith("2.2") else 1,
  )


def ltx2_plan(tiny: bool) -> Plan:
  import md_ltx

  cfg = md_ltx.LTX2_VARIANTS["tiny" if tiny else "2.0"]
  frames, height, width = (9, 64, 64) if tiny else (121, 512, 768)
  f, h, w = (frames - 1) // 8 + 1, height // 32, width // 32
  audio = round(frames / 24 * 25)  # audio latents at 25 per second of 24 fps video
  text = 8 if tiny else 1024
  inputs = dict(
    hidden_states=_sds((2, f * h * w, cfg.in_channels)),
    audio_hidden_states=_sds((2, audio, cfg.audio_in_channels)),
    encoder_hidden_states=_sds((2, text, cfg.caption_channels)),
    audio_encoder_hidden_states=_sds((2, text, cfg.caption_channels)),
    timestep=_sds((2,), jnp.float32),
  )

  def call(m, **kw):
    grid = dict(num_frames=f, height=h, width=w, audio_num_frames=audio)
    return m(**kw, **grid)

  return Plan(
    f"LTX-2 {'tiny' if tiny else f'{width}x{height} x {frames}'}",
    lambda: md_ltx.LTX2Transformer(cfg, rngs=nnx.Rngs(0)),
    inputs,
    call,
  )
