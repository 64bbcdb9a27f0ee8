"""The reference itself against a NumPy softmax, plus the entry point's input validation."""

import jax.numpy as jnp
import numpy as np
import pytest

import md_attention as mda
import md_attention.testing as mdat


def _numpy_attention(q, k, v, mask, causal, scale):
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  scores = np.einsum("bqhd,bkhd->bhqk", q, k) * scale
  keep = np.ones(scores.shape, bool)
  if mask is not None:
    keep &= np.asarray(mask)[:, None, None, :]
  if causal:
    keep &= np.tril(np.ones(scores.shape[-2:], bool))
  scores = np.where(keep, scores, -np.inf)
  top = np.max(scores, axis=-1, keepdims=True)
  top = np.where(np.isfinite(top), top, 0)
  p = np.exp(scores - top)
  total = p.sum(-1, keepdims=True)
  p = np.where(total > 0, p / np.where(total > 0, total, 1), 0)
  return np.einsum("bhqk,bkhd->bqhd", p, v)


@pytest.mark.parametrize(
  "s_q, s_kv, mask, causal, scale",
  [(33, 33, False, False, None), (33, 33, True, True, None), (20, 45, True, False, 0.2)],
)
def test_dot_product_matches_numpy(s_q, s_kv, mask, causal, scale):
  q, k, v, keep, _ = mdat.random_inputs(2, s_q, s_kv, 3, 16, mask=mask)
  got = mda.attention(q, k, v, mask=keep, causal=causal, scale=scale, implementation="dot_product")
  want = _numpy_attention(q, k, v, keep, causal, 16**-0.5 if scale is None else scale)
  np.testing.assert_allclose(np.asarray(got), want, atol=2e-6, rtol=0)


def test_unmasked_softmax_skips_the_masks_with_the_same_result():
  """Without a mask, causality or a window the entry point runs the softmax without its masking
  passes (`masked=False`): the masked path's output and gradients with every key kept; the jaxpr has
  no `select_n` (the masks' `where`); a mask of all True still goes the masked way."""
  import jax

  from md_attention._dot_product import dot_product_attention

  q, k, v, _, d_out = mdat.random_inputs(2, 24, 24, 3, 16)
  out, grads = mdat.forward_and_grads(q, k, v, d_out, implementation="dot_product")
  everyone = jnp.ones((2, 24), bool)
  out_m, grads_m = mdat.forward_and_grads(
    q, k, v, d_out, mask=everyone, implementation="dot_product"
  )
  np.testing.assert_allclose(np.asarray(out), np.asarray(out_m), atol=1e-6, rtol=0)
  for g, gm in zip(grads, grads_m):
    np.testing.assert_allclose(np.asarray(g), np.asarray(gm), atol=1e-6, rtol=0)
  np.testing.assert_allclose(
    np.asarray(out), _numpy_attention(q, k, v, None, False, 16**-0.5), atol=2e-6, rtol=0
  )

  def prims(**kw):  # the printed jaxpr, nested ones included
    return str(jax.make_jaxpr(lambda q, k, v: mda.attention(q, k, v, **kw))(q, k, v))

  assert "select_n" not in prims(implementation="dot_product")
  assert "select_n" in prims(implementation="dot_product", mask=everyone)
  assert "select_n" in prims(implementation="dot_product", causal=True)
  pos = jnp.arange(24)
  with pytest.raises(ValueError, match="masked=False needs causal=False and window=None"):
    dot_product_attention(q, k, v, None, pos, pos, causal=True, scale=0.25, masked=False)


@pytest.mark.parametrize("implementation", ["dot_product", "blockwise"])
def test_fully_masked_rows_are_zero(implementation):
  q, k, v, _, d_out = mdat.random_inputs(2, 9, 9, 2, 8)
  mask = jnp.ones((2, 9), bool).at[1].set(False)
  out, grads = mdat.forward_and_grads(q, k, v, d_out, mask=mask, implementation=implementation)
  np.testing.assert_array_equal(np.asarray(out[1]), 0)
  for g in grads:
    assert np.all(np.isfinite(np.asarray(g)))
    np.testing.assert_array_equal(np.asarray(g[1]), 0)


def test_bf16_accumulates_in_f32():
  q, k, v, keep, _ = mdat.random_inputs(1, 64, 64, 2, 32, mask=True, dtype=jnp.bfloat16)
  got = mda.attention(q, k, v, mask=keep, implementation="dot_product")
  assert got.dtype == jnp.bfloat16
  want = _numpy_attention(q, k, v, keep, False, 32**-0.5)
  # bf16 output rounding (~4e-3 relative) is the only error left when scores and softmax are f32.
  np.testing.assert_allclose(np.asarray(got, np.float32), want, atol=1.6e-2, rtol=0)


def test_bad_inputs_raise():
  q, k, v, _, _ = mdat.random_inputs(2, 8, 8, 2, 8)
  with pytest.raises(ValueError, match=r"q must be \[B, S, H, D\], got shape \(2, 8, 16\)"):
    mda.attention(q.reshape(2, 8, 16), k, v)
  with pytest.raises(ValueError, match="k and v must have the same shape"):
    mda.attention(q, k, v[:, :4])
  with pytest.raises(ValueError, match="must agree in batch, heads and head dim"):
    mda.attention(q, k[..., :4], v[..., :4])
  with pytest.raises(
    ValueError, match="fewer heads than q if they divide"
  ):  # 3 K/V heads, 2 q heads
    mda.attention(q, k[:, :, :1].repeat(3, 2), v[:, :, :1].repeat(3, 2))
  with pytest.raises(ValueError, match=r"mask must be \[B, S_kv\] = \(2, 8\), got \(2, 7\)"):
    mda.attention(q, k, v, mask=jnp.ones((2, 7), bool))
  with pytest.raises(TypeError, match="one floating dtype"):
    mda.attention(q, k.astype(jnp.bfloat16), v)
  with pytest.raises(ValueError, match="implementation='flash' is not one of auto, dot_product"):
    mda.attention(q, k, v, implementation="flash")
  with pytest.raises(ValueError, match="implementation='nope'"):
    mda.AttentionConfig(implementation="nope")
  with pytest.raises(ValueError, match="block_q=0 must be a positive int"):
    mda.AttentionConfig(block_q=0)
  with pytest.raises(ValueError, match="'ring' needs a mesh with a 'context' axis"):
    mda.attention(q, k, v, implementation="ring")
  with pytest.raises(RuntimeError, match="'cudnn' needs an NVIDIA GPU, but the backend is 'cpu'"):
    mda.attention(q, k, v, implementation="cudnn")
  with pytest.raises(RuntimeError, match="'splash' needs a TPU, but the backend is 'cpu'"):
    mda.attention(q, k, v, implementation="splash")
