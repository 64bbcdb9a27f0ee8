"""DoRA on a tiny SD UNet's attention projections and resnet convs. peft's (tests/fixtures/lora_dora,
tools/fixtures/lora_dora.py: `use_dora=True`, saved by diffusers): merged by md at scales 1 and 0.5, the UNet's
output equals peft's DoRA model. LyCORIS' (tests/fixtures/lora_dora_lycoris, tools/fixtures/lora_dora_lycoris.py:
`weight_decompose=True` LoCon with norms per output and per input, LoHa): merged at multipliers 1 and 0.6, the
output equals LyCORIS' own `get_merged_weight`; in run-time slots with gain slots, all of them and a plain
LoRA in one compiled program. save_peft writes peft's DoRA file back (magnitudes `[out]` / `[1, out, 1, 1]`,
`use_dora` in the metadata). What DoRA cannot do (input-axis norms at run time, unmerge, saving LyCORIS'
norms as PEFT) says so, and a malformed magnitude is named."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import md_core
import md_lora
import md_sd
from md_core.testing import fixture_path, load_arrays

ATOL = 1e-5


@pytest.fixture(scope="module")
def setup(tiny_sd_unet, channels_last_outputs):
  unet, args = tiny_sd_unet
  root = fixture_path("lora_dora")
  adapter = md_lora.load_lora(root / "unet_dora.safetensors", md_sd.unet_key_map(unet.cfg), unet)
  return unet, args, adapter, channels_last_outputs(root)


def test_magnitudes_are_read_per_output(setup):
  unet, _, adapter, _ = setup
  assert adapter.format == "peft" and adapter.dora and "48 DoRA" in repr(adapter)
  assert len(adapter.weights) == 48  # 8 attentions x 4 projections + 8 resnets x 2 convs
  shapes = {tuple(p): v.shape for p, v in nnx.to_flat_state(nnx.state(unet))}
  for site, w in adapter.weights.items():
    kernel = shapes[site.path]
    assert w.scale == 2.0  # lora_alpha 4 / r 2, from the header's metadata
    assert np.shape(w.magnitude) == (1,) * (len(kernel) - 1) + (kernel[-1],), site


def test_merged_matches_peft(setup):
  unet, args, adapter, want = setup
  graphdef, state = nnx.split(unet)
  run = jax.jit(lambda state, args: nnx.merge(graphdef, state)(*args))
  chex.assert_trees_all_close(np.asarray(run(state, args)), want["base"], atol=ATOL, rtol=0)
  for case, scale in (("dora", 1.0), ("dora_half", 0.5)):
    got = np.asarray(run(md_lora.merge(state, [(adapter, scale)]), args))
    print(f"{case}: max abs {float(np.abs(got - want[case]).max()):.1e}")
    assert float(np.abs(want[case] - want["base"]).max()) > 0.5
    chex.assert_trees_all_close(got, want[case], atol=ATOL, rtol=0)


@pytest.mark.parametrize(
  "name, cases",
  [
    ("locon_out", (("locon_out", 1.0), ("locon_out_0.6", 0.6))),
    ("locon_in", (("locon_in", 1.0),)),
    ("loha_out", (("loha_out", 1.0),)),
  ],
)
def test_lycoris_dora_matches_lycoris(setup, channels_last_outputs, name, cases):
  unet, args, _, _ = setup
  root = fixture_path("lora_dora_lycoris")
  want = channels_last_outputs(root)
  adapter = md_lora.load_lora(root / f"{name}.safetensors", md_sd.unet_key_map(unet.cfg), unet)
  assert adapter.format == "kohya" and adapter.dora
  assert {w.dora_rule for w in adapter.weights.values()} == {"lycoris"}
  report = md_lora.lora_report(adapter).splitlines()
  assert f"{len(adapter.weights)} DoRA" in report[0] and all(
    " dora=lycoris" in line for line in report[1:]
  )
  # The norm axis: the output one (md's last), or the input one for `wd_on_out=False` files.
  axis = -2 if name == "locon_in" else -1
  assert all(np.shape(w.magnitude)[axis] > 1 for w in adapter.weights.values())
  graphdef, state = nnx.split(unet)
  run = jax.jit(lambda state, args: nnx.merge(graphdef, state)(*args))
  for case, multiplier in cases:
    got = np.asarray(run(md_lora.merge(state, [(adapter, multiplier)]), args))
    print(f"{case}: max abs {float(np.abs(got - want[case]).max()):.1e}")
    assert float(np.abs(want[case] - want["base"]).max()) > 0.5
    chex.assert_trees_all_close(got, want[case], atol=ATOL, rtol=0)


def test_runtime_slots_match_without_recompiling(setup, channels_last_outputs):
  """peft and LyCORIS DoRA adapters and a plain LoRA in the same gain-slotted program: each output equals
  its reference, and the program compiles once."""
  unet, args, peft_dora, want = setup
  want = want | channels_last_outputs(fixture_path("lora_dora_lycoris"))
  want_conv = channels_last_outputs(fixture_path("lora_lycoris_conv"))
  key_map = md_sd.unet_key_map(unet.cfg)
  lycoris = {
    n: md_lora.load_lora(fixture_path("lora_dora_lycoris") / f"{n}.safetensors", key_map, unet)
    for n in ("locon_out", "loha_out")
  }
  plain = md_lora.load_lora(fixture_path("lora_lycoris_conv") / "locon.safetensors", key_map, unet)
  slotted = nnx.clone(unet)
  md_core.add_lora_slots(slotted, 4, gain=True)
  assert md_core.lora_gains(slotted) and not md_core.lora_gains(unet)
  graphdef, state = nnx.split(slotted)
  traces = []

  @jax.jit
  def run(state, args):
    traces.append(1)
    return nnx.merge(graphdef, state)(*args)

  cases = [
    ("dora", peft_dora, 1.0, want),
    ("dora_half", peft_dora, 0.5, want),
    ("locon_out", lycoris["locon_out"], 1.0, want),
    ("locon_out_0.6", lycoris["locon_out"], 0.6, want),
    ("loha_out", lycoris["loha_out"], 1.0, want),
    ("locon", plain, 1.0, want_conv),
    ("base", None, 0.0, want),
  ]
  for case, adapter, scale, reference in cases:
    pairs = [] if adapter is None else [(adapter, scale)]
    got = np.asarray(run(md_lora.apply_runtime(state, pairs), args))
    print(f"{case} run time: max abs {float(np.abs(got - reference[case]).max()):.1e}")
    chex.assert_trees_all_close(got, reference[case], atol=ATOL, rtol=0)
  assert len(traces) == 1


def test_what_dora_cannot_do_is_named(setup, tmp_path):
  unet, _, adapter, _ = setup
  slotted = nnx.clone(unet)
  md_core.add_lora_slots(slotted, 2)  # no gain slots
  with pytest.raises(
    ValueError, match=r"has no gain slot for a DoRA adapter; add the slots with gain=True"
  ):
    md_lora.apply_runtime(nnx.state(slotted), [(adapter, 1.0)])
  with pytest.raises(ValueError, match=r"a DoRA adapter at run time needs the model's state"):
    md_lora.to_slots(adapter, 1.0)
  per_input = md_lora.load_lora(
    fixture_path("lora_dora_lycoris") / "locon_in.safetensors", md_sd.unet_key_map(unet.cfg), unet
  )
  with pytest.raises(
    ValueError, match=r"DoRA norms along the layer's input axis .* merge this adapter"
  ):
    md_lora.to_slots(per_input, 1.0, unet)
  with pytest.raises(ValueError, match=r"a DoRA adapter cannot be unmerged"):
    md_lora.unmerge(unet, [(adapter, 1.0)])
  with pytest.raises(ValueError, match=r"'lycoris' norms of shape .* peft's per-output magnitudes"):
    md_lora.save_peft(per_input, tmp_path / "x.safetensors", md_sd.unet_key_map(unet.cfg), [])


def test_save_peft_writes_the_dora_file_back(setup, tmp_path):
  """The peft DoRA file read and written again: the same tensors under the same names and shapes (the
  file's alpha / r = 2 folded into lora_B), `use_dora` in the header; read back, the same adapter."""
  unet, _, adapter, _ = setup
  keymap = md_sd.unet_key_map(unet.cfg)
  names = list(md_core.open_checkpoint(fixture_path("lora_extract") / "base"))
  path = tmp_path / "dora.safetensors"
  md_lora.save_peft(adapter, path, keymap, names, prefix="unet")
  got = md_core.SafetensorsFile(path)
  want = md_core.SafetensorsFile(fixture_path("lora_dora") / "unet_dora.safetensors")
  assert sorted(got) == sorted(want)
  for k in want:
    fold = 2.0 if k.endswith("lora_B.weight") else 1.0
    assert got[k].shape == want[k].shape, k
    np.testing.assert_allclose(got[k], np.asarray(want[k]) * fold, atol=1e-6, rtol=0, err_msg=k)
  assert '"unet.use_dora": true' in got.metadata["lora_adapter_metadata"]
  again = md_lora.load_lora(path, keymap, unet)
  assert sorted(map(str, again.weights)) == sorted(map(str, adapter.weights))
  for site, w in adapter.weights.items():
    np.testing.assert_allclose(again.weights[site].magnitude, w.magnitude, rtol=0, atol=0)


M = "unet.down_blocks.0.resnets.0.conv1"


@pytest.mark.parametrize(
  "slots, match",
  [
    (
      {"lora_A.weight": (2, 8, 3, 3), "lora_B.weight": (8, 2, 1, 1), "lora_magnitude_vector": (1, 6, 1, 1)},
      r"'unet.down_blocks.0.resnets.0.conv1.lora_magnitude_vector' has shape \(1, 6, 1, 1\); a DoRA "
      r"magnitude holds one norm per output \(8,",
    ),
    (
      {"lora_A.weight": (2, 8, 3, 3), "lora_B.weight": (8, 2, 1, 1), "lora_magnitude_vector": (2, 4)},
      r"lora_magnitude_vector' has shape \(2, 4\)",
    ),
    (
      {"lora_A.weight": (2, 8, 3, 3), "lora_magnitude_vector": (8,)},
      r"module 'unet.down_blocks.0.resnets.0.conv1' has no lora_B",
    ),
  ],
)  # fmt: skip
def test_malformed_magnitude_is_named(tmp_path, slots, match):
  tensors = {f"{M}.{s}": np.ones(shape, np.float32) for s, shape in slots.items()}
  _expect_error(tmp_path, tensors, match)


K = "lora_unet_down_blocks_0_resnets_0_conv1"


@pytest.mark.parametrize(
  "shape, match",
  [
    ((6, 1, 1, 1), r"'lora_unet_down_blocks_0_resnets_0_conv1.dora_scale' has shape \(6, 1, 1, 1\); LyCORIS' "
     r"dora_scale holds one norm per output \[8, 1, …\] or per input"),
    ((8, 8, 1, 1), r"dora_scale' has shape \(8, 8, 1, 1\)"),
    ((1, 1, 3, 1), r"dora_scale' has shape \(1, 1, 3, 1\)"),
    ((1, 6, 1, 1), r"the DoRA magnitude is \(1, 1, 6, 1\) in md's layout, the weight \(3, 3, 8, 8\)"),
  ],
)  # fmt: skip
def test_malformed_dora_scale_is_named(tmp_path, shape, match):
  tensors = {
    f"{K}.lora_down.weight": np.ones((2, 8, 3, 3), np.float32),
    f"{K}.lora_up.weight": np.ones((8, 2, 1, 1), np.float32),
    f"{K}.dora_scale": np.ones(shape, np.float32),
  }
  _expect_error(tmp_path, tensors, match)


def _expect_error(tmp_path, tensors, match):
  md_core.save_safetensors(tmp_path / "bad.safetensors", tensors)
  key_map = lambda name: (  # noqa: E731
    md_core.Target(("down_blocks", 0, "resnets", 0, "conv1", "kernel"), "conv2d")
    if name == "down_blocks.0.resnets.0.conv1.weight"
    else None
  )
  shapes = {("down_blocks", 0, "resnets", 0, "conv1", "kernel"): (3, 3, 8, 8)}
  with pytest.raises(md_lora.LoRAFileError, match="bad.safetensors: .*" + match):
    md_lora.load_lora(tmp_path / "bad.safetensors", key_map, shapes)


def _wan_dora(model):
  """peft-rule DoRA sites on every layer's `to_q` of the tiny Wan transformer's scanned stack."""
  kernels = {tuple(p): np.asarray(v.get_value()) for p, v in nnx.to_flat_state(nnx.state(model))}
  rng = np.random.default_rng(0)
  weights = {}
  for path in [p for p in kernels if p[-1] == "kernel" and "to_q" in p]:
    layers, n_in, n_out = kernels[path].shape
    for layer in range(layers):
      norms = np.linalg.norm(kernels[path][layer], axis=0) * rng.uniform(0.7, 1.3, n_out)
      down = 0.3 * rng.standard_normal((n_in, 2))
      up = 0.3 * rng.standard_normal((2, n_out))
      weights[md_lora.Site(path, layer)] = md_lora.LoRAWeight(
        down.astype(np.float32),
        up.astype(np.float32),
        0.5,
        norms.reshape(1, n_out).astype(np.float32),
      )
  assert len(weights) == 4  # to_q of attn1 and attn2, two layers each
  return md_lora.Adapter(weights, dict.fromkeys(weights, "made here"), "made here", "peft")


@pytest.fixture(scope="module")
def wan():
  import md_wan

  model = md_wan.load_transformer(fixture_path("wan_transformer") / "t2v")
  io = load_arrays(fixture_path("wan_transformer") / "t2v.npz")
  args = tuple(jnp.asarray(io[k]) for k in ("hidden_states", "timestep", "encoder_hidden_states"))
  return model, args, _wan_dora(model)


def test_runtime_dora_on_a_scanned_stack_equals_the_merge(wan):
  """DoRA sites on every layer of the tiny Wan transformer's scanned stack (peft's rule, scale 0.7): the
  gain-slotted run (per-layer gains) equals the merged model, whose rule test_merged_matches_peft checks."""
  model, args, adapter = wan

  def run(module, state):
    graphdef = nnx.graphdef(module)
    return np.asarray(jax.jit(lambda s, a: nnx.merge(graphdef, s)(*a, None))(state, args))

  want = run(model, md_lora.merge(nnx.state(model), [(adapter, 0.7)]))
  assert float(np.abs(want - run(model, nnx.state(model))).max()) > 0.03
  slotted = nnx.clone(model)
  md_core.add_lora_slots(slotted, 4, gain=True)
  got = run(slotted, md_lora.apply_runtime(nnx.state(slotted), [(adapter, 0.7)]))
  chex.assert_trees_all_close(got, want, atol=ATOL, rtol=0)


def test_runtime_gains_are_computed_where_the_kernels_are(wan):
  """The gains come from one jitted program on the kernels' devices: with the stacked kernels sharded
  over two devices along their output axis they equal the one-device gains and the NumPy rule
  `m / ||W + kΔ||`; another scale reuses the program."""
  model, _, adapter = wan
  state = nnx.state(model)
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("x",))
  split = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(None, None, "x"))
  paths = {site.path for site in adapter.weights}
  sharded = nnx.from_flat_state(
    [
      (p, v.replace(jax.device_put(v.get_value(), split)) if tuple(p) in paths else v)
      for p, v in nnx.to_flat_state(state)
    ]
  )
  assert all(
    len(v.get_value().sharding.device_set) == 2
    for p, v in nnx.to_flat_state(sharded)
    if tuple(p) in paths
  )
  for scale in (0.7, 0.3):
    one = md_lora.to_slots(adapter, scale, state)
    two = md_lora.to_slots(adapter, scale, sharded)
    kernels = {tuple(p): np.asarray(v.get_value()) for p, v in nnx.to_flat_state(state)}
    for site, w in adapter.weights.items():
      path = ".".join(str(p) for p in site.path[:-1])
      (a,) = [x for x in one[path] if x.layer == site.layer]
      (b,) = [x for x in two[path] if x.layer == site.layer]
      v = kernels[site.path][site.layer] + scale * w.scale * (w.down @ w.up)
      rule = w.magnitude.reshape(-1) / np.linalg.norm(v, axis=0)
      np.testing.assert_allclose(a.gain, rule, rtol=2e-6)
      np.testing.assert_allclose(b.gain, a.gain, rtol=2e-6)
      assert a.scale == b.scale == scale * w.scale
  sites = [(site, w) for site, w in adapter.weights.items()]
  order = tuple(dict.fromkeys(site.path for site, _ in sites))
  spec = tuple((order.index(site.path), site.layer, w.dora_rule) for site, w in sites)
  # Compiled once per placement of the kernels (one device, two), not per scale.
  assert md_lora._runtime._gain_program(spec)._cache_size() == 2
