"""md-cache policies in the pipelines, against diffusers' own hooks on the tiny Flux.1 dev pipeline
(tests/fixtures/cache_hooks, tools/fixtures/cache_hooks.py): the same steps computed and the output
latents within 1e-3; MagCache calibration reproduces the ratios diffusers records (1e-4); a new threshold
reuses the compiled loop.

Block-level policies size their slots through `StepCache.prepare` (which `md_schedulers.drive` calls on
the first carry); `pipe.last_cache` holds the final cache state of a call.
"""

import json

import numpy as np
import pytest

import md_cache
import md_flux
import md_schedulers as mdsch
from md_cache import settings as cache_settings
from md_core import testing

FIXTURES = testing.fixture_path("cache_hooks")
REF = testing.load_arrays(FIXTURES / "outputs.npz")
CASES = json.loads((FIXTURES / "cases.json").read_text())
PROMPTS = ["a photo of a cat", "an astronaut riding a horse on the moon"]


@pytest.fixture(scope="module")
def pipe():
  return md_flux.load_pipeline(testing.fixture_path("flux_pipeline") / "dev")


def _policy(case: dict):
  kw = {k: v for k, v in case.items() if k != "policy"}
  return getattr(md_cache, case["policy"])(**kw)


def _run(pipe, cache):
  return pipe(
    prompt=PROMPTS, latents=REF["inputs/latents"], height=32, width=48, num_inference_steps=8,
    guidance_scale=3.5, max_sequence_length=8, output_type="latent", cache=cache, progress=False,
  )  # fmt: skip


def test_uncached_matches(pipe):
  out = np.asarray(_run(pipe, None))
  np.testing.assert_allclose(out, REF["none/latents"], atol=1e-4)


@pytest.mark.parametrize("case", [k for k in CASES if k != "none"])
def test_parity_with_diffusers_hooks(pipe, case):
  out = np.asarray(_run(pipe, _policy(CASES[case])))
  state = pipe.last_cache
  want = REF[f"{case}/computed"]
  np.testing.assert_array_equal(md_cache.computed_steps(state), want)
  err = float(np.abs(out - REF[f"{case}/latents"]).max())
  assert err < 1e-3, f"{case}: max |md - diffusers| = {err:.2e}"
  if not want.all():  # the cache changed the output
    assert float(np.abs(out - REF["none/latents"]).max()) > 1e-3
  if case == "mag_calibrate":
    got = md_cache.calibrated_ratios(state)
    np.testing.assert_allclose(got, REF["mag_calibrate/mag_ratios"], rtol=1e-4, atol=1e-4)


def test_magcache_calibration_per_guidance_branch(pipe):
  """Flux.1 true CFG runs its branches as separate calls in diffusers, whose MagCache calibration records
  one ratio list per branch (cache contexts "uncond" / "cond"; tests/fixtures/cache_mag_branches,
  tools/fixtures/cache_mag_branches.py): md records the same two lists, and says which one it reports."""
  ref = testing.load_arrays(testing.fixture_path("cache_mag_branches") / "outputs.npz")
  out = pipe(
    prompt=PROMPTS, negative_prompt=["blurry, low quality"] * 2, true_cfg_scale=2.0,
    latents=REF["inputs/latents"], height=32, width=48, num_inference_steps=8, guidance_scale=3.5,
    max_sequence_length=8, output_type="latent", cache=md_cache.magcache(calibrate=True),
    progress=False,
  )  # fmt: skip
  np.testing.assert_allclose(np.asarray(out), ref["latents"], atol=1e-3)
  state = pipe.last_cache
  assert md_cache.calibrated_branches(state) == ("negative", "positive")
  for branch in ("negative", "positive"):
    got = md_cache.calibrated_ratios(state, branch)
    np.testing.assert_allclose(got, ref[branch], rtol=1e-4, atol=1e-4, err_msg=branch)
  default = md_cache.calibrated_ratios(state)
  np.testing.assert_array_equal(default, md_cache.calibrated_ratios(state, "positive"))
  report = cache_settings.cache_report(pipe)
  assert report["mag_ratios_branch"] == "positive"
  np.testing.assert_allclose(report["mag_ratios"], ref["positive"], rtol=1e-4, atol=1e-4)
  np.testing.assert_allclose(
    report["mag_ratios_per_branch"]["negative"], ref["negative"], atol=1e-4
  )
  with pytest.raises(
    ValueError, match=r"branch='perturbed'; this run recorded \('negative', 'positive'\)"
  ):
    md_cache.calibrated_ratios(state, "perturbed")


def test_new_threshold_reuses_the_compiled_loop(pipe):
  traces = []
  run_steps = mdsch.run_steps

  def counted(denoise, scheduler, carry, *args, **kw):
    if carry.cache.slots is not None:  # not the slot probe (an abstract trace on every call)
      traces.append(1)
    return run_steps(denoise, scheduler, carry, *args, **kw)

  mp = pytest.MonkeyPatch()
  mp.setattr(mdsch, "run_steps", counted)
  try:
    _run(pipe, md_cache.first_block_cache(0.2))
    first = len(traces)
    _run(pipe, md_cache.first_block_cache(0.6))
    assert len(traces) == first, "a new threshold retraced the loop"
    ratios = CASES["mag_default"]["mag_ratios"]
    _run(pipe, md_cache.magcache(ratios, threshold=0.06))
    second = len(traces)
    _run(pipe, md_cache.magcache(ratios, threshold=0.1, max_skip_steps=2, retention_ratio=0.1))
    assert len(traces) == second
  finally:
    mp.undo()
  np.testing.assert_array_equal(md_cache.computed_steps(pipe.last_cache), REF["mag_k2/computed"])


def test_wan_with_cfg_branches():
  """Wan with classifier-free guidance (two branch groups deciding apart): a zero threshold computes
  every step and equals the uncached run; an unreachable one computes step 0 only; calibration runs."""
  import md_wan

  wan = md_wan.load_pipeline(testing.fixture_path("wan_pipeline") / "t2v")
  kw = dict(prompt="a cat", height=32, width=32, num_frames=5, num_inference_steps=4, seed=0)
  kw.update(guidance_scale=5.0, output_type="latent", progress=False)
  plain = np.asarray(wan(**kw))
  out = np.asarray(wan(**kw, cache=md_cache.first_block_cache(0.0)))
  np.testing.assert_array_equal(md_cache.computed_steps(wan.last_cache), [1, 1, 1, 1])
  np.testing.assert_allclose(out, plain, atol=1e-5)
  out = np.asarray(wan(**kw, cache=md_cache.first_block_cache(1e9)))
  np.testing.assert_array_equal(md_cache.computed_steps(wan.last_cache), [1, 0, 0, 0])
  assert float(np.abs(out - plain).max()) > 1e-4
  out = np.asarray(wan(**kw, cache=md_cache.magcache(calibrate=True)))
  np.testing.assert_allclose(out, plain, atol=1e-5)
  ratios = md_cache.calibrated_ratios(wan.last_cache)
  assert ratios[0] == 1.0 and np.isfinite(ratios).all() and (ratios > 0).all()
