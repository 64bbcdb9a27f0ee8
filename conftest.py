"""Shared test settings: 8 virtual CPU devices and strict numerics.

Every package's conftest.py holds the same settings (this file down to the `jax.config` lines), so a package's
tests behave the same when run alone (`uv run --package md-core python -m pytest packages/md-core`) and inside
the whole suite. The file order below matters only for the whole suite, so it lives here alone.
"""

import os
import pathlib

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
_flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in _flags:
  _flags += " --xla_force_host_platform_device_count=8"
# The tests' models are tiny, so compiling, not running, is most of their time; XLA's CPU backend
# optimisation (LLVM's passes) makes compiling about 1.6x slower. Without it results move by an ulp at
# most (tests that compare two md programs allow 1e-6, not bit equality).
if "xla_backend_optimization_level" not in _flags:
  _flags += " --xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
os.environ["XLA_FLAGS"] = _flags.strip()

import jax  # noqa: E402

jax.config.update("jax_numpy_rank_promotion", "raise")
jax.config.update("jax_default_matmul_precision", "highest")
jax.config.update("jax_threefry_partitionable", True)


# Long files with few tests, longest first. With `--dist loadfile` a file runs on one worker, and a long
# file that starts last keeps that worker busy after the other has run out of work. These start first;
# the other files follow by test count, most first (xdist's own order, which pyproject's
# `--no-loadscope-reorder` turns off so that this one is kept), and the short ones fill in at the end.
RUN_FIRST = (
  "tests/test_train_app.py",  # ~180 s: two training runs, a kill and a resume
  "tests/test_prepare_data.py",  # ~60 s: the prepare_data app as a subprocess, TensorFlow's import
  "tests/test_train_records.py",  # ~120 s: prepare_data then apps/train, both subprocesses
  "tests/test_ltx2_generate_app.py",  # the app subprocesses that generate, each compiling a pipeline
  "tests/test_ltx_generate_app.py",
  "tests/test_wan_generate_app.py",
  "tests/test_flux_generate_app.py",
  "tests/test_sd_generate_app.py",
  "tests/test_app_interrupt.py",
  "packages/md-sharding/tests/test_multihost.py",
  "tests/test_flux_pipeline_sharded.py",  # whole pipelines on 8 devices
  "tests/test_sd_pipeline_sharded.py",
  "tests/test_ltx_pipeline_sharded.py",
  "tests/test_wan_pipeline_sharded.py",
  "tests/test_md_info_app.py",
)


@pytest.hookimpl(trylast=True)  # after `-m` has deselected
def pytest_collection_modifyitems(config, items):
  """Orders the files: `RUN_FIRST` in its order, then by number of tests; each file's tests keep theirs."""
  root = pathlib.Path(config.rootpath)
  names = {}
  for item in items:
    try:
      names[item] = pathlib.Path(item.path).relative_to(root).as_posix()
    except ValueError:
      names[item] = str(item.path)
  counts, first = {}, {}
  for i, item in enumerate(items):
    counts[names[item]] = counts.get(names[item], 0) + 1
    first.setdefault(names[item], i)
  rank = {name: i for i, name in enumerate(RUN_FIRST)}

  def key(item):
    name = names[item]
    return rank.get(name, len(RUN_FIRST)), -counts[name], first[name]

  items.sort(key=key)
