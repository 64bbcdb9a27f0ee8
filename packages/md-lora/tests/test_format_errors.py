"""Bad LoRA files and settings on the tiny Wan transformer: each error names the file, the key and what was
expected; full deltas (`diff`, `diff_b`) land on the tensors they name."""

import numpy as np
import pytest

import md_core
import md_lora
import md_wan
from md_core.testing import fixture_path

DIM, FFN = 48, 32  # the tiny Wan t2v fixture's width and FFN width
RNG = np.random.default_rng(14)


@pytest.fixture(scope="module")
def model():
  return md_wan.load_transformer(fixture_path("wan_transformer") / "t2v")


def _comfy(path, modules, *, alpha=None, extra=None):
  """A ComfyUI / lightx2v Wan file: `{original module: (rank, out)}` with random factors."""
  tensors = {}
  for name, (r, out) in modules.items():
    k = f"diffusion_model.{name}"
    tensors[f"{k}.lora_down.weight"] = RNG.standard_normal((r, DIM)).astype(np.float32)
    tensors[f"{k}.lora_up.weight"] = RNG.standard_normal((out, r)).astype(np.float32)
    if alpha is not None:
      tensors[f"{k}.alpha"] = np.asarray(alpha, np.float32)
  tensors.update(extra or {})
  md_core.save_safetensors(path, tensors)
  return path


def _musubi(path, *, drop_alpha=(), alphas=True):
  tensors = {}
  for name in ("blocks_0_self_attn_q", "blocks_1_cross_attn_o"):
    tensors[f"lora_unet_{name}.lora_down.weight"] = np.ones((2, DIM), np.float32)
    tensors[f"lora_unet_{name}.lora_up.weight"] = np.ones((DIM, 2), np.float32)
    if alphas and name not in drop_alpha:
      tensors[f"lora_unet_{name}.alpha"] = np.asarray(1.0, np.float32)
  md_core.save_safetensors(path, tensors)
  return path


def test_full_deltas_land_where_they_say(tmp_path, model):
  norm3 = RNG.standard_normal(DIM).astype(np.float32)
  norm_q = RNG.standard_normal(DIM).astype(np.float32)
  bias = RNG.standard_normal(DIM).astype(np.float32)
  path = _comfy(
    tmp_path / "light.safetensors",
    {"blocks.1.self_attn.q": (2, DIM)},
    extra={
      "diffusion_model.blocks.0.norm3.diff": norm3,  # Wan's norm3 is diffusers' (and md's) norm2
      "diffusion_model.blocks.1.self_attn.norm_q.diff": norm_q,
      "diffusion_model.blocks.1.self_attn.q.diff_b": bias,
    },
  )
  adapter = md_lora.load_lora(path, md_wan.convert_key, model)
  deltas = {str(s): w.delta() for s, w in adapter.weights.items()}
  assert set(deltas) == {
    "blocks/norm2/scale[0]",
    "blocks/attn1/norm_q/scale[1]",
    "blocks/attn1/to_q/bias[1]",
    "blocks/attn1/to_q/kernel[1]",
  }
  np.testing.assert_array_equal(deltas["blocks/norm2/scale[0]"], norm3)  # not scaled
  np.testing.assert_array_equal(deltas["blocks/attn1/norm_q/scale[1]"], norm_q)
  np.testing.assert_array_equal(deltas["blocks/attn1/to_q/bias[1]"], bias)
  report = md_lora.lora_report(adapter)
  assert "blocks/norm2/scale[0]  <- blocks.0.norm2.weight  r=1 scale=1" in report
  assert "blocks/attn1/to_q/kernel[1]  <- blocks.1.attn1.to_q  r=2 scale=1" in report


def test_truncated_and_unknown_files(tmp_path, model):
  good = _comfy(tmp_path / "good.safetensors", {"blocks.0.self_attn.q": (2, DIM)})
  data = good.read_bytes()
  (tmp_path / "cut.safetensors").write_bytes(data[: len(data) - 100])
  with pytest.raises(md_core.SafetensorsError, match="cut.safetensors.*truncated"):
    md_lora.load_lora(tmp_path / "cut.safetensors", md_wan.convert_key, model)

  oft = {
    "lora_unet_blocks_0_self_attn_q.oft_blocks": np.ones((4, 4), np.float32)
  }  # LyCORIS OFT, 2-D
  md_core.save_safetensors(tmp_path / "oft.safetensors", oft)
  with pytest.raises(
    md_lora.LoRAFileError,
    match=r"oft.safetensors: OFT module .* has shape \(4, 4\); LyCORIS' oft_blocks are \[num, b, b\]",
  ):
    md_lora.load_lora(tmp_path / "oft.safetensors", md_wan.convert_key, model)

  unknown = {"lora_unet_blocks_0_self_attn_q.glora_w1a": np.ones((4, 4), np.float32)}
  md_core.save_safetensors(tmp_path / "unknown.safetensors", unknown)
  with pytest.raises(
    md_lora.LoRAFileError,
    match=r"unknown.safetensors: unknown LoRA format.*LyCORIS LoHa / LoKr",
  ):
    md_lora.load_lora(tmp_path / "unknown.safetensors", md_wan.convert_key, model)

  mixed = tmp_path / "mixed.safetensors"
  tensors = dict(md_core.SafetensorsFile(_musubi(tmp_path / "plain.safetensors")))
  md_core.save_safetensors(mixed, tensors | {"lora_unet_head_head.oft_diag": np.ones(2)})
  with pytest.raises(
    md_lora.LoRAFileError,
    match=r"mixed.safetensors: 'lora_unet_head_head.oft_diag' is a LyCORIS / DoRA / OFT tensor \(oft_diag\), which md does not read yet",
  ):
    md_lora.load_lora(mixed, md_wan.convert_key, model)
  adapter = md_lora.load_lora(mixed, md_wan.convert_key, model, allow_unmatched=[r".*\.oft_diag"])
  assert adapter.skipped == ("lora_unet_head_head.oft_diag",) and len(adapter.weights) == 2

  with pytest.raises(md_lora.LoRAFileError, match=r"good.safetensors: format='lycoris'; md reads"):
    md_lora.load_lora(good, md_wan.convert_key, model, format="lycoris")
  with pytest.raises(
    md_lora.LoRAFileError,
    match=r"'diffusion_model.blocks.0.self_attn.q.lora_down.weight' is no "
    "tensor of a xlabs LoRA",
  ):
    md_lora.load_lora(good, md_wan.convert_key, model, format="xlabs")


def test_rank_alpha_and_bias_errors(tmp_path, model):
  path = _comfy(tmp_path / "ok.safetensors", {"blocks.0.self_attn.q": (2, DIM)})
  tensors = dict(md_core.SafetensorsFile(path))
  tensors["diffusion_model.blocks.0.self_attn.q.lora_up.weight"] = np.ones((DIM, 3), np.float32)
  path = tmp_path / "r.safetensors"
  md_core.save_safetensors(path, tensors)
  with pytest.raises(
    md_lora.LoRAFileError,
    match=r"r.safetensors: rank mismatch for 'diffusion_model.blocks.0.self_attn.q'.*\(2, 48\).*"
    r"\(48, 3\)",
  ):
    md_lora.load_lora(path, md_wan.convert_key, model)

  path = _musubi(tmp_path / "m.safetensors", drop_alpha=("blocks_1_cross_attn_o",))
  with pytest.raises(
    md_lora.LoRAFileError,
    match=r"m.safetensors: module 'lora_unet_blocks_1_cross_attn_o' has no "
    r"'lora_unet_blocks_1_cross_attn_o.alpha' while the file's other modules have one",
  ):
    md_lora.load_lora(path, md_wan.convert_key, model)
  assert {w.scale for w in md_lora.load_lora(
    path, md_wan.convert_key, model, default_alpha=4.0
  ).weights.values()} == {0.5, 2.0}  # fmt: skip
  # No alpha anywhere: kohya's (sd-scripts') default, alpha = rank.
  none = md_lora.load_lora(
    _musubi(tmp_path / "n.safetensors", alphas=False), md_wan.convert_key, model
  )
  assert {w.scale for w in none.weights.values()} == {1.0}

  for bad, why in (
    (np.ones(2, np.float32), "an alpha is one number"),
    (np.float32("nan"), "finite"),
  ):
    path = _comfy(tmp_path / "a.safetensors", {"blocks.0.self_attn.q": (2, DIM)}, alpha=bad)
    with pytest.raises(
      md_lora.LoRAFileError,
      match=rf"a.safetensors: 'diffusion_model.blocks.0.self_attn.q.alpha'.*{why}",
    ):
      md_lora.load_lora(path, md_wan.convert_key, model)
  extra = {"diffusion_model.blocks.0.self_attn.q.alpha": np.asarray(True)}
  path = _comfy(tmp_path / "b.safetensors", {"blocks.0.self_attn.q": (2, DIM)}, extra=extra)
  with pytest.raises(md_lora.LoRAFileError, match=r"has dtype bool; an alpha is a number"):
    md_lora.load_lora(path, md_wan.convert_key, model)

  loha = {
    f"lora_unet_blocks_0_self_attn_q.hada_w{i}_a": np.ones((DIM, 2), np.float32) for i in (1, 2)
  }
  loha |= {"lora_unet_blocks_0_self_attn_q.hada_w1_b": np.ones((2, DIM), np.float32)}
  loha |= {"lora_unet_blocks_0_self_attn_q.hada_w2_b": np.ones((3, DIM), np.float32)}
  md_core.save_safetensors(tmp_path / "h.safetensors", loha)
  with pytest.raises(
    md_lora.LoRAFileError,
    match=r"h.safetensors: rank or shape mismatch for LoHa module 'lora_unet_blocks_0_self_attn_q'.*"
    r"hada_w2_b' \(3, 48\)",
  ):
    md_lora.load_lora(tmp_path / "h.safetensors", md_wan.convert_key, model)

  peft = {
    "transformer.blocks.0.attn1.to_q.lora_A.weight": np.ones((2, DIM), np.float32),
    "transformer.blocks.0.attn1.to_q.lora_B.weight": np.ones((DIM, 2), np.float32),
    "transformer.blocks.0.attn1.to_q.lora_B.bias": np.ones(DIM + 1, np.float32),
  }
  md_core.save_safetensors(tmp_path / "p.safetensors", peft)
  with pytest.raises(
    md_lora.LoRAFileError,
    match=r"p.safetensors: 'transformer.blocks.0.attn1.to_q.lora_B.bias' has shape \(49,\), expected "
    r"\(48,\)",
  ):
    md_lora.load_lora(tmp_path / "p.safetensors", md_wan.convert_key, model)


def test_scale_that_is_not_a_number(tmp_path, model):
  adapter = md_lora.load_lora(_musubi(tmp_path / "s.safetensors"), md_wan.convert_key, model)
  for scale in ("0.8", None, float("inf")):
    with pytest.raises(
      TypeError, match=rf"s.safetensors\): scale {scale!r} is not a finite number"
    ):
      md_lora.merge(model, [(adapter, scale)])


def test_another_size_and_another_family(tmp_path, model):
  wide = _comfy(
    tmp_path / "wide.safetensors", {f"blocks.{i}.self_attn.q": (2, 2 * DIM) for i in (0, 1)}
  )
  with pytest.raises(
    md_lora.LoRAFileError,
    match=r"wide.safetensors: this LoRA is for another model .*2 of its 2 modules do not fit the shapes "
    r"of WanTransformer",
  ) as e:
    md_lora.load_lora(wide, md_wan.convert_key, model)
  assert "'blocks/attn1/to_q/kernel[0]' is (48, 48)" in str(e.value)
  flux = {
    f"lora_unet_double_blocks_{i}_img_attn_qkv.lora_{d}.weight": np.ones((2, 2), np.float32)
    for i in range(3)
    for d in ("down", "up")
  }
  md_core.save_safetensors(tmp_path / "flux.safetensors", flux)
  with pytest.raises(
    md_lora.LoRAFileError,
    match=r"(?s)flux.safetensors: this LoRA is for another model \(its names are those of Flux.1 \(BFL "
    r"names\)\): 3 of its 3 modules match nothing in WanTransformer.*"
    r"has 2 output rows, which do not split into transformer_blocks.0.attn.to_q",
  ):
    md_lora.load_lora(tmp_path / "flux.safetensors", md_wan.convert_key, model, default_alpha=1.0)
