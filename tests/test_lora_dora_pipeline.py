"""DoRA through the pipeline API on the tiny SD pipeline: at run time (gain slots added at the first DoRA load)
the UNet gives the merged model's output (`md_lora.merge`, whose numerics packages/md-lora/tests/test_dora.py
checks against peft); `fuse_lora` gives the merged weights, and `unfuse_lora` / `unload_lora` give the
weights back, though a DoRA rescaling cannot be unmerged from its factors (the pipeline keeps what the fuse
added)."""

import numpy as np
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


def _unet_out(unet, state=None):
  """The UNet (or `state` in its graph) on fixed small inputs."""
  graphdef, own = nnx.split(unet)
  rng = np.random.default_rng(1)
  x = rng.standard_normal((2, 8, 8, unet.cfg.in_channels)).astype(np.float32)
  dim = int(np.ravel(unet.cfg.cross_attention_dim)[0])
  ctx = rng.standard_normal((2, 7, dim)).astype(np.float32)
  return np.asarray(nnx.merge(graphdef, own if state is None else state)(x, 500.0, ctx))


def test_dora_through_the_pipeline(tmp_path):
  pipe = md_sd.load_pipeline(testing.fixture_path("sd_pipeline") / "sd")
  path = tmp_path / "dora.safetensors"
  _dora_file(path, pipe)
  before = _kernels(pipe)
  adapter = md_lora.load_lora(path, md_sd.unet_key_map(pipe.unet.cfg), pipe.unet)
  merged_state = md_lora.merge(nnx.state(pipe.unet), [(adapter, 0.8)])
  want = {tuple(p): np.asarray(v.get_value()) for p, v in nnx.to_flat_state(merged_state)}
  want_out = _unet_out(pipe.unet, merged_state)

  # At run time: gain slots come with the first DoRA load; the output is the merged model's.
  pipe.load_lora(path, name="d", scale=0.8)
  assert md_core.lora_gains(pipe.unet) and pipe.loras["d"]["active"]
  np.testing.assert_allclose(_unet_out(pipe.unet), want_out, rtol=0, atol=1e-5)

  # Fused: the weights `md_lora.merge` gives, the slots empty; unfused: the weights back, in the slots again.
  pipe.fuse_lora("d")
  fused = _kernels(pipe)
  changed = [p for p in before if p in fused and not np.array_equal(before[p], fused[p])]
  assert sorted(p[-1] for p in changed) == ["kernel", "kernel"]
  for p in changed:
    np.testing.assert_array_equal(fused[p], want[p])
  np.testing.assert_allclose(_unet_out(pipe.unet), want_out, rtol=0, atol=1e-5)
  pipe.unfuse_lora("d")
  assert not pipe.loras["d"]["fused"] and pipe.loras["d"]["active"]
  for p in changed:
    np.testing.assert_allclose(_kernels(pipe)[p], before[p], rtol=0, atol=1e-6)
  np.testing.assert_allclose(_unet_out(pipe.unet), want_out, rtol=0, atol=1e-5)
  pipe.fuse_lora("d")
  pipe.unload_lora("d")
  assert not pipe.loras
  for p in changed:
    np.testing.assert_allclose(_kernels(pipe)[p], before[p], rtol=0, atol=1e-6)


def test_dora_after_a_plain_lora_adds_gain_slots(tmp_path):
  """A plain LoRA at run time first (slots without gains), then a DoRA one: the slots are added again with
  gains, and the two together give `md_lora.merge` of both (the DoRA against the base weights, as peft
  sums adapters)."""
  pipe = md_sd.load_pipeline(testing.fixture_path("sd_pipeline") / "sd")
  plain_file = testing.fixture_path("lora") / "sd_a.safetensors"
  dora_file = tmp_path / "dora.safetensors"
  _dora_file(dora_file, pipe)
  key_map = md_sd.unet_key_map(pipe.unet.cfg)
  plain = md_lora.load_lora(plain_file, key_map, pipe.unet)
  dora = md_lora.load_lora(dora_file, key_map, pipe.unet)
  want = _unet_out(pipe.unet, md_lora.merge(nnx.state(pipe.unet), [(plain, 1.0), (dora, 0.8)]))
  pipe.load_lora(plain_file, name="a")
  assert md_core.lora_rank(pipe.unet) == 64 and not md_core.lora_gains(pipe.unet)
  pipe.load_lora(dora_file, name="d", scale=0.8)
  assert md_core.lora_gains(pipe.unet) and pipe.loras["a"]["active"] and pipe.loras["d"]["active"]
  np.testing.assert_allclose(_unet_out(pipe.unet), want, rtol=0, atol=1e-5)
