"""Pipeline errors: what went wrong and what would work, named in the message."""

import shutil

import pytest

import md_core
import md_sd
from md_core import pipeline as mdp
from md_core import testing


@pytest.fixture(scope="module")
def root():
  return testing.fixture_path("sd_pipeline")


def test_missing_component(root, tmp_path):
  shutil.copytree(root / "sd", tmp_path / "sd")
  shutil.rmtree(tmp_path / "sd" / "vae")
  with pytest.raises(
    FileNotFoundError, match=r"component 'vae' is missing.*model_index.json lists"
  ):
    md_sd.load_pipeline(tmp_path / "sd")


def test_not_a_pipeline_folder(root):
  with pytest.raises(FileNotFoundError, match="no model_index.json"):
    md_sd.load_pipeline(root / "sd" / "unet")


def test_truncated_safetensors(root, tmp_path):
  shutil.copytree(root / "sd", tmp_path / "sd")
  f = tmp_path / "sd" / "unet" / "diffusion_pytorch_model.safetensors"
  data = f.read_bytes()
  f.write_bytes(data[: len(data) // 2])
  with pytest.raises(md_core.SafetensorsError, match="diffusion_pytorch_model.safetensors"):
    md_sd.load_pipeline(tmp_path / "sd")


def test_truncated_unet_file(root, tmp_path):
  data = (root / "lightning_unet.safetensors").read_bytes()
  (tmp_path / "unet.safetensors").write_bytes(data[:1000])
  with pytest.raises(md_core.SafetensorsError, match="unet.safetensors"):
    md_sd.load_unet_file(tmp_path / "unet.safetensors", root / "sdxl" / "unet" / "config.json")


def test_size_not_multiple_of_8():
  with pytest.raises(mdp.SizeError, match=r"height=30 → 24 or 32.*width=513 → 512 or 520"):
    md_sd.check_size(30, 513)
  with pytest.raises(mdp.SizeError, match=r"height=0 → 8"):
    md_sd.check_size(0, 64)
  md_sd.check_size(32, 64)
  md_sd.check_size(None, 64)  # None: the pipeline's default size


def test_pipeline_rejects_bad_size_and_scheduler(root):
  pipe = md_sd.load_pipeline(root / "sd")
  with pytest.raises(ValueError, match=r"height=36 → 32 or 40"):
    pipe("a cat", height=36, width=32, progress=False)
  with pytest.raises(
    ValueError, match=r"unknown scheduler 'EulerScheduler'; supported: \[.*EulerDiscreteScheduler"
  ):
    pipe("a cat", height=32, width=32, scheduler="EulerScheduler", progress=False)
  with pytest.raises(ValueError, match="latents have shape"):
    pipe(
      "a cat", height=32, width=32, latents=__import__("numpy").zeros((1, 4, 8, 8)), progress=False
    )
  with pytest.raises(ValueError, match="no ControlNet"):
    pipe(
      "a cat",
      height=32,
      width=32,
      control_image=__import__("numpy").zeros((1, 32, 32, 3)),
      progress=False,
    )
