"""`auto` selection (and its one log line per choice) and the block-size tuner's cache."""

import json
import logging

import jax
import jax.numpy as jnp
import pytest

import md_attention as mda
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


def test_tuner_measures_once_and_caches(tmp_path):
  config = mda.AttentionConfig(tuner_cache_dir=str(tmp_path))
  shape = (1, 96, 2, 16)
  best = mda.tune_block_sizes(shape, shape, jnp.float32, candidates=[(16, 16), (32, 96)],
                              config=config, repeats=1)  # fmt: skip
  assert best in ((16, 16), (32, 96))
  table = json.loads((tmp_path / "block_sizes.json").read_text())
  key = mda.cache_key(shape, shape, jnp.float32, "blockwise", False)
  assert tuple(table[key]) == best
  # A hit does not measure: impossible candidates are never tried.
  again = mda.tune_block_sizes(shape, shape, jnp.float32, candidates=[(0, 0)], config=config)
  assert again == best
  # attention(tune=True) picks the cached blocks and stays exact.
  q, k, v, keep, d_out = mdat.random_inputs(*shape[:2], *shape[1:], mask=True)
  tuned = mda.AttentionConfig(implementation="blockwise", tune=True, tuner_cache_dir=str(tmp_path))
  errors = mdat.max_errors(q, k, v, d_out, mask=keep, config=tuned)
  assert max(errors[n] for n in ("out", "dq", "dk", "dv")) < 2e-5


def test_tuner_miss_while_tracing_measures_for_real(tmp_path):
  q, k, v, keep, _ = mdat.random_inputs(1, 96, 96, 2, 16, mask=True)
  config = mda.AttentionConfig(implementation="blockwise", tune=True, tuner_cache_dir=str(tmp_path))
  got = jax.jit(lambda q, k, v: mda.attention(q, k, v, mask=keep, config=config))(q, k, v)
  want = mda.attention(q, k, v, mask=keep, implementation="dot_product")
  assert float(jnp.max(jnp.abs(got - want))) < 2e-5
  table = json.loads((tmp_path / "block_sizes.json").read_text())
  assert table == {mda.cache_key(q.shape, k.shape, jnp.float32, "blockwise", False): [128, 128]}
