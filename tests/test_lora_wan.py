"""Wan 2.2's two experts through the pipeline's LoRA API (tests/fixtures/lora_wan): per-expert scales and a
file on one expert. The denoiser parity against diffusers is in tests/test_lora_families.py."""

import numpy as np
import pytest
from flax import nnx

import md_core
import md_wan
from md_core import testing


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


PROMPT = "a cat surfing a wave at sunset"
NEGATIVE = "bright colors, overexposed, static, blurred details, worst quality, low quality"
COMMON = dict(
  height=32, width=32, num_frames=5, num_inference_steps=3, guidance_scale=4.0, guidance_scale_2=3.0,
  output_type="latent", progress=False,
)  # fmt: skip


def test_wan22_experts_match_diffusers():
  """Against diffusers' `load_lora_weights(..., load_into_transformer_2=True)` on the whole tiny Wan 2.2
  pipeline (tests/fixtures/lora_wan22, tools/fixtures/lora_wan22.py): a file per expert, one file on both
  with a scale each, at run time and fused; both experts run (the steps cross the boundary)."""
  pipe = md_wan.load_pipeline(testing.fixture_path("wan_pipeline") / "t2v_a14b")
  root = testing.fixture_path("lora_wan")
  want = testing.load_cases(testing.fixture_path("lora_wan22") / "outputs.npz")

  def err(case):
    got = np.asarray(pipe(PROMPT, NEGATIVE, latents=want[case]["latents"], **COMMON))
    assert got.shape == want[case]["latents_out"].shape, got.shape
    return float(np.abs(got - want[case]["latents_out"]).max())

  pipe.load_lora(root / "wan_a.safetensors", name="high", component="transformer", max_rank=8)
  pipe.load_lora(root / "wan_b.safetensors", name="low", component="transformer_2", scale=1.3)
  pipe.load_lora(
    root / "wan_a.safetensors", name="both", scale={"transformer": 1.0, "transformer_2": 0.5}
  )
  errors = {}
  pipe.set_adapters({})
  errors["base"] = err("base")
  pipe.set_adapters({"high": 0.8, "low": 1.3})
  errors["experts runtime"] = err("experts")
  pipe.fuse_lora()
  errors["experts fused"] = err("experts")
  pipe.unfuse_lora()
  pipe.set_adapters({"both": {"transformer": 1.0, "transformer_2": 0.5}})
  errors["both runtime"] = err("both")
  pipe.fuse_lora("both")
  errors["both fused"] = err("both")
  pipe.unfuse_lora()
  print({k: f"{v:.1e}" for k, v in errors.items()})
  assert max(errors.values()) < 1e-3, errors
  moved = np.abs(want["experts"]["latents_out"] - want["base"]["latents_out"]).max()
  assert moved > 0.05  # the LoRAs matter
