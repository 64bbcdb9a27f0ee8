"""A cache that measures the model decides as the reference batches the guidance branches: once for the
batch where diffusers runs them in one call (LTX-Video), per branch where it runs one call per branch.

Against diffusers' FirstBlockCache on the tiny LTX-Video pipeline (tests/fixtures/cache_joint,
tools/fixtures/cache_joint.py) at a threshold where, at step 1, the negative branch's own change is above
it and the joint change below: diffusers reuses that step, a per-branch decision would compute it.
"""

import numpy as np
import pytest

import md_cache
import md_ltx
from md_core import testing

REF = testing.load_arrays(testing.fixture_path("cache_joint") / "outputs.npz")
PROMPT = "a cat surfing a wave at sunset"
NEGATIVE = "worst quality, blurry"


@pytest.fixture(scope="module")
def pipe():
  return md_ltx.load_pipeline(testing.fixture_path("ltx_pipeline") / "t2v")


def test_ltx_first_block_cache_decides_for_the_batch(pipe):
  threshold = float(REF["threshold"])
  # The fixture's case: the branches part at a step the joint measure reuses.
  joint, branches = REF["diffs"], REF["branch_diffs"]
  parted = [
    s for s in range(1, len(joint)) if np.any((branches[s] > threshold) != (joint[s] > threshold))
  ]
  assert parted and not REF["computed"][parted[0]]
  out = pipe(
    PROMPT, NEGATIVE, latents=REF["latents"], height=32, width=32, num_frames=9,
    num_inference_steps=len(joint), guidance_scale=3.0, max_sequence_length=8,
    output_type="latent", progress=False, cache=md_cache.first_block_cache(threshold),
  )  # fmt: skip
  computed = np.asarray(pipe.last_cache.computed)
  np.testing.assert_array_equal(computed, REF["computed"])
  want = np.asarray(REF["out"]).reshape(1, 3, 4, 4, 8).transpose(0, 4, 1, 2, 3)
  err = float(np.abs(np.asarray(out) - want).max())
  print(f"computed {computed.astype(int)}, latents max abs error {err:.2e}")
  assert err < 1e-3, err
