"""md-lora on the tiny LTX-Video transformer against diffusers (tests/fixtures/lora_ltx, made by
tools/fixtures/lora_ltx.py: PEFT LoRAs made by peft, applied by diffusers' `load_lora_adapter` with the
file's metadata + `set_adapters`): merged and at run time (scanned blocks: per-layer sites in one slot),
one adapter and two at different scales, within 1e-4."""

import functools

import chex
import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import md_core
import md_lora
import md_ltx
from md_core import testing

ATOL = 1e-4
CASES = {"one": [("ltx_a", 1.0)], "two": [("ltx_a", 0.7), ("ltx_b", 1.3)]}


@functools.partial(jax.jit, static_argnums=(0, 6, 7))
def _apply(graphdef, state, x, text, t, mask, grid, scale):
  f, h, w = grid
  return nnx.merge(graphdef, state)(
    x, text, t, mask, num_frames=f, height=h, width=w, rope_interpolation_scale=scale
  )


@pytest.fixture(scope="module")
def setup():
  io = testing.load_arrays(testing.fixture_path("ltx_transformer") / "t2v.npz")
  names = ("hidden_states", "encoder_hidden_states", "timestep", "encoder_attention_mask")
  args = [jnp.asarray(io[k]) for k in names]
  args += [
    tuple(int(n) for n in io["grid"]),
    tuple(float(s) for s in io["rope_interpolation_scale"]),
  ]
  root = testing.fixture_path("lora_ltx")
  model = md_ltx.load_transformer(testing.fixture_path("ltx_transformer"))
  adapters = {
    n: md_lora.load_lora(root / f"{n}.safetensors", md_ltx.convert_key, model)
    for n in ("ltx_a", "ltx_b")
  }
  return model, args, adapters, testing.load_arrays(root / "outputs.npz")


@pytest.mark.parametrize("case", sorted(CASES))
def test_merged_matches_diffusers(setup, case):
  model, args, adapters, want = setup
  graphdef, state = nnx.split(model)
  got = _apply(graphdef, md_lora.merge(state, [(adapters[n], s) for n, s in CASES[case]]), *args)
  chex.assert_trees_all_close(got, want[case], atol=ATOL, rtol=0)


def test_runtime_matches_diffusers(setup):
  model, args, adapters, want = setup
  slotted = nnx.clone(model)
  md_core.add_lora_slots(slotted, 8)
  graphdef, state = nnx.split(slotted)
  assert any(site.layer is not None for site in adapters["ltx_a"].weights)
  for case, pairs in CASES.items():
    got = _apply(
      graphdef, md_lora.apply_runtime(state, [(adapters[n], s) for n, s in pairs]), *args
    )
    chex.assert_trees_all_close(got, want[case], atol=ATOL, rtol=0)
  chex.assert_trees_all_close(_apply(graphdef, state, *args), want["base"], atol=ATOL, rtol=0)
