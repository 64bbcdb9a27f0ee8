"""md's pytest plugin: the settings every md test runs under, and the order of the test files.

The workspace's pyproject loads it for every run (`addopts = "-p md_core.pytest_plugin"`), the whole suite's
and one package's alone (`uv run --package md-wan python -m pytest packages/md-wan`), so both see the same:

- JAX on the CPU with 8 virtual devices (`--xla_force_host_platform_device_count=8`), unless `JAX_PLATFORMS`
  or `XLA_FLAGS` already say otherwise; the hub offline (`HF_HUB_OFFLINE=1`).
- XLA's fast-compile flags (`md_core.testing.FAST_COMPILE_XLA_FLAGS`): the tests' models are tiny, so
  compiling, not running, is most of their time, and XLA's CPU backend optimisation (LLVM's passes) makes
  compiling about 1.6x slower. Without it results move by an ulp at most (tests that compare two md programs
  allow 1e-6, not bit equality).
- Strict numerics: rank promotion raises, matmuls at the highest precision, partitionable threefry.
- The files in the order of the ini setting `md_run_first` (long files with few tests, longest first), then
  by number of tests, most first; each file's tests keep their order. With `--dist loadfile` a file runs on
  one worker, and a long file that starts last keeps that worker busy after the other has run out of work.
  The pyproject's `--no-loadscope-reorder` keeps this order (xdist's own is by test count alone).

The settings are applied when pytest loads the plugin, before any test module or conftest imports JAX's
backends; importing this module anywhere else applies them too, so only pytest should.
"""

import os
import pathlib

import pytest

from md_core.testing import FAST_COMPILE_XLA_FLAGS


def apply_settings() -> None:
  """Sets the environment and JAX's configuration described above (idempotent)."""
  os.environ.setdefault("HF_HUB_OFFLINE", "1")
  platforms = os.environ.setdefault("JAX_PLATFORMS", "cpu")
  flags = os.environ.get("XLA_FLAGS", "")
  if "xla_force_host_platform_device_count" not in flags:
    flags += " --xla_force_host_platform_device_count=8"
  if "xla_backend_optimization_level" not in flags:
    flags += " " + FAST_COMPILE_XLA_FLAGS
  os.environ["XLA_FLAGS"] = flags.strip()

  import jax

  # md_core imports JAX before this runs, so the platform goes through the config as well as the
  # environment (which the tests' subprocesses inherit); XLA reads its flags when the first backend starts.
  jax.config.update("jax_platforms", platforms)
  jax.config.update("jax_numpy_rank_promotion", "raise")
  jax.config.update("jax_default_matmul_precision", "highest")
  jax.config.update("jax_threefry_partitionable", True)


apply_settings()


def pytest_addoption(parser):
  parser.addini(
    "md_run_first",
    type="linelist",
    default=[],
    help="test files (relative to the rootdir) that start first, in this order (md_core.pytest_plugin)",
  )


@pytest.hookimpl(trylast=True)  # after `-m` has deselected
def pytest_collection_modifyitems(config, items):
  """Orders the files: `md_run_first` in its order, then by number of tests; each file's tests keep theirs."""
  run_first = config.getini("md_run_first")
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
  rank = {name: i for i, name in enumerate(run_first)}

  def key(item):
    name = names[item]
    return rank.get(name, len(run_first)), -counts[name], first[name]

  items.sort(key=key)
