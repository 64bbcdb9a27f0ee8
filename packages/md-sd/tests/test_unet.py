"""md-sd UNet against diffusers' UNet2DConditionModel (tools/fixtures/unet.py): SD 1.x, 2.x and XL shapes."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import md_sd
import md_sharding as mds
from md_core.testing import fixture_path, load_arrays


def _nhwc(x):
  return jnp.asarray(x).transpose(0, 2, 3, 1)


def _set_mesh(mesh):
  return jax.set_mesh(mesh) if hasattr(jax, "set_mesh") else jax.sharding.use_mesh(mesh)


@pytest.fixture(scope="module", params=("sd1", "sd2", "sdxl"))
def outputs(request):
  """The fixture's inputs, the reference outputs and md's, from one compiled forward per model in the
  reference's layout (`call_nchw`): the plain output is the forward with zero residuals and an all-ones text
  mask, which change nothing."""
  folder = fixture_path("unet") / request.param
  model = md_sd.load_unet(folder, subfolder=None, progress=False)
  io = load_arrays(folder / "io.npz")
  graphdef, state = nnx.split(model)
  added = None
  if "text_embeds" in io:
    added = {"text_embeds": jnp.asarray(io["text_embeds"]), "time_ids": jnp.asarray(io["time_ids"])}

  @jax.jit
  def run(state, sample, down, mid, mask):
    m = nnx.merge(graphdef, state)
    return m.call_nchw(
      sample,
      jnp.asarray(io["timestep"]),
      jnp.asarray(io["encoder_hidden_states"]),
      added_cond_kwargs=added,
      down_block_additional_residuals=down,
      mid_block_additional_residual=mid,
      encoder_attention_mask=mask,
    )

  n = len([k for k in io if k.startswith("res_") and k != "res_mid"])
  down, mid = [jnp.asarray(io[f"res_{i}"]) for i in range(n)], jnp.asarray(io["res_mid"])
  zeros = jax.tree.map(jnp.zeros_like, (down, mid))
  ones = jnp.ones(io["encoder_hidden_states"].shape[:2])
  sample = jnp.asarray(io["sample"])
  got = {
    "out": np.asarray(run(state, sample, *zeros, ones)),
    "out_res": np.asarray(run(state, sample, down, mid, ones)),
  }
  if "mask" in io:
    got["out_mask"] = np.asarray(run(state, sample, *zeros, jnp.asarray(io["mask"])))
  if request.param == "sd2":
    # The same program on a (data 2, fsdp 2, context 1, tensor 2) mesh: parameters sharded by their logical
    # names as the loader places them, the batch over `data`.
    mesh = mds.make_mesh(
      mds.MeshConfig(ici_data_parallelism=2, ici_fsdp_parallelism=2, ici_tensor_parallelism=2)
    )
    sharded = md_sd.load_unet(folder, subfolder=None, mesh=mesh, progress=False)
    got["sharded_model"] = sharded
    batch = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
    with _set_mesh(mesh):
      out = run(nnx.state(sharded), jax.device_put(sample, batch), *zeros, ones)
    got["sharded_devices"] = len(out.sharding.device_set)
    got["sharded"] = np.asarray(out)
  return request.param, io, got


def test_unet_matches_reference(outputs):
  _, io, got = outputs
  assert np.abs(io["out"]).max() > 0.1  # the reference output is not trivially small
  chex.assert_trees_all_close(got["out"], io["out"], atol=1e-4, rtol=0)


def test_unet_with_controlnet_residuals_matches_reference(outputs):
  _, io, got = outputs
  assert np.abs(io["out_res"] - io["out"]).max() > 0.1  # the residuals change the result
  chex.assert_trees_all_close(got["out_res"], io["out_res"], atol=1e-4, rtol=0)


def test_text_mask_matches_reference(outputs):
  name, io, got = outputs
  if name != "sd1":
    return  # the masked run is in the sd1 fixture only
  assert np.abs(io["out_mask"] - io["out"]).max() > 1e-3  # the mask matters
  chex.assert_trees_all_close(got["out_mask"], io["out_mask"], atol=1e-4, rtol=0)


def test_sharded_unet_matches_single_device(outputs):
  """SD 2.x-like UNet on a (2, 2, 1, 2) mesh equals the single-device result."""
  name, io, got = outputs
  if name != "sd2":
    return  # the sharded run is made for the sd2 fixture only
  model = got["sharded_model"]
  to_q = model.down_blocks[1].attentions[0].transformer_blocks[0].attn1.to_q.kernel[...]
  assert tuple(to_q.sharding.spec) == ("fsdp", "tensor")  # (embed, heads)
  conv = model.up_blocks[0].resnets[0].conv1.kernel[...]
  assert tuple(conv.sharding.spec) == (None, None, None, "tensor")  # (kh, kw, conv_in, conv_out)
  assert got["sharded_devices"] == 8
  chex.assert_trees_all_close(got["sharded"], got["out"], atol=1e-5, rtol=0)
