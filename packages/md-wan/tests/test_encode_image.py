"""`WanVideoPipeline.encode_image` against diffusers' `WanImageToVideoPipeline.encode_image` on images of
odd sizes (resized and cropped by the CLIP image processor; tests/fixtures/clip_preprocess/wan.npz, with
the image encoder and processor of tests/fixtures/wan_pipeline/i2v)."""

import numpy as np
import PIL.Image
import pytest

import md_wan
from md_core import testing

CASES = ("up_wide", "down_tall", "down_wide", "square", "rgba", "noise")
TOL = 1e-4  # measured 7e-7; the JAX resize this replaced was off by 0.03 to 1.07 on the same images


@pytest.fixture(scope="module")
def pipe():
  return md_wan.load_pipeline(testing.fixture_path("wan_pipeline") / "i2v")


@pytest.fixture(scope="module")
def ref():
  folder = testing.fixture_path("clip_preprocess")
  return testing.load_arrays(folder / "cases.npz"), testing.load_arrays(folder / "wan.npz")


@pytest.mark.parametrize("case", CASES)
def test_encode_image_matches_diffusers(pipe, ref, case):
  cases, wan = ref
  image = PIL.Image.fromarray(cases[f"{case}/image"])  # RGBA for "rgba", composited onto white
  assert pipe.image_size == 32  # every case is resized (square is 28 x 28)
  tokens = pipe.encode_image(image)
  np.testing.assert_allclose(np.asarray(tokens), wan[f"{case}/image_embeds"], atol=TOL, rtol=0)


def test_encode_image_batches_arrays_and_floats(pipe, ref):
  cases, wan = ref
  images = [cases[f"{c}/image"] for c in ("up_wide", "down_wide", "noise")]
  want = np.concatenate([wan[f"{c}/image_embeds"] for c in ("up_wide", "down_wide", "noise")])
  np.testing.assert_allclose(np.asarray(pipe.encode_image(images)), want, atol=TOL, rtol=0)
  floats = np.stack([cases["noise/image"]] * 2).astype(np.float32) / 255.0
  out = np.asarray(pipe.encode_image(floats))
  np.testing.assert_allclose(out, np.concatenate([want[2:]] * 2), atol=TOL, rtol=0)
  with pytest.raises(
    ValueError, match=r"images\[0\] must be a PIL image or .* got shape \(3, 8, 8\)"
  ):
    pipe.encode_image(np.zeros((1, 3, 8, 8), np.float32))
