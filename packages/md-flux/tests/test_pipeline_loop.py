"""The Flux pipelines on the shared loop: a toy step cache (reuse the previous prediction on odd steps)
skips exactly those transformer calls, per-step callbacks, chunking and cancellation, with no Flux code
for any of it; Klein's KV-cache mode (step 0 its own program) included."""

import jax.numpy as jnp
import numpy as np
import pytest

import md_flux
import md_schedulers as mdsch
from md_core import testing

FLUX1 = dict(height=32, width=48, num_inference_steps=3, max_sequence_length=8, progress=False)
KLEIN = dict(
  height=32, width=48, num_inference_steps=3, guidance_scale=1.0, max_sequence_length=40,
  text_encoder_out_layers=(1, 2, 3), progress=False,
)  # fmt: skip


def _reuse_odd_steps():
  """A toy step cache: on odd steps reuse the previous step's prediction."""

  def init(latents, num_steps):
    del num_steps
    return jnp.zeros_like(latents)

  def decide(state, step, t, x):
    del t, x
    return step % 2 == 1, state

  def update(state, step, t, x, pred, reused):
    del state, step, t, x, reused
    return pred

  return mdsch.StepCache(init, decide, update)


def _recorded(pipe, *args, **kw):
  """The output and every step's latents (through `callback`)."""
  steps = []
  out = pipe(*args, callback=lambda i, t, x: steps.append((i, np.asarray(x))), **kw)
  assert [i for i, _ in steps] == list(range(len(steps)))
  return np.asarray(out), [x for _, x in steps]


def _check_reuse_on_odd_steps(pipe, run):
  plain, plain_steps = run()
  assert pipe.last_calls == 3
  cached, cached_steps = run(cache=_reuse_odd_steps())
  assert pipe.last_calls == 2  # steps 0 and 2; step 1 reuses step 0's prediction
  np.testing.assert_array_equal(cached_steps[0], plain_steps[0])
  assert np.abs(cached_steps[1] - plain_steps[1]).max() > 1e-4
  assert np.abs(cached - plain).max() > 1e-4
  return plain


@pytest.fixture(scope="module")
def dev():
  return md_flux.load_pipeline(testing.fixture_path("flux_pipeline") / "dev")


@pytest.fixture(scope="module")
def klein():
  return md_flux.load_pipeline(testing.fixture_path("flux2_pipeline") / "klein")


def test_flux1_step_cache_callback_chunks_and_latents(dev):
  kw = dict(FLUX1, true_cfg_scale=2.0, seed=5)
  plain = _check_reuse_on_odd_steps(dev, lambda **c: _recorded(dev, "a dog", "a cat", **kw, **c))
  whole = dev("a dog", "a cat", chunk=None, **kw)  # one dispatch for the whole loop
  np.testing.assert_allclose(np.asarray(whole), plain, atol=1e-6, rtol=0)
  packed = dev("a dog", "a cat", output_type="latent", **kw)
  assert packed.shape == (1, 6, 16)  # the reference's packed layout
  np.testing.assert_allclose(np.asarray(dev.decode(packed, 32, 48)), plain, atol=1e-6, rtol=0)


def _embeds():
  with np.load(testing.fixture_path("flux2_pipeline") / "outputs.npz") as f:
    return f["t2i/prompt_embeds"][:1]


def _refs():
  rng = np.random.RandomState(0)
  return [rng.randn(1, 2, 2, 16).astype(np.float32), rng.randn(1, 1, 3, 16).astype(np.float32)]


def test_klein_kv_step_cache_callback_chunks_and_cancel(klein):
  kw = dict(KLEIN, prompt_embeds=_embeds(), image_latents=_refs(), kv_cache=True, seed=2)
  plain = _check_reuse_on_odd_steps(klein, lambda **c: _recorded(klein, **kw, **c))
  whole = klein(chunk=None, **kw)  # step 0's program, then steps 1-2 in one dispatch
  np.testing.assert_allclose(np.asarray(whole), plain, atol=1e-6, rtol=0)
  calls = []

  def cancel():
    calls.append(1)
    return True

  with pytest.raises(mdsch.Cancelled, match="cancelled at step 1/3"):
    klein(cancel=cancel, **kw)
  assert len(calls) == 1


def test_bad_output_type_names_the_choices(dev):
  with pytest.raises(ValueError, match="expected 'np' or 'latent'"):
    dev("a dog", output_type="image", **FLUX1)
