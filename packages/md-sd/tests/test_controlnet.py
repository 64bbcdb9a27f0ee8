"""md-sd ControlNet against diffusers' ControlNetModel / MultiControlNetModel (tools/fixtures/controlnet.py)."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import md_sd
from md_core.testing import fixture_path, load_arrays

SCALE = 0.7


def _nhwc(x):
  return jnp.asarray(x).transpose(0, 2, 3, 1)


def _nchw(x):
  return np.asarray(x).transpose(0, 3, 1, 2)


@pytest.fixture(scope="module", params=("sd", "sdxl"))
def outputs(request):
  """Everything md computes for one fixture, in one compiled program: the ControlNet's residuals, the UNet's
  output with them and, for sd, guess mode and two ControlNets at once."""
  name = request.param
  folder = fixture_path("controlnet") / name
  io = load_arrays(folder / "io.npz")
  load = dict(progress=False)
  models = {
    "unet": md_sd.load_unet(folder / "unet", subfolder=None, **load),
    "net": md_sd.load_controlnet(folder / "controlnet", **load),
  }
  if name == "sd":
    models["net_b"] = md_sd.load_controlnet(folder / "controlnet_b", **load)
  graphdef, state = nnx.split(models)
  added = None
  if "text_embeds" in io:
    added = {"text_embeds": jnp.asarray(io["text_embeds"]), "time_ids": jnp.asarray(io["time_ids"])}
  args = (
    _nhwc(io["sample"]),
    jnp.asarray(io["timestep"]),
    jnp.asarray(io["encoder_hidden_states"]),
  )
  cond = _nhwc(io["controlnet_cond"])

  @jax.jit
  def run(state, scale):
    m = nnx.merge(graphdef, state)
    out = {}
    down, mid = m["net"](*args, cond, conditioning_scale=scale, added_cond_kwargs=added)
    out["down"], out["mid"] = down, mid
    out["unet_out"] = m["unet"](
      *args,
      added_cond_kwargs=added,
      down_block_additional_residuals=down,
      mid_block_additional_residual=mid,
    )
    if "net_b" in m:
      out["guess"] = m["net"](*args, cond, conditioning_scale=scale, guess_mode=True)
      multi = md_sd.MultiControlNetModel([m["net"], m["net_b"]])
      out["multi"] = multi(
        *args, [cond, _nhwc(io["controlnet_cond_b"])], conditioning_scale=[scale, 1.3]
      )
    return out

  return name, io, run(state, jnp.float32(SCALE))


def _ref_residuals(io, prefix):
  n = len([k for k in io if k.startswith(f"{prefix}down_")])
  return [io[f"{prefix}down_{i}"] for i in range(n)], io[f"{prefix}mid"]


def test_controlnet_residuals_match_reference(outputs):
  _, io, got = outputs
  down, mid = _ref_residuals(io, "")
  assert len(got["down"]) == len(down) and min(np.abs(d).max() for d in down) > 1e-2
  chex.assert_trees_all_close([_nchw(d) for d in got["down"]], down, atol=1e-4, rtol=0)
  chex.assert_trees_all_close(_nchw(got["mid"]), mid, atol=1e-4, rtol=0)


def test_unet_with_controlnet_matches_reference(outputs):
  _, io, got = outputs
  chex.assert_trees_all_close(_nchw(got["unet_out"]), io["unet_out"], atol=1e-4, rtol=0)


def test_guess_mode_and_multi_controlnet_match_reference(outputs):
  name, io, got = outputs
  if name != "sd":
    return  # guess mode and two ControlNets are in the sd fixture only
  for key, prefix in (("guess", "guess_"), ("multi", "multi_")):
    down, mid = _ref_residuals(io, prefix)
    chex.assert_trees_all_close([_nchw(d) for d in got[key][0]], down, atol=1e-4, rtol=0)
    chex.assert_trees_all_close(_nchw(got[key][1]), mid, atol=1e-4, rtol=0)
