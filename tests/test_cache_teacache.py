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


def _probe_of(model, static=None, **inputs):
  """`run.probe(carry)` of the model's first hooked block stack, under jit (`static`: keyword
  arguments passed as Python values)."""
  from flax import nnx

  import md_core

  graphdef, state = nnx.split(model)

  def call(state, inputs):
    seen = {}

    def hook(run, carry, *, num_layers, index):
      if index == 0:
        seen["probe"] = run.probe(carry)
      return run(carry, 0, num_layers)

    with md_core.block_hook(hook):
      nnx.merge(graphdef, state)(**inputs, **(static or {}))
    return seen["probe"]

  return np.asarray(jax.jit(call)(state, inputs))


def test_what_teacache_measures_is_the_references_modulated_input():
  """Flux.1: block 0's modulated image input; LTX-Video: block 0's modulated input; Wan: the timestep
  projection (TeaCache4Wan's `e0`); each against the PyTorch model's (tools/fixtures/teacache_probe.py)."""
  import jax.numpy as jnp

  import md_ltx
  import md_wan

  io = testing.load_arrays(testing.fixture_path("flux_transformer") / "io.npz")
  flux = md_flux.load_flux(testing.fixture_path("flux_transformer") / "dev")
  names = ("hidden_states", "encoder_hidden_states", "pooled_projections", "timestep", "img_ids")
  got = _probe_of(flux, **{k: jnp.asarray(io[k]) for k in (*names, "txt_ids", "guidance")})
  ref = testing.load_arrays(testing.fixture_path("teacache_probe") / "flux.npz")["modulated"]
  np.testing.assert_allclose(got, ref, atol=1e-5, rtol=0)
  io = testing.load_arrays(testing.fixture_path("wan_transformer") / "t2v.npz")
  wan = md_wan.load_transformer(testing.fixture_path("wan_transformer") / "t2v")
  got = _probe_of(
    wan, hidden_states=jnp.asarray(io["hidden_states"]), timestep=jnp.asarray(io["timestep"]),
    encoder_hidden_states=jnp.asarray(io["encoder_hidden_states"]),
  )  # fmt: skip
  ref = testing.load_arrays(testing.fixture_path("teacache_probe") / "wan.npz")["modulated"]
  np.testing.assert_allclose(got[:, 0], ref, atol=1e-5, rtol=0)
  io = testing.load_arrays(testing.fixture_path("ltx_transformer") / "t2v.npz")
  ltx = md_ltx.load_transformer(testing.fixture_path("ltx_transformer"))
  f, h, w = (int(n) for n in io["grid"])
  scale = tuple(float(x) for x in io["rope_interpolation_scale"])
  got = _probe_of(
    ltx, static=dict(num_frames=f, height=h, width=w, rope_interpolation_scale=scale),
    hidden_states=jnp.asarray(io["hidden_states"]),
    encoder_hidden_states=jnp.asarray(io["encoder_hidden_states"]),
    timestep=jnp.asarray(io["timestep"]),
    encoder_attention_mask=jnp.asarray(io["encoder_attention_mask"]),
  )  # fmt: skip
  ref = testing.load_arrays(testing.fixture_path("teacache_probe") / "ltx.npz")["modulated"]
  np.testing.assert_allclose(got, ref, atol=1e-5, rtol=0)


def test_flux2_measures_the_references_modulated_input():
  """Flux.2 Klein: block 0's modulated image input, plain and on a cached step of the KV edit (the
  reference's own cache passed in), against the PyTorch model's (tools/fixtures/teacache_probe.py).
  """
  import jax.numpy as jnp

  io = testing.load_arrays(testing.fixture_path("flux2_transformer") / "io.npz")
  ref = testing.load_arrays(testing.fixture_path("teacache_probe") / "flux2.npz")
  klein = md_flux.load_flux2(testing.fixture_path("flux2_transformer") / "klein")
  base = {k: jnp.asarray(io[k]) for k in ("encoder_hidden_states", "txt_ids", "img_ids")}
  got = _probe_of(
    klein, hidden_states=jnp.asarray(io["hidden_states"]), timestep=jnp.asarray(io["timestep"]),
    **base,
  )  # fmt: skip
  np.testing.assert_allclose(got, ref["modulated"], atol=1e-5, rtol=0)
  cache = md_flux.BlockKV(*(jnp.asarray(io[f"cache_{n}"]) for n in md_flux.BlockKV._fields))
  got = _probe_of(
    klein, hidden_states=jnp.asarray(io["hidden_states_2"]),
    timestep=jnp.asarray(io["timestep_2"]), kv_cache=cache, **base,
  )  # fmt: skip
  np.testing.assert_allclose(got, ref["modulated_cached"], atol=1e-5, rtol=0)


@pytest.mark.parametrize("case", ["t2v", "i2v"])
def test_ltx2_measures_the_references_modulated_video_input(case):
  """LTX-2: block 0's modulated video input (i2v: per-token video timesteps, positions passed in),
  against the PyTorch model's (tools/fixtures/teacache_probe.py)."""
  import jax.numpy as jnp

  import md_ltx

  root = testing.fixture_path("ltx2_transformer")
  io = testing.load_arrays(root / f"{case}.npz")
  model = md_ltx.load_ltx2_transformer(root)
  names = (
    "hidden_states", "audio_hidden_states", "encoder_hidden_states", "audio_encoder_hidden_states",
    "timestep", "audio_timestep", "sigma", "encoder_attention_mask", "audio_encoder_attention_mask",
  )  # fmt: skip
  inputs = {k: jnp.asarray(io[k]) for k in names if k in io}
  coords_given, isolate, cross = (bool(f) for f in io["flags"])  # sorted, as the fixture saves them
  static = dict(isolate_modalities=isolate, use_cross_timestep=cross)
  if coords_given:
    inputs.update(
      video_coords=jnp.asarray(io["video_coords"]), audio_coords=jnp.asarray(io["audio_coords"])
    )
  else:
    f, h, w, fa = (int(n) for n in io["grid"])
    static.update(num_frames=f, height=h, width=w, fps=float(io["fps"]), audio_num_frames=fa)
  got = _probe_of(model, static=static, **inputs)
  ref = testing.load_arrays(testing.fixture_path("teacache_probe") / "ltx2.npz")[case]
  np.testing.assert_allclose(got, ref, atol=1e-5, rtol=0)
