"""The layers hold and every package declares what it imports: import-linter's layers contract (root
pyproject `[tool.importlinter]`) and a declared-vs-imported check over each package's source (every
import statement, function-level ones too, against its pyproject), each shown to fail on a deliberate
upward / undeclared import."""

from __future__ import annotations

import ast
import functools
import importlib.metadata
import pathlib
import re
import shutil
import subprocess
import sys
import tomllib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]

# Dependencies a package needs at run time without importing them by name (plugins, back ends).
RUNTIME_ONLY = {
  # transformers' tokenizer back ends and chat templates
  "md-text": {"tokenizers", "sentencepiece", "protobuf", "jinja2"},
}
# The third-party dependencies `pip install md-schedulers` must not pull (md-core's `models` extra).
HEAVY = {"flax", "orbax-checkpoint", "huggingface-hub", "imageio", "imageio-ffmpeg", "absl-py",
         "ml-collections", "pillow"}  # fmt: skip


# Distributions that provide a module under another distribution's name (when not installed, a module
# maps to its own name: `tensorflow`).
SAME_MODULE = {"tensorflow-cpu": "tensorflow"}


def _norm(name: str) -> str:
  name = re.sub(r"[-_.]+", "-", name).lower()
  return SAME_MODULE.get(name, name)


def _requirement(spec: str) -> tuple[str, set[str]]:
  """`("md-core", {"models"})` for `"md-core[models]>=1"`."""
  m = re.match(r"\s*([A-Za-z0-9_.-]+)\s*(?:\[([^\]]*)\])?", spec)
  extras = {e.strip() for e in (m.group(2) or "").split(",") if e.strip()}
  return _norm(m.group(1)), extras


def declared(pyproject: pathlib.Path) -> set[str]:
  """The distributions a pyproject declares: dependencies and every optional extra."""
  project = tomllib.loads(pyproject.read_text())["project"]
  specs = list(project.get("dependencies", []))
  for extra in project.get("optional-dependencies", {}).values():
    specs += extra
  return {_requirement(s)[0] for s in specs} - {_norm(project["name"])}


def imported_modules(src: pathlib.Path) -> dict[str, str]:
  """`{top-level module: first file:line importing it}` over every .py under `src` (absolute
  imports anywhere in a file, function-level ones included)."""
  out: dict[str, str] = {}
  for file in sorted(src.rglob("*.py")):
    for node in ast.walk(ast.parse(file.read_text(), str(file))):
      if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
      elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
        names = [node.module]
      else:
        continue
      for name in names:
        out.setdefault(name.split(".")[0], f"{file}:{node.lineno}")
  return out


@functools.cache
def _distributions() -> dict[str, list[str]]:
  return importlib.metadata.packages_distributions()


def distribution_of(module: str) -> str | None:
  """The distribution that provides a top-level module (None: the standard library)."""
  if module in sys.stdlib_module_names or module == "__future__":
    return None
  if module.startswith("md_"):
    return _norm(module.replace("_", "-"))
  dists = _distributions().get(module)
  return _norm(dists[0]) if dists else _norm(module)


def dependency_problems(package: pathlib.Path, runtime_only: set[str] = frozenset()) -> list[str]:
  """What a package imports without declaring it, and declares without importing it (one line each)."""
  own = package.name.replace("-", "_")
  have = declared(package / "pyproject.toml")
  used: dict[str, str] = {}
  for module, where in imported_modules(package / "src").items():
    dist = distribution_of(module)
    if dist is not None and module != own:
      used.setdefault(dist, where)
  lines = [
    f"{package.name}: imports {d} undeclared ({w})" for d, w in used.items() if d not in have
  ]
  lines += [
    f"{package.name}: declares {d} but never imports it"
    for d in sorted(have - set(used) - set(runtime_only))
  ]
  return lines


def test_every_package_declares_exactly_what_it_imports():
  lines = []
  for package in sorted((ROOT / "packages").glob("md-*")):
    lines += dependency_problems(package, RUNTIME_ONLY.get(package.name, set()))
  assert not lines, "\n".join(lines)


def test_the_dependency_check_catches_an_undeclared_import(tmp_path):
  package = tmp_path / "md-thing"
  (package / "src" / "md_thing").mkdir(parents=True)
  (package / "pyproject.toml").write_text(
    '[project]\nname = "md-thing"\ndependencies = ["md-core", "numpy>=1.26", "optax"]\n'
  )
  (package / "src" / "md_thing" / "__init__.py").write_text(
    "import numpy as np\n\n\ndef f():\n  import md_core\n  import md_flux  # upward and undeclared\n"
  )
  lines = dependency_problems(package)
  assert any(line.startswith("md-thing: imports md-flux undeclared") for line in lines), lines
  assert "md-thing: declares optax but never imports it" in lines
  assert not any("md-core" in line or "numpy" in line for line in lines), lines


def _lint_imports(cwd: pathlib.Path, *args: str, pythonpath: str | None = None):
  env = None
  if pythonpath is not None:
    import os

    env = dict(os.environ, PYTHONPATH=pythonpath)
  exe = shutil.which("lint-imports") or str(pathlib.Path(sys.executable).with_name("lint-imports"))
  return subprocess.run(
    [exe, "--no-cache", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
  )


def test_layers_contract_is_kept():
  out = _lint_imports(ROOT)
  assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
  assert "md layers KEPT" in out.stdout


def test_layers_contract_breaks_on_an_upward_import(tmp_path):
  """The root pyproject's own contract over stand-in packages, one of which (md_core) imports a family
  inside a function: lint-imports fails and names the import."""
  settings = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
  for name in settings["root_packages"]:
    (tmp_path / name).mkdir()
    (tmp_path / name / "__init__.py").write_text("")
  (tmp_path / "md_core" / "apps.py").write_text("def f():\n  import md_flux\n")
  contract = settings["contracts"][0]
  layers = ", ".join(f'"{layer}"' for layer in contract["layers"])
  roots = ", ".join(f'"{r}"' for r in settings["root_packages"])
  (tmp_path / "pyproject.toml").write_text(
    f"[tool.importlinter]\nroot_packages = [{roots}]\n\n[[tool.importlinter.contracts]]\n"
    f'name = "{contract["name"]}"\ntype = "layers"\nlayers = [{layers}]\n'
  )
  out = _lint_imports(tmp_path, pythonpath=str(tmp_path))
  assert out.returncode != 0, out.stdout
  assert "md layers BROKEN" in out.stdout and "md_core.apps -> md_flux" in out.stdout, out.stdout


def _closure(name: str, extras: set[str], seen: set[str]) -> set[str]:
  """The third-party distributions `pip install <name>[extras]` pulls from the workspace pyprojects."""
  project = tomllib.loads((ROOT / "packages" / name / "pyproject.toml").read_text())["project"]
  specs = list(project.get("dependencies", []))
  for extra in extras:
    specs += project.get("optional-dependencies", {}).get(extra, [])
  out = set()
  for spec in specs:
    dist, more = _requirement(spec)
    if dist.startswith("md-"):
      if (dist, frozenset(more)) not in seen:
        seen.add((dist, frozenset(more)))
        out |= _closure(dist, more, seen)
    else:
      out.add(dist)
  return out


def test_md_schedulers_installs_without_the_model_dependencies():
  pulled = _closure("md-schedulers", set(), set())
  assert "jax" in pulled and not pulled & HEAVY, sorted(pulled & HEAVY)
  code = (
    "import sys, md_schedulers, md_core\n"
    "md_core.block_hook, md_core.resolve_source, md_core.progress.progress_enabled\n"
    f"print(sorted(m for m in {sorted(HEAVY | {'PIL', 'absl', 'orbax', 'huggingface_hub'})!r}"
    " if m.replace('-', '_') in sys.modules))\n"
  )
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
  assert out.returncode == 0, out.stderr[-2000:]
  assert out.stdout.strip() == "[]", out.stdout


if __name__ == "__main__":
  pytest.main([__file__, "-n", "0"])


def test_md_core_lazy_names_match_its_static_imports():
  """md_core loads its names on first use (`_NAMES`); the `TYPE_CHECKING` imports (what type checkers
  and the API docs read) name the same objects, and `__all__` lists exactly those."""
  import md_core

  tree = ast.parse((ROOT / "packages/md-core/src/md_core/__init__.py").read_text())
  block = next(
    n for n in tree.body if isinstance(n, ast.If) and ast.unparse(n.test) == "TYPE_CHECKING"
  )
  static = {}
  for node in block.body:
    for alias in node.names:
      static[alias.asname or alias.name] = (node.module, alias.name)
  modules = {k for k, (m, _) in static.items() if m == "md_core"}
  assert modules == set(md_core._MODULES)
  assert {k: v for k, v in static.items() if k not in modules} == md_core._NAMES
  assert sorted(md_core.__all__) == sorted(static)
  for name in md_core.__all__:
    assert getattr(md_core, name) is not None, name
