"""PEFT's own OFT and BOFT adapters (tests/fixtures/lora_peft_oft, tools/fixtures/lora_peft_oft.py): `oft_R`
vectors, `boft_R` / `boft_s` with the adapter_config.json PEFT saved, on the tiny SD UNet's attention
projections, feed-forwards and 3x3 resnet convs. Merged by md, the UNet gives the output of PEFT's own
`merge_and_unload()`: OFT's Cayley-Neumann series (5 and 3 terms), shared blocks, COFT's norm bound with the
exact Cayley transform; BOFT with three butterfly stages and with one."""

import json
import shutil

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import md_core
import md_lora
import md_sd
from md_core.testing import fixture_path

ATOL = 1e-5
CASES = {"neumann": 56, "shared": 40, "coft_exact": 56, "boft": 56, "boft_plain": 40}  # modules


@pytest.fixture(scope="module")
def setup(tiny_sd_unet, channels_last_outputs):
  unet, args = tiny_sd_unet
  root = fixture_path("lora_peft_oft")
  key_map = md_sd.unet_key_map(unet.cfg)
  adapters = {
    c: md_lora.load_lora(root / c / "adapter_model.safetensors", key_map, unet) for c in CASES
  }
  graphdef, state = nnx.split(unet)
  run = jax.jit(lambda state, args: nnx.merge(graphdef, state)(*args))
  return state, args, adapters, channels_last_outputs(root), run, key_map


def _flat(state) -> dict:
  return {tuple(p): np.asarray(v.get_value()) for p, v in nnx.to_flat_state(state)}


def test_every_module_is_read_as_an_input_rotation(setup):
  state, _, adapters, _, _, _ = setup
  shapes = {p: v.shape for p, v in _flat(state).items()}
  for case, count in CASES.items():
    adapter = adapters[case]
    assert adapter.format == "peft" and not adapter.skipped, case
    assert len(adapter.weights) == count and adapter.oft, case
    for site, w in adapter.weights.items():
      assert isinstance(w, md_lora.OFTWeight) and w.rule == "peft", site
      kernel = shapes[site.path]
      assert w.size == int(np.prod(kernel[:-1])), (site, w.size, kernel)  # 3x3 convs: 9 · in
  report = md_lora.lora_report(adapters["neumann"])
  assert "peft-oft (inputs) blocks=18x4" in report  # a resnet conv: 8 channels x 9 taps
  report = md_lora.lora_report(adapters["boft"])
  assert "peft-boft stages=3 (inputs) blocks=36x2" in report
  shared = {np.shape(w.blocks)[1:] for w in adapters["shared"].weights.values()}
  assert (2, 4, 4) in shared  # one stored block tiled over an 8-wide input


@pytest.mark.parametrize("case", CASES)
def test_merged_matches_peft_merge_and_unload(setup, case):
  state, args, adapters, want, run, _ = setup
  chex.assert_trees_all_close(np.asarray(run(state, args)), want["base"], atol=ATOL, rtol=0)
  got = np.asarray(run(md_lora.merge(state, [(adapters[case], 1.0)]), args))
  err = float(np.abs(got - want[case]).max())
  moved = float(np.abs(want[case] - want["base"]).max())
  print(f"{case} merged: max abs {err:.1e} (PEFT's merge moves the output by {moved:.2f})")
  chex.assert_trees_all_close(got, want[case], atol=ATOL, rtol=0)


@pytest.mark.parametrize("case", ["coft_exact", "boft"])
def test_unmerge_gives_the_base_weights_back(setup, case):
  """Unmerge inverts the rotation (BOFT: its stages in reverse order, after dividing by boft_s)."""
  state, _, adapters, _, _, _ = setup
  adapter = adapters[case]
  base = _flat(state)
  merged = md_lora.merge(state, [(adapter, 1.0)])
  moved = _flat(merged)
  assert min(float(np.abs(moved[s.path] - base[s.path]).max()) for s in adapter.weights) > 1e-3
  back = _flat(md_lora.unmerge(merged, [(adapter, 1.0)]))
  assert max(float(np.abs(back[p] - base[p]).max()) for p in base) < 1e-5


def test_scale_and_run_time(setup):
  """A scale k rotates by `k·R + (1 - k)·I`, so each merged OFT kernel is `k·W' + (1 - k)·W`; run-time
  slots refuse the rotation by name."""
  state, _, adapters, _, _, _ = setup
  adapter = adapters["neumann"]
  base = _flat(state)
  full = _flat(md_lora.merge(state, [(adapter, 1.0)]))
  part = _flat(md_lora.merge(state, [(adapter, 0.6)]))
  touched = {site.path for site in adapter.weights}
  assert len(touched) == CASES["neumann"]
  for p in touched:
    assert float(np.abs(full[p] - base[p]).max()) > 1e-2, p
    np.testing.assert_allclose(part[p], 0.6 * full[p] + 0.4 * base[p], atol=1e-6, rtol=0)
  with pytest.raises(ValueError, match="OFT"):
    md_lora.apply_runtime(state, [(adapter, 1.0)])


def _copy(case: str, tmp_path, config=None, tensors=None):
  """The case's file in tmp_path, with its config (edited, or none: config=False) and tensors edited."""
  src = fixture_path("lora_peft_oft") / case
  tmp_path.mkdir(parents=True, exist_ok=True)
  path = tmp_path / "adapter_model.safetensors"
  if tensors is None:
    shutil.copy(src / "adapter_model.safetensors", path)
  else:
    md_core.save_safetensors(path, tensors)
  if config is not False:
    saved = json.loads((src / "adapter_config.json").read_text())
    (tmp_path / "adapter_config.json").write_text(json.dumps(config or saved))
  return path


def _tensors(case: str) -> dict:
  path = fixture_path("lora_peft_oft") / case / "adapter_model.safetensors"
  return {k: np.asarray(v) for k, v in md_core.SafetensorsFile(path).items()}


def test_config_comes_from_the_argument(setup, tmp_path):
  """Without adapter_config.json beside the file: a clear error, or `config=` (the same fields) reads it as
  the fixture's folder does."""
  state, _, adapters, _, _, key_map = setup
  path = _copy("coft_exact", tmp_path, config=False)
  with pytest.raises(md_lora.LoRAFileError, match=r"PEFT OFT module.*adapter_config\.json"):
    md_lora.load_lora(path, key_map, state)
  config = fixture_path("lora_peft_oft") / "coft_exact" / "adapter_config.json"
  adapter = md_lora.load_lora(path, key_map, state, config=config)
  for site, w in adapters["coft_exact"].weights.items():
    np.testing.assert_array_equal(np.asarray(adapter.weights[site].blocks), np.asarray(w.blocks))


def test_bad_files_are_named(setup, tmp_path):
  state, _, _, _, _, key_map = setup
  tensors = _tensors("neumann")
  key = next(k for k in tensors if "to_q" in k)
  saved = json.loads(
    (fixture_path("lora_peft_oft") / "neumann" / "adapter_config.json").read_text()
  )

  old = {k: v for k, v in saved.items() if k != "oft_block_size"}
  with pytest.raises(md_lora.LoRAFileError, match=r"no oft_block_size.*PEFT < 0\.14"):
    md_lora.load_lora(_copy("neumann", tmp_path / "a", config=old), key_map, state)

  bad = dict(tensors, **{key: np.zeros((2, 5), np.float32)})  # 5 is no b(b-1)/2
  with pytest.raises(md_lora.LoRAFileError, match=r"to_q\.oft_R\.weight.*\(2, 5\).*b\(b-1\)/2"):
    md_lora.load_lora(_copy("neumann", tmp_path / "b", tensors=bad), key_map, state)

  wrong = dict(tensors, **{key: np.zeros((3, 6), np.float32)})  # 3 blocks of 4 for 8 inputs
  with pytest.raises(md_lora.LoRAFileError, match=r"to_q.*rotate 12 inputs.*\(8 inputs\)"):
    md_lora.load_lora(_copy("neumann", tmp_path / "c", tensors=wrong), key_map, state)

  shared = dict(saved, block_share=True)
  with pytest.raises(md_lora.LoRAFileError, match=r"block_share stores one shared block"):
    md_lora.load_lora(_copy("neumann", tmp_path / "d", config=shared), key_map, state)

  boft = dict(saved, peft_type="BOFT")
  with pytest.raises(md_lora.LoRAFileError, match=r"peft_type 'BOFT'.*OFT tensor"):
    md_lora.load_lora(_copy("neumann", tmp_path / "e", config=boft), key_map, state)

  module = key[: -len(".oft_R.weight")]
  legacy = {f"{module}.oft_r": np.zeros((2, 4, 4), np.float32)}
  legacy[f"{module}.oft_s"] = np.ones((8, 1), np.float32)
  legacy[key] = tensors[key]
  with pytest.raises(md_lora.LoRAFileError, match=r"oft_r.*PEFT < 0\.14's OFT"):
    md_lora.load_lora(_copy("neumann", tmp_path / "f", tensors=legacy), key_map, state)

  both = {f"{module}.boft_R": np.zeros((2, 2, 4, 4), np.float32), key: tensors[key]}
  with pytest.raises(md_lora.LoRAFileError, match=r"to_q.oft_R.weight.*also has.*to_q\.boft_R"):
    md_lora.load_lora(_copy("neumann", tmp_path / "g", tensors=both), key_map, state)


def test_bad_boft_files_are_named(setup, tmp_path):
  state, _, _, _, _, key_map = setup
  tensors = _tensors("boft")
  module = next(k for k in tensors if "attn1.to_q" in k).rsplit(".", 1)[0]
  r_key, s_key = f"{module}.boft_R", f"{module}.boft_s"
  assert tensors[r_key].shape == (3, 4, 2, 2) and tensors[s_key].shape == (8, 1)

  lone = {k: v for k, v in tensors.items() if k != s_key}
  with pytest.raises(
    md_lora.LoRAFileError, match=r"PEFT BOFT module.*to_q.*holds boft_R and boft_s"
  ):
    md_lora.load_lora(_copy("boft", tmp_path / "a", tensors=lone), key_map, state)

  odd = dict(tensors, **{r_key: np.zeros((3, 2, 4, 4), np.float32)})  # 2 blocks, 3 stages
  with pytest.raises(md_lora.LoRAFileError, match=r"to_q\.boft_R.*\(3, 2, 4, 4\).*divisible by"):
    md_lora.load_lora(_copy("boft", tmp_path / "b", tensors=odd), key_map, state)

  scales = dict(tensors, **{s_key: np.ones((6, 1), np.float32)})
  with pytest.raises(
    md_lora.LoRAFileError, match=r"to_q.*scales 6 outputs \(boft_s\).*\(8 outputs\)"
  ):
    md_lora.load_lora(_copy("boft", tmp_path / "c", tensors=scales), key_map, state)

  wide = dict(tensors, **{r_key: np.zeros((3, 8, 2, 2), np.float32)})
  with pytest.raises(md_lora.LoRAFileError, match=r"to_q.*rotate 16 inputs.*\(8 inputs\)"):
    md_lora.load_lora(_copy("boft", tmp_path / "d", tensors=wide), key_map, state)

  lora = json.loads((fixture_path("lora_peft_oft") / "boft" / "adapter_config.json").read_text())
  lora["peft_type"] = "LORA"
  with pytest.raises(md_lora.LoRAFileError, match=r"peft_type 'LORA'.*PEFT BOFT tensor"):
    md_lora.load_lora(_copy("boft", tmp_path / "e", config=lora), key_map, state)


def test_pipeline_fuses_a_peft_oft_file(tmp_path):
  """`pipe.load_lora(..., fuse=True)` takes a PEFT OFT file (an attention projection and a resnet conv of
  the SD pipeline's UNet) and its config: the UNet's kernels are `md_lora.merge`'s; unloading gives the
  base weights back."""
  pipe = md_sd.load_pipeline(fixture_path("sd_pipeline") / "sd")
  key_map = md_sd.unet_key_map(pipe.unet.cfg)
  base = _flat(nnx.state(pipe.unet))
  rng = np.random.default_rng(0)
  tensors = {}
  for module in (
    "down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_q",
    "down_blocks.0.resnets.0.conv1",
  ):
    kernel = base[tuple(key_map(module + ".weight").path)]
    inputs = int(np.prod(kernel.shape[:-1]))
    rows = (inputs // 4, 6)  # blocks of 4: 6 numbers above each diagonal
    tensors[f"base_model.model.{module}.oft_R.weight"] = (0.2 * rng.standard_normal(rows)).astype(
      np.float32
    )
  saved = json.loads(
    (fixture_path("lora_peft_oft") / "neumann" / "adapter_config.json").read_text()
  )
  path = _copy("neumann", tmp_path, config=saved, tensors=tensors)
  adapter = md_lora.load_lora(path, key_map, pipe.unet)
  want = _flat(md_lora.merge(nnx.state(pipe.unet), [(adapter, 0.8)]))
  pipe.load_lora(path, name="oft", scale=0.8, fuse=True)
  got = _flat(nnx.state(pipe.unet))
  assert max(float(np.abs(got[p] - want[p]).max()) for p in want) < 1e-6
  assert max(float(np.abs(got[p] - base[p]).max()) for p in base) > 0.01
  pipe.unload_lora("oft")
  back = _flat(nnx.state(pipe.unet))
  assert max(float(np.abs(back[p] - base[p]).max()) for p in base) < 1e-5


class _Stack(nnx.Module):
  def __init__(self, kernel):
    self.kernel = nnx.Param(jnp.asarray(kernel))


def test_scanned_stack_equals_each_layer(setup):
  """PEFT OFT / BOFT sites on layers 0 and 2 of a stacked kernel `[3, in, out]` (as md's scanned
  transformers hold them) merge as each layer alone does (which the UNet tests check against PEFT), and
  unmerge back."""
  state, _, adapters, _, _, _ = setup
  site = next(s for s in adapters["boft"].weights if str(s).endswith("attn1/to_q/kernel"))
  kernel = _flat(state)[site.path]  # [8, 8]
  rng = np.random.default_rng(0)
  stack = np.stack([kernel, rng.standard_normal(kernel.shape), kernel.T]).astype(np.float32)
  rotations = {0: adapters["boft"].weights[site], 2: adapters["neumann"].weights[site]}
  stacked = md_lora.Adapter(
    {md_lora.Site(("kernel",), layer): w for layer, w in rotations.items()},
    {md_lora.Site(("kernel",), layer): "to_q" for layer in rotations},
    "stacked",
    "peft",
  )
  merged = md_lora.merge(_Stack(stack), [(stacked, 0.6)])
  for layer in range(3):
    want = stack[layer]
    if layer in rotations:
      one = md_lora.Adapter({md_lora.Site(("kernel",)): rotations[layer]}, {}, "one", "peft")
      want = md_lora.merge(_Stack(stack[layer]), [(one, 0.6)]).kernel.get_value()
      assert float(np.abs(want - stack[layer]).max()) > 1e-2
    chex.assert_trees_all_close(merged.kernel.get_value()[layer], want, atol=1e-6, rtol=0)
  back = md_lora.unmerge(merged, [(stacked, 0.6)]).kernel.get_value()
  chex.assert_trees_all_close(back, stack, atol=1e-5, rtol=0)
