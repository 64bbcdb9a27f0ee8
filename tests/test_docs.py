"""The docs site builds with `mkdocs build --strict` (warnings are errors), offline, and fails on a broken
reference; its API reference has an entry for every name in every package's `__all__`."""

import ast
import os
import pathlib
import re
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = sorted(p.name for p in (ROOT / "packages").iterdir() if (p / "pyproject.toml").is_file())


def _build(config: pathlib.Path, site: pathlib.Path) -> subprocess.CompletedProcess:
  env = dict(os.environ, NO_MKDOCS_2_WARNING="1", HF_HUB_OFFLINE="1")
  return subprocess.run(
    [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(config), "-d", str(site)],
    cwd=config.parent,
    env=env,
    capture_output=True,
    text=True,
    timeout=300,
  )


def _public_names(package: str) -> list[str]:
  init = next((ROOT / "packages" / package / "src").glob("*/__init__.py"))
  for node in ast.parse(init.read_text()).body:
    if isinstance(node, ast.Assign) and any(
      getattr(t, "id", "") == "__all__" for t in node.targets
    ):
      return list(ast.literal_eval(node.value))
  raise AssertionError(f"{init}: no __all__")


@pytest.fixture(scope="module")
def site(tmp_path_factory):
  site = tmp_path_factory.mktemp("site")
  result = _build(ROOT / "mkdocs.yml", site)
  assert result.returncode == 0, result.stdout + result.stderr
  return site


def test_every_page_is_in_the_nav_and_every_package_has_an_api_page(site):
  config = (ROOT / "mkdocs.yml").read_text()
  for page in (ROOT / "docs").rglob("*.md"):
    assert page.relative_to(ROOT / "docs").as_posix() in config, (
      f"{page} is not in mkdocs.yml's nav"
    )
  for package in PACKAGES:
    page = (ROOT / "docs" / "api" / f"{package}.md").read_text()
    assert f"::: {package.replace('-', '_')}\n" in page, package
  assert (site / "ARCHITECTURE" / "index.html").is_file()


@pytest.mark.parametrize("package", PACKAGES)
def test_api_reference_has_every_public_name(site, package):
  module = package.replace("-", "_")
  html = (site / "api" / package / "index.html").read_text()
  ids = set(re.findall(r'id="([\w.]+)"', html))
  missing = [n for n in _public_names(package) if f"{module}.{n}" not in ids]
  assert not missing, f"{package}: no API entry for {missing}"


@pytest.mark.parametrize(
  "page",
  [
    "See [the mesh][md_sharding.make_mesh_renamed].\n",  # a cross-reference to a name that is gone
    "::: md_sharding.make_mesh_renamed\n",  # an API entry for a name that is gone
    "See [the caches](no-such-page.md).\n",  # a link to a page that is gone
  ],
)
def test_a_broken_reference_fails_the_build(tmp_path, page):
  """The same settings as mkdocs.yml on a two-page site: the good page builds, the broken one fails."""
  docs = tmp_path / "docs"
  docs.mkdir()
  (docs / "index.md").write_text(
    "# md\n\nSee [make_mesh][md_sharding.make_mesh].\n\n::: md_sharding.make_mesh\n"
  )
  config = (ROOT / "mkdocs.yml").read_text().split("\nnav:")[0]
  (tmp_path / "mkdocs.yml").write_text(config + "\nnav:\n  - index.md\n  - broken.md\n")
  (docs / "broken.md").write_text("# broken\n\nNothing broken yet.\n")
  good = _build(tmp_path / "mkdocs.yml", tmp_path / "site")
  assert good.returncode == 0, good.stdout + good.stderr
  shutil.rmtree(tmp_path / "site")
  (docs / "broken.md").write_text("# broken\n\n" + page)
  bad = _build(tmp_path / "mkdocs.yml", tmp_path / "site")
  assert bad.returncode != 0
  assert "make_mesh_renamed" in bad.stderr or "no-such-page.md" in bad.stderr, bad.stderr
