"""Extraction on a real diffusers model (tests/fixtures/lora_extract, tools/fixtures/lora_extract.py): a tiny
SD UNet and a finetune that differs from it by an exact rank-4 delta on the attention projections and a 3×3
conv. md's rank-4 extraction recovers the delta, writes the committed PEFT file (made by
tools/lora_extract_export.py), and diffusers, loading that file into the base UNet, gave the tuned output."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import md_core
import md_lora
import md_sd
from md_core.testing import fixture_path, load_arrays

RANK = 4


@pytest.fixture(scope="module")
def case():
  folder = fixture_path("lora_extract")
  base = md_sd.load_unet(folder / "base", subfolder=None, progress=False)
  tuned = md_sd.load_unet(folder / "tuned", subfolder=None, progress=False)
  return folder, base, tuned, md_lora.extract_lora(base, tuned, RANK)


def _kernels(model):
  return {
    md_core.path_str(p): np.asarray(v.get_value())
    for p, v in nnx.to_flat_state(nnx.state(model))
    if p[-1] == "kernel"
  }


def test_extraction_recovers_the_delta(case):
  _, base, tuned, out = case
  # The 32 attention projections and the one conv; nothing else of the UNet moved.
  assert len(out.adapter.weights) == 33
  assert sum("conv1" in str(s) for s in out.adapter.weights) == 1
  assert {w.rank for w in out.adapter.weights.values()} == {RANK}
  assert min(out.energy.values()) > 1 - 1e-9
  got, want = _kernels(md_lora.merge(base, [(out.adapter, 1.0)])), _kernels(tuned)
  assert got.keys() == want.keys()
  chex.assert_trees_all_close(got, want, atol=1e-5, rtol=0)


def test_extracted_file_is_the_committed_one(case, tmp_path):
  """md writes the committed file (deltas 1e-5, factors up to each component's sign) with its metadata."""
  folder, base, _, out = case
  names = list(md_core.open_checkpoint(folder / "base"))
  path = tmp_path / "extracted.safetensors"
  md_lora.save_peft(out.adapter, path, md_sd.unet_key_map(base.cfg), names, prefix="unet")
  got, want = (
    md_core.open_checkpoint(path),
    md_core.open_checkpoint(folder / "extracted.safetensors"),
  )
  assert sorted(got) == sorted(want) and len(want) == 2 * 33
  for key in want:
    if not key.endswith(".lora_A.weight"):
      continue
    b_key = key.replace(".lora_A.", ".lora_B.")
    a, b, a0, b0 = got[key], got[b_key], want[key], want[b_key]
    assert a.shape == a0.shape and b.shape == b0.shape, key
    flat, flat0 = a.reshape(RANK, -1), a0.reshape(RANK, -1)
    delta = b.reshape(-1, RANK) @ flat
    delta0 = b0.reshape(-1, RANK) @ flat0
    np.testing.assert_allclose(delta, delta0, atol=1e-5, rtol=0, err_msg=key)
    # An SVD's singular vectors are fixed up to a sign per component (which LAPACK picks).
    sign = np.sign(np.sum(flat * flat0, axis=1))
    np.testing.assert_allclose(flat * sign[:, None], flat0, atol=1e-5, rtol=0, err_msg=key)
  assert got.files[0].metadata == want.files[0].metadata
  again = md_lora.load_lora(path, md_sd.unet_key_map(base.cfg), base)
  assert again.format == "peft" and len(again.weights) == 33
  assert {w.scale for w in again.weights.values()} == {1.0}


def test_merged_output_and_diffusers_reading(case):
  """md's base + extraction gives the reference's tuned output; diffusers' reading of the file did too."""
  folder, base, _, out = case
  io = load_arrays(folder / "io.npz")
  merged = md_lora.merge(base, [(out.adapter, 1.0)])
  graphdef, state = nnx.split(merged)
  sample = jnp.asarray(io["sample"]).transpose(0, 2, 3, 1)  # [B, H, W, C]
  args = (sample, jnp.asarray(io["timestep"]), jnp.asarray(io["encoder_hidden_states"]))
  got = jax.jit(lambda s, *a: nnx.merge(graphdef, s)(*a))(state, *args)
  want = io["tuned_out"].transpose(0, 2, 3, 1)
  chex.assert_trees_all_close(np.asarray(got), want, atol=1e-4, rtol=0)
  # The extraction is what moves the output (by 0.4 at a scale of 1.2).
  assert float(np.abs(want - io["base_out"].transpose(0, 2, 3, 1)).max()) > 0.1
  # diffusers' `load_lora_adapter` of the committed file into base/ vs tuned/, measured by the generator.
  assert float(io["diffusers_err"]) <= 1e-4
