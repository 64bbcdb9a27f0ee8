"""Flux.1 pipelines against diffusers' `FluxPipeline` on tiny random pipelines (tests/fixtures/flux_pipeline)."""

import pathlib
import warnings

import jax.numpy as jnp
import numpy as np
import pytest

import md_flux

FIXTURES = pathlib.Path(__file__).resolve().parents[3] / "tests" / "fixtures" / "flux_pipeline"
PROMPTS = ["a photo of a cat", "an astronaut riding a horse on the moon"]
COMMON = dict(height=32, width=48, num_inference_steps=3, max_sequence_length=8, progress=False)
ATOL = 1e-3


@pytest.fixture(scope="module")
def outputs():
  return dict(np.load(FIXTURES / "outputs.npz"))


@pytest.fixture(scope="module")
def dev():
  return md_flux.load_pipeline(FIXTURES / "dev")


@pytest.fixture(scope="module")
def schnell():
  return md_flux.load_pipeline(FIXTURES / "schnell")


def _close(got, want):
  got = np.asarray(got)
  assert got.shape == want.shape
  err = float(np.abs(got - want).max())
  assert err < ATOL, f"max abs error {err}"


def test_dev_text_to_image(dev, outputs):
  with warnings.catch_warnings():
    warnings.simplefilter(
      "ignore"
    )  # the second prompt is longer than 8 T5 tokens, as in the reference
    images = dev(PROMPTS, guidance_scale=3.5, latents=outputs["dev/latents"], **COMMON)
  _close(images, outputs["dev/images"])


def test_dev_true_cfg_and_images_per_prompt(dev, outputs):
  images = dev(
    "a dog",
    "a cat",
    true_cfg_scale=3.0,
    num_images_per_prompt=2,
    guidance_scale=2.0,
    latents=outputs["dev_true_cfg/latents"],
    **COMMON,
  )
  _close(images, outputs["dev_true_cfg/images"])


def test_dev_prompt_embeds(dev, outputs):
  images = dev(
    prompt_embeds=outputs["dev_embeds/prompt_embeds"],
    pooled_prompt_embeds=outputs["dev_embeds/pooled_prompt_embeds"],
    guidance_scale=4.0,
    latents=outputs["dev_embeds/latents"],
    **COMMON,
  )
  _close(images, outputs["dev_embeds/images"])


def test_schnell(schnell, outputs):
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    images = schnell(PROMPTS, guidance_scale=0.0, latents=outputs["schnell/latents"], **COMMON)
  _close(images, outputs["schnell/images"])


def test_same_seed_same_images(schnell):
  kw = dict(COMMON, num_inference_steps=1)
  a = schnell("a dog", seed=3, **kw)
  b = schnell("a dog", seed=3, **kw)
  c = schnell("a dog", seed=4, **kw)
  assert a.shape == (1, 32, 48, 3) and a.dtype == jnp.float32
  np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert float(jnp.abs(a - c).max()) > 1e-3
  assert 0.0 <= float(a.min()) and float(a.max()) <= 1.0


def test_pack_roundtrip():
  x = jnp.arange(2 * 4 * 6 * 3, dtype=jnp.float32).reshape(2, 4, 6, 3)
  packed = md_flux.pack_latents(x)
  assert packed.shape == (2, 6, 12)
  # The reference's layout: feature index = channel * 4 + row-in-patch * 2 + column-in-patch.
  np.testing.assert_array_equal(packed[0, 1, 4 + 2 + 1], x[0, 1, 3, 1])
  np.testing.assert_array_equal(md_flux.unpack_latents(packed, 4, 6), x)


def test_size_error_names_nearest_sizes(schnell):
  with pytest.raises(ValueError, match=r"height=40 → 32 or 48.*"):
    schnell("a dog", height=40, width=48, num_inference_steps=1, progress=False)
  with pytest.raises(ValueError, match=r"width=8 → 16"):
    md_flux.check_size(32, 8)


def test_input_errors(dev, outputs):
  with pytest.raises(
    ValueError, match=r"latents have shape \(2, 6, 16\); expected the packed \(1, 6, 16\)"
  ):
    dev("a dog", latents=outputs["dev/latents"], **COMMON)
  with pytest.raises(ValueError, match="also need pooled_prompt_embeds"):
    dev(prompt_embeds=outputs["dev_embeds/prompt_embeds"], **COMMON)
  with pytest.raises(ValueError, match="pass prompt"):
    dev(**COMMON)


def test_load_errors(tmp_path):
  with pytest.raises(FileNotFoundError, match="no model_index.json"):
    md_flux.load_pipeline(tmp_path)
  (tmp_path / "model_index.json").write_text('{"_class_name": "StableDiffusionPipeline"}')
  with pytest.raises(ValueError, match="is not one md loads here"):
    md_flux.load_pipeline(tmp_path)
