"""The tiny LTX-Video pipelines on 8 virtual devices give the single-device frames (within 1e-5) with
weights FSDP-sharded, the video tokens over `context` (ring attention) and the CFG batch over `data`.

Default: (data, fsdp, context, tensor) = (1, 2, 4, 1), text-to-video, and a batch of two prompts (a CFG
batch of 4) split over `data` on (2, 1, 4, 1). Under `-m slow`: (1, 1, 8, 1), the conditioning mode
(frame-0 image + keyframe: 64 tokens with explicit coordinates) on (1, 1, 8, 1), and the official guidance
(STG with a skipped block, CFG-star: a batch of 3) on (1, 2, 4, 1).
"""

import jax
import numpy as np
import pytest

import md_ltx
import md_sharding as mds
from md_core import testing

ROOT = testing.fixture_path("ltx_pipeline")
# The fixture's tokenizer is tiny: the prompts are cut to its 8 tokens (as the reference would).
pytestmark = pytest.mark.filterwarnings("ignore:prompt .* tokens long")
PROMPTS = ["a cat surfing", "a dog running"]
# 32x32 pixels, 9 frames: a 3x4x4 latent grid, 48 tokens (64 with a keyframe), which 8 and 4 divide.
KW = dict(
  height=32, width=32, num_frames=9, num_inference_steps=2, guidance_scale=3.0,
  max_sequence_length=8, decode_timestep=0.05, decode_noise_scale=0.0, progress=False,
)  # fmt: skip


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


def _inputs(n: int, conditions: bool, stg: bool = False):
  key = jax.random.key(0)
  kw = dict(prompt=PROMPTS[:n], latents=jax.random.normal(key, (n, 8, 3, 4, 4)))
  if stg:  # the official guidance: a third batch slot with block 1's self-attention skipped
    kw.update(stg_scale=1.5, stg_blocks=[1], stg_rescale=0.7, cfg_star=True)
  if conditions:
    rng = np.random.default_rng(0)
    pics = [rng.integers(0, 256, (32, 32, 3), dtype=np.uint8) for _ in range(2)]
    kw["conditions"] = [
      md_ltx.LTXCondition(pics[0], frame_index=0, strength=0.9),
      md_ltx.LTXCondition(pics[1], frame_index=6, strength=1.0),
    ]
    kw["image_cond_noise_scale"] = 0.0
  return kw


@pytest.fixture(scope="module")
def single():
  pipe = md_ltx.load_pipeline(ROOT / "t2v")
  cache = {}

  def run(n: int, conditions: bool, stg: bool):
    if (n, conditions, stg) not in cache:
      cache[n, conditions, stg] = np.asarray(pipe(**_inputs(n, conditions, stg), **KW))
    return cache[n, conditions, stg]

  return run


def _check(single, shape, n=1, conditions=False, stg=False, **extra):
  mesh = _mesh(shape)
  pipe = md_ltx.load_pipeline(ROOT / "t2v", mesh=mesh, attention="ring")
  kernel = pipe.transformer.blocks.attn1.to_q.kernel[...]
  if mesh.shape["fsdp"] > 1:
    assert len(kernel.sharding.device_set) == 8 and kernel.sharding.spec != (None, None, None)
  got = pipe(**_inputs(n, conditions, stg), **KW, **extra)
  np.testing.assert_allclose(np.asarray(got), single(n, conditions, stg), atol=1e-5, rtol=0)


def test_sharded_fsdp_context_matches_single_device(single):
  _check(single, (1, 2, 4, 1))


@pytest.mark.slow
@pytest.mark.parametrize(
  ("shape", "n", "conditions", "stg"),
  [
    ((1, 1, 8, 1), 1, False, False),
    ((1, 1, 8, 1), 1, True, False),
    ((1, 2, 4, 1), 1, False, True),
  ],
  ids=["c8", "c8-conditions", "f2c4-stg"],
)
def test_sharded_grid_matches_single_device(single, shape, n, conditions, stg):
  _check(single, shape, n, conditions, stg)


# --- LTX-2 (audio + video) ---------------------------------------------------------------------------------

LTX2_ROOT = testing.fixture_path("ltx2_pipeline")
# 32x64, 9 frames: the tiny VAE's 2x4x8 latent grid (64 video tokens) and 8 audio latent frames, which the
# context axis divides; every guidance term on (CFG, STG on block 1, modality, rescale): 8 rows of 2.
LTX2_KW = dict(
  height=32, width=64, num_frames=9, num_inference_steps=2, spatio_temporal_guidance_blocks=[1],
  output_type="latent", progress=False,
)  # fmt: skip


def test_ltx2_data_context_matches_single_device():
  """(data, fsdp, context, tensor) = (2, 1, 4, 1): the two videos split over data, the tokens over
  context (ring attention); the latents equal one device's within 1e-5."""
  one = md_ltx.load_ltx2_pipeline(LTX2_ROOT / "pipe")
  embeds, mask = one.prompt_embeds(["a cat playing a piano", "waves on a beach"], 16)
  neg, nmask = one.prompt_embeds(["blurry", "blurry"], 16)
  keys = jax.random.split(jax.random.key(0), 2)
  kw = dict(
    prompt_embeds=embeds, prompt_attention_mask=mask, negative_prompt_embeds=neg,
    negative_prompt_attention_mask=nmask, latents=jax.random.normal(keys[0], (2, 8, 2, 4, 8)),
    audio_latents=jax.random.normal(keys[1], (2, 2, 8, 4)), **LTX2_KW,
  )  # fmt: skip
  want = one(**kw)
  mesh = _mesh((2, 1, 4, 1))
  sharded = md_ltx.load_ltx2_pipeline(LTX2_ROOT / "pipe", mesh=mesh, attention="ring")
  assert sharded.place(np.zeros((2, 3))).sharding.spec[0] == "data"
  got = sharded(**kw)
  assert sharded.last_calls == one.last_calls == 2
  np.testing.assert_allclose(np.asarray(got.frames), np.asarray(want.frames), atol=1e-5, rtol=0)
  np.testing.assert_allclose(np.asarray(got.audio), np.asarray(want.audio), atol=1e-5, rtol=0)


def test_batch_of_two_splits_over_data(single):
  """Two prompts on (data 2, context 4): the latents are split over `data` at every step and the videos
  equal the single-device ones."""
  specs = []
  _check(single, (2, 1, 4, 1), n=2, callback=lambda i, t, x: specs.append(x.sharding.spec))
  assert len(specs) == KW["num_inference_steps"] and all(s[0] == "data" for s in specs)
