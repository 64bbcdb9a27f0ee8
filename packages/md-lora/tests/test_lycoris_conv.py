"""LyCORIS adapters on convolutions (tests/fixtures/lora_lycoris_conv, tools/fixtures/lora_lycoris_conv.py): LoHa and
LoKr with and without Tucker cores (made by peft) and LoCon with a `lora_mid` core, on every resnet conv of a
tiny SD UNet, read as exact LoRAs: merged and in run-time slots, the UNet's output equals peft's LoHa / LoKr
model (the explicit LyCORIS merge for LoCon); malformed cores are named."""

import chex
import jax
import numpy as np
import pytest
from flax import nnx

import md_core
import md_lora
import md_sd
from md_core.testing import fixture_path

ATOL = 1e-5
CASES = ("loha_tucker", "loha_flat", "lokr_tucker", "lokr_flat", "locon")
RANKS = {"loha_tucker": 4, "loha_flat": 4, "lokr_tucker": 2, "lokr_flat": 2, "locon": 2}


@pytest.fixture(scope="module")
def setup(tiny_sd_unet, channels_last_outputs):
  unet, args = tiny_sd_unet
  root = fixture_path("lora_lycoris_conv")
  key_map = md_sd.unet_key_map(unet.cfg)
  adapters = {c: md_lora.load_lora(root / f"{c}.safetensors", key_map, unet) for c in CASES}
  return unet, args, adapters, channels_last_outputs(root)


def _forward(graphdef):
  traces = []

  @jax.jit
  def run(state, args):
    traces.append(1)
    return nnx.merge(graphdef, state)(*args)

  return run, traces


def test_adapters_cover_every_resnet_conv(setup):
  _, _, adapters, _ = setup
  for case, adapter in adapters.items():
    assert adapter.format == "kohya" and not adapter.skipped, case
    assert len(adapter.weights) == 16, case  # 8 resnets x (conv1, conv2)
    assert all(site.path[-1] == "kernel" and "resnets" in str(site) for site in adapter.weights)
    assert {w.rank for w in adapter.weights.values()} == {RANKS[case]}, case
    assert all(np.ndim(w.down) == 4 for w in adapter.weights.values())  # [3, 3, in, r]


def test_merged_matches_the_reference(setup):
  unet, args, adapters, want = setup
  graphdef, state = nnx.split(unet)
  run, _ = _forward(graphdef)
  chex.assert_trees_all_close(np.asarray(run(state, args)), want["base"], atol=ATOL, rtol=0)
  for case in CASES:
    got = np.asarray(run(md_lora.merge(state, [(adapters[case], 1.0)]), args))
    moved = float(np.abs(want[case] - want["base"]).max())
    print(f"{case} merged: max abs {float(np.abs(got - want[case]).max()):.1e} (moves {moved:.2f})")
    assert moved > 0.5
    chex.assert_trees_all_close(got, want[case], atol=ATOL, rtol=0)


def test_runtime_slots_match_without_recompiling(setup):
  unet, args, adapters, want = setup
  slotted = nnx.clone(unet)
  md_core.add_lora_slots(slotted, max(RANKS.values()))
  graphdef, state = nnx.split(slotted)
  run, traces = _forward(graphdef)
  for case in CASES:
    got = np.asarray(run(md_lora.apply_runtime(state, [(adapters[case], 1.0)]), args))
    print(f"{case} run time: max abs {float(np.abs(got - want[case]).max()):.1e}")
    chex.assert_trees_all_close(got, want[case], atol=ATOL, rtol=0)
  assert len(traces) == 1  # one program for all five adapters


def _load(tmp_path, tensors):
  md_core.save_safetensors(tmp_path / "bad.safetensors", tensors)
  shapes = {("down_blocks", 0, "resnets", 0, "conv1", "kernel"): (3, 3, 8, 8)}
  return md_lora.load_lora(tmp_path / "bad.safetensors", _key_map(), shapes)


def _key_map():
  return lambda name: (
    md_core.Target(("down_blocks", 0, "resnets", 0, "conv1", "kernel"), "conv2d")
    if name == "down_blocks.0.resnets.0.conv1.weight"
    else None
  )


M = "lora_unet_down_blocks_0_resnets_0_conv1"


def test_tucker_loha_delta_is_lycoris_rebuild(tmp_path):
  """One Tucker LoHa module: the delta is LyCORIS' `cp(t1, w1) * cp(t2, w2) * alpha / r`, written out here."""
  rng = np.random.default_rng(0)
  t = {f"{M}.hada_t{i}": rng.standard_normal((2, 2, 3, 3)).astype(np.float32) for i in (1, 2)}
  w = {
    f"{M}.hada_w{i}_{x}": rng.standard_normal((2, 8)).astype(np.float32)
    for i in (1, 2)
    for x in "ab"
  }
  adapter = _load(tmp_path, t | w | {f"{M}.alpha": np.float32(3.0)})
  (weight,) = adapter.weights.values()
  parts = [
    np.einsum("abhw,bi,ao->oihw", t[f"{M}.hada_t{i}"], w[f"{M}.hada_w{i}_b"], w[f"{M}.hada_w{i}_a"])
    for i in (1, 2)
  ]
  want = 1.5 * parts[0] * parts[1]  # [out, in, kh, kw]
  np.testing.assert_allclose(weight.delta(), want.transpose(2, 3, 1, 0), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
  "slots, match",
  [
    (
      {"lora_down.weight": (2, 8, 1, 1), "lora_mid.weight": (3, 2, 3, 3), "lora_up.weight": (8, 2, 1, 1)},
      r"LoCon module 'lora_unet_down_blocks_0_resnets_0_conv1': '.*lora_mid.weight' has shape \(3, 2, 3, 3\)",
    ),
    (
      {"lora_down.weight": (2, 8, 3, 3), "lora_mid.weight": (2, 2, 3, 3), "lora_up.weight": (8, 2, 1, 1)},
      r"a Tucker core is \[r, r, \*k\] beside a 1x1 down",
    ),
    ({"lora_mid.weight": (2, 2, 3, 3)}, r"module 'lora_unet_down_blocks_0_resnets_0_conv1' has no lora_down / lora_up"),
    (
      {"hada_t1": (2, 2, 3, 3), "hada_w1_a": (3, 8), "hada_w1_b": (2, 8), "hada_w2_a": (8, 2), "hada_w2_b": (2, 72)},
      r"rank or shape mismatch for LoHa module .*hada_t1' \(2, 2, 3, 3\).*hada_w1_a' \(3, 8\)",
    ),
    (
      {"hada_w1_a": (8, 2), "hada_w1_b": (2, 72), "hada_w2_a": (8, 2), "hada_w2_b": (2, 8)},
      r"LoHa module .*: its two parts are \[8, 72\] and \[8, 8\]",
    ),
    ({"lokr_w1": (2, 2), "lokr_t1": (1, 1, 3, 3), "lokr_w2": (4, 4, 3, 3)}, r"has a Tucker core on its first part"),
    (
      {"lokr_w1": (2, 2), "lokr_t2": (1, 1, 3, 3), "lokr_w2_a": (2, 4), "lokr_w2_b": (1, 4)},
      r"rank or shape mismatch for LoKr module .*lokr_t2' \(1, 1, 3, 3\)",
    ),
    ({"lokr_w1": (2, 2), "lokr_w2": (4, 4, 3, 3), "lokr_t2": (1, 1, 3, 3)}, r"has both lokr_w2 and"),
  ],
)  # fmt: skip
def test_malformed_conv_modules_are_named(tmp_path, slots, match):
  tensors = {f"{M}.{s}": np.ones(shape, np.float32) for s, shape in slots.items()}
  with pytest.raises(md_lora.LoRAFileError, match="bad.safetensors: .*" + match):
    _load(tmp_path, tensors)


def test_kernel_of_another_size_is_refused(tmp_path):
  """A LoHa whose flattened columns do not fit the model's kernel (a 1x1 module's factors on a 3x3 conv)."""
  tensors = {f"{M}.hada_w{i}_a": np.ones((8, 2), np.float32) for i in (1, 2)}
  tensors |= {f"{M}.hada_w{i}_b": np.ones((2, 8), np.float32) for i in (1, 2)}
  with pytest.raises(
    md_lora.LoRAFileError, match=r"bad.safetensors: .*conv1.*takes a 4-d weight, the LoRA is 2-d"
  ):
    _load(tmp_path, tensors)
