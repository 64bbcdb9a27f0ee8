"""Wan pipelines against diffusers' WanPipeline / WanImageToVideoPipeline on tiny saved pipelines
(tests/fixtures/wan_pipeline, built by tools/fixtures/wan_pipeline.py): same latents and prompts, 3 UniPC
steps, frames within 1e-3 (measured: below 1e-6). The flf2v/ case is Wan 2.1 FLF2V (first and last frame)."""

import dataclasses
import functools
import json

import jax
import numpy as np
import pytest
from flax import nnx

import md_core
import md_schedulers as mdsch
import md_sharding as mds
import md_wan
from md_core import testing
from md_core.pipeline import SizeError

PROMPT = "a cat surfing a wave at sunset"
NEGATIVE = "bright colors, overexposed, static, blurred details, worst quality, low quality"
ROOT = testing.fixture_path("wan_pipeline")

# case → (folder, call settings the fixture used)
CASES = {
  "t2v": ("t2v", dict(num_frames=9)),  # the fixture asked 8, which the reference rounds to 9
  "i2v": ("i2v", dict(num_frames=5)),
  "t2v_a14b": ("t2v_a14b", dict(num_frames=5, guidance_scale=4.0, guidance_scale_2=3.0)),
  "i2v_a14b": ("i2v_a14b", dict(num_frames=9, guidance_scale=3.5, guidance_scale_2=2.0)),
  "ti2v": ("ti2v", dict(num_frames=5, width=64)),
  "ti2v_image": ("ti2v", dict(num_frames=5, width=64)),
  "flf2v": ("flf2v", dict(num_frames=9)),
}


@pytest.fixture(scope="module")
def ref():
  return testing.load_arrays(ROOT / "outputs.npz")


@pytest.fixture(scope="module")
def t2v():
  return md_wan.load_pipeline(ROOT / "t2v")


def _run(pipe, ref, case, **extra):
  _, kw = CASES[case]
  kw = dict(height=32, width=32, num_inference_steps=3, guidance_scale=5.0, progress=False) | kw
  for name in ("image", "last_image"):
    if f"{case}/{name}" in ref:
      kw[name] = ref[f"{case}/{name}"]
  kw = dict(latents=ref[f"{case}/latents"]) | kw | extra
  return pipe(PROMPT, NEGATIVE, **kw)


def test_t2v_matches_reference(t2v, ref):
  out = _run(t2v, ref, "t2v")
  assert out.shape == (1, 9, 32, 32, 3)
  np.testing.assert_allclose(np.asarray(out), ref["t2v/frames"], atol=1e-3, rtol=0)
  # The text states: trimmed at the prompt's length and zero-padded, as the reference.
  embeds = t2v.encode_prompt([PROMPT], 226)
  np.testing.assert_allclose(np.asarray(embeds), ref["t2v/prompt_embeds"], atol=1e-5, rtol=0)


def test_t2v_precomputed_embeds_and_seed(t2v, ref):
  """Precomputed embeddings give the prompt's result; the same seed gives the same video."""
  kw = dict(height=32, width=32, num_frames=9, num_inference_steps=3, progress=False)
  a = t2v(
    prompt_embeds=t2v.encode_prompt([PROMPT]),
    negative_prompt_embeds=t2v.encode_prompt([NEGATIVE]),
    latents=ref["t2v/latents"],
    **kw,
  )
  np.testing.assert_allclose(np.asarray(a), ref["t2v/frames"], atol=1e-3, rtol=0)
  b = t2v(PROMPT, NEGATIVE, seed=3, **kw)
  c = t2v(PROMPT, NEGATIVE, seed=3, **kw)
  np.testing.assert_array_equal(np.asarray(b), np.asarray(c))
  assert float(np.abs(np.asarray(b) - np.asarray(a)).max()) > 1e-2


@pytest.mark.parametrize("case", ["i2v", "t2v_a14b", "i2v_a14b", "ti2v", "ti2v_image"])
def test_matches_reference(ref, case):
  pipe = md_wan.load_pipeline(ROOT / CASES[case][0])
  out = _run(pipe, ref, case)
  np.testing.assert_allclose(np.asarray(out), ref[f"{case}/frames"], atol=1e-3, rtol=0)
  if case == "i2v":
    image = np.asarray(ref["i2v/image"], np.float32)[None] / 255.0
    tokens = pipe.encode_image(image)
    np.testing.assert_allclose(np.asarray(tokens), ref["i2v/image_embeds"], atol=1e-4, rtol=0)


def test_i2v_image_forms(ref):
  """Wan 2.1 I2V takes the image forms every family takes (`md_core.images`): uint8 `[H, W, 3]`, its floats
  `[1, H, W, 3]` in [0, 1] and a PIL image give bit-identical videos (uint8 scaled on the host as
  `md_core.images` does), and the uint8 one is the reference's."""
  from PIL import Image

  pipe = md_wan.load_pipeline(ROOT / "i2v")
  image = ref["i2v/image"]
  assert image.dtype == np.uint8 and image.ndim == 3
  base = np.asarray(_run(pipe, ref, "i2v"))
  np.testing.assert_allclose(base, ref["i2v/frames"], atol=1e-3, rtol=0)
  floats = md_core.images.pixel_values(image)[None]  # [1, H, W, 3]
  for form in (floats[0], Image.fromarray(image), floats):
    np.testing.assert_array_equal(np.asarray(_run(pipe, ref, "i2v", image=form)), base)
  with pytest.raises(ValueError, match="image: expected one image per call; got a batch of 2"):
    _run(pipe, ref, "i2v", image=np.stack([floats[0]] * 2))


def test_per_layer_views_match_reference(ref, monkeypatch):
  """The pipeline's CPU path with every stacked transformer parameter passed per layer
  (`md_core.layer_views`, on here for the tiny weights too): the two-expert video stays within the
  reference tolerance."""
  import md_core._scan

  every = functools.partial(md_core._scan.layer_views, min_bytes=0)
  monkeypatch.setattr(md_core._scan, "layer_views", every)
  pipe = md_wan.load_pipeline(ROOT / CASES["t2v_a14b"][0])
  out = _run(pipe, ref, "t2v_a14b")
  np.testing.assert_allclose(np.asarray(out), ref["t2v_a14b/frames"], atol=1e-3, rtol=0)
  for split in (pipe._t1, pipe._t2):
    kernel = split.jit_state()["blocks"]["ffn"]["proj_in"]["kernel"].get_value()
    assert isinstance(kernel, md_core.LayerViews)


@pytest.mark.slow
def test_flf2v_two_videos_per_prompt(flf2v, ref):
  """Two videos of one prompt from the reference's noise: each is the reference's video (the image tokens
  stay paired first/last per video)."""
  latents = np.concatenate([ref["flf2v/latents"]] * 2)
  out = _run(flf2v, ref, "flf2v", latents=latents, num_videos_per_prompt=2)
  for video in np.asarray(out):
    np.testing.assert_allclose(video, ref["flf2v/frames"][0], atol=1e-3, rtol=0)


@pytest.fixture(scope="module")
def flf2v():
  return md_wan.load_pipeline(ROOT / "flf2v")


def test_flf2v_matches_reference(flf2v, ref):
  """Wan 2.1 FLF2V: first and last frame, both images' CLIP tokens through the learned position table."""
  assert flf2v.transformer.cfg.pos_embed_seq_len == 34
  out = _run(flf2v, ref, "flf2v")
  assert out.shape == (1, 9, 32, 32, 3)
  np.testing.assert_allclose(np.asarray(out), ref["flf2v/frames"], atol=1e-3, rtol=0)
  images = np.stack([ref["flf2v/image"], ref["flf2v/last_image"]]).astype(np.float32) / 255.0
  tokens = flf2v.encode_image(images)
  np.testing.assert_allclose(np.asarray(tokens), ref["flf2v/image_embeds"], atol=1e-4, rtol=0)


def test_flf2v_transformer_pairs_images_per_video(flf2v, ref):
  """Two videos' image tokens [first 1, last 1, first 2, last 2] → one 34-token sequence per video."""
  r = {k.split("/", 1)[1]: v for k, v in ref.items() if k.startswith("flf2v_transformer/")}
  graphdef, state = nnx.split(flf2v.transformer)
  out = jax.jit(lambda st, *a: nnx.merge(graphdef, st)(*a))(
    state,
    r["hidden_states"],
    r["timestep"],
    r["encoder_hidden_states"],
    r["encoder_hidden_states_image"],
  )
  np.testing.assert_allclose(np.asarray(out), r["sample"], atol=1e-4, rtol=0)


def test_flf2v_errors(flf2v, ref):
  image = ref["flf2v/image"]
  with pytest.raises(ValueError, match="first/last-frame checkpoint .* pass last_image="):
    flf2v(PROMPT, image=image, height=32, width=32, num_frames=9)
  with pytest.raises(
    ValueError, match=r"image_embeds has shape \(1, 17, 20\); .* \[2, tokens, 20\]"
  ):
    flf2v(
      PROMPT,
      image=image,
      last_image=image,
      image_embeds=ref["flf2v/image_embeds"][:1],
      height=32,
      width=32,
      num_frames=9,
    )


def test_two_expert_switch_is_static():
  """The 3 steps (timesteps 1000, 857, 600) cross the 0.875 boundary after the first."""
  index = json.loads((ROOT / "t2v_a14b" / "model_index.json").read_text())
  assert index["boundary_ratio"] == 0.875 and index["transformer_2"][0] is not None
  sched = mdsch.load(ROOT / "t2v_a14b")
  ts = np.asarray(sched.init(3, shape=(1, 2, 4, 4, 4)).timesteps)
  assert len(ts) == 3 and (ts >= 875).sum() == 1


def test_size_errors_name_valid_values(t2v):
  with pytest.raises(
    SizeError, match=r"height=40 is not a multiple of 16; the nearest valid: 32 or 48"
  ):
    t2v(PROMPT, height=40, width=32, num_frames=5)
  with pytest.raises(
    SizeError, match=r"width=20 is not a multiple of 16; the nearest valid: 16 or 32"
  ):
    t2v(PROMPT, height=32, width=20, num_frames=5)
  with pytest.raises(SizeError, match="num_frames=0 must be >= 1"):
    t2v(PROMPT, height=32, width=32, num_frames=0)
  with pytest.raises(SizeError, match=r"num_frames=8 is not 4k \+ 1; the nearest valid: 5 or 9"):
    t2v(PROMPT, height=32, width=32, num_frames=8)
  with pytest.raises(ValueError, match=r"expected \[B, C, F, H, W\] = \(1, 4, 2, 2, 2\)"):
    t2v(PROMPT, height=16, width=16, num_frames=5, latents=np.zeros((1, 4, 3, 2, 2), np.float32))


def test_image_errors(t2v):
  i2v_like = md_wan.WanVideoPipeline(
    transformer=t2v.transformer,
    vae=t2v.vae,
    text_encoder=t2v.text_encoder,
    tokenizer=t2v.tokenizer,
    scheduler_config=t2v.scheduler_config,
    image_to_video=True,
  )
  with pytest.raises(ValueError, match="image-to-video checkpoint: pass image="):
    i2v_like(PROMPT, height=32, width=32, num_frames=5)
  with pytest.raises(ValueError, match="text-to-video checkpoint"):
    t2v(PROMPT, image=np.zeros((32, 32, 3), np.uint8), height=32, width=32, num_frames=5)
  with pytest.raises(ValueError, match="last_image needs image"):
    t2v(PROMPT, last_image=np.zeros((32, 32, 3)), height=32, width=32, num_frames=5)


def _with(t2v, transformer, mesh):
  return md_wan.WanVideoPipeline(
    transformer=transformer,
    vae=t2v.vae,
    text_encoder=t2v.text_encoder,
    tokenizer=t2v.tokenizer,
    scheduler_config=t2v.scheduler_config,
    mesh=mesh,
  )


def test_heads_not_divisible_by_tensor_or_ulysses_degree(t2v):
  """The tiny transformer has 4 heads: tensor=8 cannot split them, nor Ulysses over 8 context shards."""
  pipe = _with(t2v, t2v.transformer, mds.make_mesh(mds.MeshConfig(ici_tensor_parallelism=8)))
  with pytest.raises(
    ValueError, match="num_attention_heads=4 is not divisible by the mesh's tensor"
  ):
    pipe(PROMPT, height=32, width=32, num_frames=5)
  cfg = dataclasses.replace(t2v.transformer.cfg, attention="ulysses")
  uly = nnx.eval_shape(lambda: md_wan.WanTransformer(cfg, rngs=nnx.Rngs(0)))
  pipe = _with(t2v, uly, mds.make_mesh(mds.MeshConfig(ici_context_parallelism=8)))
  with pytest.raises(ValueError, match="attention='ulysses' splits the 4 heads"):
    pipe(PROMPT, height=32, width=32, num_frames=5)


def test_latent_output_callback_and_cancel(t2v, ref):
  """`output_type="latent"` gives the reference-layout latents that decode to the frames; `callback` sees
  every step with the schedule's timesteps; `cancel` stops at a step boundary."""
  seen = []
  z = _run(
    t2v, ref, "t2v", output_type="latent", callback=lambda i, t, x: seen.append((i, float(t)))
  )
  assert z.shape == (1, 4, 3, 4, 4)  # [B, C, F, H, W]
  frames = t2v.decode(np.transpose(np.asarray(z), (0, 2, 3, 4, 1)))
  np.testing.assert_allclose(np.asarray(frames), ref["t2v/frames"], atol=1e-3, rtol=0)
  sched = t2v.make_scheduler()
  want = np.asarray(sched.init(3, shape=(1, 3, 4, 4, 4)).timesteps, np.float32)
  assert [i for i, _ in seen] == [0, 1, 2]
  np.testing.assert_allclose([t for _, t in seen], want)
  assert t2v.last_calls == 3
  with pytest.raises(mdsch.Cancelled, match="cancelled at step 1/3"):
    _run(t2v, ref, "t2v", cancel=lambda: True)
  with pytest.raises(ValueError, match="output_type='pil': expected 'np' or 'latent'"):
    _run(t2v, ref, "t2v", output_type="pil")
