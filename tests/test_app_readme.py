"""The README's commands and facts stay true: the apps and config variants it names exist, the docs it
points at ship with the repo, its test count is not a number that drifts, and its offline hint is `hf`."""

import importlib.util
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def _variants(config: str) -> list[str]:
  spec = importlib.util.spec_from_file_location("_cfg", ROOT / config)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return list(module.VARIANTS) if hasattr(module, "VARIANTS") else ["default"]


def test_readme_commands_name_existing_apps_and_variants():
  commands = re.findall(
    r"uv run (apps/\w+) --config=(apps/configs/\w+\.py)(?::([\w.\-]+))?", README
  )
  assert len(commands) >= 5
  for app, config, variant in commands:
    assert (ROOT / app / "__main__.py").is_file(), app
    assert (ROOT / config).is_file(), config
    if variant:
      assert variant in _variants(config), (config, variant)


def test_readme_links_exist_and_no_drifting_numbers():
  for link in re.findall(r"\]\(([^)#]+)\)", README):
    if not link.startswith("http"):
      assert (ROOT / link).exists(), link
  assert "DESIGN.md" not in README
  assert not re.search(r"\(\d{3,} tests\)", README)  # the count comes from --collect-only
  assert (ROOT / "docs" / "ARCHITECTURE.md").is_file()


def test_config_docstrings_name_existing_variants():
  for config in sorted((ROOT / "apps" / "configs").glob("*.py")):
    text = config.read_text()
    for name, variant in re.findall(r"--config=apps/configs/(\w+\.py):([\w.\-]+)", text):
      assert variant in _variants(f"apps/configs/{name}"), (config.name, variant)


def test_offline_hint_names_hf():
  from md_core import _sources

  source = pathlib.Path(_sources.__file__).read_text()
  assert "hf download" in source and "huggingface-cli" not in source
