"""LTX-Video image-to-video against diffusers' LTXImageToVideoPipeline and LTXConditionPipeline on tiny saved
pipelines whose VAE posterior has a real std (0.21 to 0.32; tests/fixtures/ltx_i2v, built by
tools/fixtures/ltx_i2v.py): same prompts, image and recorded noise (posterior, initial, per-step, decode),
3 steps, frames within 1e-3."""

import numpy as np
import PIL.Image
import pytest

import md_ltx
from md_core import testing

PROMPTS = ["a cat surfing a wave at sunset", "an astronaut riding a horse on the moon"]
NEGATIVE = "worst quality, blurry"
ROOT = testing.fixture_path("ltx_i2v")
KW = dict(
  height=32, width=32, num_frames=5, num_inference_steps=3, max_sequence_length=8,
  decode_timestep=0.05, decode_noise_scale=0.025, progress=False,
)  # fmt: skip
# The fixture's prompts are longer than its 8 T5 tokens (as the reference, they are cut).
pytestmark = pytest.mark.filterwarnings("ignore:prompt .* tokens long")


@pytest.fixture(scope="module")
def ref():
  return testing.load_arrays(ROOT / "outputs.npz")


@pytest.fixture(scope="module")
def image():
  with PIL.Image.open(ROOT / "image.png") as im:
    return np.asarray(im.convert("RGB"))


@pytest.fixture(scope="module")
def i2v():
  """An LTXImageToVideoPipeline folder."""
  pipe = md_ltx.load_pipeline(ROOT / "i2v")
  assert not pipe.condition_pipeline
  return pipe


@pytest.fixture(scope="module")
def cond():
  """An LTXConditionPipeline folder (its components link to i2v/'s)."""
  pipe = md_ltx.load_pipeline(ROOT / "cond")
  assert pipe.condition_pipeline
  return pipe


def _max_diff(out, want):
  return float(np.abs(np.asarray(out) - want).max())


def _i2v_kw(ref, case):
  return dict(
    latents=ref[f"{case}/latents"], image_noise=ref[f"{case}/image_noise"],
    decode_noise=ref[f"{case}/decode_noise"],
  )  # fmt: skip


def test_image_to_video_folder_matches_reference(i2v, ref):
  """The folder's class picks LTXImageToVideoPipeline semantics for `image=` (the image file is read as
  the reference reads its PIL image); the posterior noise decides the first frame."""
  out = i2v(PROMPTS[0], NEGATIVE, image=ROOT / "image.png", guidance_scale=3.0, **_i2v_kw(ref, "i2v"),
            **KW)  # fmt: skip
  assert out.shape == (1, 5, 32, 32, 3)
  err = _max_diff(out, ref["i2v/frames"])
  assert err < 1e-3, err
  # The posterior's std is real: other noise gives another video.
  other = dict(_i2v_kw(ref, "i2v"), image_noise=np.zeros_like(ref["i2v/image_noise"]))
  moved = i2v(PROMPTS[0], NEGATIVE, image=ROOT / "image.png", guidance_scale=3.0, **other, **KW)
  assert _max_diff(moved, ref["i2v/frames"]) > 1e-2


def test_mode_image_to_video_on_a_condition_folder(cond, ref, image):
  """`mode="image_to_video"` on an LTXConditionPipeline folder: two prompts sharing the image (one
  posterior draw), guidance_rescale, frame rate 24, the folder's scheduler without dynamic shift; latents
  given packed [B, S, C] as the reference takes them."""
  kw = _i2v_kw(ref, "cond_as_i2v")
  packed = np.asarray(kw["latents"]).transpose(0, 2, 3, 4, 1).reshape(2, -1, 8)
  kw["latents"] = packed
  out = cond(
    PROMPTS, NEGATIVE, image=image, mode="image_to_video", guidance_scale=4.0, guidance_rescale=0.7,
    frame_rate=24, **kw, **KW,
  )  # fmt: skip
  assert out.shape == (2, 5, 32, 32, 3)
  err = _max_diff(out, ref["cond_as_i2v/frames"])
  assert err < 1e-3, err


def test_condition_folder_keeps_condition_semantics(cond, ref, image):
  """`image=` on an LTXConditionPipeline folder is `LTXCondition(image)` (default image_cond_noise_scale
  0.15 with the recorded per-step noise), and the posterior noise can be given there too."""
  out = cond(
    PROMPTS[0], NEGATIVE, image=image, guidance_scale=3.0, latents=ref["cond/latents"],
    image_noise=[ref["cond/image_noise"]], step_noise=ref["cond/step_noise"],
    decode_noise=ref["cond/decode_noise"], **KW,
  )  # fmt: skip
  err = _max_diff(out, ref["cond/frames"])
  assert err < 1e-3, err


def test_mode_condition_on_an_image_to_video_folder(i2v, cond, ref, image):
  """`mode="condition"` on the LTXImageToVideoPipeline folder runs the conditioning semantics (here the
  two folders differ only in their scheduler's dynamic shift, which md applies by the token count)."""
  kw = dict(
    guidance_scale=3.0, latents=ref["cond/latents"], image_noise=ref["cond/image_noise"],
    step_noise=ref["cond/step_noise"], decode_noise=ref["cond/decode_noise"], **KW,
  )  # fmt: skip
  out = i2v(PROMPTS[0], NEGATIVE, image=image, mode="condition", **kw)
  same_sched = md_ltx.LTXVideoPipeline(
    transformer=i2v.transformer, vae=i2v.vae, text_encoder=i2v.text_encoder,
    tokenizer=i2v.tokenizer, scheduler_config=cond.scheduler_config,
  )  # fmt: skip
  again = same_sched(PROMPTS[0], NEGATIVE, image=image, mode="condition", **kw)
  err = _max_diff(again, ref["cond/frames"])
  assert err < 1e-3, err
  assert _max_diff(out, ref["cond/frames"]) > 1e-3  # the shifted schedule is another schedule
  assert _max_diff(out, ref["i2v/frames"]) > 1e-2


def test_mode_errors(i2v, cond, image, ref):
  with pytest.raises(
    ValueError, match=r"mode='i2v' must be one of \('text_to_video', 'image_to_vid"
  ):
    i2v(PROMPTS[0], image=image, mode="i2v", **KW)
  with pytest.raises(ValueError, match="mode='image_to_video' needs image="):
    cond(PROMPTS[0], mode="image_to_video", **KW)
  with pytest.raises(ValueError, match="mode='image_to_video' takes image= .*, not conditions="):
    i2v(PROMPTS[0], conditions=[md_ltx.LTXCondition(image)], mode="image_to_video", **KW)
  with pytest.raises(ValueError, match="mode='text_to_video' takes no image="):
    i2v(PROMPTS[0], image=image, mode="text_to_video", **KW)
  with pytest.raises(
    ValueError, match="image_cond_noise_scale is not used by mode='image_to_video'"
  ):
    i2v(PROMPTS[0], image=image, image_cond_noise_scale=0.15, **KW)
  with pytest.raises(ValueError, match="timesteps is not used by mode='image_to_video'"):
    i2v(PROMPTS[0], image=image, timesteps=[1000.0, 500.0], **KW)
  with pytest.raises(ValueError, match="denoise_strength < 1 needs the conditioning mode"):
    i2v(PROMPTS[0], image=image, denoise_strength=0.5, latents=ref["i2v/latents"], **KW)
  with pytest.raises(ValueError, match=r"image_noise must be the posterior's noise \[1, C, F, H, W\] = "
                     r"\(1, 8, 1, 4, 4\) .*got \(1, 8, 2, 4, 4\)"):  # fmt: skip
    i2v(PROMPTS[0], image=image, image_noise=np.zeros((1, 8, 2, 4, 4), np.float32), **KW)
  with pytest.raises(ValueError, match="image_noise has 2 arrays for 1 conditioning items"):
    cond(PROMPTS[0], image=image, image_noise=[ref["cond/image_noise"]] * 2, **KW)
  with pytest.raises(ValueError, match="image_noise is the conditioning image's posterior noise"):
    i2v(PROMPTS[0], image_noise=ref["i2v/image_noise"], **KW)
