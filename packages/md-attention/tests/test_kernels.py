"""The cuDNN and splash wrappers, through what runs on CPU.

cuDNN: `jax.nn.dot_product_attention` is patched so the wrapper's `implementation="cudnn"` call runs
the XLA path with exactly the arguments the wrapper built (key reordering, per-batch key lengths, dense
mask for causal, head-dim padding); the real cuDNN call needs an NVIDIA GPU. Splash: the real Pallas
kernel in interpret mode.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import md_attention as mda
import md_attention.testing as mdat

_REAL_DPA = jax.nn.dot_product_attention


@pytest.fixture
def cudnn_calls(monkeypatch):
  calls = []

  def fake(q, k, v, bias=None, mask=None, **kwargs):
    assert kwargs.pop("implementation") == "cudnn"
    assert q.shape[-1] % 8 == 0, q.shape
    calls.append(dict(mask=None if mask is None else mask.shape, **kwargs))
    return _REAL_DPA(q, k, v, bias, mask, implementation="xla", **kwargs)

  monkeypatch.setattr(jax.nn, "dot_product_attention", fake)
  return calls


@pytest.mark.parametrize("s_q, s_kv, head_dim, mask, causal", [
  (40, 40, 60, True, False),
  (33, 33, 64, True, True),
  (20, 48, 64, False, False),
])  # fmt: skip
def test_cudnn_wrapper(cudnn_calls, s_q, s_kv, head_dim, mask, causal):
  q, k, v, keep, d_out = mdat.random_inputs(2, s_q, s_kv, 2, head_dim, mask=mask)
  if mask:
    keep = keep.at[1].set(False)  # a fully masked batch row must come out as zeros
  want, want_grads = mdat.forward_and_grads(
    q, k, v, d_out, mask=keep, causal=causal, implementation="dot_product"
  )
  bf16 = [x.astype(jnp.bfloat16) for x in (q, k, v)]

  def loss(q, k, v):
    out = mda.cudnn_attention(q, k, v, keep, causal=causal)
    return jnp.sum(out.astype(jnp.float32) * d_out), out

  (_, got), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(*bf16)
  assert got.shape == q.shape and got.dtype == jnp.bfloat16
  # bf16 inputs: errors of a correct wrapper are ~1e-2; a wrong mask or key order gives O(1).
  assert float(jnp.max(jnp.abs(got.astype(jnp.float32) - want))) < 3e-2
  for g, w in zip(grads, want_grads):
    assert float(jnp.max(jnp.abs(g.astype(jnp.float32) - w))) < 6e-2 * float(jnp.max(jnp.abs(w)))
  if mask:
    np.testing.assert_array_equal(np.asarray(got[1], np.float32), 0)
  call = cudnn_calls[0]
  assert call["is_causal"] == causal
  assert call["scale"] == pytest.approx(head_dim**-0.5)
  if mask and not causal:
    assert call["mask"] is None and "key_value_seq_lengths" in call
  elif mask:
    assert call["mask"] == (2, 1, s_q, s_kv)


def test_cudnn_rejects_float32():
  q, k, v, _, _ = mdat.random_inputs(1, 8, 8, 2, 8)
  with pytest.raises(
    TypeError, match="cudnn attention takes bfloat16 or float16 inputs, got float32"
  ):
    mda.cudnn_attention(q, k, v)


def test_splash_interpret_matches_dot_product():
  # S = 200: padded to the 128 block; D = 64: padded to 128 lanes; masked keys become segment 0.
  q, k, v, keep, d_out = mdat.random_inputs(2, 200, 200, 2, 64, mask=True)

  def loss(q, k, v):
    out = mda.splash_attention(
      q, k, v, keep, causal=True, block_q=128, block_kv=128, interpret=True
    )
    return jnp.sum(out * d_out), out

  (_, got), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
  want, want_grads = mdat.forward_and_grads(
    q, k, v, d_out, mask=keep, causal=True, implementation="dot_product"
  )
  assert float(jnp.max(jnp.abs(got - want))) < 2e-5
  for g, w in zip(grads, want_grads):
    assert float(jnp.max(jnp.abs(g - w))) < 2e-5


@pytest.mark.slow
@pytest.mark.parametrize(
  "s_q, s_kv, causal", [(77, 300, False), (300, 300, False), (257, 257, True)]
)
def test_splash_interpret_full(s_q, s_kv, causal):
  q, k, v, keep, d_out = mdat.random_inputs(1, s_q, s_kv, 2, 128, mask=True)

  def loss(q, k, v):
    out = mda.splash_attention(q, k, v, keep, causal=causal, block_q=128, block_kv=128,
                               interpret=True)  # fmt: skip
    return jnp.sum(out * d_out), out

  (_, got), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
  want, want_grads = mdat.forward_and_grads(
    q, k, v, d_out, mask=keep, causal=causal, implementation="dot_product"
  )
  assert float(jnp.max(jnp.abs(got - want))) < 2e-5
  for g, w in zip(grads, want_grads):
    assert float(jnp.max(jnp.abs(g - w))) < 2e-5
