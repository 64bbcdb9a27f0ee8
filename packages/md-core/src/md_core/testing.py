"""Helpers for md's tests (any package may use them)."""

import gzip
import json
import os
import pathlib

import numpy as np

# XLA flags for a test's app subprocess: the tests' models are tiny, so compiling is most of a run, and
# XLA's CPU backend optimisation (LLVM's passes) makes it about 1.6x slower (md_core.pytest_plugin sets the
# same for the test processes themselves).
FAST_COMPILE_XLA_FLAGS = (
  "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
)


def app_env(**extra: str) -> dict[str, str]:
  """The environment for a test's app subprocess: this one's, on the CPU, offline, without progress bars,
  compiling fast (`FAST_COMPILE_XLA_FLAGS`, no forced device count); `extra` adds or replaces variables."""
  env = dict(
    os.environ,
    JAX_PLATFORMS="cpu",
    HF_HUB_OFFLINE="1",
    MD_PROGRESS="0",
    XLA_FLAGS=FAST_COMPILE_XLA_FLAGS,
  )
  env.update(extra)
  return env


def repo_root() -> pathlib.Path:
  """The checkout's root: the nearest folder above this file that holds `tests/fixtures`."""
  here = pathlib.Path(__file__).resolve()
  for parent in here.parents:
    if (parent / "tests" / "fixtures").is_dir() and (parent / "packages").is_dir():
      return parent
  raise FileNotFoundError(
    f"no md checkout (a folder with tests/fixtures and packages/) above {here}"
  )


def fixture_path(name: str) -> pathlib.Path:
  """The folder of fixture set `name` (`tests/fixtures/<name>`), which must exist."""
  path = repo_root() / "tests" / "fixtures" / name
  if not path.is_dir():
    raise FileNotFoundError(
      f"fixture set {name!r} not found at {path}; run `bash tools/make_fixtures.sh {name}`"
    )
  return path


def load_manifest(name: str, folder: pathlib.Path | None = None) -> dict:
  """Reads key manifest `name`: the tensor names, shapes and dtypes of a real checkpoint
  (`<folder>/<name>.json.gz`, gzipped JSON written by tools/key_manifest.py and the fixture generators;
  `folder` defaults to tests/fixtures/manifests)."""
  path = (fixture_path("manifests") if folder is None else pathlib.Path(folder)) / f"{name}.json.gz"
  if not path.is_file():
    have = sorted(p.name.removesuffix(".json.gz") for p in path.parent.glob("*.json.gz"))
    raise FileNotFoundError(f"no key manifest {name!r} at {path}; manifests there: {have}")
  with gzip.open(path, "rt", encoding="utf-8") as f:
    return json.load(f)


def app_config(spec: str):
  """The config `--config=apps/configs/SPEC` gives an app (`"wan.py:default"`), by the apps' own loader."""
  from md_core import apps

  return apps._load_config_file(str(repo_root() / "apps" / "configs" / spec))[1]


def load_arrays(path: pathlib.Path) -> dict[str, np.ndarray]:
  """Reads an .npz written by the fixture tools into a dict of numpy arrays."""
  with np.load(path) as data:
    return {k: data[k] for k in data.files}


def load_cases(path: pathlib.Path) -> dict[str, dict[str, np.ndarray]]:
  """Reads an .npz whose keys are `case/name` into `{case: {name: array}}`."""
  cases = {}
  for key, value in load_arrays(path).items():
    case, name = key.split("/")
    cases.setdefault(case, {})[name] = value
  return cases


def base_weights(module) -> dict[tuple, np.ndarray]:
  """A module's parameters other than LoRA slots (`lora_a` / `lora_b` / `lora_gain`) as host arrays, by path:
  to check that unloading adapters gives the weights back."""
  from flax import nnx

  return {
    tuple(k): np.array(v.get_value())
    for k, v in nnx.to_flat_state(nnx.state(module))
    if k[-1] not in ("lora_a", "lora_b", "lora_gain")
  }


def lora_pipeline_errors(pipe, files, err, extra=None) -> dict:
  """The steps of a pipeline-level LoRA parity test (the fixtures tools/fixtures/lora_*_pipeline.py write):
  loads `files = (a, b)` as adapters "a" (slots of rank 8) and "b", then `err(case)` for "base" (slots in
  place, every scale 0: one compiled denoiser for all cases), "one" (a at 1.0; then each
  `extra = {label: (case, kwargs)}` as `err(case, **kwargs)`), "two" (a 0.7, b 1.3) at run time and fused,
  and "fused" (a at 0.8) at run time and fused; unloads and checks the transformer's weights come back.
  Returns `{step label: err's result}`."""
  a, b = files
  before = base_weights(pipe.transformer)
  pipe.load_lora(a, name="a", max_rank=8)
  pipe.load_lora(b, name="b")
  pipe.set_adapters({})
  errors = {"base": err("base")}
  pipe.set_adapters({"a": 1.0})
  errors["one runtime"] = err("one")
  for label, (case, kwargs) in (extra or {}).items():
    errors[label] = err(case, **kwargs)
  pipe.set_adapters({"a": 0.7, "b": 1.3})
  errors["two runtime"] = err("two")
  pipe.fuse_lora()
  errors["two fused"] = err("two")
  pipe.unfuse_lora()
  pipe.set_adapters({"a": 0.8})
  errors["fused-at-0.8 as runtime"] = err("fused")
  pipe.fuse_lora("a")
  errors["fused at 0.8"] = err("fused")
  pipe.unfuse_lora()
  pipe.unload_lora()
  after = base_weights(pipe.transformer)
  unload = max(float(np.abs(after[k] - before[k]).max()) for k in before)
  assert unload < 1e-6, f"unload_lora leaves the weights {unload:.1e} off"
  return errors


def assert_same_step_on_devices(build, counts=(1, 2), *, rtol=1e-4, atol=1e-6) -> None:
  """For each device count n, `build(n)` makes a training recipe (an `md_train.Recipe`: `state`, `step`,
  `batches`) whose state must sit on n devices; one step from each must give the first's loss (rtol 1e-5)
  and parameters (`rtol`, `atol`): data parallelism is the same arithmetic, reordered."""
  import jax

  results = []
  for n in counts:
    recipe = build(n)
    assert len(jax.tree.leaves(recipe.state.params)[0].sharding.device_set) == n
    state, metrics = recipe.step(recipe.state, next(recipe.batches))
    results.append((float(metrics["loss"]), jax.tree.map(np.asarray, state.params)))
  (loss, params), *rest = results
  for other_loss, other in rest:
    np.testing.assert_allclose(other_loss, loss, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(other), strict=True):
      np.testing.assert_allclose(b, a, rtol=rtol, atol=atol)
