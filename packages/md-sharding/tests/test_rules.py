"""Logical axis rules: specs, conflicts, divisibility fallback, errors, and specs after jit."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import md_sharding as mds


def _strip(spec: P) -> tuple:
  """A spec as a tuple without trailing Nones (jax drops them from the specs it reports)."""
  entries = list(spec)
  while entries and entries[-1] is None:
    entries.pop()
  return tuple(entries)


@pytest.mark.parametrize(
  "names, spec",
  [
    (("embed", "mlp"), P("fsdp", "tensor")),
    (("mlp", "embed"), P("tensor", "fsdp")),
    (("embed", "heads", "kv"), P("fsdp", "tensor", None)),
    (("heads", "kv", "embed"), P("tensor", None, "fsdp")),
    (("layers", "embed", "mlp"), P(None, "fsdp", "tensor")),
    (("vocab", "embed"), P("tensor", "fsdp")),
    ((None, None, "conv_in", "conv_out"), P(None, None, None, "tensor")),
    (("norm",), P(None)),
    (("conv_out",), P("tensor")),
    (
      ("batch", "activation_length", "activation_heads", "activation_kv"),
      P(("data", "fsdp"), "context", "tensor", None),
    ),
    (("activation_batch", "length", "activation_embed"), P(("data", "fsdp"), "context", None)),
    (
      ("activation_batch", "activation_length", "activation_mlp"),
      P(("data", "fsdp"), "context", "tensor"),
    ),
    ((), P()),
  ],
)
def test_default_rules_without_mesh(names, spec):
  assert mds.logical_to_spec(names) == spec


def test_default_rules_cover_the_documented_names():
  table = dict(mds.DEFAULT_RULES)
  expected = {
    "batch": ("data", "fsdp"),
    "activation_length": "context",
    "length": "context",
    "activation_heads": "tensor",
    "heads": "tensor",
    "kv": None,
    "embed": "fsdp",
    "mlp": "tensor",
    "vocab": "tensor",
    "layers": None,
    "conv_in": None,
    "conv_out": "tensor",
    "norm": None,
  }
  for name, axes in expected.items():
    assert name in table and table[name] == axes, name


def test_a_mesh_axis_is_used_once_per_spec():
  # embed twice: only the first dimension gets fsdp.
  assert mds.logical_to_spec(("embed", "embed")) == P("fsdp", None)
  # heads and mlp both want tensor.
  assert mds.logical_to_spec(("heads", "mlp")) == P("tensor", None)
  # batch takes (data, fsdp), so embed (fsdp) after it stays whole.
  assert mds.logical_to_spec(("batch", "embed")) == P(("data", "fsdp"), None)


def test_later_rules_are_fallbacks():
  rules = (
    ("a", "tensor"),
    ("b", "tensor"),
    ("b", "fsdp"),
    ("c", ("fsdp", "context")),
    ("c", "data"),
  )
  assert mds.logical_to_spec(("a", "b"), rules=rules) == P("tensor", "fsdp")
  assert mds.logical_to_spec(("b", "a"), rules=rules) == P("tensor", None)
  assert mds.logical_to_spec(("b", "c"), rules=rules) == P("tensor", ("fsdp", "context"))
  assert mds.logical_to_spec(("a", "b", "c"), rules=rules) == P("tensor", "fsdp", "data")
  # Lists are accepted for multi-axis rules (config files hold lists).
  assert mds.logical_to_spec(("c",), rules=(("c", ["data", "tensor"]),)) == P(("data", "tensor"))


def test_divisibility_fallback():
  mesh = mds.make_mesh(
    dict(ici_data_parallelism=2, ici_fsdp_parallelism=2, ici_tensor_parallelism=2)
  )
  spec = lambda names, shape: mds.logical_to_spec(names, mesh=mesh, shape=shape)
  assert spec(("embed", "mlp"), (16, 8)) == P("fsdp", "tensor")
  assert spec(("embed", "mlp"), (6, 5)) == P("fsdp", None)  # 5 is odd: mlp stays whole
  assert spec(("embed", "mlp"), (3, 4)) == P(None, "tensor")
  # batch wants data x fsdp = 4 ways; 2 rows fit data only, 1 row fits nothing.
  assert spec(("batch", None), (4, 3)) == P(("data", "fsdp"), None)
  assert spec(("batch", None), (2, 3)) == P("data", None)
  assert spec(("batch", None), (6, 3)) == P("data", None)
  assert spec(("batch", None), (1, 3)) == P(None, None)
  # Without a shape only size-1 axes are dropped (context has size 1 here).
  assert mds.logical_to_spec(("activation_length", "mlp"), mesh=mesh) == P(None, "tensor")


def test_size_one_axes_are_dropped():
  mesh = mds.make_mesh(dict(ici_fsdp_parallelism=8))
  assert mds.logical_to_spec(("batch", "activation_length", "heads"), mesh=mesh) == P(
    "fsdp", None, None
  )
  mesh = mds.make_mesh(dict(ici_fsdp_parallelism=1, ici_data_parallelism=8))
  assert mds.logical_to_spec(("batch", "embed"), mesh=mesh) == P("data", None)


def test_fallback_tries_the_next_rule_when_nothing_divides():
  mesh = mds.make_mesh(dict(ici_fsdp_parallelism=4, ici_tensor_parallelism=2))
  rules = (("x", "fsdp"), ("x", "tensor"))
  assert mds.logical_to_spec(("x",), rules=rules, mesh=mesh, shape=(8,)) == P("fsdp")
  assert mds.logical_to_spec(("x",), rules=rules, mesh=mesh, shape=(6,)) == P("tensor")
  assert mds.logical_to_spec(("x",), rules=rules, mesh=mesh, shape=(3,)) == P(None)


def test_replace_rules():
  rules = mds.replace_rules((("embed", None), ("frames", "context")))
  assert rules[:2] == (("embed", None), ("frames", "context"))
  assert ("embed", "fsdp") not in rules
  assert ("mlp", "tensor") in rules
  assert mds.logical_to_spec(("embed", "mlp", "frames"), rules=rules) == P(
    None, "tensor", "context"
  )


def test_errors():
  with pytest.raises(
    ValueError, match=r"unknown logical axis name 'embd'.*the rules know: .*embed"
  ):
    mds.logical_to_spec(("embd", "mlp"))
  with pytest.raises(TypeError, match=r"one per dimension, got the string 'embed'"):
    mds.logical_to_spec("embed")
  with pytest.raises(TypeError, match=r"strings or None, got 3"):
    mds.logical_to_spec(("embed", 3))
  mesh = mds.make_mesh()
  with pytest.raises(ValueError, match=r"got 2 logical names .* rank 3"):
    mds.logical_to_spec(("embed", "mlp"), mesh=mesh, shape=(2, 3, 4))
  with pytest.raises(ValueError, match=r"names mesh axes \['expert'\] that the mesh lacks"):
    mds.logical_to_spec(("moe",), rules=(("moe", "expert"),), mesh=mesh)
  with pytest.raises(TypeError, match=r"\(logical_name, mesh_axes\) pair"):
    mds.logical_to_spec(("embed",), rules=(("embed",),))
  with pytest.raises(TypeError, match=r"needs a jax.sharding.Mesh"):
    mds.logical_to_sharding(("embed",), None)


def test_logical_to_sharding():
  mesh = mds.make_mesh(dict(ici_fsdp_parallelism=4, ici_tensor_parallelism=2))
  sharding = mds.logical_to_sharding(("embed", "mlp"), mesh, shape=(8, 6))
  assert isinstance(sharding, NamedSharding)
  assert sharding.mesh is mesh
  assert sharding.spec == P("fsdp", "tensor")
  assert sharding.shard_shape((8, 6)) == (2, 3)


MESHES = {
  "2x2x2x1": dict(ici_data_parallelism=2, ici_fsdp_parallelism=2, ici_context_parallelism=2),
  "1x2x1x4": dict(ici_fsdp_parallelism=2, ici_tensor_parallelism=4),
  "1x1x8x1": dict(ici_fsdp_parallelism=1, ici_context_parallelism=8),
}
# Expected specs, written out by hand for an activation [B=8, S=16, H=4, D=6] and a weight
# [embed=8, mlp=12].
ACTIVATION = ("batch", "activation_length", "activation_heads", "activation_kv")
WEIGHT = ("embed", "mlp")
EXPECTED = {
  "2x2x2x1": ((("data", "fsdp"), "context"), ("fsdp",)),
  "1x2x1x4": (("fsdp", None, "tensor"), ("fsdp", "tensor")),
  "1x1x8x1": ((None, "context"), ()),
}


@pytest.mark.parametrize("mesh_name", sorted(MESHES))
def test_specs_after_jit(mesh_name):
  mesh = mds.make_mesh(MESHES[mesh_name])
  want_activation, want_weight = EXPECTED[mesh_name]
  x = jnp.arange(8 * 16 * 4 * 6, dtype=jnp.float32).reshape(8, 16, 4, 6)
  w = jnp.arange(8 * 12, dtype=jnp.float32).reshape(8, 12)

  @jax.jit
  def constrained(x, w):
    return (
      mds.with_logical_constraint(x * 2, ACTIVATION, mesh=mesh),
      mds.with_logical_constraint(w + 1, WEIGHT, mesh=mesh),
    )

  x_out, w_out = constrained(x, w)
  assert _strip(x_out.sharding.spec) == want_activation
  assert _strip(w_out.sharding.spec) == want_weight
  np.testing.assert_array_equal(np.asarray(x_out), np.asarray(x) * 2)
  np.testing.assert_array_equal(np.asarray(w_out), np.asarray(w) + 1)

  out_shardings = (
    mds.logical_to_sharding(ACTIVATION, mesh, shape=x.shape),
    mds.logical_to_sharding(WEIGHT, mesh, shape=w.shape),
  )
  x_out, w_out = jax.jit(lambda x, w: (x - 1, w * 3), out_shardings=out_shardings)(x, w)
  assert _strip(x_out.sharding.spec) == want_activation
  assert _strip(w_out.sharding.spec) == want_weight
  np.testing.assert_array_equal(np.asarray(w_out), np.asarray(w) * 3)
  # Each device holds the block the spec implies.
  sizes = dict(mesh.shape)
  for out, want in ((x_out, want_activation), (w_out, want_weight)):
    block = list(out.shape)
    for dim, axes in enumerate(want):
      for axis in (axes,) if isinstance(axes, str) else axes or ():
        block[dim] //= sizes[axis]
    assert all(s.data.shape == tuple(block) for s in out.addressable_shards)


def test_constraint_uses_the_context_mesh():
  mesh = mds.make_mesh(MESHES["1x2x1x4"])
  x = jnp.ones((8, 16, 4, 6))
  with jax.sharding.set_mesh(mesh):
    out = jax.jit(lambda x: mds.with_logical_constraint(x + 1, ACTIVATION))(x)
  assert _strip(out.sharding.spec) == EXPECTED["1x2x1x4"][0]
  np.testing.assert_array_equal(np.asarray(out), 2.0)


def test_constraint_without_mesh_is_a_no_op():
  x = jnp.ones((4, 6))
  assert mds.with_logical_constraint(x, ("embed", "mlp")) is x
  out = jax.jit(lambda x: mds.with_logical_constraint(x * 2, ("embed", "mlp")))(x)
  np.testing.assert_array_equal(np.asarray(out), 2.0)
  # Names are still checked, so typos fail on one device as well.
  with pytest.raises(ValueError, match=r"unknown logical axis name 'mpl'"):
    mds.with_logical_constraint(x, ("embed", "mpl"))


def test_logical_tree_to_sharding():
  mesh = mds.make_mesh(dict(ici_fsdp_parallelism=4, ici_tensor_parallelism=2))
  names = {
    "dense": {"kernel": ("embed", "mlp"), "bias": P("mlp")},
    "norm": None,
    "blocks": [P("layers", "embed", "heads", "kv")],
  }
  shapes = {
    "dense": {"kernel": jax.ShapeDtypeStruct((8, 6), jnp.float32), "bias": (6,)},
    "norm": np.zeros(8),
    "blocks": [(2, 16, 4, 3)],
  }
  shardings = mds.logical_tree_to_sharding(names, mesh, shapes=shapes)
  specs = jax.tree.map(lambda s: s.spec, shardings, is_leaf=lambda s: isinstance(s, NamedSharding))
  assert specs == {
    "dense": {"kernel": P("fsdp", "tensor"), "bias": P("tensor")},
    "norm": P(None),
    "blocks": [P(None, "fsdp", "tensor", None)],
  }
  assert all(s.mesh is mesh for s in jax.tree.leaves(shardings))
  # Without shapes: no divisibility check, and a short PartitionSpec stays short.
  shardings = mds.logical_tree_to_sharding({"w": ("mlp", "embed"), "b": P("mlp")}, mesh)
  assert shardings["w"].spec == P("tensor", "fsdp")
  assert shardings["b"].spec == P("tensor")
  # A PartitionSpec of logical names is padded to the rank; 3 rows do not split 4 ways.
  shardings = mds.logical_tree_to_sharding(P("embed"), mesh, shapes=(3, 4))
  assert shardings.spec == P(None, None)
  with pytest.raises(ValueError, match=r"got 1 logical names \('embed',\) for an array of rank 2"):
    mds.logical_tree_to_sharding({"w": ("embed",)}, mesh, shapes={"w": (8, 4)})
