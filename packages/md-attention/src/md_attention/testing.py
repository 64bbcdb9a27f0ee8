"""Helpers for tests of md-attention and of the packages that use it."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from md_attention._attention import attention
from md_attention._config import AttentionConfig

MESH_AXES = ("data", "fsdp", "context", "tensor")


def make_mesh(shape: tuple[int, int, int, int]) -> Mesh:
  """A `(data, fsdp, context, tensor)` mesh over the first `prod(shape)` devices, Auto axes."""
  n = int(np.prod(shape))
  devices = np.array(jax.devices()[:n]).reshape(shape)
  return Mesh(devices, MESH_AXES, axis_types=(jax.sharding.AxisType.Auto,) * 4)


def random_inputs(
  batch: int,
  s_q: int,
  s_kv: int,
  heads: int,
  head_dim: int,
  *,
  mask: bool = False,
  dtype=jnp.float32,
  seed: int = 0,
):
  """`(q, k, v, mask, d_out)`; the mask keeps ~80% of keys and at least the first of each row."""
  rng = np.random.default_rng(seed)
  q = jnp.asarray(rng.standard_normal((batch, s_q, heads, head_dim)), dtype)
  k = jnp.asarray(rng.standard_normal((batch, s_kv, heads, head_dim)), dtype)
  v = jnp.asarray(rng.standard_normal((batch, s_kv, heads, head_dim)), dtype)
  d_out = jnp.asarray(rng.standard_normal((batch, s_q, heads, head_dim)), jnp.float32)
  keep = None
  if mask:
    keep = rng.random((batch, s_kv)) < 0.8
    keep[:, 0] = True
    keep = jnp.asarray(keep)
  return q, k, v, keep, d_out


def forward_and_grads(q, k, v, d_out, **kwargs):
  """Output and `d<out, d_out>/d(q, k, v)` of `attention(q, k, v, **kwargs)`, in one jitted program."""

  def loss(q, k, v):
    out = attention(q, k, v, **kwargs)
    return jnp.sum(out.astype(jnp.float32) * d_out), out

  (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
  return out, grads


def max_errors(
  q, k, v, d_out, *, mask=None, causal=False, scale=None, window=None, **kwargs
) -> dict:
  """Largest absolute differences to `dot_product` in the output and in dq, dk, dv.

  Args:
    q, k, v, d_out: inputs and the output cotangent.
    mask, causal, scale, window: passed to both.
    **kwargs: `implementation`, `mesh`, `config` of the implementation under test.

  Returns:
    `{"out": e, "dq": e, "dk": e, "dv": e}` and, under `"result"`, the tested output.
  """
  common = dict(mask=mask, causal=causal, scale=scale)
  if window is not None:
    common["window"] = window
  want, want_grads = forward_and_grads(
    q, k, v, d_out, implementation="dot_product", config=AttentionConfig(), **common
  )
  got, got_grads = forward_and_grads(q, k, v, d_out, **common, **kwargs)
  errors = {"out": float(jnp.max(jnp.abs(got.astype(jnp.float32) - want.astype(jnp.float32))))}
  for name, a, b in zip(("dq", "dk", "dv"), got_grads, want_grads):
    errors[name] = float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))))
  errors["result"] = got
  return errors
