"""LyCORIS OFT and BOFT (tests/fixtures/lora_oft, tools/fixtures/lora_oft.py): `DiagOFTModule` and
`ButterflyOFTModule` files, with and without constraint and rescale, on a tiny SD UNet's attention projections,
feed-forward inputs and resnet convs. md's merge gives the UNet LyCORIS' own `get_merged_weight` gives (at
multiplier 1 and 0.6); unmerge inverts the rotations; run-time slots refuse them by name; malformed
files are named."""

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
CASES = ("oft", "oft_rescaled", "boft", "boft_rescaled")
MULTIPLIERS = (1.0, 0.6)
K = "lora_unet_down_blocks_0_attentions_0_transformer_blocks_0_attn1_to_q"
UNET_FILE = "diffusion_pytorch_model.safetensors"
KERNEL = ("down_blocks", 0, "attentions", 0, "transformer_blocks", 0, "attn1", "to_q", "kernel")


@pytest.fixture(scope="module")
def setup(tiny_sd_unet, channels_last_outputs):
  unet, args = tiny_sd_unet
  root = fixture_path("lora_oft")
  key_map = md_sd.unet_key_map(unet.cfg)
  adapters = {c: md_lora.load_lora(root / f"{c}.safetensors", key_map, unet) for c in CASES}
  graphdef, state = nnx.split(unet)
  run = jax.jit(lambda state, args: nnx.merge(graphdef, state)(*args))
  return state, args, adapters, channels_last_outputs(root), run, key_map


def _flat(state) -> dict:
  return {tuple(p): np.asarray(v.get_value()) for p, v in nnx.to_flat_state(state)}


def test_adapters_cover_every_module(setup):
  _, _, adapters, _, _, _ = setup
  for case, adapter in adapters.items():
    assert adapter.format == "kohya" and not adapter.skipped, case
    assert adapter.oft and not adapter.dora, case
    # 4 transformer blocks x (2 attentions x 4 projections + ff.net.0.proj) + 8 resnets x 2 convs
    assert len(adapter.weights) == 52, case
    assert all(isinstance(w, md_lora.OFTWeight) for w in adapter.weights.values())
    assert {w.butterfly for w in adapter.weights.values()} == {case.startswith("boft")}
    assert {w.rescale is not None for w in adapter.weights.values()} == {"rescaled" in case}
  w = adapters["boft"].weights[md_lora.Site(KERNEL)]
  assert np.shape(w.blocks) == (2, 2, 4, 4) and w.size == 8 and w.constraint == 0
  w = adapters["oft_rescaled"].weights[md_lora.Site(KERNEL)]
  assert np.shape(w.blocks) == (1, 8, 1, 1) and w.constraint == pytest.approx(0.8)  # 0.1 · 8
  report = md_lora.lora_report(adapters["boft_rescaled"])
  assert "52 OFT" in report and "boft stages=3 blocks=4x2 constraint=0.8 rescale" in report


def test_merged_matches_lycoris(setup):
  state, args, adapters, want, run, _ = setup
  chex.assert_trees_all_close(np.asarray(run(state, args)), want["base"], atol=ATOL, rtol=0)
  for case in CASES:
    for multiplier in MULTIPLIERS:
      key = case if multiplier == 1.0 else f"{case}_{multiplier:g}"
      got = np.asarray(run(md_lora.merge(state, [(adapters[case], multiplier)]), args))
      err = float(np.abs(got - want[key]).max())
      moved = float(np.abs(want[key] - want["base"]).max())
      print(f"{key} merged: max abs {err:.1e} (the adapter moves the output by {moved:.2f})")
      chex.assert_trees_all_close(got, want[key], atol=ATOL, rtol=0)


def _subset(adapter, words=("to_q", "ff", "resnets/0/conv1", "resnets/0/conv2")):
  """The adapter on a few of its sites (an attention projection, the feed-forwards, two convs): the same
  math as on all 52 in a smaller program to compile."""
  keep = [site for site in adapter.weights if any(w in str(site) for w in words)]
  return adapter._replace(weights={s: adapter.weights[s] for s in keep})


def test_unmerge_inverts_the_rotations(setup):
  """merge → unmerge gives the weights back (also beside a LoRA on the same convs, and at 0.6, where the
  rotation is taken toward the identity and is no longer orthogonal); two rotations of one weight merged
  in one call cannot be taken back in one call, two calls can."""
  state, _, adapters, _, _, key_map = setup
  base = _flat(state)
  locon = md_lora.load_lora(fixture_path("lora_lycoris_conv") / "locon.safetensors", key_map, state)
  oft, boft = _subset(adapters["oft_rescaled"]), _subset(adapters["boft_rescaled"])
  for pairs in ([(boft, 0.6)], [(_subset(locon), 0.7), (oft, 1.3)]):
    merged = md_lora.merge(state, pairs)
    back = _flat(md_lora.unmerge(merged, pairs))
    err = max(float(np.abs(back[p] - base[p]).max()) for p in base)
    moved = max(float(np.abs(v - base[p]).max()) for p, v in _flat(merged).items())
    print(
      f"unmerge {[a.source.rsplit('/', 1)[-1] for a, _ in pairs]}: {err:.1e} (moved {moved:.2f})"
    )
    assert moved > 0.05 and err < ATOL
  both = [(oft, 1.0), (boft, 1.0)]
  with pytest.raises(ValueError, match="unmerge them one call per adapter, in the reverse order"):
    md_lora.unmerge(state, both)
  merged = md_lora.merge(md_lora.merge(state, both[:1]), both[1:])
  back = _flat(md_lora.unmerge(md_lora.unmerge(merged, both[1:]), both[:1]))
  assert max(float(np.abs(back[p] - base[p]).max()) for p in base) < ATOL


class _Stack(nnx.Module):
  def __init__(self, kernel):
    self.kernel = nnx.Param(jnp.asarray(kernel))


def test_scanned_stack_equals_each_layer(setup):
  """OFT / BOFT sites on layers 0 and 2 of a stacked kernel `[3, in, out]` merge as each layer alone does
  (which test_merged_matches_lycoris checks), and unmerge back."""
  state, _, adapters, _, _, _ = setup
  site = md_lora.Site(KERNEL)
  kernel = _flat(state)[KERNEL]  # [8, 8]
  rng = np.random.default_rng(0)
  stack = np.stack([kernel, rng.standard_normal(kernel.shape), kernel.T]).astype(np.float32)
  rotations = {0: adapters["boft_rescaled"].weights[site], 2: adapters["oft"].weights[site]}
  stacked = md_lora.Adapter(
    {md_lora.Site(("kernel",), layer): w for layer, w in rotations.items()},
    {md_lora.Site(("kernel",), layer): "to_q" for layer in rotations},
    "stacked",
    "kohya",
  )
  merged = md_lora.merge(_Stack(stack), [(stacked, 0.6)])
  for layer in range(3):
    want = stack[layer]
    if layer in rotations:
      one = md_lora.Adapter({md_lora.Site(("kernel",)): rotations[layer]}, {}, "one", "kohya")
      want = md_lora.merge(_Stack(stack[layer]), [(one, 0.6)]).kernel.get_value()
    chex.assert_trees_all_close(merged.kernel.get_value()[layer], want, atol=1e-6, rtol=0)
  back = md_lora.unmerge(merged, [(stacked, 0.6)]).kernel.get_value()
  chex.assert_trees_all_close(back, stack, atol=ATOL, rtol=0)


def test_runtime_slots_refuse_oft(setup):
  state, _, adapters, _, _, _ = setup
  way_out = r"merge it: pipe.load_lora\(..., fuse=True\) or md_lora.merge"
  with pytest.raises(ValueError, match=r"52 site\(s\) are OFT / BOFT rotations .*" + way_out):
    md_lora.to_slots(adapters["boft"], 1.0, state)
  with pytest.raises(ValueError, match=way_out):
    md_lora.apply_runtime(state, [(adapters["oft"], 0.5)])


def test_save_peft_refuses_oft(setup, tmp_path):
  _, _, adapters, _, _, key_map = setup
  names = list(md_core.SafetensorsFile(fixture_path("lora_extract") / "base" / UNET_FILE))
  with pytest.raises(
    ValueError, match=r"an OFT adapter .*save_peft writes plain LoRA factors only"
  ):
    md_lora.save_peft(adapters["oft"], tmp_path / "oft_as_peft.safetensors", key_map, names)
  assert not (tmp_path / "oft_as_peft.safetensors").exists()


def _oft_file(path, unet) -> None:
  """Random BOFT blocks (alpha 0, a rescale) for two modules of this UNet, as LyCORIS names them."""
  rng = np.random.default_rng(0)
  key_map, kernels = md_sd.unet_key_map(unet.cfg), _flat(nnx.state(unet))
  tensors = {}
  for module in ("down_blocks.0.resnets.0.conv1", "down_blocks.0.attentions.0.proj_in"):
    out = kernels[tuple(key_map(module + ".weight").path)].shape[-1]
    kohya = "lora_unet_" + module.replace(".", "_")
    blocks = (0.3 * rng.standard_normal((2, out // 2, 2, 2))).astype(np.float32)
    tensors[f"{kohya}.oft_blocks"] = blocks
    tensors[f"{kohya}.alpha"] = np.zeros((), np.float32)
    tensors[f"{kohya}.rescale"] = (1 + 0.2 * rng.standard_normal((out, 1))).astype(np.float32)
  md_core.save_safetensors(path, tensors)


def test_pipeline_fuses_and_unfuses_oft(tmp_path):
  """`pipe.load_lora(..., fuse=False)` refuses an OFT file by name; `fuse=True` merges it as md_lora.merge
  does, and `unload_lora` gives the weights back (the rotation inverted)."""
  pipe = md_sd.load_pipeline(fixture_path("sd_pipeline") / "sd")
  path = tmp_path / "boft.safetensors"
  _oft_file(path, pipe.unet)
  before = _flat(nnx.state(pipe.unet))
  with pytest.raises(ValueError, match=r"fuse=True\) or md_lora.merge"):
    pipe.load_lora(path, name="boft")
  assert pipe.loras == {}
  adapter = md_lora.load_lora(path, md_sd.unet_key_map(pipe.unet.cfg), pipe.unet)
  want = _flat(md_lora.merge(nnx.state(pipe.unet), [(adapter, 0.8)]))
  pipe.load_lora(path, name="boft", scale=0.8, fuse=True)
  fused = _flat(nnx.state(pipe.unet))
  assert max(float(np.abs(fused[p] - want[p]).max()) for p in want) < 1e-6
  assert max(float(np.abs(fused[p] - before[p]).max()) for p in want) > 0.01
  pipe.unload_lora("boft")
  after = _flat(nnx.state(pipe.unet))
  err = max(float(np.abs(after[p] - before[p]).max()) for p in before)
  print(f"pipeline fuse → unload: weights back within {err:.1e}")
  assert err < ATOL


def _expect_error(tmp_path, tensors, match, shapes=None):
  md_core.save_safetensors(tmp_path / "bad.safetensors", tensors)
  key_map = lambda name: (  # noqa: E731
    md_core.Target(KERNEL, "linear")
    if name == "down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_q.weight"
    else None
  )
  shapes = shapes or {KERNEL: (8, 8)}
  with pytest.raises(md_lora.LoRAFileError, match="bad.safetensors: .*" + match):
    md_lora.load_lora(tmp_path / "bad.safetensors", key_map, shapes)


@pytest.mark.parametrize(
  "tensors, match",
  [
    ({"oft_blocks": (4, 2, 3), "alpha": ()},
     rf"OFT module '{K}': '{K}.oft_blocks' has shape \(4, 2, 3\); LyCORIS' oft_blocks are \[num, b, b\]"),
    ({"oft_blocks": (8,), "alpha": ()}, r"oft_blocks' has shape \(8,\)"),
    ({"oft_blocks": (3, 2, 2), "alpha": ()},
     rf"'{K}.oft_blocks': OFT blocks \(3, 2, 2\) of '.*attn1.to_q' rotate 6 outputs, the model's "
     r"'down_blocks/0/.*/to_q/kernel' is \(8, 8\) \(8 outputs\)"),
    ({"oft_blocks": (4, 2, 2)}, rf"OFT module '{K}' has no '{K}.alpha'"),
    ({"oft_blocks": (4, 2, 2), "alpha": (2,)}, r"alpha' has shape \(2,\); an alpha is one number"),
    ({"oft_blocks": (2, 2, 3, 3), "alpha": ()}, r"BOFT blocks are \[stages, num, b, b\] with b even"),
    ({"oft_blocks": (3, 2, 4, 4), "alpha": ()}, r"num divisible by 2\^\(stages - 1\) = 4"),
    ({"oft_blocks": (4, 2, 2), "alpha": (), "rescale": (4, 1)},
     rf"'{K}.rescale' has shape \(4, 1\); a rescale holds one factor per output \[8, 1, ...\]"),
    ({"rescale": (8, 1), "alpha": ()}, rf"OFT module '{K}' has '{K}.rescale' but no oft_blocks"),
    ({"oft_blocks": (4, 2, 2), "alpha": (), "lora_down.weight": (2, 8)},
     rf"OFT module '{K}' also has '{K}.lora_down.weight'"),
  ],
)  # fmt: skip
def test_malformed_oft_is_named(tmp_path, tensors, match):
  arrays = {f"{K}.{k}": np.full(shape, 0.1, np.float32) for k, shape in tensors.items()}
  _expect_error(tmp_path, arrays, match)


def test_peft_boft_beside_lora_factors_is_named(tmp_path):
  """PEFT's BOFT tensors (read: test_peft_oft.py) in a module that also holds LoRA factors."""
  module = "unet.down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_q"
  tensors = {
    f"{module}.lora_A.weight": np.ones((2, 8), np.float32),
    f"{module}.lora_B.weight": np.ones((8, 2), np.float32),
    f"{module}.boft_R.default": np.ones((1, 4, 2, 2), np.float32),
  }
  match = r"PEFT BOFT module 'unet\..*to_q' has .*lora_A\.weight.*holds boft_R and boft_s"
  _expect_error(tmp_path, tensors, match)


def test_pre_0_14_peft_oft_tensors_are_named(tmp_path):
  module = "unet.down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_q"
  tensors = {
    f"{module}.lora_A.weight": np.ones((2, 8), np.float32),
    f"{module}.lora_B.weight": np.ones((8, 2), np.float32),
    f"{module}.oft_r": np.ones((2, 4, 4), np.float32),
  }
  match = (
    r"'unet\..*\.oft_r' is a LyCORIS / DoRA / OFT tensor \(oft_r\), which md does not read yet in a "
    r"peft file .*PEFT < 0\.14's OFT, which PEFT itself no longer loads"
  )
  _expect_error(tmp_path, tensors, match)
