"""The loop's step-cache hook, plugged into every family's pipeline with no family code: a toy policy that
reuses the previous step's prediction on odd steps. Checks the denoiser calls made and that the sample
equals the uncached run's up to the first reused step and differs from it after."""

import jax.numpy as jnp
import numpy as np
import pytest

import md_schedulers as mdsch
from md_core import testing


def reuse_odd_steps() -> mdsch.StepCache:
  def init(latents, num_steps):
    del num_steps
    return jnp.zeros_like(latents)  # the last prediction

  def decide(state, step, t, x):
    return step % 2 == 1, state

  def update(state, step, t, x, prediction, reused):
    return prediction

  return mdsch.StepCache(init, decide, update)


def _wan():
  import md_wan

  pipe = md_wan.load_pipeline(testing.fixture_path("wan_pipeline") / "t2v")
  kw = dict(height=32, width=32, num_frames=5, num_inference_steps=4, guidance_scale=5.0)
  return pipe, dict(prompt="a cat", seed=0, progress=False, **kw)


FAMILIES = {"wan": _wan}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_toy_step_cache_in_every_pipeline(family):
  pipe, kw = FAMILIES[family]()
  plain, cached = [], []
  pipe(**kw, output_type="latent", callback=lambda i, t, x: plain.append(np.asarray(x)))
  assert pipe.last_calls == 4
  pipe(
    **kw, output_type="latent", cache=reuse_odd_steps(),
    callback=lambda i, t, x: cached.append(np.asarray(x)),
  )  # fmt: skip
  assert pipe.last_calls == 2  # steps 0 and 2 computed, 1 and 3 reused
  np.testing.assert_array_equal(cached[0], plain[0])  # step 0 is computed in both
  for i in (1, 2, 3):
    assert float(np.abs(cached[i] - plain[i]).max()) > 1e-4, f"step {i} should differ"
