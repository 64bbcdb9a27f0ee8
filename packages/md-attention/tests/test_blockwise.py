"""`blockwise` against `dot_product`, forward and gradients, and its O(S) memory at S = 32768."""

import jax
import jax.numpy as jnp
import pytest

import md_attention as mda
import md_attention.testing as mdat

TOL = 2e-5

# (S_q, S_kv, head_dim, mask, causal): odd lengths, both head dims, cross-attention both ways.
CASES = [
  (1000, 1000, 64, True, False),
  (1000, 1000, 128, False, True),
  (77, 77, 128, True, True),
  (257, 257, 64, True, True),
  (257, 77, 128, True, False),
  (77, 1000, 64, False, True),
]


@pytest.mark.parametrize("s_q, s_kv, head_dim, mask, causal", CASES)
def test_blockwise_matches_dot_product(s_q, s_kv, head_dim, mask, causal):
  q, k, v, keep, d_out = mdat.random_inputs(1, s_q, s_kv, 2, head_dim, mask=mask)
  config = mda.AttentionConfig(implementation="blockwise", block_q=128, block_kv=64)
  errors = mdat.max_errors(q, k, v, d_out, mask=keep, causal=causal, config=config)
  for name in ("out", "dq", "dk", "dv"):
    assert errors[name] < TOL, (name, errors[name])


# All keys in one block (CPU's query chunks): the heads-major one-block forward, against dot_product.
# (S_q, S_kv, heads, kv heads, head_dim, mask, causal, window, scale): padded keys, causal, a window,
# grouped K/V, cross-attention both ways, a scale that is not a power of two, query rows past the last
# chunk's end (S_q not a multiple of the chunk).
ONE_BLOCK_CASES = [
  (100, 100, 4, 4, 64, True, False, None, None),
  (100, 100, 4, 4, 48, False, True, None, None),
  (90, 130, 4, 2, 32, True, False, (20, 5), None),
  (130, 40, 2, 2, 16, True, False, None, 0.3),
  (70, 70, 4, 1, 64, False, False, None, None),
]


@pytest.mark.parametrize("s_q, s_kv, h, h_kv, d, mask, causal, window, scale", ONE_BLOCK_CASES)
def test_one_key_block_matches_dot_product(s_q, s_kv, h, h_kv, d, mask, causal, window, scale):
  q, k, v, keep, d_out = mdat.random_inputs(2, s_q, s_kv, h, d, mask=mask)
  k, v = k[:, :, :h_kv], v[:, :, :h_kv]
  config = mda.AttentionConfig(implementation="blockwise", block_q=32, block_kv=256)
  errors = mdat.max_errors(
    q, k, v, d_out, mask=keep, causal=causal, window=window, scale=scale, config=config
  )
  for name in ("out", "dq", "dk", "dv"):
    assert errors[name] < TOL, (name, errors[name])


def test_one_key_block_rows_that_see_no_key_are_zero():
  # The second sample's keys are all padding: its rows are zeros (as dot_product), and nothing is NaN.
  q, k, v, keep, d_out = mdat.random_inputs(2, 40, 40, 2, 16, mask=True)
  keep = keep.at[1].set(False)
  config = mda.AttentionConfig(implementation="blockwise", block_q=16, block_kv=64)
  errors = mdat.max_errors(q, k, v, d_out, mask=keep, config=config)
  assert max(errors[n] for n in ("out", "dq", "dk", "dv")) < TOL
  assert float(jnp.abs(errors["result"][1]).max()) == 0.0


@pytest.mark.parametrize("head_dim", [48, 64])
def test_one_key_block_bf16_against_the_float32_reference(head_dim):
  # head dim 48: the scale 1/sqrt(48) is not a power of two, so a bfloat16 q is not multiplied by it
  # (that would round q to bfloat16 again); 64: it is, and q takes it. The gradient runs the key-block
  # tiles on the heads-major forward's log-sum-exp. Both within bf16's own error of float32 (gradients
  # up to ~1.1; dot_product on the same bf16 inputs measured 4.4e-3).
  q, k, v, keep, d_out = mdat.random_inputs(1, 200, 200, 2, head_dim, mask=True, dtype=jnp.bfloat16)
  config = mda.AttentionConfig(implementation="blockwise", block_q=64, block_kv=256)
  got, grads = mdat.forward_and_grads(q, k, v, d_out, mask=keep, config=config)
  want, want_grads = mdat.forward_and_grads(
    *(x.astype(jnp.float32) for x in (q, k, v)), d_out, mask=keep, implementation="dot_product"
  )
  assert got.dtype == jnp.bfloat16
  assert float(jnp.max(jnp.abs(got.astype(jnp.float32) - want))) < 1.6e-2
  for name, a, b in zip(("dq", "dk", "dv"), grads, want_grads):
    assert float(jnp.max(jnp.abs(a.astype(jnp.float32) - b))) < 1e-2, name


def test_blockwise_bf16_close_to_f32_reference():
  q, k, v, keep, _ = mdat.random_inputs(2, 300, 300, 2, 64, mask=True, dtype=jnp.bfloat16)
  got = mda.attention(q, k, v, mask=keep, implementation="blockwise")
  want = mda.attention(
    *(x.astype(jnp.float32) for x in (q, k, v)), mask=keep, implementation="dot_product"
  )
  assert got.dtype == jnp.bfloat16
  assert float(jnp.max(jnp.abs(got.astype(jnp.float32) - want))) < 1.6e-2


def test_blockwise_scale_override():
  q, k, v, keep, d_out = mdat.random_inputs(2, 50, 50, 2, 16, mask=True)
  config = mda.AttentionConfig(block_q=16, block_kv=16)
  errors = mdat.max_errors(
    q, k, v, d_out, mask=keep, scale=0.05, implementation="blockwise", config=config
  )
  assert max(errors[n] for n in ("out", "dq", "dk", "dv")) < TOL


def test_blockwise_memory_is_linear_at_32k():
  s, h, d = 32768, 4, 64
  x = jax.ShapeDtypeStruct((1, s, h, d), jnp.float32)

  def loss(q, k, v):
    return jnp.sum(mda.attention(q, k, v, implementation="blockwise"))

  compiled = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2))).lower(x, x, x).compile()
  temp = compiled.memory_analysis().temp_size_in_bytes
  scores = s * s * 4  # one f32 score matrix of one head: 4 GiB
  # Measured ~180 MiB (inputs, f32 gradient accumulators, a few 512x512 tiles per head).
  assert temp < scores / 16, f"temporary bytes {temp} not far below S^2*4 = {scores}"


def test_local_implementations_under_a_mesh():
  # Under jax.set_mesh inside jit: batch and heads stay sharded, the output comes back sharded.
  mesh = mdat.make_mesh((2, 1, 2, 2))
  q, k, v, keep, d_out = mdat.random_inputs(2, 16, 16, 4, 8, mask=True)
  config = mda.AttentionConfig(implementation="blockwise", block_q=8, block_kv=8)
  with jax.sharding.set_mesh(mesh):
    errors = mdat.max_errors(q, k, v, d_out, mask=keep, causal=True, config=config)
  assert max(errors[n] for n in ("out", "dq", "dk", "dv")) < TOL
  want = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data", "context", "tensor"))
  assert errors["result"].sharding.is_equivalent_to(want, 4), errors["result"].sharding


@pytest.mark.parametrize(
  "policy",
  [jax.checkpoint_policies.dots_saveable, jax.checkpoint_policies.dots_with_no_batch_dims_saveable],
)
def test_remat_policies_do_not_save_the_tiles(policy):
  # Under jax.checkpoint with a dots policy, the forward rule's query x key tiles must not become saved
  # residuals: the gradient's temporaries stay those of the unrematerialised gradient (before the
  # forward rule was opaque to remat, `dots_saveable` kept all S^2 logits: 1.4 GB here, against 63 MB).
  s, h, d = 8192, 4, 64
  config = mda.AttentionConfig(implementation="blockwise", block_q=512, block_kv=512)
  x = jax.ShapeDtypeStruct((1, s, h, d), jnp.float32)

  def loss(q, k, v):
    return mda.attention(q, k, v, config=config).sum()

  def temp_bytes(fn):
    compiled = jax.jit(jax.grad(fn, argnums=(0, 1, 2))).lower(x, x, x).compile()
    return compiled.memory_analysis().temp_size_in_bytes

  logits = s * s * h * 4
  plain = temp_bytes(loss)
  remat = temp_bytes(jax.checkpoint(loss, policy=policy))
  assert remat <= 1.5 * plain and remat < logits / 8, (remat, plain, logits)
