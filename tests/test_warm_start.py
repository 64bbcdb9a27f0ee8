"""Warm starts: an app's first run writes every program it compiles to the persistent compilation cache
(md_core.apps.CACHE_MIN_COMPILE_SECONDS = 0), and a second run of the same command finds them all there
(it writes no new cache entry). Times are bench/warm_start.py's (bench/README.md), not asserted here."""

import subprocess
import sys

import jax

from md_core import apps
from md_core.testing import app_env, repo_root


def _entries(cache):
  return sorted(p.name for p in cache.rglob("*") if p.is_file() and "atime" not in p.name)


def test_second_run_of_an_app_compiles_nothing_new(tmp_path):
  cache = tmp_path / "cache"
  env = app_env(MD_COMPILATION_CACHE=str(cache))
  args = [sys.executable, "apps/sd_generate", "--config=apps/configs/sd.py:tiny"]
  first = subprocess.run(
    [*args, f"--workdir={tmp_path / 'a'}"], cwd=repo_root(), env=env, capture_output=True,
    text=True, timeout=600,
  )  # fmt: skip
  assert first.returncode == 0, first.stderr[-2000:]
  written = _entries(cache)
  assert len(written) >= 5, written  # text encoders, the loop's chunks, the VAE decode, small ops
  second = subprocess.run(
    [*args, f"--workdir={tmp_path / 'b'}"], cwd=repo_root(), env=env, capture_output=True,
    text=True, timeout=600,
  )  # fmt: skip
  assert second.returncode == 0, second.stderr[-2000:]
  assert _entries(cache) == written


def test_configure_jax_caches_every_program_unless_told(tmp_path, monkeypatch):
  keys = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs")
  before = {k: getattr(jax.config, k) for k in keys}
  try:
    apps.configure_jax(compilation_cache=tmp_path / "c")
    assert jax.config.jax_compilation_cache_dir == str(tmp_path / "c")
    assert jax.config.jax_persistent_cache_min_compile_time_secs == 0.0
    monkeypatch.setenv("MD_CACHE_MIN_COMPILE_SECONDS", "2.5")
    apps.configure_jax(compilation_cache=tmp_path / "c")
    assert jax.config.jax_persistent_cache_min_compile_time_secs == 2.5
  finally:
    for k, v in before.items():
      jax.config.update(k, v)
