"""Every Python code block of the docs site runs, page by page in one namespace, from the repository root,
except blocks titled "not run: …" (they need downloads or several hosts). Shell blocks (and the README's
commands) name apps, config variants and `--config.*` keys that exist."""

import importlib.util
import pathlib
import re
import shlex

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
FENCE = re.compile(r"^```(\w+)([^\n]*)\n(.*?)^```$", re.M | re.S)
NOT_RUN = 'title="not run'


def _blocks(page: pathlib.Path, language: str) -> list[tuple[str, str]]:
  """(info string, code) of the page's fenced blocks in `language`."""
  return [(m[2], m[3]) for m in FENCE.finditer(page.read_text()) if m[1] == language]


PAGES = sorted(DOCS.rglob("*.md"))
RUN_PAGES = [p for p in PAGES if any(NOT_RUN not in info for info, _ in _blocks(p, "python"))]


def test_blocks_are_found_and_every_not_run_block_says_why():
  assert len(RUN_PAGES) >= 5
  for page in PAGES:
    for info, _ in _blocks(page, "python") + _blocks(page, "bash"):
      if NOT_RUN in info:
        assert re.search(r'title="not run: \w', info), f"{page.name}: {info!r} does not say why"


@pytest.mark.parametrize("page", RUN_PAGES, ids=lambda p: p.relative_to(DOCS).as_posix())
def test_python_blocks_run(page, monkeypatch):
  monkeypatch.chdir(ROOT)  # the docs name paths from the repository root (models/…)
  namespace: dict = {"__name__": f"docs_{page.stem}"}
  for i, (info, code) in enumerate(_blocks(page, "python")):
    if NOT_RUN in info:
      continue
    exec(compile(code, f"{page.relative_to(ROOT)} block {i + 1}", "exec"), namespace)


def _variants(config: pathlib.Path) -> dict:
  spec = importlib.util.spec_from_file_location(f"_docs_cfg_{config.stem}", config)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def _default_config(app: pathlib.Path) -> str | None:
  found = re.search(
    r'"configs", "(\w+\.py)"\)(?: \+ ":([\w.\-]+)")?', (app / "__main__.py").read_text()
  )
  return found and f"apps/configs/{found[1]}" + (f":{found[2]}" if found[2] else "")


def _commands() -> list[tuple[str, str]]:
  """(where, command) for every `uv run apps/…` line of the docs' shell blocks and the README."""
  found = []
  for page in PAGES:
    for _info, code in _blocks(page, "bash"):
      found += [(page.name, line) for line in code.splitlines() if line.startswith("uv run apps/")]
  readme = (ROOT / "README.md").read_text().splitlines()
  found += [("README.md", line.strip()) for line in readme if line.startswith("    uv run apps/")]
  return found


COMMANDS = _commands()


def test_commands_are_found():
  assert len(COMMANDS) >= 20


@pytest.mark.parametrize(
  "where, command", COMMANDS, ids=[f"{w}:{i}" for i, (w, _) in enumerate(COMMANDS)]
)
def test_shell_commands_name_existing_apps_variants_and_keys(where, command):
  words = shlex.split(command, comments=True)
  app = ROOT / words[2]
  assert (app / "__main__.py").is_file(), f"{where}: no app {words[2]}"
  flags = [w[2:].split("=", 1) for w in words[3:] if w.startswith("--")]
  config_arg = dict(f for f in flags if len(f) == 2).get("config") or _default_config(app)
  if config_arg is None:
    assert not [k for k, *_ in flags if k.startswith("config.")], f"{where}: {command}"
    return
  file, _, variant = config_arg.partition(":")
  module = _variants(ROOT / file)
  config = module.get_config(variant or None)
  for key, *_ in flags:
    if not key.startswith("config."):
      continue
    node = config
    for part in key.split(".")[1:]:
      assert part in node, f"{where}: {command}: {file}:{variant} has no key {key!r}"
      node = node[part]
