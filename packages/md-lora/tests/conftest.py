"""What md-lora's tests share (the settings themselves come from md_core.pytest_plugin)."""

import jax.numpy as jnp
import pytest

import md_sd
from md_core.testing import fixture_path, load_arrays


@pytest.fixture(scope="session")
def tiny_sd_unet():
  """`(unet, args)`: the tiny SD UNet of tests/fixtures/lora_extract (which the LyCORIS and DoRA fixtures
  adapt) and its inputs, channels-last as md takes them."""
  base = fixture_path("lora_extract")
  unet = md_sd.load_unet(base / "base", subfolder=None, progress=False)
  io = load_arrays(base / "io.npz")
  args = (
    jnp.asarray(io["sample"]).transpose(0, 2, 3, 1),
    jnp.asarray(io["timestep"]),
    jnp.asarray(io["encoder_hidden_states"]),
  )
  return unet, args


@pytest.fixture(scope="session")
def channels_last_outputs():
  """Reads a fixture's outputs.npz of torch UNet outputs `[B, C, H, W]` as md's `[B, H, W, C]`."""
  return lambda folder: {
    k: v.transpose(0, 2, 3, 1) for k, v in load_arrays(folder / "outputs.npz").items()
  }
