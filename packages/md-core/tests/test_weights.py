"""md-core weights: safetensors, checkpoint sources, key maps, loading, errors, Orbax reloads, coverage."""

import json
import shutil

import chex
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file as st_load_file
from safetensors.numpy import save_file as st_save_file

import md_core
import md_sharding as mds
from md_core import nn
from md_core.testing import fixture_path, load_arrays


class Stack(nnx.Module):
  """md's twin of tools/fixtures/core.py:Stack (channels-last)."""

  def __init__(self, rngs: nnx.Rngs):
    self.embed = nn.Embed(11, 8, rngs=rngs)
    self.proj = nn.Dense(8, 12, rngs=rngs)
    self.norm = nn.LayerNorm(12, eps=1e-6, rngs=rngs)
    self.conv1 = nn.Conv(12, 6, (3,), padding=1, rngs=rngs)
    self.conv2 = nn.Conv(3, 8, (3, 3), stride=2, padding=1, rngs=rngs)
    self.gn = nn.GroupNorm(4, 8, eps=1e-6, rngs=rngs)
    self.conv3 = nn.Conv(8, 4, (3, 3, 3), padding=1, rngs=rngs)
    self.grouped = nn.Conv(8, 8, (3, 3), padding=1, groups=2, use_bias=False, rngs=rngs)

  def __call__(self, ids, image):  # image [B, H, W, C]
    seq = self.conv1(self.norm(self.proj(self.embed(ids))))
    x = self.grouped(jax.nn.silu(self.gn(self.conv2(image))))
    return seq, self.conv3(jnp.stack([x, 0.5 * x], axis=1))  # [B, F, H, W, C]


STACK_MAP = md_core.torch_module_keymap(
  [
    ("embed", "embed", "embedding"),
    ("proj", "proj", "linear"),
    ("norm", "norm", "norm"),
    ("conv1", "conv1", "conv1d"),
    ("conv2", "conv2", "conv2d"),
    ("gn", "gn", "norm"),
    ("conv3", "conv3", "conv3d"),
    ("grouped", "grouped", "conv2d"),
  ]
)


def make_stack():
  return Stack(nnx.Rngs(0))


@pytest.fixture(scope="module")
def ref():
  return load_arrays(fixture_path("core") / "stack.npz")


def run_stack(model, ref):
  seq, vid = nnx.jit(lambda m, i, x: m(i, x))(
    model, jnp.asarray(ref["ids"]), jnp.asarray(ref["image"]).transpose(0, 2, 3, 1)
  )
  return seq, vid.transpose(0, 4, 1, 2, 3)  # → torch's [B, C, F, H, W]


@pytest.mark.parametrize(
  "source", ["stack.safetensors", "stack_sharded", "stack_sharded/model.safetensors.index.json"]
)
def test_stack_matches_torch(ref, source):
  ckpt = md_core.open_checkpoint(fixture_path("core") / source)
  model = md_core.load_weights(make_stack, ckpt, STACK_MAP, progress=False)
  seq, vid = run_stack(model, ref)
  chex.assert_trees_all_close(seq, ref["seq"], atol=1e-5, rtol=0)
  chex.assert_trees_all_close(vid, ref["vid"], atol=1e-5, rtol=0)


def test_sharded_index_spans_files():
  ckpt = md_core.open_checkpoint(fixture_path("core") / "stack_sharded")
  assert len(ckpt.files) == 4
  assert {ckpt.file_of(k).name for k in ckpt} == {f.path.name for f in ckpt.files}


def test_safetensors_roundtrip_all_dtypes(tmp_path):
  rng = np.random.default_rng(0)
  tensors = {
    "f32": rng.normal(size=(3, 4)).astype(np.float32),
    "bf16": rng.normal(size=(5,)).astype(ml_dtypes.bfloat16),
    "f16": rng.normal(size=(2, 2, 2)).astype(np.float16),
    "i64": np.arange(6, dtype=np.int64).reshape(2, 3),
    "u8": np.arange(4, dtype=np.uint8),
    "bool": np.array([True, False]),
    "scalar": np.array(3.5, np.float32),
    "empty": np.zeros((0, 3), np.float32),
  }
  md_core.save_safetensors(tmp_path / "a.safetensors", tensors, metadata={"format": "pt"})
  f = md_core.SafetensorsFile(tmp_path / "a.safetensors")
  assert set(f) == set(tensors) and f.metadata == {"format": "pt"}
  for k, v in tensors.items():
    assert f[k].dtype == v.dtype and f.shape(k) == v.shape
    np.testing.assert_array_equal(f[k], v)
  # The official library reads what md writes, and md reads what it writes.
  plain = {k: v for k, v in tensors.items() if k not in ("bf16", "empty")}
  for k, v in st_load_file(str(tmp_path / "a.safetensors")).items():
    if k in plain:
      np.testing.assert_array_equal(v, plain[k])
  st_save_file(plain, str(tmp_path / "b.safetensors"))
  g = md_core.SafetensorsFile(tmp_path / "b.safetensors")
  for k, v in plain.items():
    np.testing.assert_array_equal(g[k], v)


def test_truncated_file_is_a_clear_error(tmp_path):
  src = fixture_path("core") / "stack.safetensors"
  data = src.read_bytes()
  (tmp_path / "cut.safetensors").write_bytes(data[: len(data) - 100])
  with pytest.raises(
    md_core.SafetensorsError, match=r"cut.safetensors: tensor '.*' ends at byte \d+ .*truncated"
  ):
    md_core.SafetensorsFile(tmp_path / "cut.safetensors")
  (tmp_path / "head.safetensors").write_bytes(data[:50])
  with pytest.raises(
    md_core.SafetensorsError,
    match=r"head.safetensors: header claims \d+ bytes but the file holds 50",
  ):
    md_core.SafetensorsFile(tmp_path / "head.safetensors")
  (tmp_path / "tiny.safetensors").write_bytes(b"abc")
  with pytest.raises(md_core.SafetensorsError, match="too short"):
    md_core.SafetensorsFile(tmp_path / "tiny.safetensors")


def test_open_checkpoint_errors_and_variants(tmp_path):
  with pytest.raises(FileNotFoundError, match="no such file or folder"):
    md_core.open_checkpoint(tmp_path / "nope")
  (tmp_path / "config.json").write_text("{}")
  with pytest.raises(FileNotFoundError, match=r"no \*.safetensors weights here .*config.json"):
    md_core.open_checkpoint(tmp_path)
  md_core.save_safetensors(tmp_path / "m.safetensors", {"a": np.zeros(2, np.float32)})
  md_core.save_safetensors(tmp_path / "m.fp16.safetensors", {"a": np.zeros(2, np.float16)})
  assert md_core.open_checkpoint(tmp_path)["a"].dtype == np.float32
  assert md_core.open_checkpoint(tmp_path, variant="fp16")["a"].dtype == np.float16
  shard = tmp_path / "sharded"
  shutil.copytree(fixture_path("core") / "stack_sharded", shard)
  next(shard.glob("model-00002-*.safetensors")).unlink()
  with pytest.raises(
    md_core.SafetensorsError, match=r"shard files \['model-00002-of-00004.safetensors'\] .* missing"
  ):
    md_core.open_checkpoint(shard)


def _edited_checkpoint(tmp_path, edit):
  src = md_core.open_checkpoint(fixture_path("core") / "stack.safetensors")
  tensors = {k: np.array(src[k]) for k in src}
  edit(tensors)
  path = tmp_path / "edited.safetensors"
  md_core.save_safetensors(path, tensors)
  return md_core.open_checkpoint(path)


def test_all_problems_in_one_error(tmp_path):
  def edit(t):
    t["proj.weight"] = np.zeros((12, 9), np.float32)  # mis-shaped
    t["extra.weight"] = np.zeros(3, np.float32)  # unknown
    del t["gn.bias"]  # missing

  ckpt = _edited_checkpoint(tmp_path, edit)
  with pytest.raises(md_core.WeightLoadError) as info:
    md_core.load_weights(make_stack, ckpt, STACK_MAP, progress=False)
  msg = str(info.value)
  assert "3 problem(s)" in msg
  assert (
    "edited.safetensors: tensor 'proj.weight' has shape (12, 9) (→ (9, 12) as linear), expected (8, 12) for 'proj/kernel'"
    in msg
  )
  assert "edited.safetensors: tensor 'extra.weight' (3,) maps to no parameter of the model" in msg
  assert "parameter 'gn/bias' (8,) has no tensor in the checkpoint" in msg


def test_allow_lists(tmp_path):
  def edit(t):
    t["num_batches_tracked"] = np.zeros((), np.int64)
    del t["gn.bias"]

  ckpt = _edited_checkpoint(tmp_path, edit)
  model, report = md_core.load_weights(
    make_stack,
    ckpt,
    STACK_MAP,
    allow_unused=[r"num_batches_tracked"],
    allow_missing=[r"gn/bias"],
    progress=False,
    return_report=True,
  )
  assert report.unused == ("num_batches_tracked",) and report.missing == ("gn/bias",)
  np.testing.assert_array_equal(model.gn.bias[...], np.zeros(8))


def test_maps_to_absent_parameter(tmp_path):
  ckpt = md_core.open_checkpoint(fixture_path("core") / "stack.safetensors")
  bad = lambda k: (
    md_core.Target(("nope", "kernel"), "linear") if k == "proj.weight" else STACK_MAP(k)
  )  # noqa: E731
  with pytest.raises(
    md_core.WeightLoadError,
    match=r"'proj.weight' maps to 'nope/kernel', which the model does not have",
  ):
    md_core.load_weights(make_stack, ckpt, bad, progress=False)


def test_dtype_policy_keeps_f32_where_asked():
  ckpt = md_core.open_checkpoint(fixture_path("core") / "stack.safetensors")
  model = md_core.load_weights(
    make_stack, ckpt, STACK_MAP, dtype=jnp.bfloat16, keep_f32=[r"^(gn|norm)/"], progress=False
  )
  assert model.proj.kernel[...].dtype == jnp.bfloat16
  assert model.conv3.kernel[...].dtype == jnp.bfloat16
  assert model.gn.scale[...].dtype == jnp.float32 and model.norm.bias[...].dtype == jnp.float32
  np.testing.assert_array_equal(
    np.asarray(model.proj.kernel[...], np.float32),
    np.asarray(ckpt["proj.weight"].T.astype(ml_dtypes.bfloat16), np.float32),
  )


def test_dtype_none_and_stored(tmp_path):
  """A bfloat16 file with float32 norms (mixed, as the real LTX-2 transformer): dtype=None gives the model's
  own float32; dtype="stored" keeps each tensor's dtype and value; stacked layers take their common type."""
  src = md_core.open_checkpoint(fixture_path("core") / "stack.safetensors")
  half = {
    k: np.asarray(src[k]) if k.startswith(("norm.", "gn.")) else src[k].astype(ml_dtypes.bfloat16)
    for k in src.keys()
  }
  md_core.save_safetensors(tmp_path / "model.safetensors", half)
  ckpt = md_core.open_checkpoint(tmp_path)
  upcast = md_core.load_weights(make_stack, ckpt, STACK_MAP, progress=False)
  assert {v.dtype for v in jax.tree.leaves(nnx.state(upcast))} == {jnp.dtype(jnp.float32)}
  stored = md_core.load_weights(make_stack, ckpt, STACK_MAP, dtype="stored", progress=False)
  assert (
    stored.proj.kernel[...].dtype == jnp.bfloat16 and stored.conv3.bias[...].dtype == jnp.bfloat16
  )
  assert stored.embed.embedding[...].dtype == jnp.bfloat16
  assert stored.norm.scale[...].dtype == jnp.float32 and stored.gn.bias[...].dtype == jnp.float32
  np.testing.assert_array_equal(stored.proj.kernel[...], half["proj.weight"].T)
  chex.assert_trees_all_equal(
    jax.tree.map(lambda x: x.astype(jnp.float32), nnx.state(stored)), nnx.state(upcast)
  )
  # keep_f32 still wins.
  kept = md_core.load_weights(
    make_stack, ckpt, STACK_MAP, dtype="stored", keep_f32=[r"^proj/"], progress=False
  )
  assert kept.proj.kernel[...].dtype == jnp.float32 and kept.conv1.kernel[...].dtype == jnp.bfloat16

  class Scanned(nnx.Module):
    def __init__(self, rngs):
      self.layers = nnx.Param(jnp.zeros((2, 3)), logical_axes=("layers", None))
      self.steps = nnx.Param(jnp.zeros((2,), jnp.int32), logical_axes=(None,))

  layers = {
    "blocks.0.w": np.ones(3, ml_dtypes.bfloat16),
    "blocks.1.w": np.ones(3, np.float32),
    "steps": np.arange(2, dtype=np.int64),
  }

  def convert(name):
    if name == "steps":
      return md_core.Target(("steps",))
    return md_core.Target(("layers",), layer=int(name.split(".")[1]))

  model = md_core.load_weights(
    lambda: Scanned(nnx.Rngs(0)), layers, convert, dtype="stored", progress=False
  )
  assert model.layers[...].dtype == jnp.float32 and model.steps[...].dtype == jnp.int32
  only_half = {**layers, "blocks.1.w": layers["blocks.1.w"].astype(ml_dtypes.bfloat16)}
  model = md_core.load_weights(
    lambda: Scanned(nnx.Rngs(0)), only_half, convert, dtype="stored", progress=False
  )
  assert model.layers[...].dtype == jnp.bfloat16


def test_placement_follows_logical_axes():
  mesh = mds.make_mesh(
    mds.MeshConfig(ici_data_parallelism=2, ici_fsdp_parallelism=2, ici_tensor_parallelism=2)
  )
  ckpt = md_core.open_checkpoint(fixture_path("core") / "stack.safetensors")
  model = md_core.load_weights(make_stack, ckpt, STACK_MAP, mesh=mesh, progress=False)
  kernel = model.proj.kernel[...]  # logical (embed, mlp), shape (8, 12) → (fsdp, tensor)
  assert kernel.sharding.mesh.shape == mesh.shape
  assert kernel.sharding.spec == mds.logical_to_spec(("embed", "mlp"), mesh=mesh, shape=(8, 12))
  assert tuple(kernel.sharding.spec) == ("fsdp", "tensor")
  conv = model.conv2.kernel[...]  # (None, None, conv_in, conv_out), out 8 → tensor
  assert tuple(conv.sharding.spec)[-1] == "tensor"
  np.testing.assert_array_equal(np.asarray(kernel), ckpt["proj.weight"].T)


def test_stacked_layers_and_split():
  class Scanned(nnx.Module):
    def __init__(self, rngs):
      self.q = nn.Dense(4, 6, rngs=rngs)
      self.k = nn.Dense(4, 6, rngs=rngs)
      self.layers = nnx.Param(jnp.zeros((3, 5, 2)), logical_axes=("layers", None, None))

  rng = np.random.default_rng(0)
  qkv = rng.normal(size=(12, 4)).astype(np.float32)  # fused (out = q|k, in)
  layers = [rng.normal(size=(5, 2)).astype(np.float32) for _ in range(3)]
  ckpt = {"qk.weight": qkv, **{f"blocks.{i}.w": layers[i] for i in range(3)}}

  def convert_key(name):
    if name == "qk.weight":
      return [
        md_core.Target(("q", "kernel"), "linear", split=(0, 2, 0)),
        md_core.Target(("k", "kernel"), "linear", split=(1, 2, 0)),
      ]
    i = int(name.split(".")[1])
    return md_core.Target(("layers",), layer=i)

  model = md_core.load_weights(
    lambda: Scanned(nnx.Rngs(0)), ckpt, convert_key, allow_missing=[r"(q|k)/bias"], progress=False
  )
  np.testing.assert_array_equal(model.q.kernel[...], qkv[:6].T)
  np.testing.assert_array_equal(model.k.kernel[...], qkv[6:].T)
  np.testing.assert_array_equal(model.layers[...], np.stack(layers))
  del ckpt["blocks.1.w"]
  with pytest.raises(
    md_core.WeightLoadError,
    match=r"stacked over 3 layers; checkpoint gives layers \[0, 2\] .*missing layers \[1\]",
  ):
    md_core.load_weights(
      lambda: Scanned(nnx.Rngs(0)), ckpt, convert_key, allow_missing=[r"(q|k)/bias"], progress=False
    )


def test_key_map_rules():
  km = md_core.rule_keymap(
    [(r"blocks\.(\d+)\.attn\.to_(q|k|v)\.weight", "blocks/{1}/attn/{2}/kernel", "linear")]
  )
  assert km("blocks.12.attn.to_k.weight") == md_core.Target(
    ("blocks", 12, "attn", "k", "kernel"), "linear"
  )
  assert km("blocks.1.ff.weight") is None
  assert md_core.target_shape((8, 3, 2, 5, 7), md_core.Target(("w",), "conv3d")) == (2, 5, 7, 3, 8)
  with pytest.raises(ValueError, match="unknown layout 'conv4d'"):
    md_core.Target(("w",), "conv4d")
  with pytest.raises(ValueError, match=r"layout 'linear' takes a 2-d tensor, got shape \(3,\)"):
    md_core.target_shape((3,), md_core.Target(("w",), "linear"))


def test_coverage_against_manifest(tmp_path):
  manifest = json.loads((fixture_path("core") / "stack_manifest.json").read_text())
  shapes = {k: v["shape"] for k, v in manifest["tensors"].items()}
  assert md_core.coverage(shapes, make_stack, STACK_MAP) == []
  shapes["conv3.weight"] = [4, 8, 3, 3, 5]
  del shapes["embed.weight"]
  problems = md_core.coverage(shapes, make_stack, STACK_MAP)
  assert len(problems) == 2
  assert any(
    "'conv3.weight' has shape (4, 8, 3, 3, 5)" in p and "expected (3, 3, 3, 8, 4)" in p
    for p in problems
  )
  assert any("'embed/embedding' (11, 8) has no tensor" in p for p in problems)


def _hub_cache(root, repo_id, files):
  folder = root / f"models--{repo_id.replace('/', '--')}"
  commit = "0123456789abcdef0123456789abcdef01234567"
  (folder / "refs").mkdir(parents=True)
  (folder / "refs" / "main").write_text(commit)
  snap = folder / "snapshots" / commit
  for name, text in files.items():
    (snap / name).parent.mkdir(parents=True, exist_ok=True)
    (snap / name).write_text(text)
  return snap


def test_hub_id_resolves_offline_from_cache(tmp_path, monkeypatch):
  monkeypatch.setenv("HF_HUB_OFFLINE", "1")
  snap = _hub_cache(
    tmp_path, "org/tiny-model", {"model_index.json": "{}", "transformer/config.json": '{"a": 1}'}
  )
  got = md_core.resolve_source("org/tiny-model", subfolder="transformer", cache_dir=tmp_path)
  assert got == snap / "transformer"
  monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
  assert md_core.load_config("org/tiny-model", subfolder="transformer") == {"a": 1}
  with pytest.raises(
    FileNotFoundError,
    match=rf"hub id 'org/absent' is not available in the cache at {tmp_path}: HF_HUB_OFFLINE=1",
  ):
    md_core.resolve_source("org/absent", cache_dir=tmp_path)
  with pytest.raises(
    FileNotFoundError, match=r"has no component 'vae' \(components here: \['transformer'\]\)"
  ):
    md_core.resolve_source("org/tiny-model", subfolder="vae", cache_dir=tmp_path)


def test_local_sources(tmp_path):
  (tmp_path / "unet").mkdir()
  assert md_core.resolve_source(tmp_path, subfolder="unet") == tmp_path / "unet"
  with pytest.raises(FileNotFoundError, match="neither an existing folder nor a hub id"):
    md_core.resolve_source("./no/such/folder")
  (tmp_path / "unet" / "config.json").write_text("{not json")
  with pytest.raises(ValueError, match=r"unet/config.json: not valid JSON"):
    md_core.load_config(tmp_path, subfolder="unet")


def test_orbax_roundtrip_on_mesh(tmp_path):
  ckpt = md_core.open_checkpoint(fixture_path("core") / "stack.safetensors")
  model = md_core.load_weights(
    make_stack, ckpt, STACK_MAP, dtype=jnp.bfloat16, keep_f32=["norm"], progress=False
  )
  md_core.save_converted(model, tmp_path / "converted")
  with pytest.raises(FileExistsError, match="exists; pass force=True"):
    md_core.save_converted(model, tmp_path / "converted")
  mesh = mds.make_mesh(mds.MeshConfig(ici_fsdp_parallelism=2, ici_tensor_parallelism=4))
  back = md_core.restore_converted(make_stack, tmp_path / "converted", mesh=mesh)
  assert back.proj.kernel[...].dtype == jnp.bfloat16 and back.norm.scale[...].dtype == jnp.float32
  assert tuple(back.proj.kernel[...].sharding.spec) == ("fsdp", "tensor")
  chex.assert_trees_all_equal(nnx.state(back), nnx.state(model))

  class Other(nnx.Module):
    def __init__(self, rngs):
      self.proj = nn.Dense(8, 13, rngs=rngs)

  with pytest.raises(
    ValueError, match=r"'proj/kernel' has shape \(8, 12\), the model expects \(8, 13\)"
  ):
    md_core.restore_converted(lambda: Other(nnx.Rngs(0)), tmp_path / "converted")
