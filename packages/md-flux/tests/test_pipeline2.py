"""Flux.2 Klein pipelines against diffusers' `Flux2KleinPipeline` / `Flux2KleinKVPipeline` run from text
and reference PNGs on a tiny random pipeline (tests/fixtures/flux2_pipeline), reference-latent
conditioning against a closed form, and input errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import md_flux
import md_schedulers as mdsch
from md_core import testing

FIXTURES = testing.fixture_path("flux2_pipeline")
PROMPTS = ["a photo of a cat", "An astronaut riding a horse on the moon"]
REFS = [FIXTURES / "ref_0.png", FIXTURES / "ref_1.png"]
TEXT = dict(max_sequence_length=40, text_encoder_out_layers=(1, 2, 3), progress=False)
SMALL = dict(height=32, width=48, **TEXT)


@pytest.fixture(scope="module")
def outputs():
  return dict(np.load(FIXTURES / "outputs.npz"))


@pytest.fixture(scope="module")
def klein():
  return md_flux.load_pipeline(FIXTURES / "klein")


def _check(got, want, what):
  got = np.asarray(got)
  assert got.shape == want.shape, (what, got.shape, want.shape)
  err = float(np.abs(got - want).max())
  assert err < 1e-3, f"{what}: max abs error {err}"


@pytest.mark.filterwarnings("ignore:prompt 1 is")  # the long prompt is cut as in the reference
def test_klein_text_to_image_matches_diffusers(klein, outputs):
  assert isinstance(klein, md_flux.Flux2KleinPipeline) and not klein.is_distilled
  embeds = klein.encode_prompt(PROMPTS, max_sequence_length=40, text_encoder_out_layers=(1, 2, 3))
  _check(embeds, outputs["t2i/prompt_embeds"], "prompt_embeds")
  images = klein(
    PROMPTS, latents=outputs["t2i/latents"], num_inference_steps=3, guidance_scale=4.0, **SMALL
  )
  _check(images, outputs["t2i/images"], "t2i images")


@pytest.mark.filterwarnings("ignore:prompt 0 is")
def test_klein_edit_matches_diffusers(klein, outputs):
  """Two reference PNGs (one centre-cropped from 100x72, one grey), two images per prompt, guidance
  on; the output size defaults to the first reference's 96x64."""
  images = klein(
    PROMPTS[1],
    image=REFS,
    num_images_per_prompt=2,
    latents=outputs["edit/latents"],
    num_inference_steps=3,
    guidance_scale=4.0,
    **TEXT,
  )
  _check(images, outputs["edit/images"], "edit images")


@pytest.mark.filterwarnings("ignore:prompt 1 is")
def test_klein_kv_edit_matches_diffusers(klein, outputs):
  """Flux2KleinKVPipeline over the same components: the KV-cache mode without guidance (the loaded
  `klein` pipeline runs it, sharing its compiled text and image programs)."""
  images = klein(
    PROMPTS,
    images=REFS,
    kv_cache=True,
    guidance_scale=1.0,
    latents=outputs["kv_edit/latents"],
    num_inference_steps=3,
    **SMALL,
  )
  _check(images, outputs["kv_edit/images"], "kv edit images")


def test_kv_checkpoint_loads_in_kv_mode():
  kv = md_flux.load_pipeline(FIXTURES / "klein_kv")
  assert kv.use_kv_cache and kv.is_distilled
  assert kv.text_encoder is not None and kv.vae is not None


def test_reference_latents_appended_with_time_offsets(klein, outputs):
  """One Euler step with two references equals the transformer on [target; ref1; ref2] with ids at
  t = 0, 10, 20, keeping only the target's prediction (the references are never updated)."""
  embeds = outputs["t2i/prompt_embeds"][:1]
  noise = outputs["t2i/latents"][:1]  # [1, 16, 2, 3]
  rng = np.random.RandomState(0)
  refs = [rng.randn(1, 2, 2, 16).astype(np.float32), rng.randn(1, 1, 3, 16).astype(np.float32)]
  sigmas = [0.8]
  z = klein(
    prompt_embeds=embeds,
    latents=noise,
    image_latents=refs,
    num_inference_steps=1,
    sigmas=sigmas,
    guidance_scale=1.0,
    output_type="latent",
    **SMALL,
  )
  # Closed form: the scheduler's shifted sigma, one step to sigma 0.
  st = mdsch.from_config(klein.scheduler_config).init(
    1, sigmas=sigmas, mu=mdsch.flux2_empirical_mu(6, 1)
  )
  s0 = float(st.sigmas[0])
  x = noise.transpose(0, 2, 3, 1).reshape(1, 6, 16)
  packed = [r.reshape(1, -1, 16) for r in refs]
  ids = np.concatenate(
    [
      md_flux.image_ids(2, 3, axes=4),
      md_flux.image_ids(2, 2, time=10.0, axes=4),
      md_flux.image_ids(1, 3, time=20.0, axes=4),
    ]
  )
  graphdef, state = nnx.split(klein.transformer)
  forward = jax.jit(lambda state, *args: nnx.merge(graphdef, state)(*args))  # eager scans are slow
  v = forward(
    state,
    jnp.concatenate([x, *packed], axis=1),
    jnp.asarray(embeds),
    jnp.full((1,), float(st.timesteps[0]) / 1000),
    jnp.asarray(ids),
    jnp.asarray(md_flux.text_ids(embeds.shape[1])),
  )[:, :6]
  want = (x + (0.0 - s0) * v) * klein.bn_std[None, None] + klein.bn_mean[None, None]
  np.testing.assert_allclose(
    np.asarray(z), np.asarray(md_flux.unpack_latents(want, 4, 6)), atol=1e-5, rtol=0
  )


def test_reference_image_preparation():
  """Sizes as the reference's image processor: large images scaled to ~1024² pixels, then centre-
  cropped to multiples of 16; small or extreme images rejected."""
  grey = np.full((1100, 1300), 128, np.uint8)
  pixels = md_flux.prepare_reference_image(grey)
  assert pixels.shape == (
    928,
    1104,
    3,
  )  # 1300x1100 (w x h) → 1113x941 (area ≤ 1024²) → multiples of 16
  assert np.abs(pixels - (128 / 255 * 2 - 1)).max() < 2.5 / 255  # Lanczos keeps a flat image flat
  from PIL import Image

  with Image.open(REFS[0]) as pil:  # a path, a PIL image and an array give the same pixels
    from_pil = md_flux.prepare_reference_image(pil)
    from_array = md_flux.prepare_reference_image(np.asarray(pil))
  from_path = md_flux.prepare_reference_image(REFS[0])
  assert from_path.shape == (64, 96, 3)  # 100x72 centre-cropped
  np.testing.assert_array_equal(from_path, from_pil)
  np.testing.assert_array_equal(from_path, from_array)
  with pytest.raises(ValueError, match=r"too small.*at least 64"):
    md_flux.prepare_reference_image(np.zeros((48, 80, 3), np.uint8), what="reference image 1")
  with pytest.raises(ValueError, match=r"aspect ratio of 9.0:1"):
    md_flux.prepare_reference_image(np.zeros((64, 576, 3), np.uint8))


def test_klein_input_errors(klein, outputs, tmp_path):
  embeds = outputs["t2i/prompt_embeds"][:1]
  one = dict(prompt_embeds=embeds, guidance_scale=1.0, **SMALL)
  ref = np.zeros((1, 2, 2, 16), np.float32)
  with pytest.raises(ValueError, match="5 reference images given; Flux.2 Klein takes at most 4"):
    klein(image=[REFS[0]] * 5, **one)
  with pytest.raises(ValueError, match="5 reference images given"):
    klein(image_latents=[ref] * 5, **one)
  with pytest.raises(ValueError, match=r"image_latents\[0\] has shape \(1, 2, 2, 8\)"):
    klein(image_latents=[ref[..., :8]], **one)
  broken = tmp_path / "broken.png"
  broken.write_text("not an image")
  with pytest.raises(ValueError, match=r"reference image 1: cannot read .*broken\.png"):
    klein(image=[REFS[0], broken], **one)
  with pytest.raises(FileNotFoundError, match=r"reference image 0: .*missing\.png"):
    klein(image=tmp_path / "missing.png", **one)
  with pytest.raises(ValueError, match="negative_prompt_embeds|not both"):
    klein("a cat", prompt_embeds=embeds, **SMALL)
  with pytest.raises(ValueError, match=r"width=40 → 32 or 48"):
    klein(prompt_embeds=embeds, height=32, width=40, progress=False)
  with pytest.raises(ValueError, match=r"height=72 → 64 or 80"):
    klein(prompt_embeds=embeds, image=REFS[0], height=72, guidance_scale=1.0, **TEXT)
  with pytest.raises(ValueError, match="output_type"):
    klein(prompt_embeds=embeds, output_type="pil", **SMALL)


def test_klein_without_text_encoder_asks_for_embeddings(klein, outputs):
  bare = md_flux.Flux2KleinPipeline(
    transformer=klein.transformer, scheduler_config=klein.scheduler_config, vae=klein.vae
  )
  with pytest.raises(ValueError, match="no text encoder.*pass prompt_embeds"):
    bare("a cat", **SMALL)
  with pytest.raises(ValueError, match="negative_prompt_embeds"):
    bare(prompt_embeds=outputs["t2i/prompt_embeds"], guidance_scale=4.0, **SMALL)
  with pytest.raises(ValueError, match="no guidance|without guidance"):
    bare(prompt_embeds=outputs["t2i/prompt_embeds"], guidance_scale=4.0, kv_cache=True, **SMALL)
