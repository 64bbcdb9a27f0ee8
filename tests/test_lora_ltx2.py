"""md-lora on the tiny LTX-2 audio+video transformer against diffusers (tests/fixtures/lora_ltx2, made by
tools/fixtures/lora_ltx2.py: PEFT LoRAs made by peft on video, audio and cross-modal attention, both
feed-forwards, the patch projections and the adaLN linear, applied by diffusers' `LTX2Pipeline.lora_state_dict`
+ `load_lora_adapter` + `set_adapters`). md applies them merged and at run time (slots, scanned stack), one
adapter and two at 0.7 / 1.3, within 1e-4 on both the video and the audio output; the ComfyUI / LTX-2
trainer layout of the first file gives the same adapter.
"""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import md_core
import md_lora
import md_ltx
from md_core import testing

ATOL = 1e-4
INPUTS = (
  "hidden_states", "audio_hidden_states", "encoder_hidden_states", "audio_encoder_hidden_states",
  "encoder_attention_mask", "audio_encoder_attention_mask", "timestep",
)  # fmt: skip


@functools.partial(jax.jit, static_argnums=(0, 3))
def _apply(graphdef, state, inputs, static):
  return nnx.merge(graphdef, state)(**inputs, **dict(static))


@pytest.fixture(scope="module")
def setup():
  io = testing.load_arrays(testing.fixture_path("ltx2_transformer") / "t2v.npz")
  inputs = {k: jnp.asarray(io[k]) for k in INPUTS}
  f, h, w, fa = (int(n) for n in io["grid"])
  static = (
    ("audio_num_frames", fa), ("fps", float(io["fps"])), ("height", h), ("num_frames", f),
    ("width", w),
  )  # fmt: skip
  model = md_ltx.load_ltx2_transformer(
    testing.fixture_path("ltx2_transformer"), subfolder="transformer"
  )
  root = testing.fixture_path("lora_ltx2")
  adapters = {
    s: md_lora.load_lora(root / f"ltx2_{s}.safetensors", md_ltx.ltx2_convert_key, model)
    for s in ("a", "b", "a_comfyui")
  }
  raw = testing.load_arrays(root / "outputs.npz")
  want = {c: (raw[f"{c}/sample"], raw[f"{c}/audio_sample"]) for c in ("base", "one", "two")}
  cases = {"one": [(adapters["a"], 1.0)], "two": [(adapters["a"], 0.7), (adapters["b"], 1.3)]}
  return model, inputs, static, adapters, cases, want


def _check(got, want, what):
  errs = [float(np.abs(np.asarray(g) - w).max()) for g, w in zip(got, want, strict=True)]
  print(f"{what}: video {errs[0]:.1e}, audio {errs[1]:.1e}")
  assert max(errs) < ATOL, (what, errs)


def test_comfyui_layout_equals_peft(setup):
  _, _, _, adapters, _, _ = setup
  peft, comfy = adapters["a"], adapters["a_comfyui"]
  assert set(peft.weights) == set(comfy.weights) and len(peft.weights) > 50
  for site, w in peft.weights.items():
    c = comfy.weights[site]
    delta = w.scale * np.tensordot(w.down, w.up, 1)
    chex.assert_trees_all_close(c.scale * np.tensordot(c.down, c.up, 1), delta, atol=1e-6, rtol=0)


@pytest.mark.parametrize("case", ["one", "two"])
def test_merged_matches_diffusers(setup, case):
  model, inputs, static, _, cases, want = setup
  graphdef, state = nnx.split(model)
  _check(_apply(graphdef, md_lora.merge(state, cases[case]), inputs, static), want[case], case)


def test_runtime_matches_diffusers(setup):
  model, inputs, static, adapters, cases, want = setup
  slotted = nnx.clone(model)
  md_core.add_lora_slots(slotted, 8)
  graphdef, state = nnx.split(slotted)
  assert any(site.layer is not None for site in adapters["a"].weights)  # the scanned stack
  _check(_apply(graphdef, md_core.clear_lora(state), inputs, static), want["base"], "base")
  compiled = _apply._cache_size()
  for case, pairs in cases.items():
    got = _apply(graphdef, md_lora.apply_runtime(state, pairs), inputs, static)
    _check(got, want[case], f"{case} runtime")
  comfy = md_lora.apply_runtime(state, [(adapters["a_comfyui"], 1.0)])
  _check(_apply(graphdef, comfy, inputs, static), want["one"], "one runtime (comfyui file)")
  assert _apply._cache_size() == compiled  # swapping adapters reuses the slotted program
