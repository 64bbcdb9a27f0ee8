"""LyCORIS LoKr read as exact LoRAs of rank r1·r2 (tests/fixtures/lora_lokr, tools/fixtures/lora_lokr.py):
merged and at run time, the tiny Wan transformer's output equals the reference's explicit torch merge
`W += scale · kron(w1, w2)` (the peft-made file also equals peft's LoKr model there); malformed modules are
named."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import md_core
import md_lora
import md_wan
from md_core.testing import fixture_path, load_arrays

ATOL = 1e-4


@jax.jit(static_argnums=0)
def _apply(graphdef, state, args):
  return nnx.merge(graphdef, state)(*args, None)


@pytest.fixture(scope="module")
def setup():
  model = md_wan.load_transformer(fixture_path("wan_transformer") / "t2v")
  io = load_arrays(fixture_path("wan_transformer") / "t2v.npz")
  args = tuple(jnp.asarray(io[k]) for k in ("hidden_states", "timestep", "encoder_hidden_states"))
  root = fixture_path("lora_lokr")
  adapters = {
    case: md_lora.load_lora(root / f"{name}.safetensors", md_wan.convert_key, model)
    for case, name in (("lokr", "wan_lokr"), ("whole", "wan_lokr_whole"))
  }
  return model, args, adapters, load_arrays(root / "outputs.npz")


def test_lokr_merged_matches_torch(setup):
  model, args, adapters, want = setup
  assert adapters["lokr"].format == "kohya" and adapters["whole"].format == "comfyui"
  assert len(adapters["lokr"].weights) == 2 * 10  # 2 blocks x (8 attention + 2 feed-forward)
  graphdef, state = nnx.split(model)
  for case in ("lokr", "whole"):
    got = _apply(graphdef, md_lora.merge(state, [(adapters[case], 1.0)]), args)
    print(f"{case} merged: max abs {float(np.abs(np.asarray(got) - want[case]).max()):.1e}")
    chex.assert_trees_all_close(np.asarray(got), want[case], atol=ATOL, rtol=0)
  chex.assert_trees_all_close(np.asarray(_apply(graphdef, state, args)), want["base"], atol=ATOL)


def test_lokr_runtime_matches_torch(setup):
  model, args, adapters, want = setup
  rank = max(w.rank for w in adapters["lokr"].weights.values())
  slotted = nnx.clone(model)
  md_core.add_lora_slots(slotted, rank)
  graphdef, state = nnx.split(slotted)
  got = _apply(graphdef, md_lora.apply_runtime(state, [(adapters["lokr"], 1.0)]), args)
  print(
    f"lokr run time (rank {rank}): max abs {float(np.abs(np.asarray(got) - want['lokr']).max()):.1e}"
  )
  chex.assert_trees_all_close(np.asarray(got), want["lokr"], atol=ATOL, rtol=0)


def test_lokr_delta_is_the_kronecker_product(tmp_path):
  """A whole `lokr_w1` and a factored `lokr_w2` (alpha / r2) give `scale · kron(w1, w2_a @ w2_b)`."""
  rng = np.random.default_rng(0)
  w1, w2a, w2b = (rng.standard_normal(s).astype(np.float32) for s in ((2, 3), (4, 2), (2, 5)))
  name = "lora_unet_blocks_0_self_attn_q"
  tensors = {f"{name}.lokr_w1": w1, f"{name}.lokr_w2_a": w2a, f"{name}.lokr_w2_b": w2b}
  tensors[f"{name}.alpha"] = np.float32(3.0)
  md_core.save_safetensors(tmp_path / "k.safetensors", tensors)
  shapes = {("blocks", "attn1", "to_q", "kernel"): (2, 15, 8)}  # a scanned stack of 2
  adapter = md_lora.load_lora(tmp_path / "k.safetensors", md_wan.convert_key, shapes)
  (site, weight), = adapter.weights.items()  # fmt: skip
  assert site.layer == 0 and weight.rank == 2 * 2
  want = 1.5 * np.kron(w1, w2a @ w2b)  # torch layout [out, in]
  np.testing.assert_allclose(weight.delta(), want.T, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
  "slots, match",
  [
    ({"lokr_w1": (2, 3)}, r"LoKr module 'lora_unet_blocks_0_self_attn_q' has neither lokr_w2 nor"),
    (
      {"lokr_w1": (2, 3), "lokr_w2": (4, 5), "lokr_w2_a": (4, 2)},
      r"has both lokr_w2 and lokr_w2_a / lokr_w2_b",
    ),
    ({"lokr_w1": (2, 3), "lokr_w2_a": (4, 2), "lokr_w2_b": (3, 5)}, r"rank or shape mismatch"),
    (  # a convolution's LoKr on a linear weight: the delta's shape is named against the weight's
      {"lokr_w1": (2, 3), "lokr_w2": (4, 5, 3, 3)},
      r"the delta of 'blocks.0.attn1.to_q' \(lora_A \(8, 135\), lora_B \(8, 8\)\) is \(135, 8\) "
      r"in md's layout, the model's 'blocks/attn1/to_q/kernel\[0\]' is \(15, 8\)",
    ),
  ],
)
def test_lokr_errors(tmp_path, slots, match):
  name = "lora_unet_blocks_0_self_attn_q"
  tensors = {f"{name}.{s}": np.ones(shape, np.float32) for s, shape in slots.items()}
  md_core.save_safetensors(tmp_path / "bad.safetensors", tensors)
  shapes = {("blocks", "attn1", "to_q", "kernel"): (2, 15, 8)}
  with pytest.raises(md_lora.LoRAFileError, match="bad.safetensors: .*" + match):
    md_lora.load_lora(tmp_path / "bad.safetensors", md_wan.convert_key, shapes)
