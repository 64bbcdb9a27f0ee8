"""md-lora on whole pipelines against diffusers (tests/fixtures/lora, made by tools/fixtures/lora.py).

PEFT LoRAs made by peft on the tiny SD UNet, loaded by diffusers' `load_lora_weights` + `set_adapters`;
md reads the same files, merges them into its UNet and runs the same inputs (3 DDIM steps, 32 px).
"""

import numpy as np
import pytest
from flax import nnx

import md_lora
import md_sd
import md_text
from md_core import testing

ATOL = 1e-3
PROMPTS = ["a photo of a cat", "an astronaut riding a horse on the moon"]
COMMON = dict(height=32, width=32, num_inference_steps=3, guidance_scale=5.0, progress=False)


@pytest.fixture(scope="module")
def root():
  return testing.fixture_path("lora")


@pytest.fixture(scope="module")
def outputs(root):
  return testing.load_cases(root / "outputs.npz")


@pytest.fixture(scope="module")
def sd():
  return md_sd.load_pipeline(testing.fixture_path("sd_pipeline") / "sd")


def _read(sd, path, **kw):
  return md_lora.load_lora(path, md_sd.unet_key_map(sd.unet.cfg), sd.unet, **kw)


def _generate(sd, base, adapters, latents):
  sd.replace_unet(md_lora.merge(base, adapters))
  try:
    return np.asarray(sd(PROMPTS, latents=latents, **COMMON))
  finally:
    sd.replace_unet(base)


@pytest.mark.parametrize("case", ["one", "two"])
def test_merged_lora_matches_diffusers(sd, root, outputs, case):
  a = _read(sd, root / "sd_a.safetensors")
  assert a.format == "peft" and len(a.weights) > 20
  assert {w.scale for w in a.weights.values()} == {2.0}  # lora_alpha 8 / r 4 from the header
  adapters = [(a, 1.0)]
  if case == "two":
    b = _read(sd, root / "sd_b.safetensors")
    assert {w.scale for w in b.weights.values()} == {0.5}
    adapters = [(a, 0.7), (b, 1.3)]
  want = outputs[case]["images"]
  got = _generate(sd, sd.unet, adapters, outputs[case]["latents"])
  err = float(np.abs(got - want).max())
  print(f"{case}: max abs error {err:.2e}")
  assert err < ATOL, f"max abs error {err:.2e}"


def test_kohya_file_equals_peft_file(sd, root):
  peft = _read(sd, root / "sd_a.safetensors")
  kohya = _read(sd, root / "sd_a_kohya.safetensors")
  assert kohya.format == "kohya" and set(kohya.weights) == set(peft.weights)
  for site, w in peft.weights.items():
    np.testing.assert_allclose(kohya.weights[site].delta(), w.delta(), atol=1e-6, rtol=0)
  # The merged UNets agree weight for weight (so do their outputs).
  merged = [nnx.state(md_lora.merge(sd.unet, [(x, 0.9)])) for x in (peft, kohya)]
  for (p, v0), (_, v1) in zip(*(nnx.to_flat_state(m) for m in merged)):
    np.testing.assert_allclose(v1.get_value(), v0.get_value(), atol=1e-6, rtol=0, err_msg=str(p))


def test_diffusers_pre_peft_layouts(sd, root, outputs):
  """The layouts diffusers' own SD / SDXL scripts wrote before PEFT (tests/fixtures/lora_diffusers_old, from
  sd_a's tensors with alpha / r folded into `up`): `<module>.lora.down` names read into sd_a's adapter,
  `attn.processor.to_q_lora` names into its attention part, and both run as diffusers runs them."""
  old = testing.fixture_path("lora_diffusers_old")
  peft = _read(sd, root / "sd_a.safetensors")
  layers = _read(sd, old / "sd_a_lora_layers.safetensors")
  procs = _read(sd, old / "sd_a_attn_procs.safetensors")
  assert set(layers.weights) == set(peft.weights)
  attention = {s for s in peft.weights if s.path[-2] in ("to_q", "to_k", "to_v", "to_out")}
  assert set(procs.weights) == attention and len(attention) > 10
  assert {w.scale for w in (*layers.weights.values(), *procs.weights.values())} == {1.0}  # no alpha
  for site, w in peft.weights.items():
    np.testing.assert_allclose(layers.weights[site].delta(), w.delta(), atol=1e-6, rtol=0)
    if site in attention:
      np.testing.assert_allclose(procs.weights[site].delta(), w.delta(), atol=1e-6, rtol=0)
  latents = outputs["one"]["latents"]
  for adapter, want in ((layers, outputs["one"]["images"]), (procs, None)):
    if want is None:
      want = testing.load_arrays(old / "outputs.npz")["attn_procs/images"]
    err = float(np.abs(_generate(sd, sd.unet, [(adapter, 1.0)], latents) - want).max())
    print(f"{adapter.source}: max abs error {err:.2e}")
    assert err < ATOL, f"max abs error {err:.2e}"


def test_diffusers_pre_peft_text_encoder_names(sd):
  """Text-encoder factors named `q_proj.lora_linear_layer.down` (diffusers 0.21-0.24) or
  `self_attn.to_q_lora.down` (older) read as the PEFT file of the same tensors (`q_proj.lora_A`)."""
  rng = np.random.default_rng(0)
  width = sd.text_encoder.config.hidden_size
  peft, linear_layer, processor = {}, {}, {}
  for proj, old in (("q_proj", "to_q_lora"), ("out_proj", "to_out_lora")):
    down = rng.standard_normal((2, width), np.float32)
    up = rng.standard_normal((width, 2), np.float32)
    attn = "text_encoder.text_model.encoder.layers.0.self_attn"
    peft |= {f"{attn}.{proj}.lora_A.weight": down, f"{attn}.{proj}.lora_B.weight": up}
    linear_layer |= {
      f"{attn}.{proj}.lora_linear_layer.down.weight": down,
      f"{attn}.{proj}.lora_linear_layer.up.weight": up,
    }
    processor |= {f"{attn}.{old}.down.weight": down, f"{attn}.{old}.up.weight": up}
  read = [
    md_lora.load_lora(t, md_text.clip_text_convert_key, sd.text_encoder, prefix="text_encoder.")
    for t in (peft, linear_layer, processor)
  ]
  assert len(read[0].weights) == 2
  for other in read[1:]:
    assert set(other.weights) == set(read[0].weights)
    for site, w in read[0].weights.items():
      np.testing.assert_array_equal(other.weights[site].delta(), w.delta())


def test_unmerge_restores_the_unet(sd, root):
  a = _read(sd, root / "sd_a.safetensors")
  back = md_lora.unmerge(md_lora.merge(sd.unet, [(a, 0.8)]), [(a, 0.8)])
  for (p, v0), (_, v1) in zip(
    nnx.to_flat_state(nnx.state(sd.unet)), nnx.to_flat_state(nnx.state(back))
  ):
    np.testing.assert_allclose(
      np.asarray(v1.get_value()), np.asarray(v0.get_value()), atol=1e-5, err_msg=str(p)
    )
