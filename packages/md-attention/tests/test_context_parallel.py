"""ring, ulysses (plain and chunked) and ulysses_ring on 8 virtual CPU devices, against dot_product.

The default grid runs every variant on every required mesh, (1,1,8,1), (2,1,4,1) and (1,2,4,1), plus
the Ulysses x ring splits 2x4 and 4x2, forward and gradients, with masks, causal masking, odd lengths
(77, 257, 1000), cross-attention and batch/heads sharded over data/fsdp/tensor. `-m slow` runs the full
cross product of variants, meshes, lengths and masks.
"""

import itertools

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import md_attention as mda
import md_attention.testing as mdat

TOL = 2e-5
MESHES = [(1, 1, 8, 1), (2, 1, 4, 1), (1, 2, 4, 1)]

# implementation, mesh, config overrides, (S_q, S_kv), heads, head_dim, mask, causal
CASES = [
  ("ring", (1, 1, 8, 1), {}, (77, 77), 8, 16, True, True),
  ("ring", (2, 1, 4, 1), {}, (64, 64), 4, 16, True, False),
  ("ring", (1, 2, 4, 1), {}, (257, 257), 2, 64, False, True),
  ("ulysses", (1, 1, 8, 1), {}, (77, 77), 8, 16, True, True),
  ("ulysses", (2, 1, 4, 1), {"ulysses_chunks": 2}, (64, 64), 8, 16, True, False),
  ("ulysses", (1, 2, 4, 1), {"local_implementation": "blockwise"}, (257, 257), 4, 64, True, True),
  ("ulysses_ring", (1, 1, 8, 1), {"ulysses_degree": 2}, (77, 77), 4, 16, True, True),
  ("ulysses_ring", (1, 1, 8, 1), {"ulysses_degree": 4}, (100, 100), 4, 16, True, False),
  ("ulysses_ring", (2, 1, 4, 1), {"ulysses_degree": 2}, (64, 64), 2, 16, False, True),
  (
    "ulysses_ring",
    (1, 2, 4, 1),
    {"ulysses_degree": 2, "ulysses_chunks": 2},
    (1000, 1000),
    4,
    16,
    True,
    False,
  ),  # fmt: skip
  # Cross-attention: queries sharded, keys and values replicated over the context axis.
  ("ring", (1, 1, 8, 1), {}, (77, 20), 2, 16, True, False),
  ("ulysses", (2, 1, 4, 1), {}, (64, 77), 4, 16, True, True),
  (
    "ulysses_ring",
    (1, 2, 4, 1),
    {"local_implementation": "blockwise"},
    (257, 33),
    4,
    16,
    False,
    False,
  ),  # fmt: skip
  # Batch over fsdp/data and heads over tensor besides the context axis.
  ("ring", (1, 2, 2, 2), {}, (64, 64), 4, 16, True, True),
  ("ulysses", (2, 1, 2, 2), {"ulysses_chunks": 2}, (64, 64), 8, 16, True, False),
]


def _config(overrides):
  return mda.AttentionConfig(block_q=32, block_kv=16, **overrides)


def _check(implementation, mesh_shape, overrides, lengths, heads, head_dim, mask, causal):
  mesh = mdat.make_mesh(mesh_shape)
  q, k, v, keep, d_out = mdat.random_inputs(2, *lengths, heads, head_dim, mask=mask)
  errors = mdat.max_errors(
    q, k, v, d_out, mask=keep, causal=causal, implementation=implementation, mesh=mesh,
    config=_config(overrides),
  )  # fmt: skip
  for name in ("out", "dq", "dk", "dv"):
    assert errors[name] < TOL, (name, errors[name])
  return errors["result"], mesh


@pytest.mark.parametrize(
  "implementation, mesh_shape, overrides, lengths, heads, head_dim, mask, causal", CASES
)
def test_context_parallel_matches_dot_product(
  implementation, mesh_shape, overrides, lengths, heads, head_dim, mask, causal
):
  out, mesh = _check(implementation, mesh_shape, overrides, lengths, heads, head_dim, mask, causal)
  if lengths[0] % mesh.shape["context"] == 0:
    batch = tuple(a for a in ("data", "fsdp") if mesh.shape[a] > 1) or None
    batch = batch[0] if batch and len(batch) == 1 else batch
    heads_axis = "tensor" if mesh.shape["tensor"] > 1 else None
    want = NamedSharding(mesh, P(batch, "context", heads_axis, None))
    assert out.sharding.is_equivalent_to(want, 4), (out.sharding, want)


@pytest.mark.parametrize("implementation", ["ring", "ulysses", "ulysses_ring"])
def test_sharded_inputs_keep_their_sharding(implementation):
  mesh = mdat.make_mesh((1, 2, 2, 2))
  q, k, v, keep, _ = mdat.random_inputs(2, 64, 64, 4, 16, mask=True)
  spec = NamedSharding(mesh, P("fsdp", "context", "tensor", None))
  q, k, v = (jax.device_put(x, spec) for x in (q, k, v))
  keep = jax.device_put(keep, NamedSharding(mesh, P("fsdp", "context")))
  config = mda.AttentionConfig(implementation=implementation, ulysses_degree=2)
  got = jax.jit(lambda q, k, v: mda.attention(q, k, v, mask=keep, mesh=mesh, config=config))(
    q, k, v
  )
  want = mda.attention(q, k, v, mask=keep, implementation="dot_product")
  assert got.sharding.is_equivalent_to(spec, 4), got.sharding
  assert float(np.max(np.abs(np.asarray(got) - np.asarray(want)))) < TOL


@pytest.mark.parametrize("implementation, jit", [("ulysses", False), ("ulysses_ring", True)])
def test_context_mesh_is_used_when_none_is_passed(implementation, jit):
  mesh = mdat.make_mesh((1, 1, 8, 1))
  q, k, v, _, _ = mdat.random_inputs(1, 64, 64, 8, 16)
  config = mda.AttentionConfig(implementation=implementation, ulysses_degree=4)
  f = lambda q, k, v: mda.attention(q, k, v, config=config)
  with jax.sharding.set_mesh(mesh):  # concrete outside jit, abstract inside
    got = (jax.jit(f) if jit else f)(q, k, v)
  want = mda.attention(q, k, v, implementation="dot_product")
  assert float(np.max(np.abs(np.asarray(got) - np.asarray(want)))) < TOL


def test_ulysses_heads_error_lists_working_degrees():
  mesh = mdat.make_mesh((1, 1, 8, 1))
  q, k, v, _, _ = mdat.random_inputs(1, 16, 16, 6, 8)
  with pytest.raises(
    ValueError, match=r"Ulysses degree 8 x ulysses_chunks 1 must divide the 6 heads"
  ):
    mda.attention(q, k, v, implementation="ulysses", mesh=mesh)
  with pytest.raises(ValueError, match=r"Ulysses degrees that work: \[1, 2\]"):
    mda.attention(q, k, v, implementation="ulysses", mesh=mesh)
  config = mda.AttentionConfig(ulysses_degree=3)
  with pytest.raises(
    ValueError, match=r"ulysses_degree=3 must divide the 'context' axis of size 8"
  ):
    mda.attention(q, k, v, implementation="ulysses_ring", mesh=mesh, config=config)
  no_context = jax.sharding.Mesh(
    np.array(jax.devices()).reshape(2, 4), ("data", "model"),
    axis_types=(jax.sharding.AxisType.Auto,) * 2,
  )  # fmt: skip
  with pytest.raises(ValueError, match=r"over mesh axis 'context', but the mesh has axes"):
    mda.attention(q, k, v, implementation="ring", mesh=no_context)


def _slow_grid():
  for implementation, mesh_shape, length, (mask, causal) in itertools.product(
    ("ring", "ulysses", "ulysses_ring"),
    MESHES,
    (77, 257, 1000),
    ((False, False), (True, False), (False, True), (True, True)),
  ):
    overrides = {"ulysses_degree": 2} if implementation == "ulysses_ring" else {}
    yield implementation, mesh_shape, overrides, (length, length), 8, 16, mask, causal
  for implementation, split in itertools.product(("ulysses_ring",), (2, 4)):
    for length, head_dim in ((257, 64), (1000, 128)):
      overrides = {"ulysses_degree": split, "ulysses_chunks": 2 if split == 2 else 1}
      yield implementation, (1, 1, 8, 1), overrides, (length, length), 8, head_dim, True, True
  for implementation, mesh_shape in itertools.product(("ring", "ulysses", "ulysses_ring"), MESHES):
    yield implementation, mesh_shape, {}, (257, 77), 8, 64, True, True


@pytest.mark.slow
@pytest.mark.parametrize(
  "implementation, mesh_shape, overrides, lengths, heads, head_dim, mask, causal",
  list(_slow_grid()),
)
def test_context_parallel_full_grid(
  implementation, mesh_shape, overrides, lengths, heads, head_dim, mask, causal
):
  _check(implementation, mesh_shape, overrides, lengths, heads, head_dim, mask, causal)
