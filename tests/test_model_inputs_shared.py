"""The pipeline's denoiser and the training loss of a family make the model's inputs with one public
function (`md_wan.model_inputs`, `md_flux.flux1_model_inputs`): a change to that function alone (here a
timestep offset) moves both the loss away from its torch reference and the pipeline's output away from
its diffusers reference, so the two cannot drift apart again. (Unchanged, both match their references:
packages/md-train/tests/test_parity.py and the families' pipeline tests.)"""

import warnings

import jax
import jax.numpy as jnp
import numpy as np

import md_flux
import md_train as mdt
import md_train.families as mtf
import md_wan
from md_core.testing import fixture_path, load_arrays


def _shifted(fn, delta):
  def shifted(latents, timestep, *args, **kwargs):
    return fn(latents, timestep + delta, *args, **kwargs)

  return shifted


def _bfhwc(x):
  return jnp.asarray(x).transpose(0, 2, 3, 4, 1)


def _wan_ti2v_loss():
  ref = load_arrays(fixture_path("train_step_wan_cond") / "ti2v.npz")
  frozen, params = mdt.split_trainable(
    md_wan.load_transformer(fixture_path("wan_transformer") / "ti2v")
  )
  batch = {
    "latents": _bfhwc(ref["latents"]),
    "noise": _bfhwc(ref["noise"]),
    "sigmas": jnp.asarray(ref["sigmas"]),
    "encoder_hidden_states": jnp.asarray(ref["encoder_hidden_states"]),
  }
  loss, _ = mtf.wan_loss(frozen, clean_first_frame=True)(params, batch, jax.random.key(0))
  return float(loss), float(ref["loss"])


def _wan_ti2v_frames():
  ref = load_arrays(fixture_path("wan_pipeline") / "outputs.npz")
  pipe = md_wan.load_pipeline(fixture_path("wan_pipeline") / "ti2v")  # compiled after any patch
  frames = pipe(
    "a cat surfing a wave at sunset",
    "bright colors, overexposed, static, blurred details, worst quality, low quality",
    image=ref["ti2v_image/image"], latents=ref["ti2v_image/latents"], height=32, width=64,
    num_frames=5, num_inference_steps=3, guidance_scale=5.0, progress=False,
  )  # fmt: skip
  return np.asarray(frames), ref["ti2v_image/frames"]


def test_wan_model_inputs_reach_the_loss_and_the_pipeline(monkeypatch):
  loss, want = _wan_ti2v_loss()
  assert abs(loss - want) <= 1e-5  # unchanged: the torch reference's loss
  monkeypatch.setattr(md_wan, "model_inputs", _shifted(md_wan.model_inputs, 400.0))
  loss, want = _wan_ti2v_loss()
  assert abs(loss - want) > 1e-3, (loss, want)
  frames, want = _wan_ti2v_frames()
  # Past the pipeline parity tolerance (1e-3); the tiny random model's timestep embedding is weak,
  # hence the large offset.
  assert np.abs(frames - want).max() > 1e-3, np.abs(frames - want).max()


def _flux_loss():
  ref = load_arrays(fixture_path("train_step") / "flux.npz")
  frozen, params = mdt.split_trainable(md_flux.load_flux(fixture_path("flux_transformer") / "dev"))
  nhwc = lambda x: jnp.asarray(x).transpose(0, 2, 3, 1)  # noqa: E731
  batch = {
    k: jnp.asarray(ref[k])
    for k in ("sigmas", "encoder_hidden_states", "pooled_projections", "txt_ids")
  }
  batch.update(latents=nhwc(ref["latents"]), noise=nhwc(ref["noise"]))
  loss, _ = mtf.flux_loss(frozen, guidance=3.5)(params, batch, jax.random.key(0))
  return float(loss), float(ref["loss"])


def test_flux_model_inputs_reach_the_loss_and_the_pipeline(monkeypatch):
  loss, want = _flux_loss()
  assert abs(loss - want) <= 1e-5
  monkeypatch.setattr(md_flux, "flux1_model_inputs", _shifted(md_flux.flux1_model_inputs, 0.05))
  loss, want = _flux_loss()
  assert abs(loss - want) > 1e-3, (loss, want)
  ref = load_arrays(fixture_path("flux_pipeline") / "outputs.npz")
  pipe = md_flux.load_pipeline(fixture_path("flux_pipeline") / "dev")
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # the second prompt is longer than 8 T5 tokens
    images = pipe(
      ["a photo of a cat", "an astronaut riding a horse on the moon"], guidance_scale=3.5,
      latents=ref["dev/latents"], height=32, width=48, num_inference_steps=3,
      max_sequence_length=8, progress=False,
    )  # fmt: skip
  err = np.abs(np.asarray(images) - ref["dev/images"]).max()
  assert err > 1e-3, err  # past the pipeline parity tolerance
