"""md_cache.faster_cache (FasterCache's CFG cache) against diffusers' FasterCache denoiser hook on the tiny
SD pipeline (tests/fixtures/cache_faster, tools/fixtures/cache_faster.py): the same steps run the
unconditional rows, the output latents agree; a new setting reuses the compiled loop; errors."""

import json

import numpy as np
import pytest

import md_cache
import md_schedulers as mdsch
from md_core import testing

FIXTURES = testing.fixture_path("cache_faster")
REF = testing.load_arrays(FIXTURES / "outputs.npz")
CASES = json.loads((FIXTURES / "cases.json").read_text())
PROMPTS = ["a photo of a cat", "an astronaut riding a horse on the moon"]


@pytest.fixture(scope="module")
def pipe():
  import md_sd

  return md_sd.load_pipeline(testing.fixture_path("sd_pipeline") / "sd")


def _run(pipe, cache, **kw):
  args = dict(
    prompt=PROMPTS, latents=REF["inputs/latents"], height=64, width=64, num_inference_steps=10,
    guidance_scale=5.0, output_type="latent", progress=False,
  )  # fmt: skip
  args.update(kw)
  return np.asarray(pipe(**args, cache=cache))


def test_uncached_matches(pipe):
  np.testing.assert_allclose(_run(pipe, None), REF["none/latents"], atol=1e-4)


@pytest.mark.parametrize("case", sorted(CASES))
def test_parity_with_diffusers_faster_cache(pipe, case):
  out = _run(pipe, md_cache.faster_cache(**CASES[case]))
  want = REF[f"{case}/computed"]
  np.testing.assert_array_equal(md_cache.computed_steps(pipe.last_cache), want)
  err = float(np.abs(out - REF[f"{case}/latents"]).max())
  assert err < 1e-4, f"{case}: max |md - diffusers| = {err:.2e}"
  assert float(np.abs(out - REF["none/latents"]).max()) > 1e-3  # the cache changed the output


def test_new_setting_reuses_the_compiled_loop(pipe):
  traces = []
  run_steps = mdsch.run_steps

  def counted(*args, **kw):
    traces.append(1)
    return run_steps(*args, **kw)

  with pytest.MonkeyPatch.context() as mp:
    mp.setattr(mdsch, "run_steps", counted)
    _run(pipe, md_cache.faster_cache(**CASES["default"]))
    first = len(traces)
    _run(pipe, md_cache.faster_cache(**CASES["interval2"]))
    assert len(traces) == first, "a new faster_cache setting retraced the loop"
  np.testing.assert_array_equal(md_cache.computed_steps(pipe.last_cache), REF["interval2/computed"])


def test_needs_classifier_free_guidance(pipe):
  with pytest.raises(ValueError, match="negative.*guidance_scale > 1"):
    _run(pipe, md_cache.faster_cache(), guidance_scale=1.0)


def test_bad_settings():
  with pytest.raises(ValueError, match="interval=0 must be at least 1"):
    md_cache.faster_cache(0)
  with pytest.raises(ValueError, match=r"timestep_range=\(5.0, 1.0\)"):
    md_cache.faster_cache(timestep_range=(5, 1))
  assert md_cache.faster_cache(2) == md_cache.faster_cache(5, alpha_low=2.0)


def test_low_frequency_disc_matches_the_shifted_reference_mask():
  """The disc in the unshifted spectrum is the reference's centred disc after fftshift."""
  from md_cache import _faster_cache

  for h, w in ((8, 8), (10, 7), (5, 12)):
    m = np.asarray(_faster_cache.low_mask((1, h, w, 1), (1, 2)))[0, :, :, 0]
    y, x = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
    centred = (x - w // 2) ** 2 + (y - h // 2) ** 2 <= (min(h, w) // 5) ** 2
    np.testing.assert_array_equal(np.fft.fftshift(m), centred)
