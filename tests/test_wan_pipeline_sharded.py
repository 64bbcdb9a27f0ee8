"""The tiny Wan T2V pipeline on 8 virtual devices gives the single-device frames (within 1e-5) with weights
FSDP-sharded, heads over `tensor`, the 16 video tokens over `context` (ring / Ulysses / 2D Ulysses x ring)
and the CFG batch of 2 over `data`.

The default run checks two representative (mesh, attention) pairs; the full grid of meshes
(data, fsdp, context, tensor) = (1,1,8,1), (2,1,4,1), (1,2,2,2) times blockwise / ring / ulysses /
ulysses_ring runs under `-m slow` (one pipeline load and one compile per pair).
"""

import jax
import numpy as np
import pytest

import md_sharding as mds
import md_wan
from md_core import testing

ROOT = testing.fixture_path("wan_pipeline")
# 32x64 pixels, 5 frames: latents 2x4x8, tokens 2x2x4 = 16, which 8, 4 and 2 context shards divide.
KW = dict(
  height=32, width=64, num_frames=5, num_inference_steps=2, guidance_scale=5.0, progress=False
)
MESHES = {"c8": (1, 1, 8, 1), "d2c4": (2, 1, 4, 1), "f2c2t2": (1, 2, 2, 2)}
ATTENTION = ("blockwise", "ring", "ulysses", "ulysses_ring")


def _mesh(shape):
  d, f, c, t = shape
  return mds.make_mesh(
    mds.MeshConfig(
      ici_data_parallelism=d,
      ici_fsdp_parallelism=f,
      ici_context_parallelism=c,
      ici_tensor_parallelism=t,
    )
  )


@pytest.fixture(scope="module")
def single():
  pipe = md_wan.load_pipeline(ROOT / "t2v")
  embeds = pipe.encode_prompt(["a cat surfing a wave at sunset"])
  negative = pipe.encode_prompt([""])
  latents = jax.random.normal(jax.random.key(0), (1, 4, 2, 4, 8))
  inputs = dict(prompt_embeds=embeds, negative_prompt_embeds=negative, latents=latents)
  return inputs, np.asarray(pipe(**inputs, **KW))


def _check(single, mesh_name, attention):
  inputs, want = single
  mesh = _mesh(MESHES[mesh_name])
  pipe = md_wan.load_pipeline(ROOT / "t2v", mesh=mesh, attention=attention)
  kernel = pipe.transformer.blocks.attn1.to_q.kernel[...]
  if mesh.shape["fsdp"] > 1 or mesh.shape["tensor"] > 1:
    assert len(kernel.sharding.device_set) == 8 and kernel.sharding.spec != (None, None, None)
  got = pipe(**inputs, **KW)
  assert len(got.sharding.device_set) == 8
  np.testing.assert_allclose(np.asarray(got), want, atol=1e-5, rtol=0)


@pytest.mark.parametrize(("mesh_name", "attention"), [("d2c4", "ring"), ("f2c2t2", "ulysses_ring")])
def test_sharded_matches_single_device(single, mesh_name, attention):
  _check(single, mesh_name, attention)


@pytest.mark.slow
@pytest.mark.parametrize("mesh_name", sorted(MESHES))
@pytest.mark.parametrize("attention", ATTENTION)
def test_sharded_grid_matches_single_device(single, mesh_name, attention):
  if attention == "ulysses" and mesh_name == "c8":
    # 4 heads cannot be split 8 ways; the pipeline says so before compiling anything.
    pipe = md_wan.load_pipeline(ROOT / "t2v", mesh=_mesh(MESHES["c8"]), attention="ulysses")
    with pytest.raises(ValueError, match="Ulysses degrees that work"):
      pipe(**single[0], **KW)
    return
  _check(single, mesh_name, attention)


def test_batch_of_two_splits_over_data(single):
  """Two videos on (data 2, context 4): the latents are split over `data` and each video equals the
  single-device one."""
  inputs, want = single
  two = {k: np.concatenate([np.asarray(v)] * 2) for k, v in inputs.items()}
  pipe = md_wan.load_pipeline(ROOT / "t2v", mesh=_mesh(MESHES["d2c4"]), attention="ring")
  specs = []
  got = pipe(**two, **KW, callback=lambda i, t, x: specs.append(x.sharding.spec))
  assert specs and all(s[0] == "data" for s in specs)
  for video in np.asarray(got):
    np.testing.assert_allclose(video, want[0], atol=1e-5, rtol=0)
