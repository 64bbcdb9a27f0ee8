"""The pipeline LoRA API (`pipe.load_lora`, `set_adapters`, `unload_lora`, `fuse_lora`, `unfuse_lora`) on
the tiny SD pipeline against diffusers (tests/fixtures/lora, made by tools/fixtures/lora.py: PEFT LoRAs
made by peft, loaded by diffusers' `load_lora_weights` + `set_adapters`), at run time and fused, and the
hot-swap contract: five adapters of ranks 4…64 in a 64 slot, other scales, disabled — zero compilations
after the first call.
"""

import jax
import numpy as np
import pytest

import md_core
import md_sd
from md_core import testing
from md_lora import settings as lora_settings

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
def sd(root, outputs):
  """The tiny SD pipeline with sd_a and sd_b loaded at run time (64-rank slots on every Dense and Conv),
  and its output with both disabled (zero slots: the base model; compiled once for the whole module)."""
  pipe = md_sd.load_pipeline(testing.fixture_path("sd_pipeline") / "sd")
  assert pipe.load_lora(root / "sd_a.safetensors", name="a") == "a"
  pipe.load_lora(root / "sd_b.safetensors", name="b", scale=1.3)
  assert pipe.loras["b"]["active"] and pipe.loras["a"]["scales"] == {"unet": 1.0}
  pipe.set_adapters({})
  base = _run(pipe, outputs["one"]["latents"])
  return pipe, base


def _run(pipe, latents):
  return np.asarray(pipe(PROMPTS, latents=latents, **COMMON))


def _err(got, want):
  return float(np.abs(got - want).max())


def test_runtime_and_fused_match_diffusers(sd, outputs):
  pipe, base = sd
  assert md_core.lora_rank(pipe.unet) == 64
  assert pipe.loras["b"]["scales"] == {"unet": 1.3} and not pipe.loras["b"]["active"]
  errors = {}
  pipe.set_adapters({"a": 1.0})
  errors["one runtime"] = _err(_run(pipe, outputs["one"]["latents"]), outputs["one"]["images"])
  pipe.set_adapters({"a": 0.7, "b": 1.3})
  errors["two runtime"] = _err(_run(pipe, outputs["two"]["latents"]), outputs["two"]["images"])
  pipe.fuse_lora()
  assert all(v["fused"] for v in pipe.loras.values())
  errors["two fused"] = _err(_run(pipe, outputs["two"]["latents"]), outputs["two"]["images"])
  pipe.unfuse_lora()
  errors["two unfused"] = _err(_run(pipe, outputs["two"]["latents"]), outputs["two"]["images"])
  pipe.set_adapters("a")
  pipe.fuse_lora("a")
  errors["one fused"] = _err(_run(pipe, outputs["one"]["latents"]), outputs["one"]["images"])
  pipe.unfuse_lora()
  print({k: f"{v:.1e}" for k, v in errors.items()})
  assert max(errors.values()) < ATOL, errors
  # Disabled after fusing and unfusing: the base model again (subtracted exactly in f32).
  pipe.set_adapters({})
  assert _err(_run(pipe, outputs["one"]["latents"]), base) < 1e-5
  assert _err(base, outputs["one"]["images"]) > 0.05  # the LoRA matters


def _random_peft(path, template, rank, seed):
  """A PEFT file with sd_a's modules at another rank (random factors, alpha = rank)."""
  rng = np.random.default_rng(seed)
  tensors = {}
  f = md_core.SafetensorsFile(template)
  for key in f:
    shape = list(np.shape(f[key]))
    shape[0 if ".lora_A." in key else 1] = rank
    tensors[key] = (0.05 * rng.standard_normal(shape)).astype(np.float32)
  md_core.save_safetensors(path, tensors)
  return path


def test_hot_swap_never_compiles(sd, root, outputs, tmp_path):
  pipe, base = sd
  latents = outputs["one"]["latents"]
  pipe.set_adapters({"a": 1.0})
  first = _run(pipe, latents)  # compiled by the test above (or here, first in the module)
  compiles = []

  def listen(event, duration, **kw):
    if event == "/jax/core/compile/backend_compile_duration":
      compiles.append(event)

  jax.monitoring.register_event_duration_secs_listener(listen)
  try:
    seen = [first]
    for i, rank in enumerate((4, 8, 16, 32, 64)):
      name = f"r{rank}"
      pipe.load_lora(
        _random_peft(tmp_path / f"{name}.safetensors", root / "sd_a.safetensors", rank, i),
        name=name,
        scale=0.5 + 0.1 * i,
      )
      pipe.set_adapters({name: 0.5 + 0.1 * i})
      seen.append(_run(pipe, latents))
      pipe.set_adapters({name: 1.5})  # another scale
      seen.append(_run(pipe, latents))
      pipe.unload_lora(name)
    pipe.set_adapters({"a": 0.4, "b": 2.0})
    seen.append(_run(pipe, latents))
    pipe.set_adapters({})  # disabled
    seen.append(_run(pipe, latents))
  finally:
    jax.monitoring.unregister_event_duration_listener(listen)
  assert compiles == [], f"{len(compiles)} compilations while swapping"
  # Every swap changed the output; disabling gives the base model's.
  diffs = [_err(x, y) for x, y in zip(seen[:-1], seen[1:])]
  assert min(diffs[:-1]) > 1e-3, diffs
  assert _err(seen[-1], base) < 1e-5


def test_errors(sd, root):
  pipe, _ = sd
  with pytest.raises(ValueError, match="a LoRA named 'a' is loaded already"):
    pipe.load_lora(root / "sd_a.safetensors", name="a")
  with pytest.raises(ValueError, match="no LoRA named 'nope'; loaded: \\['a', 'b'\\]"):
    pipe.set_adapters({"nope": 1.0})
  with pytest.raises(ValueError, match="component 'transformer': LoRAs apply to \\['unet'\\]"):
    pipe.load_lora(root / "sd_a.safetensors", name="c", component="transformer")
  with pytest.raises(ValueError, match="must name exactly \\['unet'\\] \\(unknown: \\['vae'\\]\\)"):
    pipe.set_adapters({"a": {"vae": 1.0}})
  with pytest.raises(TypeError, match="scale 'x' is not a finite number"):
    pipe.set_adapters({"a": "x"})
  with pytest.raises(ValueError, match="max_rank=8, but the slots hold rank 64"):
    pipe.load_lora(root / "sd_a.safetensors", name="c", max_rank=8)
  with pytest.raises(ValueError, match="is fused into the weights; unfuse_lora\\(\\) first"):
    pipe.set_adapters("a")
    pipe.fuse_lora("a")
    try:
      pipe.set_adapters({"a": 0.5})
    finally:
      pipe.unfuse_lora()
  assert "c" not in pipe.loras and not pipe.loras["a"]["fused"]


def test_too_much_rank_names_the_layer_and_keeps_the_state(sd, root, tmp_path):
  pipe, _ = sd
  pipe.set_adapters({"a": 1.0})
  big = _random_peft(tmp_path / "big.safetensors", root / "sd_a.safetensors", 62, 0)
  with pytest.raises(ValueError, match="needs rank 66 .* slot holds 64.*max_rank=64"):
    pipe.load_lora(big, name="big")  # 4 (sd_a, active) + 62
  assert "big" not in pipe.loras and pipe.loras["a"]["active"]


def test_app_loras_config(sd, root, tmp_path):
  import ml_collections

  from md_core import apps

  assert lora_settings.parse_loras("") == []
  assert lora_settings.parse_loras(
    "a.safetensors:0.8, b.safetensors,c.safetensors:1@transformer_2"
  ) == [
    lora_settings.LoRASpec("a.safetensors", 0.8),
    lora_settings.LoRASpec("b.safetensors", 1.0),
    lora_settings.LoRASpec("c.safetensors", 1.0, "transformer_2"),
  ]
  with pytest.raises(ValueError, match="loras entry 'a.safetensors:x': scale 'x' is not a number"):
    lora_settings.parse_loras("a.safetensors:x")
  with pytest.raises(ValueError, match="loras entry 2 of 'a.safetensors,' is empty"):
    lora_settings.parse_loras("a.safetensors,")
  with pytest.raises(ValueError, match="scale 'nan' is not finite"):
    lora_settings.parse_loras("a.safetensors:nan")
  config = lora_settings.add_lora_config(ml_collections.ConfigDict())
  config.loras = f"{root / 'sd_a.safetensors'}:0.5,{tmp_path / 'missing.safetensors'}:1"
  problems = apps.Problems(config)
  lora_settings.check_loras(problems, config)
  assert problems.lines == [f"loras entry {str(tmp_path / 'missing.safetensors')!r}: no such file"]

  pipe, _ = sd
  config.loras = f"{root / 'sd_b.safetensors'}:0.25@unet"
  before = set(pipe.loras)
  names = lora_settings.load_loras(pipe, config)
  assert names == ["0_sd_b"] and pipe.loras["0_sd_b"]["scales"] == {"unet": 0.25}
  pipe.unload_lora(names)
  assert set(pipe.loras) == before
  config.loras = f"{root / 'sd_b.safetensors'}@transformer"
  with pytest.raises(ValueError, match="loras entry .*sd_b.safetensors'.*component 'transformer'"):
    lora_settings.load_loras(pipe, config)


def test_slot_targets_that_miss_layers_are_named(root):
  pipe = md_sd.load_pipeline(testing.fixture_path("sd_pipeline") / "sd")  # loads only, no compile
  with pytest.raises(
    ValueError, match="have no run-time LoRA slot .*targets=\\('to_q',\\).*fuse=True"
  ):
    pipe.load_lora(root / "sd_a.safetensors", targets=("to_q",))
  assert pipe.loras == {}
  pipe.load_lora(root / "sd_a.safetensors", name="fused", fuse=True, scale=0.5)
  assert pipe.loras["fused"]["fused"] and md_core.lora_rank(pipe.unet) == 64  # the to_q slots
