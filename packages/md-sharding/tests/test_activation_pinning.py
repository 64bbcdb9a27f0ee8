"""Pinning activations by logical name keeps a residual add after an FSDP × tensor projection exact.

jaxlib 0.10's SPMD partitioner (CPU) miscompiles `x + x @ W` when `x [B, S, D]` is split
`((data, fsdp), None, tensor)` and `W [D, D]` `(tensor, fsdp)` (an attention output projection whose rows
follow the heads and whose columns follow the model dimension): for S ≤ 8 the sum is off by O(1), while
`x @ W` alone is right. md's models pin their token streams with `with_logical_constraint(x,
("activation_batch", "activation_length", "activation_embed"))` under `jax.set_mesh`, which gives the
partitioner an unambiguous layout; this test holds that pattern to the NumPy result.
"""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import md_sharding as mds

TOKENS = ("activation_batch", "activation_length", "activation_embed")


def test_pinned_residual_add_matches_numpy():
  mesh = mds.make_mesh(
    mds.MeshConfig(ici_data_parallelism=2, ici_fsdp_parallelism=2, ici_tensor_parallelism=2)
  )
  rng = np.random.default_rng(0)
  x = rng.standard_normal((4, 4, 16)).astype(np.float32)
  w = rng.standard_normal((16, 16)).astype(np.float32)
  xs = jax.device_put(x, NamedSharding(mesh, P(("data", "fsdp"), None, "tensor")))
  ws = jax.device_put(w, NamedSharding(mesh, P("tensor", "fsdp")))

  @jax.jit
  def block(x, w):
    x = mds.with_logical_constraint(x, TOKENS)
    return mds.with_logical_constraint(x + jnp.matmul(x, w), TOKENS)

  with jax.set_mesh(mesh):
    got = block(xs, ws)
  assert got.sharding.spec[0] == ("data", "fsdp")
  np.testing.assert_allclose(np.asarray(got), x + x @ w, atol=1e-4, rtol=0)
