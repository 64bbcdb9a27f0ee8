"""Every md-cache policy on every family's tiny pipeline (SD, SDXL, Flux.1, Klein, the Klein KV edit,
Wan 2.2 experts, Wan I2V, LTX-Video, LTX-2; few steps): the steps computed are the ones the setting
implies, a setting that computes every step equals the uncached run, and block-level policies on md-sd's
UNets raise an error naming the step-level ones that apply."""

import functools

import jax
import numpy as np
import pytest

import md_cache
from md_core import testing

STEPS = 4
IMAGE = np.random.RandomState(0).randint(0, 256, (32, 32, 3)).astype(np.uint8)
REF_IMAGE = np.random.RandomState(7).randint(0, 256, (64, 64, 3)).astype(np.uint8)


def _flux(folder, **kw):
  import md_flux

  return md_flux.load_pipeline(testing.fixture_path(folder[0]) / folder[1]), kw


_KLEIN = dict(height=64, width=64, max_sequence_length=40, text_encoder_out_layers=(1, 2, 3))
_WAN = dict(height=32, width=32)


def _load(family: str):
  import md_ltx
  import md_sd
  import md_wan

  if family in UNETS:
    return md_sd.load_pipeline(testing.fixture_path("sd_pipeline") / family), dict(
      height=32, width=32, guidance_scale=5.0
    )
  if family == "flux":
    return _flux(("flux_pipeline", "dev"), height=32, width=48, max_sequence_length=8)
  if family == "klein":
    return _flux(("flux2_pipeline", "klein"), guidance_scale=4.0, **_KLEIN)
  if family == "klein_kv_edit":
    return _flux(("flux2_pipeline", "klein_kv"), image=REF_IMAGE, **_KLEIN)
  if family == "wan22_experts":
    pipe = md_wan.load_pipeline(testing.fixture_path("wan_pipeline") / "t2v_a14b")
    return pipe, dict(num_frames=5, guidance_scale=4.0, guidance_scale_2=3.0, **_WAN)
  if family == "wan_i2v":
    pipe = md_wan.load_pipeline(testing.fixture_path("wan_pipeline") / "i2v")
    return pipe, dict(num_frames=5, image=IMAGE, guidance_scale=5.0, **_WAN)
  if family == "ltx":
    pipe = md_ltx.load_pipeline(testing.fixture_path("ltx_pipeline") / "t2v")
    return pipe, dict(height=32, width=32, num_frames=9, max_sequence_length=8)
  assert family == "ltx2"
  pipe = md_ltx.load_ltx2_pipeline(testing.fixture_path("ltx2_pipeline") / "pipe")
  kw = dict(height=32, width=64, num_frames=9, max_sequence_length=16)
  return pipe, dict(spatio_temporal_guidance_blocks=(1,), **kw)


UNETS = ("sd", "sdxl")
FAMILIES = UNETS + ("flux", "klein", "klein_kv_edit", "wan22_experts", "wan_i2v", "ltx", "ltx2")
# Per policy: (a setting that computes every step, a setting and the steps it computes).
POLICIES = {
  "first_block_cache": (
    lambda: md_cache.first_block_cache(0.0),
    lambda: md_cache.first_block_cache(1e9),
    [1, 0, 0, 0],
  ),
  "magcache": (
    lambda: md_cache.magcache(calibrate=True),
    lambda: md_cache.magcache([1.0] * STEPS, threshold=1.0, retention_ratio=0.0),
    [1, 0, 0, 0],
  ),
  "taylorseer": (
    lambda: md_cache.taylorseer(5, warmup_steps=STEPS),
    lambda: md_cache.taylorseer(2, warmup_steps=1, stop_step=None),
    [1, 0, 1, 0],
  ),
  "teacache": (lambda: md_cache.teacache(0.0), lambda: md_cache.teacache(1e9), [1, 0, 0, 1]),
  "sencache": (lambda: md_cache.sencache(-1.0), lambda: md_cache.sencache(1e9), [1, 0, 0, 1]),
  "deepcache": (
    lambda: md_cache.deepcache(1),
    lambda: md_cache.deepcache(2, start=0),
    [1, 0, 1, 0],
  ),
  "faster_cache": (
    lambda: md_cache.faster_cache(1),
    lambda: md_cache.faster_cache(2, timestep_range=(-1, 2000)),
    [1, 0, 1, 0],
  ),
}
STEP_LEVEL = ("taylorseer", "sencache")
# SenCache goes through the same step-level path as TaylorSeer (decide / update), tested on every
# family; here on a UNet and on a two-leaf sample (LTX-2's video + audio) only, to keep the test short.
# The CFG cache on SD is tested against diffusers in tests/test_cache_faster.py.
ONLY = {"sencache": ("sd", "ltx2"), "faster_cache": tuple(f for f in FAMILIES if f != "sd")}
# SDXL (the UNet with added text-time conditioning): the UNet policies and one block-level refusal.
ONLY |= {p: FAMILIES for p in POLICIES if p not in ONLY}
ONLY |= {p: tuple(f for f in ONLY[p] if f != "sdxl") for p in ("magcache", "teacache", "sencache")}
# The CFG cache needs classifier-free guidance alone: refused (with the reason) where a family's call
# here runs none (guidance-distilled Flux.1 dev, the Klein KV edit) or adds STG / modality rows (LTX-2).
NO_CFG_CACHE = {
  "flux": "runs none",
  "klein_kv_edit": "runs none",
  "ltx2": "STG / modality",
}


@functools.cache
def _family(family: str):
  pipe, kw = _load(family)
  kw = dict(prompt="a cat", seed=0, progress=False, num_inference_steps=STEPS, **kw)
  kw["output_type"] = "latent"
  return pipe, kw, _flat(pipe(**kw))


def _flat(x):
  if hasattr(x, "frames"):  # LTX-2: video and audio latents
    x = (x.frames, x.audio)
  return np.concatenate([np.asarray(a, np.float32).ravel() for a in jax.tree.leaves(x)])


# The costliest rows (LTX-2's two-stream blocks, Wan I2V's DeepCache) run under `-m slow`; every family
# and every policy keeps rows in the default suite.
SLOW = {
  ("ltx2", "deepcache"), ("ltx2", "magcache"), ("ltx2", "sencache"), ("ltx2", "taylorseer"),
  ("wan_i2v", "deepcache"),
}  # fmt: skip


@pytest.mark.filterwarnings("ignore:prompt")
@pytest.mark.parametrize(
  "family, policy",
  [
    pytest.param(f, p, marks=[pytest.mark.slow] if (f, p) in SLOW else [])
    for f in FAMILIES
    for p in sorted(POLICIES)
    if f in ONLY[p]
  ],
)
def test_policy_on_family(family, policy):
  pipe, kw, plain = _family(family)
  every, some, want = POLICIES[policy]
  if family in UNETS and policy not in STEP_LEVEL + ("faster_cache", "deepcache"):
    with pytest.raises(ValueError, match="no hookable block stack.*step-level"):
      pipe(**kw, cache=every())
    return
  if policy == "deepcache" and family not in UNETS:
    with pytest.raises(
      ValueError, match="deepcache caches a UNet's deep branch.*first_block_cache"
    ):
      pipe(**kw, cache=every())
    return
  if policy == "faster_cache" and family in NO_CFG_CACHE:
    with pytest.raises(ValueError, match=NO_CFG_CACHE[family]):
      pipe(**kw, cache=every())
    return
  if family == "klein_kv_edit" and policy not in STEP_LEVEL:
    # Step 0 of the KV edit (the references' K/V) is its own program outside the block hook: it counts
    # as computed and a block cache starts at step 1 (nothing cached yet, so step 1 runs too).
    want = [1, 1] + want[2:]
  out = _flat(pipe(**kw, cache=every()))
  assert md_cache.computed_steps(pipe.last_cache).all()
  np.testing.assert_allclose(out, plain, atol=1e-5, rtol=0)
  out = _flat(pipe(**kw, cache=some()))
  np.testing.assert_array_equal(md_cache.computed_steps(pipe.last_cache), want)
  calls = sum(want) if policy in STEP_LEVEL else STEPS
  assert int(pipe.last_calls) == calls
  assert np.isfinite(out).all() and float(np.abs(out - plain).max()) > 1e-6
