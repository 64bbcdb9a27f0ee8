"""Files saved by LyCORIS' own network wrapper (tests/fixtures/lora_lycoris_wrapper,
tools/fixtures/lora_lycoris_wrapper.py): `create_lycoris(...).save_weights` names every module of the wrapped
model as kohya does but under `lycoris_`. md reads them as kohya files; merged (and, for the LoRA-like
algorithms, at run time) the tiny SD UNet gives the output of the wrapper's own forward at multipliers 1
and 0.6: LoCon, LoHa, LoKr, diagonal OFT and the "full" algorithm's whole deltas (`.diff` / `.diff_b`) over the
wrapper's SD preset (78 modules: attention, feed-forward, projections, resnet convs, time embeddings,
down/upsamplers)."""

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
ALGOS = ("lora", "loha", "lokr", "diag-oft", "full", "glora", "lora-norms", "ia3", "ia3-input")
MULTIPLIERS = (1.0, 0.6)


@pytest.fixture(scope="module")
def setup(tiny_sd_unet, channels_last_outputs):
  unet, args = tiny_sd_unet
  root = fixture_path("lora_lycoris_wrapper")
  key_map = md_sd.unet_key_map(unet.cfg)
  adapters = {a: md_lora.load_lora(root / f"{a}.safetensors", key_map, unet) for a in ALGOS}
  graphdef, state = nnx.split(unet)
  run = jax.jit(lambda state, args: nnx.merge(graphdef, state)(*args))
  return state, args, adapters, channels_last_outputs(root), run, key_map


def test_every_module_is_read_as_kohya(setup):
  _, _, adapters, _, _, _ = setup
  for algo, adapter in adapters.items():
    assert adapter.format == "kohya" and not adapter.skipped, algo
    # full: a delta on each of the 78 weights and on the 54 biases (to_q / to_k / to_v have none)
    # lora-norms: the 78 LoCon sites and the 32 norm layers' scale and bias (whole deltas)
    assert len(adapter.weights) == {"full": 132, "lora-norms": 142}.get(algo, 78), algo
    assert bool(adapter.oft) == (algo == "diag-oft"), algo
  sites = {str(s) for s in adapters["lora"].weights}
  words = ("time_emb_proj", "downsampler/", "upsampler/", "proj_in", "ff/proj_out", "conv_shortcut")
  for word in words:
    assert any(word in s for s in sites), word


@pytest.mark.parametrize("algo", ALGOS)
def test_merged_matches_the_wrappers_forward(setup, algo):
  state, args, adapters, want, run, _ = setup
  chex.assert_trees_all_close(np.asarray(run(state, args)), want["base"], atol=ATOL, rtol=0)
  for multiplier in MULTIPLIERS:
    key = algo if multiplier == 1.0 else f"{algo}_{multiplier:g}"
    got = np.asarray(run(md_lora.merge(state, [(adapters[algo], multiplier)]), args))
    err = float(np.abs(got - want[key]).max())
    moved = float(np.abs(want[key] - want["base"]).max())
    print(f"{key} merged: max abs {err:.1e} (the network moves the output by {moved:.2f})")
    chex.assert_trees_all_close(got, want[key], atol=ATOL, rtol=0)


def test_runtime_matches_the_wrappers_forward(setup, tiny_sd_unet):
  """LoCon, LoHa and LoKr as run-time slots give the wrapper's forward too, the three files swapped in as
  values of one compiled program; OFT is refused there by name."""
  _, args, adapters, want, _, _ = setup
  slotted = nnx.clone(tiny_sd_unet[0])
  rank = max(w.rank for a in ("lora", "loha", "lokr") for w in adapters[a].weights.values())
  md_core.add_lora_slots(slotted, rank)
  graphdef, state = nnx.split(slotted)
  traces = []

  @jax.jit
  def run(state, args):
    traces.append(1)
    return nnx.merge(graphdef, state)(*args)

  for algo in ("lora", "loha", "lokr"):
    for multiplier in MULTIPLIERS:
      key = algo if multiplier == 1.0 else f"{algo}_{multiplier:g}"
      got = np.asarray(run(md_lora.apply_runtime(state, [(adapters[algo], multiplier)]), args))
      err = float(np.abs(got - want[key]).max())
      print(f"{key} at run time (slots of rank {rank}): max abs {err:.1e}")
      chex.assert_trees_all_close(got, want[key], atol=ATOL, rtol=0)
  assert len(traces) == 1
  with pytest.raises(ValueError, match="OFT"):
    md_lora.apply_runtime(state, [(adapters["diag-oft"], 1.0)])


def test_a_module_outside_the_unet_is_named(setup, tmp_path):
  """A wrapper file of another model (a text encoder's `lycoris_text_model_…` modules) read for the UNet:
  the error names the file, the module and why."""
  state, _, _, _, _, key_map = setup
  tensors = dict(md_core.SafetensorsFile(fixture_path("lora_lycoris_wrapper") / "lora.safetensors"))
  tensors = {k: np.asarray(v) for k, v in tensors.items()}
  tensors["lycoris_text_model_encoder_layers_0_mlp_fc1.lora_down.weight"] = np.zeros(
    (4, 8), np.float32
  )
  tensors["lycoris_text_model_encoder_layers_0_mlp_fc1.lora_up.weight"] = np.zeros(
    (8, 4), np.float32
  )
  tensors["lycoris_text_model_encoder_layers_0_mlp_fc1.alpha"] = np.float32(2.0)
  md_core.save_safetensors(tmp_path / "te.safetensors", tensors)
  with pytest.raises(
    md_lora.LoRAFileError, match=r"te\.safetensors.*text_model_encoder_layers_0_mlp_fc1"
  ):
    md_lora.load_lora(tmp_path / "te.safetensors", key_map, state)


def test_pipeline_loads_a_wrapper_file(tmp_path):
  """`pipe.load_lora` takes a `lycoris_` file for the SD pipeline's UNet (LoCon factors on an attention
  projection and a resnet conv, written as the wrapper names them): fused, the UNet's kernels are
  `md_lora.merge`'s."""
  pipe = md_sd.load_pipeline(fixture_path("sd_pipeline") / "sd")
  key_map = md_sd.unet_key_map(pipe.unet.cfg)
  flat = {tuple(p): np.asarray(v.get_value()) for p, v in nnx.to_flat_state(nnx.state(pipe.unet))}
  rng = np.random.default_rng(0)
  tensors = {}
  for module in (
    "down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_q",
    "down_blocks.0.resnets.0.conv1",
  ):
    kernel = flat[tuple(key_map(module + ".weight").path)]
    out, fan_in = kernel.shape[-1], kernel.shape[-2]
    down_shape = (4, fan_in, *kernel.shape[:-2])  # conv: a k x k down, a 1 x 1 up (LoCon)
    up_shape = (out, 4) + (1,) * (kernel.ndim - 2)
    name = "lycoris_" + module.replace(".", "_")
    tensors[f"{name}.lora_down.weight"] = (0.2 * rng.standard_normal(down_shape)).astype(np.float32)
    tensors[f"{name}.lora_up.weight"] = (0.2 * rng.standard_normal(up_shape)).astype(np.float32)
    tensors[f"{name}.alpha"] = np.float32(2.0)
  path = tmp_path / "wrapper.safetensors"
  md_core.save_safetensors(path, tensors)
  adapter = md_lora.load_lora(path, key_map, pipe.unet)
  want = {
    tuple(p): np.asarray(v.get_value())
    for p, v in nnx.to_flat_state(md_lora.merge(nnx.state(pipe.unet), [(adapter, 0.8)]))
  }
  pipe.load_lora(path, name="wrapper", scale=0.8, fuse=True)
  got = {tuple(p): np.asarray(v.get_value()) for p, v in nnx.to_flat_state(nnx.state(pipe.unet))}
  assert max(float(np.abs(got[p] - want[p]).max()) for p in want) < 1e-6
  assert max(float(np.abs(got[p] - flat[p]).max()) for p in flat) > 0.01


@pytest.mark.parametrize("algo", ["glora", "ia3-input"])
def test_weight_dependent_deltas_unmerge_and_are_refused_where_they_cannot_go(
  setup, tmp_path, algo
):
  """GLoRA (`ΔW = γ (W a1 a2 + b1 b2)`) and IA³ (`W · (1 + k v)`), deltas through the weight itself:
  merged at 0.6 and unmerged gives the weights back; run-time slots, save_peft and the report name them."""
  state, _, adapters, _, _, key_map = setup
  adapter = adapters[algo]
  kind = "GLoRA" if algo == "glora" else "IA3"
  assert not adapter.oft and f"78 {kind}" in repr(adapter)
  assert adapter.glora == (algo == "glora") and adapter.ia3 == (algo != "glora")
  weight = md_lora.GLoRAWeight if algo == "glora" else md_lora.IA3Weight
  assert all(isinstance(w, weight) for w in adapter.weights.values())
  line = " glora r=4 scale=0.5" if algo == "glora" else " ia3 (inputs) n="  # GLoRA: alpha 2 / r 4
  assert line in md_lora.lora_report(adapter)
  base = {tuple(p): np.asarray(v.get_value()) for p, v in nnx.to_flat_state(state)}
  merged = md_lora.merge(state, [(adapter, 0.6)])
  moved = {tuple(p): np.asarray(v.get_value()) for p, v in nnx.to_flat_state(merged)}
  assert max(float(np.abs(moved[p] - base[p]).max()) for p in base) > 1e-2
  back = md_lora.unmerge(merged, [(adapter, 0.6)])
  back = {tuple(p): np.asarray(v.get_value()) for p, v in nnx.to_flat_state(back)}
  assert max(float(np.abs(back[p] - base[p]).max()) for p in base) < 1e-5
  with pytest.raises(ValueError, match=rf"78 site\(s\) are LyCORIS {kind} .*merge it"):
    md_lora.apply_runtime(state, [(adapter, 1.0)])
  with pytest.raises(
    ValueError, match="a GLoRA / IA3 adapter .*save_peft writes plain LoRA factors"
  ):
    md_lora.save_peft(adapter, tmp_path / "x.safetensors", key_map, [], prefix="unet")
