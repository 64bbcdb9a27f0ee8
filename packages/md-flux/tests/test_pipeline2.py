"""Flux.2 Klein denoising against diffusers' `Flux2KleinPipeline` (output_type="latent") on a tiny random
pipeline (tests/fixtures/flux_pipeline/klein), and reference-image conditioning against a closed form."""

import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import md_flux

FIXTURES = pathlib.Path(__file__).resolve().parents[3] / "tests" / "fixtures" / "flux_pipeline"
COMMON = dict(height=32, width=48, progress=False)


@pytest.fixture(scope="module")
def outputs():
  return dict(np.load(FIXTURES / "outputs.npz"))


@pytest.fixture(scope="module")
def klein():
  return md_flux.load_pipeline(FIXTURES / "klein")


def test_klein_text_to_latents_matches_diffusers(klein, outputs):
  assert isinstance(klein, md_flux.Flux2KleinPipeline) and not klein.is_distilled
  z = klein(
    prompt_embeds=outputs["klein/prompt_embeds"],
    negative_prompt_embeds=outputs["klein/negative_prompt_embeds"],
    latents=outputs["klein/latents"],
    num_inference_steps=3,
    guidance_scale=4.0,
    **COMMON,
  )
  want = outputs["klein/latents_out"].transpose(0, 2, 3, 1)  # reference NCHW → channels-last
  assert z.shape == want.shape
  err = float(np.abs(np.asarray(z) - want).max())
  assert err < 1e-3, f"max abs error {err}"


def _refs(outputs, case):
  """The reference's packed reference latents `[B, R, 16]` → one channels-last grid per image."""
  packed, refs, at = outputs[f"{case}/ref_latents"], [], 0
  for h, w in outputs[f"{case}/ref_shapes"]:
    refs.append(packed[:, at : at + h * w].reshape(packed.shape[0], h, w, -1))
    at += h * w
  return refs


@pytest.mark.parametrize("case", ["klein_edit", "klein_kv"])
def test_klein_edit_matches_diffusers(klein, outputs, case):
  """Two reference images: appended after the target (Flux2KleinPipeline, CFG) or cached after the
  first step (Flux2KleinKVPipeline, no guidance)."""
  kv = case == "klein_kv"
  z = klein(
    prompt_embeds=outputs[f"{case}/prompt_embeds"],
    negative_prompt_embeds=None if kv else outputs[f"{case}/negative_prompt_embeds"],
    latents=outputs[f"{case}/latents"],
    image_latents=_refs(outputs, case),
    kv_cache=kv,
    num_inference_steps=3,
    guidance_scale=1.0 if kv else 4.0,
    **COMMON,
  )
  want = outputs[f"{case}/latents_out"].transpose(0, 2, 3, 1)
  err = float(np.abs(np.asarray(z) - want).max())
  assert err < 1e-3, f"max abs error {err}"


def test_kv_checkpoint_loads_in_kv_mode(outputs):
  kv = md_flux.load_pipeline(FIXTURES / "klein_kv")
  assert kv.use_kv_cache and kv.is_distilled
  with pytest.raises(ValueError, match="no guidance|without guidance"):
    md_flux.Flux2KleinPipeline(
      transformer=kv.transformer,
      scheduler_config=kv.scheduler_config,
      bn_mean=kv.bn_mean,
      bn_std=kv.bn_std,
      use_kv_cache=True,
    )(prompt_embeds=outputs["klein_kv/prompt_embeds"], guidance_scale=4.0, **COMMON)


def test_reference_latents_appended_with_time_offsets(klein, outputs):
  """One Euler step with two references equals the transformer on [target; ref1; ref2] with ids at
  t = 0, 10, 20, keeping only the target's prediction (the references are never updated)."""
  embeds = outputs["klein/prompt_embeds"][:1]
  noise = outputs["klein/latents"][:1]  # [1, 16, 2, 3]
  rng = np.random.RandomState(0)
  refs = [rng.randn(1, 2, 2, 16).astype(np.float32), rng.randn(1, 1, 3, 16).astype(np.float32)]
  sigmas = [0.8]
  z = klein(
    prompt_embeds=embeds,
    latents=noise,
    image_latents=refs,
    num_inference_steps=1,
    sigmas=sigmas,
    guidance_scale=1.0,
    **COMMON,
  )
  # Closed form: the scheduler's shifted sigma, one step to sigma 0.
  st = md_flux._pipeline2.mdsch.from_config(klein.scheduler_config).init(
    1, sigmas=sigmas, mu=md_flux._pipeline2.mdsch.flux2_empirical_mu(6, 1)
  )
  s0 = float(st.sigmas[0])
  x = noise.transpose(0, 2, 3, 1).reshape(1, 6, 16)
  packed = [r.reshape(1, -1, 16) for r in refs]
  ids = np.concatenate(
    [
      md_flux.image_ids(2, 3, axes=4),
      md_flux.image_ids(2, 2, time=10.0, axes=4),
      md_flux.image_ids(1, 3, time=20.0, axes=4),
    ]
  )
  graphdef, state = nnx.split(klein.transformer)
  forward = jax.jit(lambda state, *args: nnx.merge(graphdef, state)(*args))  # eager scans are slow
  v = forward(
    state,
    jnp.concatenate([x, *packed], axis=1),
    jnp.asarray(embeds),
    jnp.full((1,), float(st.timesteps[0]) / 1000),
    jnp.asarray(ids),
    jnp.asarray(md_flux.text_ids(embeds.shape[1])),
  )[:, :6]
  want = (x + (0.0 - s0) * v) * klein.bn_std[None, None] + klein.bn_mean[None, None]
  np.testing.assert_allclose(
    np.asarray(z), np.asarray(md_flux.unpack_latents(want, 4, 6)), atol=1e-5, rtol=0
  )


def test_klein_input_errors(klein, outputs):
  embeds = outputs["klein/prompt_embeds"][:1]
  ref = np.zeros((1, 2, 2, 16), np.float32)
  with pytest.raises(ValueError, match="5 reference images given; Flux.2 Klein takes at most 4"):
    klein(prompt_embeds=embeds, image_latents=[ref] * 5, guidance_scale=1.0, **COMMON)
  with pytest.raises(ValueError, match=r"image_latents\[0\] has shape \(1, 2, 2, 8\)"):
    klein(prompt_embeds=embeds, image_latents=[ref[..., :8]], guidance_scale=1.0, **COMMON)
  with pytest.raises(ValueError, match="Qwen3"):
    klein("a cat", **COMMON)
  with pytest.raises(ValueError, match="negative_prompt_embeds"):
    klein(prompt_embeds=embeds, guidance_scale=4.0, **COMMON)
  with pytest.raises(ValueError, match=r"width=40 → 32 or 48"):
    klein(prompt_embeds=embeds, height=32, width=40, progress=False)
