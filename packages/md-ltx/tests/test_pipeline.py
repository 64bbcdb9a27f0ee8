"""LTX-Video pipelines against diffusers' LTXPipeline / LTXConditionPipeline on tiny saved pipelines
(tests/fixtures/ltx_pipeline, built by tools/fixtures/ltx_pipeline.py): same prompts, latents and recorded
noise, 3 steps, frames within 1e-3 (measured: below 2e-6)."""

import numpy as np
import pytest

import md_ltx
import md_schedulers as mdsch
import md_sharding as mds
from md_core import testing

PROMPTS = ["a cat surfing a wave at sunset", "an astronaut riding a horse on the moon"]
NEGATIVE = "worst quality, blurry"
ROOT = testing.fixture_path("ltx_pipeline")
KW = dict(
  height=32, width=32, num_frames=9, num_inference_steps=3, max_sequence_length=8,
  decode_timestep=0.05, progress=False,
)  # fmt: skip
# The fixture's prompts are longer than its 8 T5 tokens (as the reference, they are cut).
pytestmark = pytest.mark.filterwarnings("ignore:prompt .* tokens long")


@pytest.fixture(scope="module")
def ref():
  return testing.load_arrays(ROOT / "outputs.npz")


@pytest.fixture(scope="module")
def t2v():
  return md_ltx.load_pipeline(ROOT / "t2v")


@pytest.fixture(scope="module")
def cond(t2v):
  """LTXConditionPipeline folder (its components link to the t2v ones)."""
  pipe = md_ltx.load_pipeline(ROOT / "cond")
  assert pipe.condition_pipeline and not t2v.condition_pipeline
  return pipe


def _conditions(ref, case):
  return [
    md_ltx.LTXCondition(ref[f"{case}/image"], frame_index=0, strength=0.9),
    md_ltx.LTXCondition(ref[f"{case}/keyframe"], frame_index=6, strength=1.0),
  ]


def _max_diff(out, want):
  return float(np.abs(np.asarray(out) - want).max())


def _ref_diff(out, ref, case):
  """Max abs difference to the reference's frames of `case`, which the fixture keeps at the first, middle
  and last frame (`<case>/frame_index`)."""
  return _max_diff(np.asarray(out)[:, ref[f"{case}/frame_index"]], ref[f"{case}/frames"])


def test_t2v_matches_reference(t2v, ref):
  """CFG 3, decode timestep 0.05 without decode noise; latents packed [B, S, C] as the reference."""
  out = t2v(PROMPTS[0], NEGATIVE, latents=ref["t2v/latents"], guidance_scale=3.0,
            decode_noise_scale=0.0, **KW)  # fmt: skip
  assert out.shape == (1, 9, 32, 32, 3)
  assert _ref_diff(out, ref, "t2v") < 1e-3
  embeds, mask = t2v.encode_prompt([PROMPTS[0]], 8)
  np.testing.assert_allclose(np.asarray(embeds), ref["t2v/prompt_embeds"], atol=1e-5, rtol=0)
  np.testing.assert_array_equal(np.asarray(mask), ref["t2v/prompt_attention_mask"])


def test_t2v_precomputed_embeds_unpacked_latents_and_seed(t2v, ref):
  """Precomputed embeddings + masks and [B, C, F, H, W] latents give the same video; a seed repeats."""
  latents = np.asarray(ref["t2v/latents"]).reshape(1, 3, 4, 4, 8).transpose(0, 4, 1, 2, 3)
  a = t2v(
    prompt_embeds=ref["t2v/prompt_embeds"],
    prompt_attention_mask=ref["t2v/prompt_attention_mask"],
    negative_prompt_embeds=ref["t2v/negative_prompt_embeds"],
    negative_prompt_attention_mask=ref["t2v/negative_prompt_attention_mask"],
    latents=latents, guidance_scale=3.0, decode_noise_scale=0.0, **KW,
  )  # fmt: skip
  assert _ref_diff(a, ref, "t2v") < 1e-3
  b = t2v(PROMPTS[0], NEGATIVE, seed=3, guidance_scale=3.0, **KW)
  c = t2v(PROMPTS[0], NEGATIVE, seed=3, guidance_scale=3.0, **KW)
  np.testing.assert_array_equal(np.asarray(b), np.asarray(c))
  assert _max_diff(b, np.asarray(a)) > 1e-2


def test_condition_matches_reference(cond, ref):
  """Frame-0 image at strength 0.9 (per-token timesteps) + keyframe at frame 6 (appended tokens with
  explicit coordinates), decode noise 0.025 (the reference's draw, recorded)."""
  out = cond(
    PROMPTS[0], NEGATIVE, conditions=_conditions(ref, "cond"), guidance_scale=3.0,
    image_cond_noise_scale=0.0, decode_noise_scale=0.025, decode_noise=ref["cond/decode_noise"],
    latents=ref["cond/latents"], **KW,
  )  # fmt: skip
  assert out.shape == (1, 9, 32, 32, 3)
  assert _ref_diff(out, ref, "cond") < 1e-3


@pytest.mark.slow
def test_t2v_rescale_two_prompts_decode_noise(t2v, ref):
  out = t2v(
    PROMPTS, NEGATIVE, latents=ref["t2v_rescale/latents"], guidance_scale=4.0, guidance_rescale=0.7,
    decode_noise_scale=0.03, decode_noise=ref["t2v_rescale/decode_noise"], **KW,
  )  # fmt: skip
  assert out.shape == (2, 9, 32, 32, 3)
  assert _ref_diff(out, ref, "t2v_rescale") < 1e-3


@pytest.mark.slow
def test_condition_step_noise_matches_reference(cond, ref):
  """image_cond_noise_scale 0.15 with the reference's per-step noise draws (recorded)."""
  out = cond(
    PROMPTS[0], NEGATIVE, conditions=_conditions(ref, "cond_noise"), guidance_scale=3.0,
    image_cond_noise_scale=0.15, decode_noise_scale=0.025,
    decode_noise=ref["cond_noise/decode_noise"], step_noise=ref["cond_noise/step_noise"],
    latents=ref["cond_noise/latents"], **KW,
  )  # fmt: skip
  assert _ref_diff(out, ref, "cond_noise") < 1e-3


def test_schedules_follow_the_configs(cond):
  """The condition folder's scheduler has no dynamic shift; the linear-quadratic timesteps are used as
  given and only the sigmas are stretched to shift_terminal (as the reference)."""
  sched = mdsch.from_config(cond.scheduler_config)
  assert not sched.config["use_dynamic_shifting"] and sched.config["shift_terminal"] == 0.1
  ts = mdsch.linear_quadratic_sigmas(3) * np.float32(1000)
  state = sched.init(timesteps=ts)
  np.testing.assert_allclose(np.asarray(state.timesteps), ts, rtol=0, atol=1e-4)
  assert abs(float(state.sigmas[-2]) - 0.1) < 1e-6 and float(state.sigmas[-1]) == 0.0


def test_size_and_frame_errors_name_valid_values(t2v):
  """The tiny VAE compresses 8x in space and 4x in time (the real ones 32x and 8x)."""
  with pytest.raises(ValueError, match=r"multiples of 8 .* height=36 → 32 or 40"):
    t2v(PROMPTS[0], height=36, width=32, num_frames=9)
  with pytest.raises(ValueError, match=r"num_frames=12 → 9 or 13"):
    t2v(PROMPTS[0], height=32, width=32, num_frames=12)
  with pytest.raises(ValueError, match=r"expected \(1, 8, 3, 4, 4\)"):
    t2v(PROMPTS[0], latents=np.zeros((1, 8, 2, 4, 4), np.float32), **KW)


def test_condition_errors(t2v, tmp_path):
  image = np.zeros((32, 32, 3), np.uint8)
  with pytest.raises(ValueError, match=r"frame_index=9 is outside the video \(frames 0 … 8\)"):
    t2v(PROMPTS[0], conditions=[md_ltx.LTXCondition(image, frame_index=9)], **KW)
  with pytest.raises(ValueError, match="strength=1.5 must be in"):
    t2v(PROMPTS[0], conditions=[md_ltx.LTXCondition(image, strength=1.5)], **KW)
  bad = tmp_path / "not_an_image.png"
  bad.write_text("hello")
  with pytest.raises(ValueError, match="cannot read the image file"):
    t2v(PROMPTS[0], image=bad, **KW)
  with pytest.raises(ValueError, match=r"must be one RGB image \[H, W, 3\]"):
    t2v(PROMPTS[0], image=np.zeros((32, 32), np.uint8), **KW)
  with pytest.raises(ValueError, match="prompt_embeds needs prompt_attention_mask"):
    t2v(prompt_embeds=np.zeros((1, 8, 24), np.float32), **KW)


def test_heads_not_divisible_by_tensor(t2v):
  """The tiny transformer has 2 heads: a tensor degree of 8 cannot split them."""
  pipe = md_ltx.LTXVideoPipeline(
    transformer=t2v.transformer, vae=t2v.vae, text_encoder=t2v.text_encoder,
    tokenizer=t2v.tokenizer, scheduler_config=t2v.scheduler_config,
    mesh=mds.make_mesh(mds.MeshConfig(ici_tensor_parallelism=8)),
  )  # fmt: skip
  with pytest.raises(
    ValueError, match="num_attention_heads=2 is not divisible by the mesh's tensor"
  ):
    pipe(PROMPTS[0], **KW)


@pytest.mark.slow
def test_condition_refine_matches_reference(cond, ref):
  """The multi-scale recipe's second pass: given latents, denoise_strength 0.6 of 5 steps."""
  out = cond(
    PROMPTS[0], NEGATIVE, conditions=[md_ltx.LTXCondition(ref["cond_refine/image"])],
    guidance_scale=3.0, latents=ref["cond_refine/latents"], noise=ref["cond_refine/noise"],
    denoise_strength=0.6, image_cond_noise_scale=0.025, step_noise=ref["cond_refine/step_noise"],
    decode_noise_scale=0.025, decode_noise=ref["cond_refine/decode_noise"],
    **dict(KW, num_inference_steps=5),
  )  # fmt: skip
  assert _ref_diff(out, ref, "cond_refine") < 1e-3


def test_latent_output_and_refine_errors(t2v, cond, ref):
  with pytest.raises(ValueError, match="denoise_strength < 1 needs the conditioning mode"):
    t2v(PROMPTS[0], denoise_strength=0.5, latents=ref["cond/latents"], **KW)
  with pytest.raises(ValueError, match="refines given latents: pass latents="):
    cond(PROMPTS[0], denoise_strength=0.5, **KW)
  with pytest.raises(ValueError, match="output_type='pil': expected"):
    cond(PROMPTS[0], output_type="pil", **KW)


@pytest.mark.slow
def test_official_guidance_matches_reference(t2v, ref):
  """CFG-star, spatio-temporal guidance (blocks' self-attention replaced by its values in the perturbed
  pass), STG rescaling and per-step scales / block lists, against the fixture's loop around diffusers'
  transformer with the official repository's formulas."""
  out = t2v(
    PROMPTS[0], NEGATIVE, latents=ref["t2v_stg/latents"], guidance_scale=[1.0, 4.0, 3.0],
    stg_scale=[0.0, 2.0, 1.0], stg_rescale=[0.7, 0.7, 1.0], stg_blocks=[[], [1], [0, 1]],
    stg_mode="attention_values", cfg_star=True, decode_noise_scale=0.0, **KW,
  )  # fmt: skip
  assert _ref_diff(out, ref, "t2v_stg") < 1e-3
  # STG changes the result (the hooks and the skip mask matter).
  plain = t2v(PROMPTS[0], NEGATIVE, latents=ref["t2v_stg/latents"], guidance_scale=[1.0, 4.0, 3.0],
              cfg_star=True, decode_noise_scale=0.0, **KW)  # fmt: skip
  assert _max_diff(plain, np.asarray(out)) > 1e-3


def test_guidance_errors(t2v):
  with pytest.raises(
    ValueError, match=r"guidance_scale has 2 values; give one, or one per step \(3\)"
  ):
    t2v(PROMPTS[0], guidance_scale=[3.0, 2.0], **KW)
  with pytest.raises(ValueError, match="stg_blocks: block 5 is not one of the 2 blocks"):
    t2v(PROMPTS[0], stg_scale=1.0, stg_blocks=[5], **KW)
  with pytest.raises(ValueError, match="stg_mode='residual' must be one of"):
    t2v(PROMPTS[0], stg_scale=1.0, stg_mode="residual", **KW)


@pytest.mark.slow
def test_video_conditions_match_reference(cond, ref):
  """A 5-frame clip at frame 0 and a 9-frame clip at frame 4 of 13 (two prefix latent frames appended as
  extra tokens, the third replacing the video's latent frame 3)."""
  clip = ref["cond_video/clip"]
  out = cond(
    PROMPTS[0], NEGATIVE,
    conditions=[md_ltx.LTXCondition(video=clip[:5]), md_ltx.LTXCondition(video=clip[::-1], frame_index=4)],
    guidance_scale=3.0, image_cond_noise_scale=0.0, decode_noise_scale=0.025,
    decode_noise=ref["cond_video/decode_noise"], latents=ref["cond_video/latents"],
    **dict(KW, num_frames=13),
  )  # fmt: skip
  assert out.shape == (1, 13, 32, 32, 3)
  assert _ref_diff(out, ref, "cond_video") < 1e-3


def test_condition_item_errors(t2v):
  image = np.zeros((32, 32, 3), np.uint8)
  with pytest.raises(ValueError, match=r"conditions\[0\] needs exactly one of image= and video="):
    t2v(PROMPTS[0], conditions=[md_ltx.LTXCondition(image, video=[image] * 5)], **KW)
  with pytest.raises(ValueError, match=r"conditions\[0\] needs exactly one of image= and video="):
    t2v(PROMPTS[0], conditions=[md_ltx.LTXCondition()], **KW)
  with pytest.raises(ValueError, match=r"video: frames of different sizes"):
    t2v(PROMPTS[0], conditions=[md_ltx.LTXCondition(video=[image, image[:16]])], **KW)


@pytest.mark.slow
def test_guidance_windows_match_reference(t2v, ref):
  """The official `guidance_timesteps` windows: four windows of which the 3 steps use 0, 2 and 3 give the
  per-step reference run (window 1's values are never used)."""
  sched = mdsch.from_config(t2v.scheduler_config)
  c = sched.config
  keys = ("base_image_seq_len", "max_image_seq_len", "base_shift", "max_shift")
  mu = mdsch.calculate_shift(48, *(c[k] for k in keys))
  ts = np.asarray(sched.init(sigmas=mdsch.ltx_uniform_sigmas(3), mu=mu).timesteps) / 1000
  windows = [1.0, (1.0 + ts[1]) / 2, ts[1], ts[2]]
  assert md_ltx.guidance_windows(windows, ts) == [0, 2, 3]
  out = t2v(
    PROMPTS[0], NEGATIVE, latents=ref["t2v_stg/latents"], guidance_timesteps=windows,
    guidance_scale=[1.0, 9.0, 4.0, 3.0], stg_scale=[0.0, 9.0, 2.0, 1.0],
    stg_rescale=[0.7, 0.1, 0.7, 1.0], stg_blocks=[[], [0], [1], [0, 1]], cfg_star=True,
    decode_noise_scale=0.0, **KW,
  )  # fmt: skip
  assert _ref_diff(out, ref, "t2v_stg") < 1e-3


def test_latent_output_callback_cancel_and_calls(t2v, ref):
  """`output_type="latent"` gives the reference-layout latents that decode to the frames; `callback` sees
  every step with the schedule's timesteps; `cancel` (or a callback returning False) stops at a step
  boundary; "frames" is the old name of "np"."""
  kw = dict(latents=ref["t2v/latents"], guidance_scale=3.0, decode_noise_scale=0.0, **KW)
  seen = []
  z = t2v(PROMPTS[0], NEGATIVE, output_type="latent",
          callback=lambda i, t, x: seen.append((i, float(t), x.shape)), **kw)  # fmt: skip
  assert z.shape == (1, 8, 3, 4, 4)  # [B, C, F, H, W]
  frames = t2v.decode(
    np.transpose(np.asarray(z), (0, 2, 3, 4, 1)), decode_timestep=0.05, decode_noise_scale=0.0
  )
  assert _ref_diff(frames, ref, "t2v") < 1e-3
  np_frames = t2v(PROMPTS[0], NEGATIVE, output_type="frames", **kw)
  np.testing.assert_allclose(np.asarray(frames), np.asarray(np_frames), atol=1e-6, rtol=0)
  sched = mdsch.from_config(t2v.scheduler_config)
  keys = ("base_image_seq_len", "max_image_seq_len", "base_shift", "max_shift")
  mu = mdsch.calculate_shift(48, *(sched.config[k] for k in keys))
  want = sched.init(sigmas=mdsch.ltx_uniform_sigmas(3), mu=mu).timesteps
  # The latents the callback sees are the packed tokens [B, S, C].
  assert [i for i, _, _ in seen] == [0, 1, 2] and {s for *_, s in seen} == {(1, 48, 8)}
  np.testing.assert_allclose([t for _, t, _ in seen], np.asarray(want))
  assert t2v.last_calls == 3
  with pytest.raises(mdsch.Cancelled, match="cancelled at step 1/3"):
    t2v(PROMPTS[0], NEGATIVE, cancel=lambda: True, **kw)
  with pytest.raises(mdsch.Cancelled, match="cancelled at step 2/3"):
    t2v(PROMPTS[0], NEGATIVE, callback=lambda i, t, x: i < 1, **kw)


def test_refine_runs_the_last_steps(cond, ref):
  """`denoise_strength=0.6` of 5 steps runs steps 2 … 4 of the schedule (the loop starts part-way), in
  chunks of two as in one: the chunking never changes the result."""
  kw = dict(
    conditions=[md_ltx.LTXCondition(ref["cond_refine/image"])], guidance_scale=3.0,
    latents=ref["cond_refine/latents"], noise=ref["cond_refine/noise"], denoise_strength=0.6,
    image_cond_noise_scale=0.025, step_noise=ref["cond_refine/step_noise"], output_type="latent",
    **dict(KW, num_inference_steps=5),
  )  # fmt: skip
  seen = []
  one = cond(PROMPTS[0], NEGATIVE, callback=lambda i, t, x: seen.append(i), **kw)
  assert seen == [2, 3, 4] and cond.last_calls == 3
  two = cond(PROMPTS[0], NEGATIVE, chunk=2, **kw)
  whole = cond(PROMPTS[0], NEGATIVE, chunk=None, **kw)
  np.testing.assert_array_equal(np.asarray(two), np.asarray(one))
  np.testing.assert_array_equal(np.asarray(whole), np.asarray(one))


def test_modes_are_exported():
  assert md_ltx.MODES == ("text_to_video", "image_to_video", "condition")
