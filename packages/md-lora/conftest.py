"""Shared test settings: 8 virtual CPU devices and strict numerics.

The workspace root's conftest.py holds the same settings (and, for the whole suite only, the order of the test
files), so a package's tests behave the same when run alone (`uv run --package md-core python -m pytest
packages/md-core`) and inside the whole suite.
"""

import os

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
