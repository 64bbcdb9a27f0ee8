"""The Flux.1 and Flux.2 Klein pipelines on 8-device meshes equal the single-device run: FSDP + context
parallelism (fsdp=2, context=4, Ulysses) and pure context parallelism (context=8, ring; slow)."""

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


# Flux.2 Klein from text and reference images: 64x64 pixels (16 image tokens), one 64x64 reference (16
# tokens), 40 text tokens: every sequence the transformer sees (56, 72; 16 for the KV-cache extraction of
# the references alone) splits evenly over 4 or 8 devices.
KLEIN_KW = dict(
  height=64,
  width=64,
  num_inference_steps=2,
  max_sequence_length=40,
  text_encoder_out_layers=(1, 2, 3),
  seed=3,
  progress=False,
)
KLEIN_CASES = {"klein": dict(guidance_scale=4.0), "klein_kv": dict()}


def _reference_image():
  rng = np.random.RandomState(7)
  return rng.randint(0, 256, (64, 64, 3)).astype(np.uint8)


def _klein(folder, **kw):
  return md_flux.load_pipeline(testing.fixture_path("flux2_pipeline") / folder, **kw)


@pytest.fixture(scope="module")
def klein_single():
  """Single-device images per fixture folder, computed on first use."""
  cache = {}

  def run(folder):
    if folder not in cache:
      pipe = _klein(folder)
      cache[folder] = np.asarray(
        pipe(PROMPTS, image=_reference_image(), **KLEIN_CASES[folder], **KLEIN_KW)
      )
    return cache[folder]

  return run


@pytest.mark.filterwarnings("ignore:prompt")  # prompts cut to 40 tokens, as the reference does
@pytest.mark.parametrize(
  "folder, fsdp, context, implementation",
  [
    pytest.param("klein", 2, 4, "ulysses", marks=pytest.mark.slow),
    pytest.param("klein_kv", 2, 4, "ulysses", marks=pytest.mark.slow),
    pytest.param("klein", 1, 8, "ring", marks=pytest.mark.slow),
    pytest.param("klein_kv", 1, 8, "ring", marks=pytest.mark.slow),
  ],
)
def test_sharded_klein_matches_single_device(klein_single, folder, fsdp, context, implementation):
  """Text encoding, reference encoding, the loop (CFG edit, or the KV-cache edit) and decoding on the
  mesh equal the single-device images (same tolerance as Flux.1: f32 reductions split differently)."""
  mesh = mds.make_mesh(
    mds.MeshConfig(
      ici_data_parallelism=1, ici_fsdp_parallelism=fsdp, ici_context_parallelism=context
    )
  )
  pipe = _klein(folder, mesh=mesh, attention=mda.AttentionConfig(implementation=implementation))
  assert pipe.transformer.cfg.attention.implementation == implementation
  got = pipe(PROMPTS, image=_reference_image(), **KLEIN_CASES[folder], **KLEIN_KW)
  np.testing.assert_allclose(np.asarray(got), klein_single(folder), atol=1e-5, rtol=0)
  if fsdp > 1:
    spec = pipe.transformer.transformer_blocks.attn.to_q.kernel[...].sharding.spec
    assert tuple(spec) == (None, "fsdp", None), spec
    assert len(got.sharding.device_set) == 8
