"""Block-size tuner: time the local kernel once per problem, keep the winner in a JSON file.

A problem is what one device runs: the local kernel (`blockwise` or `splash`, also inside the ring
steps and Ulysses) on the q / kv shard shapes that the mesh's batch, head and context splits leave
it, plus dtype, causality, window, device kind and the mesh's axis sizes. `tune_block_sizes` runs
eagerly (never under a trace): it builds concrete local-shaped arrays, times forward + backward of
the kernel that `_attention._local` builds for each candidate and writes the winner atomically.
`attention(config=AttentionConfig(tune=True))` only reads the file while tracing; on a miss it
uses the config's blocks and warns once per key.
"""

from __future__ import annotations

import itertools
import json
import os
import pathlib
import tempfile
import time
import warnings
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from md_attention import _sharding as shd
from md_attention._config import CONTEXT_PARALLEL_IMPLEMENTATIONS, AttentionConfig
from md_attention._context_parallel import ulysses_degree
from md_attention._dot_product import normalize_window

DEFAULT_CANDIDATES = (128, 256, 512, 1024)
TUNED_KERNELS = ("blockwise", "splash")
_CACHE_FILE = "block_sizes.json"
_WARNED: set[tuple[str, str]] = set()  # (cache file, key) pairs already warned about


class LocalProblem(NamedTuple):
  """What one device's kernel call sees."""

  kernel: str  # the local kernel: "blockwise", "splash", or one without blocks ("dot_product", ...)
  q_shape: tuple  # [B, S_q, H, D] per device and kernel call
  kv_shape: tuple  # [B, S_kv, H_kv, D]


def _round_up(n: int, m: int) -> int:
  return -(-n // m) * m


def _resolve_local(implementation: str, s_kv: int, config: AttentionConfig) -> str:
  # As `_attention._local` resolves "auto".
  if implementation == "auto":
    return "blockwise" if s_kv >= config.min_seq_length else "dot_product"
  return implementation


def local_problem(q_shape, kv_shape, implementation: str, mesh, config: AttentionConfig):
  """The local kernel and the per-device q / kv shapes `attention` gives it on `mesh`.

  Mirrors `attention` and `context_parallel_attention`: batch and heads split as `config.rules`
  place `ACTIVATION_AXES`, K/V heads repeated as `fit_kv_heads` does; ring steps see `S / ring`
  (padded) of the sequence, Ulysses the whole sequence and `1 / (degree x chunks)` of the heads,
  cross-attention under context parallelism `S_q / context` queries and all keys.
  """
  b, s_q, h, d = (int(n) for n in q_shape)
  s_kv, h_kv = int(kv_shape[1]), int(kv_shape[2])
  if implementation in CONTEXT_PARALLEL_IMPLEMENTATIONS:
    ctx = config.context_axis
    if mesh is None or ctx not in mesh.shape:
      axes = None if mesh is None else tuple(mesh.shape)
      raise ValueError(
        f"implementation={implementation!r} shards the sequence over mesh axis {ctx!r}, but the "
        f"mesh is {axes}: pass mesh=... with that axis or set AttentionConfig(context_axis=...)"
      )
    context = mesh.shape[ctx]
    s_pad = _round_up(s_q, context)
    b_spec, h_spec = shd.activation_specs(mesh, config.rules, (b, s_pad, h, d))
    b_local = b // shd.spec_size(mesh, b_spec)
    tensor = shd.spec_size(mesh, h_spec)
    local_heads = h // tensor
    inner = _resolve_local(config.local_implementation, max(s_q, s_kv), config)
    if s_q != s_kv:
      kv_heads = shd.fit_kv_head_count(h, h_kv, tensor) // tensor
      return LocalProblem(inner, (b_local, s_pad // context, local_heads, d),
                          (b_local, s_kv, kv_heads, d))  # fmt: skip
    degree = ulysses_degree(implementation, context, local_heads, h, config)
    ring = context // degree
    split = degree * config.ulysses_chunks if degree > 1 else 1
    kv_heads = shd.fit_kv_head_count(h, h_kv, tensor * split) // (tensor * split)
    seq = s_pad // ring
    kernel = "blockwise" if ring > 1 else inner  # ring steps run blockwise tiles
    return LocalProblem(
      kernel, (b_local, seq, local_heads // split, d), (b_local, seq, kv_heads, d)
    )
  if mesh is None or mesh.size == 1:
    return LocalProblem(implementation, (b, s_q, h, d), (b, s_kv, h_kv, d))
  b_spec, h_spec = shd.activation_specs(mesh, config.rules, (b, s_q, h, d))
  b_local, tensor = b // shd.spec_size(mesh, b_spec), shd.spec_size(mesh, h_spec)
  kv_heads = shd.fit_kv_head_count(h, h_kv, tensor) // tensor
  return LocalProblem(implementation, (b_local, s_q, h // tensor, d), (b_local, s_kv, kv_heads, d))


def _cache_path(cache_dir: str | None) -> pathlib.Path:
  if cache_dir is None:
    cache_dir = os.environ.get("MD_ATTENTION_CACHE", os.path.expanduser("~/.cache/md_attention"))
  return pathlib.Path(cache_dir) / _CACHE_FILE


def _mesh_sizes(mesh) -> str:
  if mesh is None:
    return "none"
  return ",".join(f"{name}={size}" for name, size in mesh.shape.items())


def _key(problem: LocalProblem, dtype, implementation, causal, window, mesh) -> str:
  kind = jax.devices()[0].device_kind
  return (
    f"{implementation}>{problem.kernel}|q={problem.q_shape}|kv={problem.kv_shape}|"
    f"{jnp.dtype(dtype).name}|causal={causal}|window={window}|{kind}|mesh={_mesh_sizes(mesh)}"
  )


def cache_key(
  q_shape,
  kv_shape,
  dtype,
  *,
  implementation: str = "blockwise",
  causal: bool = False,
  window=None,
  mesh=None,
  config: AttentionConfig | None = None,
) -> str:
  """The tuner's cache key for global `[B, S, H, D]` shapes run by `implementation` on `mesh`.

  It holds the implementation and its local kernel, the per-device q / kv shapes, dtype, causality,
  the normalized window, the device kind and the mesh's axis sizes (`mesh=None`: the context mesh,
  if any, as in `attention`).
  """
  config = AttentionConfig() if config is None else config
  mesh = shd.context_mesh() if mesh is None else mesh
  window = normalize_window(window, causal)
  problem = local_problem(q_shape, kv_shape, implementation, mesh, config)
  return _key(problem, dtype, implementation, causal, window, mesh)


def _read(path: pathlib.Path) -> dict:
  try:
    return json.loads(path.read_text())
  except FileNotFoundError:
    return {}
  except json.JSONDecodeError:
    # A file that is not ours or got truncated: start over rather than fail the caller.
    return {}


def _write(path: pathlib.Path, table: dict) -> None:
  path.parent.mkdir(parents=True, exist_ok=True)
  fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
  try:
    with os.fdopen(fd, "w") as f:
      json.dump(table, f, indent=1, sort_keys=True)
    os.replace(tmp, path)  # atomic: readers see the old or the new table, never half of one
  except BaseException:
    os.unlink(tmp)
    raise


def _tracing(*xs) -> bool:
  """Whether this runs under a trace: some input is a tracer, or new arrays become tracers."""
  return any(isinstance(x, jax.core.Tracer) for x in xs) or isinstance(
    jnp.zeros(()), jax.core.Tracer
  )


def _measure(fn, args, repeats: int) -> float:
  jax.block_until_ready(fn(*args))  # compile and warm up
  best = float("inf")
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    best = min(best, time.perf_counter() - start)
  return best


def _time_candidates(problem, dtype, causal, window, config, candidates, repeats) -> dict:
  from md_attention import _attention  # at call time: _attention imports this module

  rng = np.random.default_rng(0)
  q = jnp.asarray(rng.standard_normal(problem.q_shape), dtype)
  k = jnp.asarray(rng.standard_normal(problem.kv_shape), dtype)
  v = jnp.asarray(rng.standard_normal(problem.kv_shape), dtype)
  s_q, s_kv = problem.q_shape[1], problem.kv_shape[1]
  kv_valid = jnp.ones((problem.kv_shape[0], s_kv), bool)
  q_pos, k_pos = jnp.arange(s_q, dtype=jnp.int32), jnp.arange(s_kv, dtype=jnp.int32)
  scale = float(problem.q_shape[3]) ** -0.5
  timings = {}
  for bq, bk in candidates:
    local = _attention._local(
      problem.kernel, causal=causal, scale=scale, config=config, block_q=bq, block_kv=bk,
      s_kv=s_kv, has_mask=False, window=window,
    )  # fmt: skip

    def loss(q, k, v, local=local):
      return jnp.sum(local(q, k, v, kv_valid, q_pos, k_pos).astype(jnp.float32))

    fn = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
    timings[(bq, bk)] = _measure(fn, (q, k, v), repeats)
  return timings


def tune_block_sizes(
  q_shape,
  kv_shape,
  dtype,
  *,
  implementation: str = "blockwise",
  causal: bool = False,
  window=None,
  mesh=None,
  config: AttentionConfig | None = None,
  candidates=None,
  repeats: int = 3,
) -> tuple[int, int]:
  """The fastest `(block_q, block_kv)` for `attention` on these global shapes; call it eagerly.

  Derives the per-device problem from the mesh (`local_problem`), returns the cached winner if
  there is one, and otherwise times forward + backward of the local kernel on concrete
  local-shaped arrays (all keys valid) for each candidate and writes the winner into
  `<tuner_cache_dir or $MD_ATTENTION_CACHE or ~/.cache/md_attention>/block_sizes.json`. Run it
  before jitting the program that calls `attention(..., config=AttentionConfig(tune=True))`, with
  the same shapes, implementation, causality, window, mesh and config.

  Args:
    q_shape: global `(B, S_q, H, D)`.
    kv_shape: global `(B, S_kv, H_kv, D)`.
    dtype: input dtype.
    implementation: one whose local kernel has blocks: "blockwise", "splash", "ring",
      "ulysses_ring", or "ulysses" when its local implementation resolves to blockwise.
    causal: whether the attention is causal.
    window: as in `attention`.
    mesh: the mesh `attention` will run on; None: the context mesh, if any.
    config: rules, context axis, Ulysses settings and `tuner_cache_dir`.
    candidates: `(block_q, block_kv)` pairs to try; default: all pairs of 128..1024 that do not
      exceed the local lengths (rounded up to 128).
    repeats: timed runs per candidate (the minimum counts).

  Returns:
    `(block_q, block_kv)`.

  Raises:
    RuntimeError: when called under a trace (jit, eval_shape, ...), or for `splash` off TPU.
    ValueError: for an implementation without blocks on this problem.
  """
  if _tracing():
    raise RuntimeError(
      "md_attention.tune_block_sizes measures kernels and writes its cache file, so it must run "
      "eagerly: call it outside jax.jit (before tracing the program that calls attention with "
      "AttentionConfig(tune=True), which then only looks the cache up)"
    )
  config = AttentionConfig() if config is None else config
  if implementation == "auto":
    raise ValueError("tune_block_sizes needs a concrete implementation, got 'auto'")
  mesh = shd.context_mesh() if mesh is None else mesh
  window = normalize_window(window, causal)
  problem = local_problem(q_shape, kv_shape, implementation, mesh, config)
  if problem.kernel not in TUNED_KERNELS:
    raise ValueError(
      f"implementation={implementation!r} runs {problem.kernel!r} on each device here, which has "
      f"no block sizes; the tuner times {' / '.join(TUNED_KERNELS)} (also inside ring steps and "
      "Ulysses with local_implementation='blockwise')"
    )
  if problem.kernel == "splash" and jax.default_backend() != "tpu":
    raise RuntimeError(f"splash runs on TPU only, the backend is {jax.default_backend()!r}")
  path = _cache_path(config.tuner_cache_dir)
  key = _key(problem, dtype, implementation, causal, window, mesh)
  hit = _read(path).get(key)
  if hit is not None:
    return tuple(hit)

  if candidates is None:
    limit_q = _round_up(problem.q_shape[1], DEFAULT_CANDIDATES[0])
    limit_kv = _round_up(problem.kv_shape[1], DEFAULT_CANDIDATES[0])
    candidates = [
      (bq, bk)
      for bq, bk in itertools.product(DEFAULT_CANDIDATES, DEFAULT_CANDIDATES)
      if bq <= limit_q and bk <= limit_kv
    ]
  timings = _time_candidates(problem, dtype, causal, window, config, candidates, repeats)
  best = min(timings, key=timings.get)
  table = _read(path)  # another process may have added entries meanwhile
  table[key] = list(best)
  _write(path, table)
  return best


def tuned_blocks(
  q, k, *, implementation, causal, window, mesh, config: AttentionConfig
) -> tuple[int, int]:
  """`attention`'s block sizes under `tune=True` (`window` already normalized).

  Under a trace it only reads the cache: on a miss it returns the config's blocks and warns once
  per key. Eagerly it tunes on a miss.
  """
  problem = local_problem(q.shape, k.shape, implementation, mesh, config)
  if problem.kernel not in TUNED_KERNELS:
    return config.block_q, config.block_kv
  if not _tracing(q, k):
    return tune_block_sizes(
      q.shape, k.shape, q.dtype, implementation=implementation, causal=causal, window=window,
      mesh=mesh, config=config,
    )  # fmt: skip
  path = _cache_path(config.tuner_cache_dir)
  key = _key(problem, q.dtype, implementation, causal, window, mesh)
  hit = _read(path).get(key)
  if hit is not None:
    return tuple(hit)
  if (str(path), key) not in _WARNED:
    _WARNED.add((str(path), key))
    warnings.warn(
      f"md_attention: no tuned block sizes for {key} in {path}; using block_q={config.block_q}, "
      f"block_kv={config.block_kv}. The tuner does not measure while tracing: tune ahead of time, "
      f"outside jit, with md_attention.tune_block_sizes({tuple(q.shape)}, {tuple(k.shape)}, "
      f"{jnp.dtype(q.dtype).name}, implementation={implementation!r}, causal={causal}, "
      f"window={window}, mesh=mesh, config=config).",
      stacklevel=3,
    )
  return config.block_q, config.block_kv
