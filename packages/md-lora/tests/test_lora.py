"""md-lora on a toy model: mapping through a key map (linear, conv, fused qkv split, stacked layers), merge
against numpy's `W + s·B·A` in torch layout, every bad input's error, extraction and PEFT saving."""

import json

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import md_core
import md_lora
from md_core import Target

RNG = np.random.default_rng(0)
R = 2


class Toy(nnx.Module):
  """proj: a linear (6 → 5); conv: a 3×3 conv (3 → 4); blocks: two stacked (5 → 5) q/k kernels."""

  def __init__(self):
    self.proj = md_core.nn.Dense(6, 5, rngs=nnx.Rngs(0))
    self.conv = md_core.nn.Conv(3, 4, (3, 3), rngs=nnx.Rngs(1))
    rng = np.random.default_rng(5)
    for name in ("q", "k"):
      w = jnp.asarray(rng.standard_normal((2, 5, 5)), jnp.float32)
      setattr(self, name, nnx.Param(w, logical_axes=("layers", "embed", "mlp")))


def convert_key(name):
  """Reference names: `proj.weight` (out, in), `conv.weight` OIHW, `blocks.<i>.qk.weight` fused (10, 5)."""
  if name == "proj.weight":
    return Target(("proj", "kernel"), "linear")
  if name == "conv.weight":
    return Target(("conv", "kernel"), "conv2d")
  if name.startswith("blocks.") and name.endswith(".qk.weight"):
    i = int(name.split(".")[1])
    return [Target((n,), "linear", split=(j, 2, 0), layer=i) for j, n in enumerate("qk")]
  return None


def _factors():
  return {
    "proj": (RNG.standard_normal((R, 6)), RNG.standard_normal((5, R))),
    "conv": (RNG.standard_normal((R, 3, 3, 3)), RNG.standard_normal((4, R, 1, 1))),
    "blocks.0.qk": (RNG.standard_normal((R, 5)), RNG.standard_normal((10, R))),
    "blocks.1.qk": (RNG.standard_normal((R, 5)), RNG.standard_normal((10, R))),
  }


def _peft_file(path, factors, prefix="transformer.", alpha=4.0, **extra):
  tensors = {}
  for m, (a, b) in factors.items():
    tensors[f"{prefix}{m}.lora_A.weight"] = np.asarray(a, np.float32)
    tensors[f"{prefix}{m}.lora_B.weight"] = np.asarray(b, np.float32)
  tensors.update(extra)
  meta = {
    "lora_adapter_metadata": json.dumps({"transformer.r": R, "transformer.lora_alpha": alpha})
  }
  md_core.save_safetensors(path, tensors, metadata=meta)
  return path


def _kohya_file(path, factors, alpha=4.0, drop_alpha=()):
  tensors = {}
  for m, (a, b) in factors.items():
    name = "lora_unet_" + m.replace(".", "_")
    tensors[f"{name}.lora_down.weight"] = np.asarray(a, np.float32)
    tensors[f"{name}.lora_up.weight"] = np.asarray(b, np.float32)
    if m not in drop_alpha:
      tensors[f"{name}.alpha"] = np.asarray(alpha, np.float32)
  md_core.save_safetensors(path, tensors)
  return path


def _value(v):
  return np.asarray(v.get_value())


def test_merge_equals_torch_layout_delta(tmp_path):
  model = Toy()
  f = _factors()
  adapter = md_lora.load_lora(_peft_file(tmp_path / "a.safetensors", f), convert_key, model)
  assert len(adapter.weights) == 2 + 2 * 2 and {w.scale for w in adapter.weights.values()} == {2.0}
  merged = md_lora.merge(model, [(adapter, 0.5)])
  s = 0.5 * 4.0 / R
  a, b = f["proj"]
  want = _value(model.proj.kernel) + s * (b @ a).T
  np.testing.assert_allclose(_value(merged.proj.kernel), want, atol=1e-5)
  a, b = f["conv"]
  delta = np.einsum("or,rihw->oihw", b[:, :, 0, 0], a)
  want = _value(model.conv.kernel) + s * delta.transpose(2, 3, 1, 0)
  np.testing.assert_allclose(_value(merged.conv.kernel), want, atol=1e-5)
  for i in (0, 1):
    a, b = f[f"blocks.{i}.qk"]
    fused = (b @ a).reshape(2, 5, 5)  # [q | k] along the output axis
    for j, name in enumerate("qk"):
      want = _value(getattr(model, name))[i] + s * fused[j].T
      np.testing.assert_allclose(_value(getattr(merged, name))[i], want, atol=1e-5)
  back = md_lora.unmerge(merged, [(adapter, 0.5)])
  np.testing.assert_allclose(_value(back.q), _value(model.q), atol=1e-5)


def test_kohya_equals_peft(tmp_path):
  model, f = Toy(), _factors()
  peft = md_lora.load_lora(_peft_file(tmp_path / "p.safetensors", f), convert_key, model)
  kohya = md_lora.load_lora(_kohya_file(tmp_path / "k.safetensors", f), convert_key, model)
  assert kohya.format == "kohya" and set(kohya.weights) == set(peft.weights)
  for site, w in peft.weights.items():
    np.testing.assert_allclose(kohya.weights[site].delta(), w.delta(), atol=1e-6)


def test_kohya_module_names():
  assert (
    md_lora.kohya_module_name("down_blocks_0_attentions_0_transformer_blocks_0_attn1_to_out_0")
    == "down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_out.0"
  )
  assert md_lora.kohya_module_name("up_blocks_1_resnets_0_conv_shortcut") == (
    "up_blocks.1.resnets.0.conv_shortcut"
  )


def test_errors_name_file_and_key(tmp_path):
  model, f = Toy(), _factors()
  good = _peft_file(tmp_path / "good.safetensors", f)
  data = good.read_bytes()
  (tmp_path / "cut.safetensors").write_bytes(data[: len(data) // 2])
  with pytest.raises(md_core.SafetensorsError, match="cut.safetensors.*truncated"):
    md_lora.load_lora(tmp_path / "cut.safetensors", convert_key, model)

  md_core.save_safetensors(tmp_path / "odd.safetensors", {"x.weight": np.zeros(2, np.float32)})
  with pytest.raises(md_lora.LoRAFileError, match="odd.safetensors: unknown LoRA format"):
    md_lora.load_lora(tmp_path / "odd.safetensors", convert_key, model)

  bad = dict(f, proj=(RNG.standard_normal((3, 6)), RNG.standard_normal((5, 2))))
  with pytest.raises(
    md_lora.LoRAFileError, match=r"rank mismatch for 'transformer.proj'.*\(3, 6\)"
  ):
    md_lora.load_lora(_peft_file(tmp_path / "r.safetensors", bad), convert_key, model)

  path = _kohya_file(tmp_path / "k.safetensors", f, drop_alpha=("conv",))
  with pytest.raises(md_lora.LoRAFileError, match="k.safetensors: module 'lora_unet_conv' has no"):
    md_lora.load_lora(path, convert_key, model)
  assert md_lora.load_lora(path, convert_key, model, default_alpha=2.0).weights

  with pytest.raises(
    md_lora.LoRAFileError, match="good.safetensors: lora_alpha for '.*'eight', not a finite"
  ):
    md_lora.load_lora(good, convert_key, model, config={"r": R, "lora_alpha": "eight"})
  adapter = md_lora.load_lora(good, convert_key, model)
  with pytest.raises(TypeError, match="scale 'x' is not a finite number"):
    md_lora.merge(model, [(adapter, "x")])


def test_unmatched_keys_and_other_models(tmp_path):
  model, f = Toy(), _factors()
  extra = dict(f, **{"proj_typo": f["proj"]})
  path = _peft_file(tmp_path / "u.safetensors", extra)
  with pytest.raises(
    md_lora.LoRAFileError, match="'transformer.proj_typo.lora_A.weight'.*nearest md"
  ):
    md_lora.load_lora(path, convert_key, model)
  adapter = md_lora.load_lora(
    path, convert_key, model, allow_unmatched=[r"transformer\.proj_typo\..*"]
  )
  assert len(adapter.skipped) == 2 and len(adapter.weights) == 6

  other = {f"double_blocks.{i}.img_attn.qkv": f["proj"] for i in range(3)} | {"proj": f["proj"]}
  path = _peft_file(tmp_path / "flux.safetensors", other)
  with pytest.raises(
    md_lora.LoRAFileError,
    match=r"is for another model \(its names are those of Flux.1 \(BFL names\)\): 4 of its 4 modules match",
  ):
    md_lora.load_lora(path, convert_key, model)

  bigger = {
    m: (np.pad(a, [(0, 0), (0, 2)] + [(0, 0)] * (a.ndim - 2)), b) for m, (a, b) in f.items()
  }
  path = _peft_file(tmp_path / "big.safetensors", bigger)
  with pytest.raises(md_lora.LoRAFileError, match="for another model.*do not fit the shapes") as e:
    md_lora.load_lora(path, convert_key, model)
  assert "'proj/kernel' is (6, 5)" in str(e.value)


def test_extract_recovers_exact_low_rank_delta(tmp_path):
  base = Toy()
  tuned = Toy()
  u, v = RNG.standard_normal((6, R)), RNG.standard_normal((R, 5))
  tuned.proj.kernel.set_value(tuned.proj.kernel.get_value() + jnp.asarray(u @ v, jnp.float32))
  q = tuned.q.get_value()
  tuned.q.set_value(
    q.at[1].add(jnp.asarray(RNG.standard_normal((5, R)) @ RNG.standard_normal((R, 5))))
  )
  out = md_lora.extract_lora(base, tuned, R, kernels=r"kernel|q|k")
  assert {str(s) for s in out.adapter.weights} == {"proj/kernel", "q[1]"}
  assert min(out.energy.values()) > 1 - 1e-9
  merged = md_lora.merge(base, [(out.adapter, 1.0)])
  for name in ("proj", "q"):
    got = merged.proj.kernel if name == "proj" else merged.q
    want = tuned.proj.kernel if name == "proj" else tuned.q
    np.testing.assert_allclose(_value(got), _value(want), atol=1e-5)

  names = ["proj.weight", "conv.weight", "blocks.0.q.weight", "blocks.1.q.weight"]

  def split_free(name):
    if name.startswith("blocks."):
      return Target(("q",), "linear", layer=int(name.split(".")[1]))
    return convert_key(name)

  path = tmp_path / "extracted.safetensors"
  md_lora.save_peft(out.adapter, path, split_free, names, prefix="transformer")
  again = md_lora.load_lora(path, split_free, base)
  for site, w in out.adapter.weights.items():
    np.testing.assert_allclose(again.weights[site].delta(), w.delta(), atol=1e-5)
