"""SD pipelines against diffusers' on the tiny saved pipelines (tests/fixtures/sd_pipeline: 3 steps, 32 px).

Each case repeats the reference's call (the settings below) on md's loaded pipeline and compares the float
images (output_type="np") within 1e-3. Pipelines load once per module; each distinct shape and setting
compiles once. The default suite covers every feature path once (SD 1.x with and without CFG, SD 2
v-prediction, SDXL, an SDXL-Lightning UNet file without CFG, SD and SDXL ControlNet); other schedulers and
combinations are under `-m slow`.
"""

import numpy as np
import pytest

import md_schedulers as mdsch
import md_sd
from md_core import testing

ATOL = 1e-3
PROMPTS = ["a photo of a cat", "an astronaut riding a horse on the moon"]
COMMON = dict(height=32, width=32, num_inference_steps=3, progress=False)
SCHEDULER = {
  "ddim": "DDIMScheduler",
  "euler": "EulerDiscreteScheduler",
  "dpm": "DPMSolverMultistepScheduler",
}


@pytest.fixture(scope="module")
def root():
  return testing.fixture_path("sd_pipeline")


@pytest.fixture(scope="module")
def outputs(root):
  return testing.load_cases(root / "outputs.npz")


@pytest.fixture(scope="module")
def features():
  """Cases of tests/fixtures/sd_features (tools/fixtures/sd_features.py) that reuse this module's loops."""
  return testing.load_cases(testing.fixture_path("sd_features") / "outputs.npz")


@pytest.fixture(scope="module")
def sd(root):
  return md_sd.load_pipeline(root / "sd")


@pytest.fixture(scope="module")
def sdxl(root):
  return md_sd.load_pipeline(root / "sdxl")


@pytest.fixture(scope="module")
def sd2(root):
  return md_sd.load_pipeline(root / "sd2")


def check(images, want):
  images = np.asarray(images)
  assert images.shape == want.shape and images.dtype == np.float32
  err = float(np.abs(images - want).max())
  print(f"max abs error {err:.2e}")  # shown with pytest -rP
  assert err < ATOL, f"max abs error {err:.2e}"


@pytest.mark.parametrize(
  "sched",
  [
    "ddim",
    pytest.param("euler", marks=pytest.mark.slow),
    pytest.param("dpm", marks=pytest.mark.slow),
  ],
)
def test_sd_text_to_image(sd, outputs, sched):
  case = outputs[f"sd_{sched}"]
  images = sd(
    PROMPTS, latents=case["latents"], guidance_scale=5.0, scheduler=SCHEDULER[sched], **COMMON
  )
  check(images, case["images"])


def test_sd_clip_skip(sd, features):
  """SD: the prompt's embeddings from the penultimate layer through the final LayerNorm (negative: none)."""
  case = features["sd_clip_skip"]
  images = sd(PROMPTS, latents=case["latents"], guidance_scale=5.0, clip_skip=1, **COMMON)
  check(images, case["images"])


def test_sd_embeds_and_guidance_rescale(sd, outputs):
  case = outputs["sd_embeds"]
  images = sd(
    prompt_embeds=case["prompt_embeds"],
    negative_prompt_embeds=case["negative_prompt_embeds"],
    latents=case["latents"],
    guidance_scale=4.0,
    guidance_rescale=0.6,
    **COMMON,
  )
  check(images, case["images"])


@pytest.mark.slow
def test_sd_images_per_prompt_and_negative(sd, outputs):
  case = outputs["sd_per_prompt"]
  images = sd(
    "a dog",
    "a cat",
    latents=case["latents"],
    num_images_per_prompt=2,
    guidance_scale=6.0,
    guidance_rescale=0.7,
    scheduler="EulerDiscreteScheduler",
    **COMMON,
  )
  check(images, case["images"])


def test_sd_without_guidance(sd, outputs):
  case = outputs["sd_nocfg"]
  check(sd(PROMPTS, latents=case["latents"], guidance_scale=1.0, **COMMON), case["images"])


@pytest.mark.parametrize(
  "sched,strength", [("ddim", 0.7), pytest.param("euler", 0.5, marks=pytest.mark.slow)]
)
def test_sd_image_to_image(sd, outputs, sched, strength):
  """Also: the run starts part-way (3 steps at strength 0.7: calls 1 and 2; at 0.5: call 2), which the
  callback sees with the scheduler's timesteps."""
  case = outputs[f"img2img_{sched}"]
  seen = []
  images = sd(
    PROMPTS,
    image=case["image"],
    strength=strength,
    noise=case["noise"],
    encode_noise=case["encode_noise"],
    guidance_scale=5.0,
    scheduler=SCHEDULER[sched],
    callback=lambda i, t, x: seen.append((i, float(t))),
    **COMMON,
  )
  check(images, case["images"])
  scheduler = sd.make_scheduler(SCHEDULER[sched])
  state = scheduler.init(3, shape=(2, 4, 4, 4))
  begin = mdsch.strength_start(3, strength, mdsch.scheduler_order(scheduler))
  assert [i for i, _ in seen] == list(range(begin, 3)) and sd.last_calls == 3 - begin
  np.testing.assert_array_equal(
    [t for _, t in seen], np.asarray(state.timesteps[begin:], np.float32)
  )


@pytest.mark.parametrize("sched", ["ddim", pytest.param("dpm", marks=pytest.mark.slow)])
def test_sd2_v_prediction(sd2, outputs, sched):
  case = outputs[f"sd2_{sched}"]
  images = sd2(
    PROMPTS,
    ["", "a dog"],
    latents=case["latents"],
    guidance_scale=5.0,
    scheduler=SCHEDULER[sched],
    **COMMON,
  )
  check(images, case["images"])


@pytest.mark.parametrize(
  "sched",
  [
    "euler",
    pytest.param("ddim", marks=pytest.mark.slow),
    pytest.param("dpm", marks=pytest.mark.slow),
  ],
)
def test_sdxl_text_to_image(sdxl, outputs, sched):
  case = outputs[f"sdxl_{sched}"]
  images = sdxl(
    PROMPTS, latents=case["latents"], guidance_scale=5.0, scheduler=SCHEDULER[sched], **COMMON
  )
  check(images, case["images"])


def test_sdxl_clip_skip(sdxl, features):
  """SDXL: both encoders' hidden_states[-(clip_skip + 2)] for the prompt, no final LayerNorm."""
  case = features["sdxl_clip_skip"]
  images = sdxl(
    PROMPTS,
    latents=case["latents"],
    guidance_scale=5.0,
    clip_skip=1,
    scheduler="EulerDiscreteScheduler",
    **COMMON,
  )
  check(images, case["images"])


@pytest.mark.slow
def test_sdxl_negative_rescale_and_micro_conditioning(sdxl, outputs):
  case = outputs["sdxl_negative"]
  images = sdxl(
    PROMPTS,
    ["a dog", ""],
    latents=case["latents"],
    guidance_scale=5.0,
    guidance_rescale=0.5,
    original_size=(64, 48),
    crops_coords_top_left=(4, 8),
    target_size=(40, 32),
    scheduler="EulerDiscreteScheduler",
    **COMMON,
  )
  check(images, case["images"])


@pytest.mark.slow
def test_sdxl_embeds(sdxl, outputs):
  case = outputs["sdxl_embeds"]
  images = sdxl(
    prompt_embeds=case["prompt_embeds"],
    negative_prompt_embeds=case["negative_prompt_embeds"],
    pooled_prompt_embeds=case["pooled_prompt_embeds"],
    negative_pooled_prompt_embeds=case["negative_pooled_prompt_embeds"],
    latents=case["latents"],
    guidance_scale=4.0,
    scheduler="DDIMScheduler",
    **COMMON,
  )
  check(images, case["images"])


def test_sdxl_lightning_unet_file(root, outputs):
  pipe = md_sd.load_pipeline(root / "sdxl", unet_file=root / "lightning_unet.safetensors")
  case = outputs["sdxl_lightning"]
  images = pipe(
    PROMPTS,
    latents=case["latents"],
    guidance_scale=0.0,
    scheduler="EulerDiscreteScheduler",
    scheduler_options=dict(timestep_spacing="trailing"),
    **COMMON,
  )
  check(images, case["images"])


def test_controlnet_sd(root, outputs):
  pipe = md_sd.load_pipeline(root / "sd", controlnet=root / "controlnet_sd")
  case = outputs["controlnet_sd"]
  images = pipe(
    PROMPTS,
    latents=case["latents"],
    control_image=case["image"],
    controlnet_conditioning_scale=0.8,
    guidance_scale=5.0,
    **COMMON,
  )
  check(images, case["images"])


def test_controlnet_sdxl(root, outputs):
  pipe = md_sd.load_pipeline(root / "sdxl", controlnet=root / "controlnet_sdxl")
  case = outputs["controlnet_sdxl"]
  images = pipe(
    PROMPTS,
    latents=case["latents"],
    control_image=case["image"],
    controlnet_conditioning_scale=0.6,
    guidance_scale=5.0,
    scheduler="EulerDiscreteScheduler",
    **COMMON,
  )
  check(images, case["images"])


def test_same_seed_same_images(sd):
  kw = dict(COMMON, num_inference_steps=2, guidance_scale=5.0)
  a = np.asarray(sd(PROMPTS, seed=3, **kw))
  b = np.asarray(sd(PROMPTS, seed=3, **kw))
  c = np.asarray(sd(PROMPTS, seed=4, **kw))
  np.testing.assert_array_equal(a, b)
  assert np.abs(a - c).max() > 1e-3
  assert a.min() >= 0.0 and a.max() <= 1.0


def test_callback_latent_output_and_cancel(sd, outputs):
  """`callback` sees every step with the scheduler's timesteps; `output_type="latent"` gives the
  reference-layout latents that decode to the images; `chunk=None` runs the same steps in one call;
  `cancel` stops at a step boundary. Same program as test_sd_text_to_image[ddim] (no new compile)."""
  case = outputs["sd_ddim"]
  kw = dict(latents=case["latents"], guidance_scale=5.0, scheduler="DDIMScheduler", **COMMON)
  seen = []
  z = sd(PROMPTS, output_type="latent", callback=lambda i, t, x: seen.append((i, float(t))), **kw)
  assert z.shape == (2, 4, 4, 4)  # [B, C, H/8, W/8]
  assert sd.last_calls == 3
  want_t = np.asarray(sd.make_scheduler("DDIMScheduler").init(3, shape=(2, 4, 4, 4)).timesteps)
  assert [i for i, _ in seen] == [0, 1, 2]
  np.testing.assert_array_equal([t for _, t in seen], want_t.astype(np.float32))
  check(sd.decode(np.transpose(np.asarray(z), (0, 2, 3, 1))), case["images"])
  whole = sd(PROMPTS, output_type="latent", chunk=None, **kw)
  np.testing.assert_allclose(np.asarray(whole), np.asarray(z), atol=1e-6, rtol=0)
  with pytest.raises(mdsch.Cancelled, match="cancelled at step 1/3"):
    sd(PROMPTS, cancel=lambda: True, **kw)
  stops = []
  with pytest.raises(mdsch.Cancelled, match="cancelled at step 2/3"):
    sd(PROMPTS, callback=lambda i, t, x: stops.append(i) or i < 1, **kw)
  assert stops == [0, 1]
  with pytest.raises(ValueError, match="output_type='pil': expected 'np' or 'latent'"):
    sd(PROMPTS, output_type="pil", **kw)


def test_rescale_noise_cfg_is_the_loops_rescale():
  """diffusers' `rescale_noise_cfg` (torch.std, unbiased, per example) in closed form."""
  rng = np.random.default_rng(0)
  guided, text = rng.standard_normal((2, 2, 4, 4, 3)).astype(np.float32)
  std = lambda a: a.reshape(2, -1).std(axis=1, ddof=1).reshape(2, 1, 1, 1)  # noqa: E731
  want = 0.7 * guided * std(text) / std(guided) + 0.3 * guided
  got = md_sd.rescale_noise_cfg(guided, text, 0.7)
  np.testing.assert_allclose(np.asarray(got), want, atol=1e-6, rtol=1e-6)
