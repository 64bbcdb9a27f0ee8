"""Pipeline folders that share components (`_md_components` in model_index.json): found by the loaders'
`resolve_source` / `pipeline.component`, copied in by `copy_pipeline`, clear errors for bad entries."""

import json

import pytest

import md_core
from md_core import pipeline as mdp


def _folder(tmp_path, shared):
  """`tmp_path/a` holds components `vae` and `unet`; `tmp_path/b` lists both and shares them per `shared`."""
  for name in ("vae", "unet"):
    (tmp_path / "a" / name).mkdir(parents=True)
    (tmp_path / "a" / name / "config.json").write_text(json.dumps({"name": name}))
  index = {"_class_name": "P", "vae": ["diffusers", "V"], "unet": ["diffusers", "U"]}
  (tmp_path / "a" / "model_index.json").write_text(json.dumps(index))
  (tmp_path / "b").mkdir()
  (tmp_path / "b" / "model_index.json").write_text(json.dumps(dict(index, _md_components=shared)))
  return tmp_path / "b"


def test_loaders_find_shared_components(tmp_path):
  b = _folder(tmp_path, {"vae": "../a/vae", "unet": "../a/unet"})
  index = md_core.read_json(b / "model_index.json")
  assert mdp.component(b, "vae", index) == tmp_path / "a" / "vae"
  assert md_core.resolve_source(b, subfolder="unet") == tmp_path / "a" / "unet"
  assert md_core.load_config(b, subfolder="vae") == {"name": "vae"}
  # The folder's own subfolder wins over the table.
  (b / "vae").mkdir()
  assert mdp.component(b, "vae", index) == b / "vae"


def test_copy_pipeline_is_self_contained(tmp_path):
  b = _folder(tmp_path, {"vae": "../a/vae"})
  (b / "unet").mkdir()
  (b / "unet" / "config.json").write_text("{}")
  out = mdp.copy_pipeline(b, tmp_path / "elsewhere" / "copy")
  assert sorted(p.name for p in out.iterdir()) == ["model_index.json", "unet", "vae"]
  assert json.loads((out / "vae" / "config.json").read_text()) == {"name": "vae"}
  assert "_md_components" not in md_core.read_json(out / "model_index.json")
  # Copying again replaces the copy.
  assert mdp.copy_pipeline(b, out) == out


def test_missing_shared_folder_is_named(tmp_path):
  b = _folder(tmp_path, {"vae": "../gone/vae"})
  index = md_core.read_json(b / "model_index.json")
  with pytest.raises(FileNotFoundError, match=r"component 'vae' is shared from '\.\./gone/vae'"):
    mdp.component(b, "vae", index)
  with pytest.raises(FileNotFoundError, match=r"gone/vae is not a folder"):
    md_core.resolve_source(b, subfolder="vae")
  # A component neither there nor in the table: the usual error.
  with pytest.raises(FileNotFoundError, match="pipeline component 'unet' is missing"):
    mdp.component(b, "unet", index)


@pytest.mark.parametrize("table", (["../a/vae"], {"vae": "/abs/vae"}, {"vae": 3}))
def test_bad_table_is_refused(tmp_path, table):
  b = _folder(tmp_path, table)
  with pytest.raises(ValueError, match="_md_components must map component names to relative"):
    md_core.resolve_source(b, subfolder="vae")
