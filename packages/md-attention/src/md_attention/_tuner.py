"""Block-size tuner: time candidate blocks once per (shape, dtype, device kind, implementation).

Winners go to a small JSON file so later processes reuse them without measuring. Measuring runs the
forward and backward pass on random inputs of the given shape, outside any trace (it builds its own
concrete arrays, so it may be called while tracing the caller's program).
"""

from __future__ import annotations

import itertools
import json
import os
import pathlib
import time

import jax
import jax.numpy as jnp
import numpy as np

from md_attention._config import AttentionConfig

DEFAULT_CANDIDATES = (128, 256, 512, 1024)
_CACHE_FILE = "block_sizes.json"


def _cache_path(cache_dir: str | None) -> pathlib.Path:
  if cache_dir is None:
    cache_dir = os.environ.get("MD_ATTENTION_CACHE", os.path.expanduser("~/.cache/md_attention"))
  return pathlib.Path(cache_dir) / _CACHE_FILE


def cache_key(q_shape, kv_shape, dtype, implementation: str, causal: bool) -> str:
  """The cache key: shapes, dtype, device kind, implementation and causality."""
  kind = jax.devices()[0].device_kind
  return (
    f"{implementation}|q={tuple(q_shape)}|kv={tuple(kv_shape)}|{jnp.dtype(dtype).name}|"
    f"{kind}|causal={causal}"
  )


def _read(path: pathlib.Path) -> dict:
  try:
    return json.loads(path.read_text())
  except FileNotFoundError:
    return {}
  except json.JSONDecodeError:
    # A torn write from a crashed run: start over rather than fail the caller.
    return {}


def _write(path: pathlib.Path, table: dict) -> None:
  path.parent.mkdir(parents=True, exist_ok=True)
  tmp = path.with_suffix(f".{os.getpid()}.tmp")
  tmp.write_text(json.dumps(table, indent=1, sort_keys=True))
  tmp.replace(path)  # atomic: concurrent readers see the old or the new table, never half of one


def _measure(fn, args, repeats: int) -> float:
  out = fn(*args)
  assert not isinstance(jax.tree.leaves(out)[0], jax.core.Tracer), "tuner is measuring a trace"
  jax.block_until_ready(out)  # compile and warm up
  best = float("inf")
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    best = min(best, time.perf_counter() - start)
  return best


def tune_block_sizes(
  q_shape,
  kv_shape,
  dtype,
  *,
  implementation: str = "blockwise",
  causal: bool = False,
  candidates=None,
  config: AttentionConfig | None = None,
  repeats: int = 3,
) -> tuple[int, int]:
  """Returns the fastest `(block_q, block_kv)` for these shapes, measuring only on a cache miss.

  Args:
    q_shape: `(B, S_q, H, D)`.
    kv_shape: `(B, S_kv, H, D)`.
    dtype: input dtype.
    implementation: "blockwise" or "splash".
    causal: whether the attention is causal.
    candidates: `(block_q, block_kv)` pairs to try; default: all pairs of 128..1024 that do not exceed
      the padded lengths.
    config: supplies `tuner_cache_dir`.
    repeats: timed runs per candidate (the minimum counts).

  Returns:
    `(block_q, block_kv)`.
  """
  from md_attention._attention import attention  # local import: _attention imports this module

  config = AttentionConfig() if config is None else config
  if implementation not in ("blockwise", "splash"):
    raise ValueError(f"the tuner measures 'blockwise' or 'splash', got {implementation!r}")
  path = _cache_path(config.tuner_cache_dir)
  key = cache_key(q_shape, kv_shape, dtype, implementation, causal)
  table = _read(path)
  if key in table:
    return tuple(table[key])

  if candidates is None:
    limit_q = max(DEFAULT_CANDIDATES[0], q_shape[1])
    limit_kv = max(DEFAULT_CANDIDATES[0], kv_shape[1])
    candidates = [
      (bq, bk)
      for bq, bk in itertools.product(DEFAULT_CANDIDATES, DEFAULT_CANDIDATES)
      if bq <= limit_q and bk <= limit_kv
    ]
  rng = np.random.default_rng(0)
  timings = {}
  # When called while the caller's program is being traced, run the measurements for real instead
  # of adding them to that program.
  with jax.ensure_compile_time_eval():
    q = jnp.asarray(rng.standard_normal(q_shape), dtype)
    k = jnp.asarray(rng.standard_normal(kv_shape), dtype)
    v = jnp.asarray(rng.standard_normal(kv_shape), dtype)
    for bq, bk in candidates:
      cfg = AttentionConfig(implementation=implementation, block_q=bq, block_kv=bk)

      def loss(q, k, v, cfg=cfg):
        return jnp.sum(attention(q, k, v, causal=causal, config=cfg).astype(jnp.float32))

      fn = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
      timings[(bq, bk)] = _measure(fn, (q, k, v), repeats)
  best = min(timings, key=timings.get)
  table = _read(path)  # another process may have added entries meanwhile
  table[key] = list(best)
  _write(path, table)
  return best
