"""md-lora on the tiny Wan 2.1 transformer against diffusers (tests/fixtures/lora_wan, made by
tools/fixtures/lora_wan.py: PEFT LoRAs made by peft, applied by diffusers' `load_lora_adapter` with the
file's metadata + `set_adapters`): merged and at run time (scanned blocks: per-layer sites in one slot),
one adapter and two at different scales, within 1e-4."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import md_core
import md_lora
import md_wan
from md_core import testing

ATOL = 1e-4
CASES = {"one": [("wan_a", 1.0)], "two": [("wan_a", 0.7), ("wan_b", 1.3)]}


@jax.jit
def _apply(graphdef, state, x, t, text):
  return nnx.merge(graphdef, state)(x, t, text, None)


@pytest.fixture(scope="module")
def setup():
  io = testing.load_arrays(testing.fixture_path("wan_transformer") / "t2v.npz")
  args = [jnp.asarray(io[k]) for k in ("hidden_states", "timestep", "encoder_hidden_states")]
  root = testing.fixture_path("lora_wan")
  model = md_wan.load_transformer(testing.fixture_path("wan_transformer") / "t2v")
  adapters = {
    n: md_lora.load_lora(root / f"{n}.safetensors", md_wan.convert_key, model)
    for n in ("wan_a", "wan_b")
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
  assert any(site.layer is not None for site in adapters["wan_a"].weights)
  for case, pairs in CASES.items():
    got = _apply(
      graphdef, md_lora.apply_runtime(state, [(adapters[n], s) for n, s in pairs]), *args
    )
    chex.assert_trees_all_close(got, want[case], atol=ATOL, rtol=0)
  chex.assert_trees_all_close(_apply(graphdef, state, *args), want["base"], atol=ATOL, rtol=0)


def _slots(module):
  flat = dict(nnx.to_flat_state(nnx.state(module)))
  return {k: np.asarray(v.get_value()) for k, v in flat.items() if k[-1] in ("lora_a", "lora_b")}


def test_wan22_experts_take_per_expert_scales():
  """Wan 2.2's two experts: one file on both with a scale each, or a file on one expert only."""
  pipe = md_wan.load_pipeline(testing.fixture_path("wan_pipeline") / "t2v_a14b")  # no compile here
  root = testing.fixture_path("lora_wan")
  pipe.load_lora(
    root / "wan_a.safetensors", name="a", scale={"transformer": 1.0, "transformer_2": 0.25},
    max_rank=8,
  )  # fmt: skip
  high, low = _slots(pipe.transformer), _slots(pipe.transformer_2)
  assert high.keys() == low.keys() and md_core.lora_rank(pipe.transformer_2) == 8
  for key in high:
    want = high[key] * (0.25 if key[-1] == "lora_b" else 1.0)
    np.testing.assert_allclose(low[key], want, rtol=1e-6, atol=1e-7, err_msg=str(key))
  assert any(np.abs(v).max() > 0 for v in high.values())
  pipe.set_adapters({"a": {"transformer": 1.0, "transformer_2": 0.0}})
  assert all(
    np.abs(v).max() == 0 for k, v in _slots(pipe.transformer_2).items() if k[-1] == "lora_b"
  )
  pipe.load_lora(root / "wan_b.safetensors", name="b_low", component="transformer_2")
  assert pipe.loras["b_low"]["scales"] == {"transformer_2": 1.0}
  with pytest.raises(ValueError, match="must name exactly \\['transformer', 'transformer_2'\\]"):
    pipe.set_adapters({"a": {"transformer": 1.0}})
