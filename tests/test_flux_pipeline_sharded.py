"""The Flux.1 pipeline on 8-device meshes equals the single-device run: FSDP + context parallelism
(fsdp=2, context=4, Ulysses) and pure context parallelism (context=8, ring; slow)."""

import numpy as np
import pytest

import md_attention as mda
import md_flux
import md_sharding as mds
from md_core import testing

# 64x64 pixels: 16 image tokens + 8 text tokens = 24, split evenly over 4 or 8 devices.
KW = dict(height=64, width=64, num_inference_steps=1, max_sequence_length=8, seed=1, progress=False)
PROMPTS = ["a cat", "a dog"]


@pytest.fixture(scope="module")
def single():
  pipe = md_flux.load_pipeline(testing.fixture_path("flux_pipeline") / "dev")
  return np.asarray(pipe(PROMPTS, guidance_scale=3.5, **KW))


@pytest.mark.parametrize(
  "fsdp, context, implementation",
  [(2, 4, "ulysses"), pytest.param(1, 8, "ring", marks=pytest.mark.slow)],
)
def test_sharded_pipeline_matches_single_device(single, fsdp, context, implementation):
  mesh = mds.make_mesh(
    mds.MeshConfig(
      ici_data_parallelism=1, ici_fsdp_parallelism=fsdp, ici_context_parallelism=context
    )
  )
  assert dict(mesh.shape) == {"data": 1, "fsdp": fsdp, "context": context, "tensor": 1}
  pipe = md_flux.load_pipeline(
    testing.fixture_path("flux_pipeline") / "dev",
    mesh=mesh,
    attention=mda.AttentionConfig(implementation=implementation),
  )
  assert pipe.transformer.cfg.attention.implementation == implementation
  got = pipe(PROMPTS, guidance_scale=3.5, **KW)
  np.testing.assert_allclose(np.asarray(got), single, atol=1e-5, rtol=0)
  if fsdp > 1:
    spec = pipe.transformer.transformer_blocks.attn.to_q.kernel[...].sharding.spec
    assert tuple(spec) == (None, "fsdp", None), spec
    assert len(got.sharding.device_set) == 8
