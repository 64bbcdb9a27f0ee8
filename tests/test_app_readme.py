"""The README's commands and facts stay true: the apps and config variants it names exist, the docs it
points at ship with the repo, its commands never write to the same folder and can be rerun as written, CI
runs exactly its test command and installs only what it names, the main job's install leaves TensorFlow
out, no dated measurement sits in it, and its offline hint is `hf`."""

import importlib.util
import pathlib
import re
import shlex
import tomllib

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
# The README's command lines: its indented code blocks, comments dropped.
COMMANDS = [
  line.strip()
  for line in README.splitlines()
  if line.startswith("    ") and not line.strip().startswith("#")
]


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
  source = (ROOT / "packages" / "md-core" / "src" / "md_core" / "_sources.py").read_text()
  assert "hf download" in source and "huggingface-cli" not in source


def _default_workdir(app: str) -> str:
  source = (ROOT / app / "__main__.py").read_text()
  found = re.search(r"define_output_flags\(\s*\"([^\"]+)\"", source)
  return found.group(1) if found else ""


def test_readme_commands_never_collide_and_rerun():
  """Every generating command writes to its own folder and says --overwrite, so each runs again as
  written; training apps resume in their --workdir instead."""
  folders = {}
  for command in COMMANDS:
    words = shlex.split(command)
    if words[:2] != ["uv", "run"] or not words[2].startswith("apps/"):
      continue
    app = words[2]
    flags = dict(w[2:].split("=", 1) if "=" in w else (w[2:], "") for w in words[3:])
    default = _default_workdir(app)
    if not default:  # train / dreambooth / serve / md_info: no output folder refusal
      continue
    workdir = flags.get("workdir", default)
    assert workdir not in folders, f"{command!r} and {folders[workdir]!r} both write to {workdir}"
    folders[workdir] = command
    assert "overwrite" in flags, f"{command!r} is refused when run again: add --overwrite"
  assert len(folders) >= 5


def test_ci_runs_exactly_the_readme_test_command_and_readme_names_its_installs():
  ci = (ROOT / ".ci" / "run").read_text()
  ci_lines = [line for line in ci.splitlines() if line.strip() and not line.startswith("#")]
  test_command = ci_lines[-1]
  assert "pytest" in test_command
  assert test_command in COMMANDS, f"README.md does not give .ci/run's command {test_command!r}"
  for package in re.search(r"apt-get install -y -qq (.+)", ci).group(1).split():
    assert re.search(rf"apt-get install .*\b{re.escape(package)}\b", README), package
  for variable in re.findall(r"^export (\w+)=", ci, flags=re.M):
    assert variable in README, variable
  assert "UV_COMPILE_BYTECODE" not in ci  # the root pyproject's [tool.uv] compile-bytecode says it


def test_uv_settings_compile_bytecode_and_keep_tensorflow_out_of_the_main_job():
  pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
  assert pyproject["tool"]["uv"]["compile-bytecode"] is True
  groups = pyproject["dependency-groups"]
  assert not [d for d in groups["dev"] if "tfrecord" in d or "tensorflow" in d]
  assert any("tfrecord" in d for d in groups["tensorflow"])
  assert "--group tensorflow" in (ROOT / ".ci" / "run").read_text()
  # `uv run apps/...` installs the default groups only: TensorFlow must not be one of them.
  assert "tensorflow" not in pyproject["tool"]["uv"].get("default-groups", ["dev"])


def test_readmes_hold_no_dated_measurements():
  pages = [*sorted((ROOT / "packages").glob("*/README.md")), *sorted((ROOT / "docs").rglob("*.md"))]
  for readme in [ROOT / "README.md", *pages]:
    dates = re.findall(r"\b20\d\d-\d\d-\d\d\b", readme.read_text())
    assert not dates, f"{readme.relative_to(ROOT)}: dated entries {dates} belong in bench/README.md"
