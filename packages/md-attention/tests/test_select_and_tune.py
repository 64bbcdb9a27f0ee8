"""`auto` selection (and its one log line per choice) and the block-size tuner's cache."""

import dataclasses
import json
import logging
import warnings

import jax
import jax.numpy as jnp
import pytest

import md_attention as mda
import md_attention._attention as mda_attention
import md_attention._select as mda_select
import md_attention.testing as mdat


@pytest.mark.parametrize("mesh_shape, heads, s, want", [
  (None, 4, 64, "dot_product"),
  (None, 4, 4096, "blockwise"),
  ((1, 1, 8, 1), 8, 64, "ulysses"),
  ((1, 1, 8, 1), 4, 64, "ulysses_ring"),
  ((2, 1, 4, 1), 3, 64, "ring"),
])  # fmt: skip
def test_auto_selection(mesh_shape, heads, s, want):
  mesh = None if mesh_shape is None else mdat.make_mesh(mesh_shape)
  got = mda.select_implementation((2, s, heads, 16), (2, s, heads, 16), jnp.float32, mesh,
                                  mda.AttentionConfig())  # fmt: skip
  assert got == want


def test_auto_on_cpu_chunks_queries_past_the_score_budget(monkeypatch):
  """On CPU `auto` keeps `dot_product` while the float32 scores fit `CPU_SCORES_BYTES`, then runs
  blockwise over query chunks with every key in one block (up to `CPU_MAX_KV_BLOCK` keys); explicit
  settings are left alone. Same values as `dot_product` either way."""
  assert jax.default_backend() == "cpu"
  monkeypatch.setattr(mda_select, "CPU_SCORES_BYTES", 2 * 96 * 96 * 4 - 1)
  calls = _record_local(monkeypatch)
  q, k, v, keep, _ = mdat.random_inputs(1, 96, 96, 2, 16, mask=True)
  small = mdat.random_inputs(1, 48, 96, 2, 16, mask=True)
  monkeypatch.setattr(mda_select, "CPU_QUERY_CHUNK", 32)
  got = mda.attention(q, k, v, mask=keep)
  want = mda.attention(q, k, v, mask=keep, implementation="dot_product")
  assert float(jnp.abs(got - want).max()) < 1e-5
  mda.attention(*small[:3], mask=small[3])  # 48 x 96 scores per head: under the budget
  mda.attention(q, k, v, mask=keep, implementation="blockwise")  # explicit: the config's blocks
  config = mda.AttentionConfig(block_q=16, block_kv=16)
  mda.attention(q, k, v, config=config)  # auto with other block sizes in the config: still chunks
  assert calls == [
    ("blockwise", 32, 96, (1, 96, 2, 16)),
    ("dot_product", 512, 512, (1, 96, 2, 16)),
    ("dot_product", 512, 512, (1, 48, 2, 16)),
    ("blockwise", 512, 512, (1, 96, 2, 16)),
    ("blockwise", 32, 96, (1, 96, 2, 16)),
  ]
  # More keys than one block takes: the config's blocks.
  monkeypatch.setattr(mda_select, "CPU_MAX_KV_BLOCK", 64)
  assert mda_select.cpu_blocks(96, 96, config) == (16, 16)


@pytest.mark.parametrize("b, h, s, want", [
  (1, 1, 512, "dot_product"),  # one head's scores: exactly CPU_HEAD_SCORES_BYTES
  (1, 1, 513, "blockwise"),  # past it, even one head of one sample
  (16, 4, 256, "dot_product"),  # 16 MiB in all, short rows (the default image model's training step)
  (17, 4, 256, "blockwise"),  # past CPU_SCORES_BYTES in all
  (1, 8, 640, "blockwise"),  # the Flux.1 bench step's 640 tokens
])  # fmt: skip
def test_auto_on_cpu_chunks_long_rows_whatever_the_batch(b, h, s, want):
  assert jax.default_backend() == "cpu"
  got = mda.select_implementation(
    (b, s, h, 64), (b, s, h, 64), jnp.float32, None, mda.AttentionConfig()
  )
  assert got == want


def test_auto_runs_and_logs_once(caplog):
  mesh = mdat.make_mesh((1, 1, 8, 1))
  q, k, v, keep, d_out = mdat.random_inputs(2, 48, 48, 4, 16, mask=True)
  with caplog.at_level(logging.INFO, logger="md_attention"):
    errors = mdat.max_errors(q, k, v, d_out, mask=keep, causal=True, mesh=mesh)
    # Tracing again (lowering is enough) must not log again.
    jax.jit(lambda q, k, v: mda.attention(q, k, v, mask=keep, causal=True, mesh=mesh)).lower(
      q, k, v
    )
  assert max(errors[n] for n in ("out", "dq", "dk", "dv")) < 2e-5
  picks = [r.getMessage() for r in caplog.records if "attention auto -> " in r.getMessage()]
  assert len(picks) == 1 and "ulysses_ring" in picks[0], picks


def _record_local(monkeypatch):
  """Patches the local kernel factory; returns the (kernel, block_q, block_kv, q shape) of each call."""
  calls = []
  real = mda_attention._local

  def local(implementation, **kwargs):
    fn = real(implementation, **kwargs)

    def recorded(q, *args):
      calls.append((implementation, kwargs["block_q"], kwargs["block_kv"], tuple(q.shape)))
      return fn(q, *args)

    return recorded

  monkeypatch.setattr(mda_attention, "_local", local)
  return calls


def _table(path):
  return json.loads((path / "block_sizes.json").read_text())


def test_tuner_times_the_local_kernel_and_caches(tmp_path, monkeypatch):
  calls = _record_local(monkeypatch)
  config = mda.AttentionConfig(tuner_cache_dir=str(tmp_path))
  shape = (1, 96, 2, 16)
  best = mda.tune_block_sizes(shape, shape, jnp.float32, candidates=[(16, 16), (32, 96)],
                              config=config, repeats=1)  # fmt: skip
  assert best in ((16, 16), (32, 96))
  # One trace of forward + backward per candidate, of the local kernel itself.
  assert sorted(calls) == [("blockwise", 16, 16, shape), ("blockwise", 32, 96, shape)]
  key = mda.cache_key(shape, shape, jnp.float32, implementation="blockwise", config=config)
  assert _table(tmp_path) == {key: list(best)}
  assert "|mesh=none" in key and f"q={shape}" in key
  # A hit does not measure: impossible candidates are never tried.
  again = mda.tune_block_sizes(shape, shape, jnp.float32, candidates=[(0, 0)], config=config)
  assert again == best and len(calls) == 2


def test_tuner_key_has_local_shapes_and_mesh_sizes(tmp_path, monkeypatch):
  calls = _record_local(monkeypatch)
  # On one device `ring` runs the local implementation: make that blockwise too.
  config = mda.AttentionConfig(local_implementation="blockwise", tuner_cache_dir=str(tmp_path))
  shape = (1, 64, 2, 16)
  context = mdat.make_mesh((1, 1, 8, 1))
  one = mdat.make_mesh((1, 1, 1, 1))
  for mesh in (context, one):
    mda.tune_block_sizes(shape, shape, jnp.float32, implementation="ring", mesh=mesh,
                         candidates=[(8, 8)], config=config, repeats=1)  # fmt: skip
  # Ring steps run blockwise tiles on S / 8 of the sequence per device.
  assert [c[3] for c in calls] == [(1, 8, 2, 16), (1, 64, 2, 16)]
  key_8 = mda.cache_key(shape, shape, jnp.float32, implementation="ring", mesh=context,
                        config=config)  # fmt: skip
  key_1 = mda.cache_key(shape, shape, jnp.float32, implementation="ring", mesh=one, config=config)
  assert key_8 != key_1 and set(_table(tmp_path)) == {key_8, key_1}
  assert "q=(1, 8, 2, 16)" in key_8 and "context=8" in key_8
  assert "q=(1, 64, 2, 16)" in key_1 and "context=1" in key_1
  # The jitted ring call under the context mesh finds that entry: no warning, exact output.
  q, k, v, keep, _ = mdat.random_inputs(*shape[:2], *shape[1:], mask=True)
  tuned = dataclasses.replace(config, implementation="ring", tune=True)
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    got = jax.jit(lambda q, k, v: mda.attention(q, k, v, mask=keep, mesh=context, config=tuned))(
      q, k, v
    )
  want = mda.attention(q, k, v, mask=keep, implementation="dot_product")
  assert float(jnp.max(jnp.abs(got - want))) < 2e-5
  # Batch and heads split too: (2, 1, 1, 4) leaves each device half the batch and a quarter of the
  # heads (grouped K/V: 2 heads repeated to 4), the whole sequence.
  key = mda.cache_key((4, 64, 8, 16), (4, 64, 2, 16), jnp.float32, implementation="blockwise",
                      mesh=mdat.make_mesh((2, 1, 1, 4)))  # fmt: skip
  assert "q=(2, 64, 2, 16)|kv=(2, 64, 1, 16)" in key and "data=2,fsdp=1,context=1,tensor=4" in key


def test_tune_under_jit_only_looks_up(tmp_path, monkeypatch):
  calls = _record_local(monkeypatch)
  q, k, v, keep, _ = mdat.random_inputs(1, 96, 96, 2, 16, mask=True)
  config = mda.AttentionConfig(implementation="blockwise", block_q=32, block_kv=32, tune=True,
                               tuner_cache_dir=str(tmp_path))  # fmt: skip
  fn = jax.jit(lambda q, k, v: mda.attention(q, k, v, mask=keep, config=config))
  with pytest.warns(UserWarning, match="tune_block_sizes") as record:
    got = fn(q, k, v)
  assert len([w for w in record if "tune_block_sizes" in str(w.message)]) == 1
  assert not (tmp_path / "block_sizes.json").exists()
  assert calls == [("blockwise", 32, 32, q.shape)]  # the config's blocks, nothing measured
  want = mda.attention(q, k, v, mask=keep, implementation="dot_product")
  assert float(jnp.max(jnp.abs(got - want))) < 2e-5
  # Once per key: tracing again does not warn again.
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    jax.jit(lambda q, k, v: mda.attention(q, k, v, mask=keep, config=config)).lower(q, k, v)

  best = mda.tune_block_sizes(q.shape, k.shape, q.dtype, implementation="blockwise",
                              candidates=[(16, 48)], config=config, repeats=1)  # fmt: skip
  assert best == (16, 48)
  calls.clear()
  jax.jit(lambda q, k, v: mda.attention(q, k, v, mask=keep, config=config))(q, k, v)
  assert calls == [("blockwise", 16, 48, q.shape)]


def test_tune_block_sizes_under_jit_raises(tmp_path):
  config = mda.AttentionConfig(tuner_cache_dir=str(tmp_path))

  def traced(x):
    mda.tune_block_sizes((1, 32, 2, 16), (1, 32, 2, 16), jnp.float32, config=config)
    return x

  with pytest.raises(RuntimeError, match="outside jax.jit"):
    jax.jit(traced)(1.0)
  assert not (tmp_path / "block_sizes.json").exists()
