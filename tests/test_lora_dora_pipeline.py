"""DoRA through the pipeline API on the tiny SD pipeline: a run-time load says that DoRA can only be fused;
`fuse=True` gives the weights `md_lora.merge` gives (whose numerics packages/md-lora/tests/test_dora.py
checks against peft), and `unfuse_lora` / `unload_lora` give the weights back, though a DoRA rescaling
cannot be unmerged from its factors (the pipeline keeps what the fuse added)."""

import numpy as np
import pytest
from flax import nnx

import md_core
import md_lora
import md_sd
from md_core import testing

MODULES = (
  "down_blocks.0.resnets.0.conv1",
  "down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_q",
)


def _kernels(pipe) -> dict:
  return {tuple(p): np.asarray(v.get_value()) for p, v in nnx.to_flat_state(nnx.state(pipe.unet))}


def _dora_file(path, pipe) -> None:
  """Random DoRA factors for two modules of this UNet, in diffusers' key names and torch layouts."""
  rng = np.random.default_rng(0)
  key_map, kernels = md_sd.unet_key_map(pipe.unet.cfg), _kernels(pipe)
  tensors = {}
  for module in MODULES:
    target = key_map(module + ".weight")
    shape = kernels[tuple(target.path)].shape  # md layout: (*k, in, out)
    out, inp, k = shape[-1], shape[-2], shape[:-2]
    tensors[f"unet.{module}.lora_A.weight"] = rng.standard_normal((2, inp, *k)).astype(np.float32)
    tensors[f"unet.{module}.lora_B.weight"] = rng.standard_normal((out, 2, *(1,) * len(k))).astype(
      np.float32
    )
    tensors[f"unet.{module}.lora_magnitude_vector"] = rng.uniform(0.5, 2.0, out).astype(np.float32)
  md_core.save_safetensors(path, tensors)


def test_dora_fuses_and_unfuses_through_the_pipeline(tmp_path):
  pipe = md_sd.load_pipeline(testing.fixture_path("sd_pipeline") / "sd")
  path = tmp_path / "dora.safetensors"
  _dora_file(path, pipe)
  with pytest.raises(ValueError, match=r"dora.safetensors: 2 DoRA site\(s\).*fuse=True"):
    pipe.load_lora(path)
  assert not pipe.loras
  before = _kernels(pipe)
  adapter = md_lora.load_lora(path, md_sd.unet_key_map(pipe.unet.cfg), pipe.unet)
  want = {
    tuple(p): np.asarray(v.get_value())
    for p, v in nnx.to_flat_state(md_lora.merge(nnx.state(pipe.unet), [(adapter, 0.8)]))
  }
  pipe.load_lora(path, name="d", scale=0.8, fuse=True)
  fused = _kernels(pipe)
  changed = [p for p in before if not np.array_equal(before[p], fused[p])]
  assert len(changed) == 2 and all(p[-1] == "kernel" for p in changed)
  for p in before:
    np.testing.assert_array_equal(fused[p], want[p])
  pipe.unfuse_lora("d")
  assert not pipe.loras["d"]["fused"] and not pipe.loras["d"]["active"]  # slots cannot hold DoRA
  for p in before:
    np.testing.assert_allclose(_kernels(pipe)[p], before[p], rtol=0, atol=1e-6)
  with pytest.raises(ValueError, match=r"DoRA site\(s\).*fuse=True"):
    pipe.set_adapters({"d": 1.0})
  assert not pipe.loras["d"]["active"]
  pipe.fuse_lora("d")
  assert pipe.loras["d"]["active"] and pipe.loras["d"]["fused"]
  for p in before:  # on the unfused weights, equal to the originals to float32 rounding
    np.testing.assert_allclose(_kernels(pipe)[p], want[p], rtol=0, atol=1e-6)
  pipe.unload_lora("d")
  assert not pipe.loras
  for p in before:
    np.testing.assert_allclose(_kernels(pipe)[p], before[p], rtol=0, atol=1e-6)
