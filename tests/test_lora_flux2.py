"""md-lora on the tiny Flux.2 Klein transformer against diffusers (tests/fixtures/lora_flux2, made by
tools/fixtures/lora_flux2.py: PEFT LoRAs made by peft, applied by diffusers' `load_lora_adapter` +
`set_adapters`): merged (`md_lora.merge`) and at run time (`md_lora.to_slots` into the Dense layers' slots,
scanned stacks and the single blocks' fused qkv+mlp projection), one adapter and two at different scales, within 1e-4."""

import functools

import chex
import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import md_core
import md_flux
import md_lora
from md_core import testing

ATOL = 1e-4
INPUTS = ("hidden_states", "timestep", "img_ids", "encoder_hidden_states", "txt_ids")
CASES = {"one": [("flux2_a", 1.0)], "two": [("flux2_a", 0.7), ("flux2_b", 1.3)]}


@functools.partial(jax.jit, static_argnums=0)
def _apply(graphdef, state, kw):
  return nnx.merge(graphdef, state)(**kw)


@pytest.fixture(scope="module")
def setup():
  io = testing.load_arrays(testing.fixture_path("flux2_transformer") / "io.npz")
  kw = {k: jnp.asarray(io[k]) for k in INPUTS}
  root = testing.fixture_path("lora_flux2")
  model = md_flux.load_flux2(testing.fixture_path("flux2_transformer") / "klein")
  adapters = {
    n: md_lora.load_lora(root / f"{n}.safetensors", md_flux.convert_key_flux2, model)
    for n in ("flux2_a", "flux2_b")
  }
  want = testing.load_arrays(root / "outputs.npz")
  return model, kw, adapters, want


@pytest.mark.parametrize("case", sorted(CASES))
def test_merged_matches_diffusers(setup, case):
  model, kw, adapters, want = setup
  pairs = [(adapters[n], s) for n, s in CASES[case]]
  graphdef, state = nnx.split(model)
  got = _apply(graphdef, md_lora.merge(state, pairs), kw)
  chex.assert_trees_all_close(got, want[case], atol=ATOL, rtol=0)


def test_runtime_matches_diffusers(setup):
  model, kw, adapters, want = setup
  slotted = nnx.clone(model)
  md_core.add_lora_slots(slotted, 8)
  graphdef, state = nnx.split(slotted)
  assert any(site.layer is not None for site in adapters["flux2_a"].weights)  # scanned stacks
  for case, pairs in CASES.items():
    got = _apply(graphdef, md_lora.apply_runtime(state, [(adapters[n], s) for n, s in pairs]), kw)
    chex.assert_trees_all_close(got, want[case], atol=ATOL, rtol=0)
  chex.assert_trees_all_close(
    _apply(graphdef, md_core.clear_lora(state), kw), want["base"], atol=ATOL, rtol=0
  )
  assert _apply._cache_size() <= 2  # merged and slotted graphs: every case reuses its program
