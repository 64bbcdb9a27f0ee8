"""Grouped-query attention (K/V with fewer heads) and local (sliding-window) attention.

`dot_product` against a float64 NumPy reference written here (which repeats K/V heads the way
transformers' `repeat_kv` does and builds the window mask as transformers' Gemma 3 sliding mask:
`i - w < j <= i`); every other implementation against `dot_product`, output and gradients, incl. under
meshes of 8 virtual devices. `-m slow` adds a larger grid.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import md_attention as mda
import md_attention.testing as mdat
from md_attention._blockwise import _visible
from md_attention._dot_product import normalize_window

TOL = 2e-5
_REAL_DPA = jax.nn.dot_product_attention


def _inputs(b, s_q, s_kv, h, h_kv, d, *, mask=False, seed=0):
  q, k, v, keep, d_out = mdat.random_inputs(b, s_q, s_kv, h, d, mask=mask, seed=seed)
  return q, k[:, :, :h_kv], v[:, :, :h_kv], keep, d_out


def _numpy_attention(q, k, v, mask, causal, scale, window):
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  groups = q.shape[2] // k.shape[2]
  k, v = (np.repeat(x, groups, axis=2) for x in (k, v))
  scores = np.einsum("bqhd,bkhd->bhqk", q, k) * scale
  i = np.arange(q.shape[1])[:, None]
  j = np.arange(k.shape[1])[None, :]
  keep = np.ones(scores.shape, bool)
  if mask is not None:
    keep &= np.asarray(mask)[:, None, None, :]
  if causal:
    keep &= j <= i
  if isinstance(window, int):
    keep &= (j > i - window) & (j <= i)
  elif window is not None:
    left, right = window
    if left is not None:
      keep &= j >= i - left
    if right is not None:
      keep &= j <= i + right
  scores = np.where(keep, scores, -np.inf)
  top = np.max(scores, axis=-1, keepdims=True)
  top = np.where(np.isfinite(top), top, 0)
  p = np.exp(scores - top)
  total = p.sum(-1, keepdims=True)
  p = np.where(total > 0, p / np.where(total > 0, total, 1), 0)
  return np.einsum("bhqk,bkhd->bqhd", p, v)


# (S_q, S_kv, H, H_kv, mask, causal, window)
REFERENCE_CASES = [
  (13, 13, 4, 2, True, True, 4),  # Gemma 3 local layer: causal window of 4, key padding, GQA
  (13, 13, 4, 1, False, False, (2, 3)),  # MQA, two-sided window
  (13, 13, 3, 3, True, True, (None, 2)),  # causal caps the right side at 0
  (9, 17, 4, 2, True, False, (1, None)),  # cross-attention: positions from 0 on both sides
  (13, 13, 6, 2, True, False, None),  # GQA alone
]


@pytest.mark.parametrize("s_q, s_kv, h, h_kv, mask, causal, window", REFERENCE_CASES)
def test_dot_product_matches_numpy(s_q, s_kv, h, h_kv, mask, causal, window):
  q, k, v, keep, _ = _inputs(2, s_q, s_kv, h, h_kv, 8, mask=mask)
  got = mda.attention(
    q, k, v, mask=keep, causal=causal, window=window, implementation="dot_product"
  )
  want = _numpy_attention(q, k, v, keep, causal, 8**-0.5, window)
  np.testing.assert_allclose(np.asarray(got), want, atol=2e-6, rtol=0)


def test_window_one_sees_only_itself_and_fully_masked_rows_are_zero():
  q, k, v, _, d_out = _inputs(1, 6, 6, 2, 1, 4)
  out = mda.attention(q, k, v, window=1, implementation="dot_product")
  np.testing.assert_allclose(np.asarray(out), np.repeat(np.asarray(v), 2, axis=2), atol=1e-6)
  # Query 3 only sees key 3 (window 1), which is masked: zeros, and finite zero gradients.
  mask = jnp.ones((1, 6), bool).at[0, 3].set(False)
  for impl in ("dot_product", "blockwise"):
    out, grads = mdat.forward_and_grads(
      q, k, v, d_out, mask=mask, window=1, implementation=impl,
      config=mda.AttentionConfig(block_q=2, block_kv=2),
    )  # fmt: skip
    np.testing.assert_array_equal(np.asarray(out[0, 3]), 0)
    assert all(np.all(np.isfinite(np.asarray(g))) for g in grads)


# (S_q, S_kv, H, H_kv, mask, causal, window); blocks of 8 so windows skip whole tiles.
BLOCKWISE_CASES = [
  (37, 37, 4, 2, True, True, 5),
  (37, 37, 4, 1, True, False, (3, 9)),
  pytest.param(21, 40, 6, 3, False, False, (None, 4), marks=pytest.mark.slow),
  pytest.param(40, 21, 4, 4, True, True, 9, marks=pytest.mark.slow),
]


@pytest.mark.parametrize("s_q, s_kv, h, h_kv, mask, causal, window", BLOCKWISE_CASES)
def test_blockwise_matches_dot_product(s_q, s_kv, h, h_kv, mask, causal, window):
  q, k, v, keep, d_out = _inputs(1, s_q, s_kv, h, h_kv, 8, mask=mask)
  config = mda.AttentionConfig(implementation="blockwise", block_q=8, block_kv=8)
  errors = mdat.max_errors(q, k, v, d_out, mask=keep, causal=causal, config=config, window=window)
  for name in ("out", "dq", "dk", "dv"):
    assert errors[name] < TOL, (name, errors[name])


def test_blockwise_skips_tiles_outside_the_window():
  # The predicate that lets a tile's work be skipped (lax.cond around the tile).
  qp = jnp.arange(64, 72)  # one query block at positions 64..71
  for k_start, window, causal, want in [
    (56, (4, 0), True, True),  # keys 56..63: query 64 sees 60..64
    (48, (4, 0), True, False),  # keys 48..55: all before every query's window
    (72, (4, 0), True, False),  # keys after the queries: causal
    (72, (None, 1), False, True),  # query 71 sees key 72
    (80, (None, 8), False, False),  # keys 80..87: query 71 sees up to 79
  ]:
    got = _visible(qp, jnp.arange(k_start, k_start + 8), causal, window)
    assert bool(got) == want, (k_start, window)


@pytest.fixture
def cudnn_calls(monkeypatch):
  calls = []

  def fake(q, k, v, bias=None, mask=None, **kwargs):
    assert kwargs.pop("implementation") == "cudnn"
    calls.append(dict(kv_heads=k.shape[2], mask=None if mask is None else mask.shape, **kwargs))
    return _REAL_DPA(q, k, v, bias, mask, implementation="xla", **kwargs)

  monkeypatch.setattr(jax.nn, "dot_product_attention", fake)
  return calls


@pytest.mark.parametrize(
  "mask, causal, window",
  [
    (True, False, (2, 3)),
    pytest.param(True, True, 4, marks=pytest.mark.slow),
    pytest.param(False, False, None, marks=pytest.mark.slow),
  ],
)
def test_cudnn_wrapper_gqa_and_window(cudnn_calls, mask, causal, window):
  q, k, v, keep, d_out = _inputs(2, 24, 24, 4, 2, 16, mask=mask)
  want = mda.attention(
    q, k, v, mask=keep, causal=causal, window=window, implementation="dot_product"
  )
  got = mda.cudnn_attention(
    *(x.astype(jnp.bfloat16) for x in (q, k, v)), keep, causal=causal, window=window
  )
  assert float(jnp.max(jnp.abs(got.astype(jnp.float32) - want))) < 3e-2
  call = cudnn_calls[0]
  assert call["kv_heads"] == 2  # passed through, not repeated
  if window is not None:
    left, right = normalize_window(window, causal)
    assert call["local_window_size"] == (left, right)


@pytest.mark.slow
def test_splash_interpret_gqa_and_window():
  q, k, v, keep, d_out = _inputs(1, 128, 128, 2, 1, 32, mask=True)

  def loss(q, k, v):
    out = mda.splash_attention(
      q, k, v, keep, causal=True, window=40, block_q=128, block_kv=128, interpret=True
    )
    return jnp.sum(out * d_out), out

  (_, got), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
  want, want_grads = mdat.forward_and_grads(
    q, k, v, d_out, mask=keep, causal=True, window=40, implementation="dot_product"
  )
  assert float(jnp.max(jnp.abs(got - want))) < TOL
  for g, w in zip(grads, want_grads):
    assert g.shape == w.shape
    assert float(jnp.max(jnp.abs(g - w))) < TOL


# implementation, mesh, config overrides, (S_q, S_kv), H, H_kv, mask, causal, window
SHARDED_CASES = [
  # Local implementations, heads over tensor: 2 kv heads split 2 ways; 1 kv head repeated to fit.
  ("blockwise", (2, 1, 2, 2), {}, (24, 24), 4, 2, True, True, 5),
  pytest.param(
    "dot_product", (1, 2, 1, 4), {}, (24, 24), 8, 1, True, False, (3, 2), marks=pytest.mark.slow
  ),
  # Ulysses: whole sequence per device, so the window works; 4 kv heads over context 4 natively,
  # 2 kv heads (1 per tensor shard) repeated to fit 4 Ulysses ways.
  pytest.param("ulysses", (2, 1, 4, 1), {}, (32, 32), 8, 4, True, True, 6, marks=pytest.mark.slow),
  ("ulysses", (1, 1, 4, 2), {"local_implementation": "blockwise"}, (30, 30), 8, 2, True, True, 7),
  # Ring steps with grouped K/V (query groups folded into rows) and windows by global position;
  # Ulysses x ring: 1 kv head per device. 37 tokens: padded to the context axis.
  ("ring", (1, 1, 8, 1), {}, (32, 32), 4, 2, True, True, 5),
  ("ulysses_ring", (1, 1, 8, 1), {"ulysses_degree": 2}, (37, 37), 4, 2, True, True, 9),
  pytest.param(
    "ring", (1, 2, 4, 1), {}, (40, 40), 2, 1, True, False, (3, 11), marks=pytest.mark.slow
  ),
  pytest.param("ring", (1, 1, 8, 1), {}, (32, 32), 4, 2, True, True, None, marks=pytest.mark.slow),
  # Cross-attention under context parallelism: K/V replicated, window applied locally.
  ("ring", (1, 1, 4, 2), {}, (32, 12), 4, 2, True, False, (None, 3)),
]


@pytest.mark.parametrize(
  "implementation, mesh_shape, overrides, lengths, h, h_kv, mask, causal, window", SHARDED_CASES
)
def test_sharded(implementation, mesh_shape, overrides, lengths, h, h_kv, mask, causal, window):
  mesh = mdat.make_mesh(mesh_shape)
  q, k, v, keep, d_out = _inputs(2, *lengths, h, h_kv, 8, mask=mask)
  config = mda.AttentionConfig(block_q=8, block_kv=8, **overrides)
  errors = mdat.max_errors(
    q, k, v, d_out, mask=keep, causal=causal, window=window, implementation=implementation,
    mesh=mesh, config=config,
  )  # fmt: skip
  for name in ("out", "dq", "dk", "dv"):
    assert errors[name] < TOL, (name, errors[name])


def test_bad_window_and_heads_raise():
  q, k, v, _, _ = _inputs(1, 8, 8, 4, 2, 8)
  with pytest.raises(ValueError, match="must agree in batch, heads and head dim"):
    mda.attention(q, k[:, :, :1].repeat(3, 2), v[:, :, :1].repeat(3, 2))
  with pytest.raises(ValueError, match="window=0 must be a positive int"):
    mda.attention(q, k, v, window=0)
  with pytest.raises(TypeError, match="window must be an int or a"):
    mda.attention(q, k, v, window="wide")
  with pytest.raises(ValueError, match=r"window=\(-3, 1\) is empty"):
    mda.attention(q, k, v, window=(-3, 1))


@pytest.mark.slow
@pytest.mark.parametrize("implementation", ["blockwise", "ulysses", "ring"])
@pytest.mark.parametrize("h_kv", [1, 2])
@pytest.mark.parametrize("window", [1, 16, (7, 30), (None, 0)])
@pytest.mark.parametrize("mask, causal", [(True, True), (True, False)])
def test_grid(implementation, h_kv, window, mask, causal):
  meshes = {"ulysses": (1, 2, 4, 1), "ring": (1, 1, 8, 1)}
  mesh = mdat.make_mesh(meshes[implementation]) if implementation in meshes else None
  q, k, v, keep, d_out = _inputs(2, 131, 131, 8, h_kv, 16, mask=mask, seed=1)
  config = mda.AttentionConfig(block_q=32, block_kv=16)
  errors = mdat.max_errors(
    q, k, v, d_out, mask=keep, causal=causal, window=window, implementation=implementation,
    mesh=mesh, config=config,
  )  # fmt: skip
  for name in ("out", "dq", "dk", "dv"):
    assert errors[name] < TOL, (name, errors[name])
  want = _numpy_attention(q, k, v, keep, causal, 16**-0.5, window)
  np.testing.assert_allclose(np.asarray(errors["result"]), want, atol=1e-5, rtol=0)
