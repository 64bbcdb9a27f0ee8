"""The loop's step-cache hook, plugged into every family's pipeline with no family code: a toy policy that
reuses the previous step's prediction on odd steps. Checks the denoiser calls made and that the sample
equals the uncached run's up to the first reused step and differs from it after."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import md_schedulers as mdsch
from md_core import testing


def reuse_odd_steps() -> mdsch.StepCache:
  def init(latents, num_steps):
    del num_steps
    return jax.tree.map(jnp.zeros_like, latents)  # the last prediction

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


def _sd():
  import md_sd

  pipe = md_sd.load_pipeline(testing.fixture_path("sd_pipeline") / "sd")
  kw = dict(height=32, width=32, num_inference_steps=4, guidance_scale=5.0)
  return pipe, dict(prompt="a cat", seed=0, progress=False, **kw)


def _flux():
  import md_flux

  pipe = md_flux.load_pipeline(testing.fixture_path("flux_pipeline") / "dev")
  kw = dict(height=32, width=48, num_inference_steps=4, max_sequence_length=8)
  return pipe, dict(prompt="a cat", seed=0, progress=False, **kw)


def _ltx():
  import md_ltx

  pipe = md_ltx.load_pipeline(testing.fixture_path("ltx_pipeline") / "t2v")
  kw = dict(height=32, width=32, num_frames=9, num_inference_steps=4, max_sequence_length=8)
  return pipe, dict(prompt="a cat", seed=0, progress=False, **kw)


def _ltx2():
  import md_ltx

  pipe = md_ltx.load_ltx2_pipeline(testing.fixture_path("ltx2_pipeline") / "pipe")
  kw = dict(height=32, width=64, num_frames=9, num_inference_steps=4, max_sequence_length=16)
  kw.update(spatio_temporal_guidance_blocks=(1,))
  return pipe, dict(prompt="a cat", seed=0, progress=False, **kw)


FAMILIES = {"sd": _sd, "flux": _flux, "wan": _wan, "ltx": _ltx, "ltx2": _ltx2}


def _flat(x):
  return np.concatenate([np.asarray(a).ravel() for a in jax.tree.leaves(x)])


# LTX-2's row (the costliest: two streams) is in the slow suite; tests/test_cache_families.py runs real
# policies through LTX-2's step-cache hook in the default one.
@pytest.mark.parametrize(
  "family",
  [pytest.param(f, marks=[pytest.mark.slow] if f == "ltx2" else []) for f in sorted(FAMILIES)],
)
def test_toy_step_cache_in_every_pipeline(family):
  pipe, kw = FAMILIES[family]()
  plain, cached = [], []
  pipe(**kw, output_type="latent", callback=lambda i, t, x: plain.append(_flat(x)))
  assert pipe.last_calls == 4
  pipe(
    **kw, output_type="latent", cache=reuse_odd_steps(),
    callback=lambda i, t, x: cached.append(_flat(x)),
  )  # fmt: skip
  assert pipe.last_calls == 2  # steps 0 and 2 computed, 1 and 3 reused
  np.testing.assert_array_equal(cached[0], plain[0])  # step 0 is computed in both
  for i in (1, 2, 3):
    assert float(np.abs(cached[i] - plain[i]).max()) > 1e-4, f"step {i} should differ"
