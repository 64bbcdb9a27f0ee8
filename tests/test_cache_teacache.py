"""md_cache.teacache on the tiny Flux.1 dev pipeline: its decisions against a NumPy re-implementation
of TeaCache's rule on the block-0 inputs recorded during the run; threshold 0 equals the uncached run;
an unreachable threshold computes the first and the last step only. (diffusers has no TeaCache.)"""

import jax
import numpy as np
import pytest

import md_cache
import md_flux
from md_cache import _teacache
from md_core import testing

REF = testing.load_arrays(testing.fixture_path("cache_hooks") / "outputs.npz")
PROMPTS = ["a photo of a cat", "an astronaut riding a horse on the moon"]


HEADS: list[np.ndarray] = []  # block 0's input per step, recorded by the compiled loop


@pytest.fixture(scope="module")
def pipe():
  decide = _teacache._Hook._decide

  def recorded(self, head):
    jax.debug.callback(lambda h: HEADS.append(np.asarray(h, np.float32)), head, ordered=True)
    return decide(self, head)

  mp = pytest.MonkeyPatch()
  mp.setattr(_teacache._Hook, "_decide", recorded)
  yield md_flux.load_pipeline(testing.fixture_path("flux_pipeline") / "dev")
  mp.undo()


def _run(pipe, cache):
  return pipe(
    prompt=PROMPTS, latents=REF["inputs/latents"], height=32, width=48, num_inference_steps=8,
    guidance_scale=3.5, max_sequence_length=8, output_type="latent", cache=cache, progress=False,
  )  # fmt: skip


def _numpy_rule(heads: list[np.ndarray], coefficients, threshold: float) -> np.ndarray:
  """TeaCache's rule: first and last steps run; else accumulate poly(rel-L1) and skip under it."""
  n, computed, acc = len(heads), [], 0.0
  for i, x in enumerate(heads):
    if i == 0 or i == n - 1:
      run, acc = True, 0.0
    else:
      prev = heads[i - 1]
      change = np.abs(x - prev).mean() / np.abs(prev).mean()
      acc += max(float(np.polyval(np.asarray(coefficients, np.float64), change)), 0.0)
      run = acc >= threshold
      acc = 0.0 if run else acc
    computed.append(run)
  return np.array(computed)


@pytest.mark.parametrize(
  "coefficients, threshold", [("identity", 0.2), ("identity", 0.3), ("flux", 0.4)]
)
def test_decisions_follow_the_numpy_rule(pipe, coefficients, threshold):
  HEADS.clear()
  _run(pipe, md_cache.teacache(threshold, coefficients))
  heads = list(HEADS)
  got = md_cache.computed_steps(pipe.last_cache)
  assert len(heads) == 8
  want = _numpy_rule(heads, _teacache.TEACACHE_COEFFICIENTS[coefficients], threshold)
  np.testing.assert_array_equal(got, want)
  assert int(pipe.last_calls) == 8  # a block-level cache still calls the denoiser every step
  assert 2 < got.sum() < 8, got  # the case exercises both branches


def test_zero_threshold_is_uncached_and_huge_computes_first_and_last(pipe):
  out = np.asarray(_run(pipe, md_cache.teacache(0.0, "flux")))
  assert md_cache.computed_steps(pipe.last_cache).all()
  np.testing.assert_allclose(out, REF["none/latents"], atol=1e-4)
  out = np.asarray(_run(pipe, md_cache.teacache(1e9, "flux")))
  np.testing.assert_array_equal(md_cache.computed_steps(pipe.last_cache), [1, 0, 0, 0, 0, 0, 0, 1])
  assert float(np.abs(out - REF["none/latents"]).max()) > 1e-3


def test_unknown_coefficients_list_the_names():
  with pytest.raises(ValueError, match="unknown coefficients 'fluxx'.*'flux'"):
    md_cache.teacache(0.2, "fluxx")
