"""Every app config variant can be changed from the command line: absl's `--config.<key>=<value>` refuses
to override a setting whose value is a bare None (its type unknown), so optional settings are typed
placeholders (`ml_collections.config_dict.placeholder(float)`), never None."""

import importlib.util
import pathlib

import ml_collections
import pytest
from absl import flags
from ml_collections import config_flags

from md_core import testing

ROOT = pathlib.Path(__file__).resolve().parents[1]
CONFIGS = sorted((ROOT / "apps" / "configs").glob("*.py"))


def _untyped_nones(config: ml_collections.ConfigDict, prefix: str = "") -> list[str]:
  out = []
  for key in config.keys():
    value = config[key]
    if isinstance(value, ml_collections.ConfigDict):
      out += _untyped_nones(value, f"{prefix}{key}.")
    elif value is None:
      field = config._fields.get(key)
      if not isinstance(field, ml_collections.FieldReference) or field.get_type() is type(None):
        out.append(prefix + key)
  return out


def _variants(path: pathlib.Path) -> list[str | None]:
  spec = importlib.util.spec_from_file_location(f"_config_{path.stem}", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  variants = getattr(module, "VARIANTS", None)
  return list(variants) if isinstance(variants, dict) else [None]


def test_the_check_finds_a_bare_none():
  config = ml_collections.ConfigDict(
    dict(a=None, b=ml_collections.config_dict.placeholder(float), c=dict(d=None, e=1))
  )
  assert _untyped_nones(config) == ["a", "c.d"]


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_no_variant_has_a_setting_the_command_line_cannot_override(path):
  for variant in _variants(path):
    spec = path.name if variant is None else f"{path.name}:{variant}"
    assert _untyped_nones(testing.app_config(spec)) == [], spec


def _parsed(argv: list[str]) -> ml_collections.ConfigDict:
  """The config absl gives an app for `argv` (config_flags reads the overrides from `sys_argv`)."""
  values = flags.FlagValues()
  config_flags.DEFINE_config_file("config", flag_values=values, sys_argv=argv)
  values(argv)
  return values.config


def test_ema_decay_is_set_from_the_command_line():
  spec = "--config=" + str(ROOT / "apps" / "configs" / "default_models.py") + ":wan"
  # Unset: the recipe exports the trained weights.
  assert _parsed(["train", spec]).recipe_options.ema_decay is None
  got = _parsed(["train", spec, "--config.recipe_options.ema_decay=0.999"])
  assert got.recipe_options.ema_decay == 0.999
