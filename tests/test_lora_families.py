"""md-lora on the tiny Flux.1, Flux.2 Klein, Wan 2.1 and LTX-Video transformers against diffusers.

Fixtures tests/fixtures/lora_<family> come from tools/fixtures/lora_<family>.py: PEFT LoRAs made by peft and
applied by diffusers (`load_lora_adapter` with the file's metadata + `set_adapters`). md applies them merged
(`md_lora.merge`) and at run time (`md_lora.apply_runtime` into the layers' slots, scanned stacks included),
one adapter and two at different scales, within 1e-4.
"""

import functools
from typing import Any, NamedTuple

import chex
import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import md_core
import md_flux
import md_lora
import md_ltx
import md_wan
from md_core import testing

ATOL = 1e-4


def _by_name(model, inputs):
  return model(**inputs)


def _wan(model, inputs):
  return model(inputs["hidden_states"], inputs["timestep"], inputs["encoder_hidden_states"], None)


def _ltx(model, inputs, *, grid, scale):
  f, h, w = grid
  return model(
    inputs["hidden_states"], inputs["encoder_hidden_states"], inputs["timestep"],
    inputs["encoder_attention_mask"], num_frames=f, height=h, width=w, rope_interpolation_scale=scale,
  )  # fmt: skip


class Family(NamedTuple):
  load: Any  # folder -> model
  convert_key: Any
  model_dir: tuple[str, str]  # (fixture, sub-folder)
  io: tuple[str, str]  # (fixture, npz)
  inputs: tuple[str, ...]
  prefix: str  # adapter files <prefix>_a / <prefix>_b in tests/fixtures/lora_<prefix>


FAMILIES = {
  "flux": Family(
    md_flux.load_flux, md_flux.convert_key, ("flux_transformer", "dev"), ("flux_transformer", "io.npz"),
    ("hidden_states", "encoder_hidden_states", "pooled_projections", "timestep", "img_ids", "txt_ids",
     "guidance"),
    "flux",
  ),
  "flux2": Family(
    md_flux.load_flux2, md_flux.convert_key_flux2, ("flux2_transformer", "klein"),
    ("flux2_transformer", "io.npz"),
    ("hidden_states", "timestep", "img_ids", "encoder_hidden_states", "txt_ids"), "flux2",
  ),
  "wan": Family(
    md_wan.load_transformer, md_wan.convert_key, ("wan_transformer", "t2v"), ("wan_transformer", "t2v.npz"),
    ("hidden_states", "timestep", "encoder_hidden_states"), "wan",
  ),
  "ltx": Family(
    md_ltx.load_transformer, md_ltx.convert_key, ("ltx_transformer", ""), ("ltx_transformer", "t2v.npz"),
    ("hidden_states", "encoder_hidden_states", "timestep", "encoder_attention_mask"), "ltx",
  ),
}  # fmt: skip


@functools.partial(jax.jit, static_argnums=(0, 1))
def _apply(call, graphdef, state, inputs):
  return call(nnx.merge(graphdef, state), inputs)


@functools.cache
def _setup(name: str):
  fam = FAMILIES[name]
  io = testing.load_arrays(testing.fixture_path(fam.io[0]) / fam.io[1])
  inputs = {k: jnp.asarray(io[k]) for k in fam.inputs}
  if name == "ltx":
    grid = tuple(int(n) for n in io["grid"])
    scale = tuple(float(s) for s in io["rope_interpolation_scale"])
    call = functools.partial(_ltx, grid=grid, scale=scale)
  else:
    call = _wan if name == "wan" else _by_name
  root = testing.fixture_path(f"lora_{fam.prefix}")
  model = fam.load(testing.fixture_path(fam.model_dir[0]) / fam.model_dir[1])
  adapters = {
    s: md_lora.load_lora(root / f"{fam.prefix}_{s}.safetensors", fam.convert_key, model)
    for s in ("a", "b")
  }
  cases = {"one": [(adapters["a"], 1.0)], "two": [(adapters["a"], 0.7), (adapters["b"], 1.3)]}
  return model, call, inputs, cases, testing.load_arrays(root / "outputs.npz")


@pytest.mark.parametrize("case", ["one", "two"])
@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_merged_matches_diffusers(name, case):
  model, call, inputs, cases, want = _setup(name)
  graphdef, state = nnx.split(model)
  got = _apply(call, graphdef, md_lora.merge(state, cases[case]), inputs)
  chex.assert_trees_all_close(got, want[case], atol=ATOL, rtol=0)


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_runtime_matches_diffusers(name):
  model, call, inputs, cases, want = _setup(name)
  slotted = nnx.clone(model)
  md_core.add_lora_slots(slotted, 8)
  graphdef, state = nnx.split(slotted)
  assert any(site.layer is not None for site in cases["one"][0][0].weights)  # scanned stacks
  base = _apply(call, graphdef, md_core.clear_lora(state), inputs)
  compiled = _apply._cache_size()
  for case, pairs in cases.items():
    got = _apply(call, graphdef, md_lora.apply_runtime(state, pairs), inputs)
    chex.assert_trees_all_close(got, want[case], atol=ATOL, rtol=0)
  chex.assert_trees_all_close(base, want["base"], atol=ATOL, rtol=0)
  assert _apply._cache_size() == compiled  # swapping adapters reuses the slotted program
