"""md's default video model (models/shapes-wan): it loads with md's loaders, its weights round-trip through
md's export, the app's default variant points at it, the evaluation prompts hold out the unseen pairs, and
a quick quality floor holds (the issue's quality gate is measured by bench/default_models.py; the model
follows colour, background and direction, shape four times in five, see models/shapes-wan/README.md)."""

import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import md_core
import md_data
import md_vae
import md_wan
from md_core import testing
from md_train import shapes_models as sm

ROOT = pathlib.Path(__file__).resolve().parents[1]
MODEL = ROOT / "models" / "shapes-wan"


@pytest.fixture(scope="module")
def pipe():
  return md_wan.load_pipeline(MODEL)


# The regression floor: every other prompt of `quality_prompts()` (8 held-out and 8 trained colour x shape
# pairs), seed 0, 10 steps, guidance 3. Measured on the shipped model (2026-12-07, the 3.3 M-parameter
# transformer, seed 2, batch 8 x 8000 steps, the whole recipe on a 2-core Xeon): colour 16/16, background
# 16/16, direction 15/16, shape 13/16 (7 held-out, 6 trained). Colour and background floors are one miss
# under the measurement per group; direction and shape are held over all 16 prompts one miss under (14,
# 12). The model before it (2026-12-06) scored 16 directions and 11 shapes, the 0.95 M-parameter one 14
# and 9, the 2026-12-05 model 6 and 2 (models/shapes-wan/README.md).
FLOOR = {"held_out": dict(colour=7, background=7), "train": dict(colour=7, background=7)}
DIRECTION_FLOOR = 14
SHAPE_FLOOR = 12


def test_quality_regression_floor(pipe):
  prompts = {group: texts[::2][:8] for group, texts in sm.quality_prompts().items()}
  scores = sm.video_scores(pipe, prompts=prompts, seeds=(0,), num_inference_steps=10)
  for group, floor in FLOOR.items():
    got = scores[group]
    for field, least in floor.items():
      hits = round(getattr(got, field) * got.counts[field])
      assert hits >= least, (group, field, hits, got.analyses)
  both = scores["all"]
  hits = round(both.direction * both.counts["direction"])
  assert both.counts["direction"] == 16 and hits >= DIRECTION_FLOOR, (hits, both.analyses)
  hits = round(both.shape * both.counts["shape"])
  assert both.counts["shape"] == 16 and hits >= SHAPE_FLOOR, (hits, both.analyses)


# Random search (md_serve.search, shapes verifier: colour, shape, direction and background) on one prompt
# per held-out pair, 10 steps, guidance 3, budget 8; the first candidate is the seed-0 sample.
# Measured on the 2026-12-03 model (2-core CPU): per prompt 0.5 0.5 0.25 0.5 0.25 for the seed-0 samples
# (mean 0.40), 0.75 1.0 0.5 1.0 1.0 for the best of 8 (mean 0.85). The floor keeps about half of that
# gain, for other CPUs' numerics, or the ceiling where the seed-0 samples leave less room: the shipped
# model (2026-12-07) scores 1.0 1.0 1.0 1.0 0.75 at seed 0 (mean 0.95) and 1.0 for every best of 8.
SEARCH_GAIN = 0.25


@pytest.mark.slow  # ~100 s of video sampling; tests/test_default_image_model.py runs the image one by default
def test_search_beats_the_seed_0_sample_on_held_out_pairs(pipe):
  import md_serve

  prompts = sm.quality_prompts()["held_out"][::4]  # one per held-out pair, the 4 directions in turn
  kw = dict(height=64, width=64, num_frames=9, num_inference_steps=10, max_sequence_length=16)
  found = [
    md_serve.search(pipe, p, md_serve.ShapesVerifier(), 8, guidance_scale=3.0, **kw)
    for p in prompts
  ]
  one = [r.history[0][1] for r in found]  # the seed-0 sample alone (budget 1)
  eight = [float(r.scores[0]) for r in found]
  assert all(r.samples == 8 and r.history[0][0] == 10 for r in found)
  assert all(e >= o for e, o in zip(eight, one)), (one, eight)
  assert np.mean(eight) >= min(np.mean(one) + SEARCH_GAIN, 1.0), (one, eight)
  # The result is what the verifier said of it: the sample scores the same when scored again.
  again = md_serve.ShapesVerifier().score(np.stack([r.images[0] for r in found]), list(prompts))
  np.testing.assert_allclose(again, eight, atol=1e-6)


def test_model_folder_is_small_diffusers_layout():
  sizes = sum(p.stat().st_size for p in MODEL.rglob("*") if p.is_file())
  assert sizes < 20 * 2**20, f"{MODEL} holds {sizes / 2**20:.1f} MB"
  for part in ("transformer", "vae", "text_encoder", "tokenizer", "scheduler"):
    assert (MODEL / part).is_dir(), part
  assert (MODEL / "model_index.json").is_file() and (MODEL / "README.md").is_file()


def test_export_round_trips_the_shipped_weights(pipe):
  # Loading then exporting gives back every stored tensor bit for bit (the exporter inverts the key map).
  for module, part, convert_key in (
    (pipe.transformer, "transformer", md_wan.convert_key),
    (pipe.vae, "vae", __import__("md_vae").vae_wan_convert_key),
  ):
    stored = md_core.open_checkpoint(MODEL / part)
    exported = sm.export_weights(module, stored, convert_key)
    assert sorted(exported) == sorted(stored)
    for key in stored:
      np.testing.assert_array_equal(exported[key], np.asarray(stored[key]), err_msg=key)


def test_export_names_the_bad_tensor(pipe):
  stored = md_core.open_checkpoint(MODEL / "transformer")
  key = next(k for k in stored if k.endswith("ffn.net.0.proj.weight"))
  bad = {key: np.zeros((3, 5), np.float32)}
  with pytest.raises(ValueError, match=rf"{key}.*shape \(3, 5\)"):
    sm.export_weights(pipe.transformer, bad, md_wan.convert_key)
  with pytest.raises(ValueError, match="'nonsense.weight' maps to no md parameter"):
    sm.export_weights(pipe.transformer, {"nonsense.weight": np.zeros(1)}, md_wan.convert_key)


def test_crop_larger_than_clip_is_refused():
  data = md_data.ShapesConfig(size=32, frames=5)
  with pytest.raises(ValueError, match="crop=48 is larger than the clips' size 32"):
    next(sm.shapes_videos(data, seed=0, batch_size=1, crop=48))
  video, captions = next(sm.shapes_videos(data, seed=0, batch_size=2, crop=24))
  assert video.shape == (2, 5, 24, 24, 3) and len(captions) == 2
  assert video.min() >= -1.0 and video.max() <= 1.0


def test_crops_hold_the_shape_and_masks_mark_it():
  data = md_data.ShapesConfig(size=64, frames=5)
  full_video, _, full_mask = next(sm.shapes_videos(data, seed=3, batch_size=16, masks=True))
  video, _, mask = next(
    sm.shapes_videos(data, seed=3, batch_size=16, crop=32, crop_on_shape=True, masks=True)
  )
  assert mask.shape == (16, 5, 32, 32, 1) and full_mask.shape == (16, 5, 64, 64, 1)
  # Every window shows part of its shape in the middle frame (a uniform crop misses it about half the time).
  assert (mask[:, 2].reshape(16, -1).sum(1) > 0).all()
  # The mask is exactly the pixels that differ from the background colour.
  pixels = 0.5 * (full_video + 1.0)
  corner = pixels[:, :, :1, :1, :]  # the shapes never touch the frame's corner
  differs = np.abs(pixels - corner).sum(-1, keepdims=True) > 0.05
  np.testing.assert_array_equal(full_mask, differs.astype(np.float32))


def test_wan_default_variant_is_the_shipped_model():
  config = testing.app_config("wan.py:default")
  assert pathlib.Path(config.model) == MODEL
  assert (config.height, config.width, config.num_frames) == (64, 64, 9)
  assert config.max_sequence_length == 16 and config.negative_prompt == ""


def test_wan_recipe_with_ema_exports_the_average(tmp_path):
  # ema_decay d: after steps with parameters p1, p2 (from p0) the export holds d²·p0 + d(1-d)·p1 + (1-d)·p2.
  config = testing.app_config("default_models.py:wan")
  config.steps = 30
  config.recipe_options.update(
    base=str(MODEL), num_clips=4, batch_size=2, ema_decay=0.5, export_dtype="float32"
  )  # the shipped folder stores bfloat16
  recipe = sm.wan_recipe(config)
  host = lambda params: jax.tree.map(np.array, params)  # noqa: E731  (the step donates the state)
  seen, state = [host(recipe.state.params)], recipe.state
  for _ in range(2):
    state, _ = recipe.step(state, next(recipe.batches))
    seen.append(host(state.params))
  recipe.export(state, tmp_path / "out")
  got = md_wan.load_pipeline(tmp_path / "out").transformer
  want = jax.tree.map(lambda a, b, c: 0.25 * a + 0.25 * b + 0.5 * c, *seen)
  name = "proj_out"  # a trained leaf that every step moves
  got_leaf = np.asarray(nnx.state(got)[name]["kernel"].value)
  want_leaf = np.asarray(want[name]["kernel"].value)
  np.testing.assert_allclose(got_leaf, want_leaf, rtol=1e-5, atol=1e-7)
  assert np.abs(got_leaf - np.asarray(seen[-1][name]["kernel"].value)).max() > 1e-6


def test_quality_prompts_hold_out_the_unseen_pairs():
  prompts = sm.quality_prompts()
  assert len(prompts["held_out"]) + len(prompts["train"]) >= 32
  trained = set(sm.train_captions(9))
  for text in prompts["held_out"]:
    c = md_data.parse_caption(text)
    assert (c.colour, c.shape) in md_data.HELD_OUT and text not in trained
  for text in prompts["train"]:
    c = md_data.parse_caption(text)
    assert (c.colour, c.shape) not in md_data.HELD_OUT and c.direction is not None


def test_vae_loss_weighs_the_foreground():
  # A stand-in VAE (a fixed pixel map as the decoder) keeps this a test of the loss's arithmetic.
  import types

  class Toy:
    def encode(self, video):
      return types.SimpleNamespace(mean=video[..., :1], logvar=0 * video[..., :1])

    def _decode_video(self, z, finish):
      return 0.5 * np.tanh(np.broadcast_to(z, z.shape[:-1] + (3,)) + 0.3)

  frozen = types.SimpleNamespace(merge=lambda params: Toy())
  video, _, mask = next(
    sm.shapes_videos(md_data.ShapesConfig(size=32, frames=5), seed=0, batch_size=2, masks=True)
  )
  batch = {"video": video, "mask": mask}
  l1_plain = sm.wan_vae_loss(frozen)(None, batch, None)[1]["l1"]
  weighted = sm.wan_vae_loss(frozen, foreground_weight=3.0)
  l1_no_mask = weighted(None, dict(batch, mask=0 * mask), None)[1]["l1"]
  l1_weighted = weighted(None, batch, None)[1]["l1"]
  recon = Toy()._decode_video(video[..., :1], True)
  np.testing.assert_allclose(l1_no_mask, l1_plain, rtol=1e-6)
  w = 1.0 + 3.0 * mask
  np.testing.assert_allclose(l1_weighted, np.mean(w / w.mean() * np.abs(recon - video)), rtol=1e-5)
  assert abs(l1_weighted - l1_plain) > 1e-3


def test_cached_latents_batches_drop_captions_from_the_seed():
  import ml_collections

  config = ml_collections.ConfigDict(dict(seed=4, batch_size=64, drop_caption=0.25, base="unused"))
  latents = np.arange(10, dtype=np.float32).reshape(10, 1)
  ids = np.arange(1, 11)  # clip i has caption row i + 1; row 0 is the empty prompt
  states = np.arange(11, dtype=np.float32).reshape(11, 1, 1)
  recipe = sm.cached_latents_recipe(config, None, None, None, latents, ids, states, "unet", None)
  first = [next(recipe.batches) for _ in range(3)]
  again = sm.cached_latents_recipe(config, None, None, None, latents, ids, states, "unet", None)
  for a, b in zip(first, [next(again.batches) for _ in range(3)]):
    np.testing.assert_array_equal(a["latents"], b["latents"])
  batch = first[0]
  pick = np.asarray(batch["latents"])[:, 0].astype(int)
  text = np.asarray(batch["encoder_hidden_states"])[:, 0, 0].astype(int)
  assert set(np.unique(text)) <= {0} | set(pick + 1)
  assert ((text == 0) | (text == pick + 1)).all()
  assert 0 < (text == 0).mean() < 0.5  # about a quarter dropped

  assert "loss_map" not in batch
  maps = np.arange(10, dtype=np.float32).reshape(10, 1) * 10  # clip i's map is 10 i
  with_maps = sm.cached_latents_recipe(
    config, None, None, None, latents, ids, states, "unet", None, maps=maps
  )
  batch = next(with_maps.batches)
  np.testing.assert_array_equal(batch["loss_map"], np.asarray(batch["latents"]) * 10)


def test_cached_latents_image_batches_take_one_frame_of_a_clip():
  """`image_fraction`: that share of the batches are single latent frames of clips (one-frame clips of
  `image_batch_size`), each frame with its clip's caption and map; 0 leaves the batches as they were."""
  import ml_collections

  n, f = 12, 3
  latents = np.arange(n * f, dtype=np.float32).reshape(
    n, f, 1, 1, 1
  )  # clip i, frame j holds 3 i + j
  maps = latents * 10
  ids = np.arange(1, n + 1)
  states = np.arange(n + 1, dtype=np.float32).reshape(n + 1, 1, 1)
  base = dict(seed=2, batch_size=4, drop_caption=0.0, base="unused")

  def recipe(**options):
    config = ml_collections.ConfigDict(base | options)
    return sm.cached_latents_recipe(
      config, None, None, None, latents, ids, states, "transformer", None, maps=maps
    )

  def draw(count, **options):
    batches = recipe(**options).batches
    return [next(batches) for _ in range(count)]

  plain = draw(4)
  zero = draw(4, image_fraction=0.0, image_batch_size=6)
  for a, b in zip(plain, zero):
    np.testing.assert_array_equal(a["latents"], b["latents"])
  assert all(b["latents"].shape == (4, f, 1, 1, 1) for b in plain)

  mixed = draw(40, image_fraction=0.5, image_batch_size=6)
  stills = [b for b in mixed if b["latents"].shape[1] == 1]
  assert 10 < len(stills) < 30  # about half
  assert all(b["latents"].shape == (6, 1, 1, 1, 1) for b in stills)
  assert all(b["latents"].shape == (4, f, 1, 1, 1) for b in mixed if b["latents"].shape[1] != 1)
  values = np.concatenate([np.asarray(b["latents"]).ravel() for b in stills]).astype(int)
  clip, frame = values // f, values % f
  assert set(frame) == {0, 1, 2}  # every latent frame is drawn
  text = np.concatenate([np.asarray(b["encoder_hidden_states"]).ravel() for b in stills]).astype(
    int
  )
  np.testing.assert_array_equal(text, clip + 1)  # the caption of the frame's own clip
  for b in stills:
    np.testing.assert_array_equal(b["loss_map"], np.asarray(b["latents"]) * 10)

  with pytest.raises(ValueError, match="image_fraction=1.0 is not a fraction"):
    recipe(image_fraction=1.0)
  flat = ml_collections.ConfigDict(base | dict(image_fraction=0.5))
  with pytest.raises(ValueError, match=r"single frames of video latents .*\(12, 3\)"):
    sm.cached_latents_recipe(
      flat, None, None, None, latents.reshape(n, f), ids, states, "unet", None
    )


def test_latent_masks_follow_the_causal_vae_grid():
  """Pixel masks [B, 9, 8, 8, 1] onto a latent grid (3, 2, 2): frame 0 alone, then chunks of 4 frames,
  4x4 pixel blocks, grown by one latent pixel."""
  fg = np.zeros((2, 9, 8, 8, 1), np.float32)
  fg[0, 0, 0, 0] = 1  # frame 0, top-left block
  fg[0, 6, 7, 7] = 1  # frame 6 (the second chunk, latent frame 2), bottom-right block
  m = sm.latent_masks(fg, (3, 2, 2))
  assert m.shape == (2, 3, 2, 2, 1) and m.dtype == np.float32
  np.testing.assert_array_equal(m[1], 0)
  np.testing.assert_array_equal(m[0, 1], 0)  # frames 1-4 hold nothing
  np.testing.assert_array_equal(m[0, 0], 1)  # the top-left block grown over the 2x2 grid
  np.testing.assert_array_equal(m[0, 2], 1)
  big = np.zeros((1, 5, 16, 16, 1), np.float32)
  big[0, 1:, 0, 0] = 1
  grown = sm.latent_masks(big, (2, 4, 4))[0, 1, ..., 0]
  np.testing.assert_array_equal(grown, np.pad(np.ones((2, 2)), ((0, 2), (0, 2))))
  with pytest.raises(ValueError, match=r"latent grid \(3, 3, 2\)"):
    sm.latent_masks(fg, (3, 3, 2))
  with pytest.raises(ValueError, match="do not map"):
    sm.latent_masks(fg, (4, 2, 2))


class _Identity:
  """A VAE stand-in whose round trip is exact (its latent is the clip itself)."""

  def encode(self, video):
    return _Mean(video)

  def decode(self, latents):
    return latents


class _Mean:
  def __init__(self, mean):
    self.mean = mean


def test_reconstruction_scores_of_an_exact_round_trip_match_ground_truth():
  data = md_data.ShapesConfig(size=64, frames=5, split="all")
  error, scores = sm.reconstruction_scores(_Identity(), data, seed=3, count=10, batch_size=4)
  assert error == 0.0
  assert len(scores.analyses) == 10  # count, not whole batches
  assert scores.colour == scores.shape == scores.direction == scores.background == 1.0


def test_reconstruction_scores_take_stills_as_one_frame_clips():
  class OneFrame(_Identity):
    def encode(self, video):
      assert video.ndim == 5 and video.shape[1] == 1, video.shape
      return _Mean(video)

  data = md_data.ShapesConfig(size=64, frames=None, split="all")
  error, scores = sm.reconstruction_scores(OneFrame(), data, seed=1, count=6, batch_size=3)
  assert error == 0.0 and len(scores.analyses) == 6
  assert scores.colour == scores.shape == scores.position == 1.0


def test_reconstruction_scores_see_a_blurred_round_trip():
  class Blank(_Identity):
    def decode(self, latents):
      return latents * 0.0  # mid-grey everywhere: no shape survives

  data = md_data.ShapesConfig(size=64, frames=5, split="all")
  error, scores = sm.reconstruction_scores(Blank(), data, seed=3, count=4, batch_size=4)
  assert error > 0.1
  assert scores.shape == 0.0


def test_reconstruction_scores_refuse_no_clips():
  with pytest.raises(ValueError, match="count must be >= 1"):
    sm.reconstruction_scores(_Identity(), md_data.ShapesConfig(size=64, frames=5), seed=0, count=0)


def test_wan_vae_recipe_trains_on_stills_as_one_frame_clips():
  # train_frames=1: still images as one-frame clips through the causal VAE's first-frame path.
  config = testing.app_config("default_models.py:wan-vae")
  config.steps = 2
  config.recipe_options.update(
    template=str(MODEL),
    train_frames=1,
    batch_size=2,
    foreground_weight=10.0,
    crop_on_shape=True,
    schedule_steps=60,
  )
  recipe = sm.wan_vae_recipe(config)
  batch = next(recipe.batches)
  assert batch["video"].shape == (2, 1, 32, 32, 3) and batch["mask"].shape == (2, 1, 32, 32, 1)
  assert float(batch["mask"].sum()) > 0  # the windows hold the shape
  state, metrics = recipe.step(recipe.state, batch)
  assert np.isfinite(float(metrics["loss"])) and int(state.step) == 1


@pytest.mark.slow  # the clip stage is measured and left out of make.sh (the card says why)
def test_wan_vae_clip_stage_trains_only_the_decoder_side(tmp_path):
  # train_encoder=False: the encoder (and so the latents a transformer trains on) stays as it started.
  config = testing.app_config("default_models.py:wan-vae")
  config.steps = 1
  config.recipe_options.update(
    template=str(MODEL),
    batch_size=1,
    train_frames=5,
    stats_count=8,
    schedule_steps=60,
    warmup_steps=0,
  )
  recipe = sm.wan_vae_recipe(config)
  paths = {
    "/".join(map(str, p)) for p, _ in jax.tree_util.tree_leaves_with_path(recipe.state.params)
  }
  assert paths and all("decoder" in p or "post_quant_conv" in p for p in paths), sorted(paths)[:5]
  state, metrics = recipe.step(recipe.state, next(recipe.batches))
  assert np.isfinite(float(metrics["loss"]))
  out = recipe.export(state, tmp_path / "export")
  before, after = md_core.open_checkpoint(MODEL / "vae"), md_core.open_checkpoint(out / "vae")
  encoder = [k for k in before if k.startswith(("encoder.", "quant_conv."))]
  assert encoder and all(np.array_equal(before[k], after[k]) for k in encoder)
  assert any(not np.array_equal(before[k], after[k]) for k in before if k.startswith("decoder."))


# Slow since 2026-12-07 (about 34 s): see test_sharding.py for the default suite's sharded-step check.
@pytest.mark.slow
def test_wan_vae_recipe_splits_each_batch_over_data_devices(monkeypatch):
  """The still VAE stage with `data_devices=2` (two CPU devices; the shipped VAE was trained on one): a
  step on two devices gives the loss and parameters of the same step on one (the foreground weights are
  normalised over the whole batch, not per device). Too many devices or a batch they cannot split are
  refused before loading."""
  config = testing.app_config("default_models.py:wan-vae-still")
  assert config.recipe_options.data_devices == 1
  config.steps = 1
  config.recipe_options.update(template=str(MODEL), batch_size=4, schedule_steps=60)

  def build(n):
    config.recipe_options.data_devices = n
    return sm.wan_vae_recipe(config)

  testing.assert_same_step_on_devices(build)
  monkeypatch.setattr(sm.md_vae, "load_vae_wan", lambda *a, **k: pytest.fail("loaded"))
  config.recipe_options.data_devices = 64
  with pytest.raises(ValueError, match=r"data_devices=64, but JAX has \d+ device\(s\)"):
    sm.wan_vae_recipe(config)
  config.recipe_options.update(data_devices=2, batch_size=3)
  with pytest.raises(ValueError, match="data_devices=2 does not divide batch_size=3"):
    sm.wan_vae_recipe(config)


def test_wan_vae_still_stage_exports_the_inflated_vae(tmp_path):
  # The still stage's export is a clip VAE: each latent frame k is the still latent of frame 4k.
  config = testing.app_config("default_models.py:wan-vae-still")
  config.steps = 1
  config.recipe_options.update(template=str(MODEL), batch_size=2, stats_count=8, schedule_steps=60)
  recipe = sm.wan_vae_recipe(config)
  out = recipe.export(recipe.state, tmp_path / "export")
  vae = md_vae.load_vae_wan(out)
  clip = jnp.asarray(np.random.default_rng(0).uniform(-1, 1, (1, 9, 16, 16, 3)), jnp.float32)
  latents = vae.encode(clip).mean
  for k in range(3):
    still = vae.encode(clip[:, 4 * k : 4 * k + 1]).mean
    np.testing.assert_allclose(latents[:, k : k + 1], still, atol=1e-5)


def test_recipe_data_options_set_the_clips_travel_and_extent():
  import ml_collections

  opts = ml_collections.ConfigDict(dict(size=64, frames=9, travel=[0.55, 0.6], extent=None))
  data = sm._shapes_config(opts)
  assert data.travel == (0.55, 0.6) and data.extent == md_data.ShapesConfig().extent
  # The clip really crosses most of the frame (the analyser's track, first frame to last).
  sample = md_data.shapes_sample(data, 0, 0)
  track = md_data.analyse(sample.pixels).track
  assert abs(track[-1] - track[0]).max() >= 0.5 * 64
  with pytest.raises(ValueError, match="travel"):
    sm._shapes_config(ml_collections.ConfigDict(dict(size=64, frames=9, travel=[0.5, 0.9])))
  with pytest.raises(ValueError, match=r"recipe option travel=0.5 must be a \[low, high\] pair"):
    sm._shapes_config(ml_collections.ConfigDict(dict(size=64, frames=9, travel=0.5)))
  shared = sm._shapes_config(ml_collections.ConfigDict(dict(size=64, frames=9, start="shared")))
  assert shared.start == "shared" and data.start == "fit"
  with pytest.raises(ValueError, match="start='middle'"):
    sm._shapes_config(ml_collections.ConfigDict(dict(size=64, frames=9, start="middle")))


def test_wan_recipe_passes_frame_noise_to_the_loss(monkeypatch):
  """The shipped recipe noises half its clips frame by frame (models/shapes-wan/README.md: what taught
  the direction); the option reaches `wan_loss`, and the loss's per-frame path runs in the step."""
  config = testing.app_config("default_models.py:wan")
  assert config.recipe_options.frame_noise == 0.5
  seen = {}
  real = sm.families.wan_loss

  def spy(frozen, **kw):
    seen.update(kw)
    return real(frozen, **kw)

  monkeypatch.setattr(sm.families, "wan_loss", spy)
  config.steps = 30
  config.recipe_options.update(base=str(MODEL), num_clips=4, batch_size=2, frame_noise=1.0)
  recipe = sm.wan_recipe(config)
  assert seen["frame_noise"] == 1.0 and seen["shift"] == config.recipe_options.shift
  _, metrics = recipe.step(recipe.state, next(recipe.batches))
  assert np.isfinite(float(metrics["loss"]))


def test_clip_probabilities_weigh_the_named_words():
  """`caption_weights`: a clip's draw weight is the product of its caption's words' weights, normalised;
  no weights leave the draws uniform (None); bad weights and unknown words are refused by name."""
  caps = [
    "a red star moving up on a black background",
    "a red circle moving up on a black background",
    "a blue star moving left on a white background",
    "a blue circle moving left on a white background",
  ]
  assert sm.clip_probabilities(None, caps) is None and sm.clip_probabilities({}, caps) is None
  np.testing.assert_allclose(sm.clip_probabilities({"star": 3}, caps), [3, 1, 3, 1] / np.float64(8))
  np.testing.assert_allclose(
    sm.clip_probabilities({"star": 3, "white": 0.5}, caps), np.array([3, 1, 1.5, 0.5]) / 6
  )
  for bad in (
    {"star": 0},
    {"star": -1.0},
    {"star": True},
    {"star": "2"},
    {"star": np.inf},
    {"star": np.nan},
  ):
    with pytest.raises(ValueError, match=r"caption_weights\['star'\].*positive finite number"):
      sm.clip_probabilities(bad, caps)
  with pytest.raises(ValueError, match=r"names \['hexagon'\], which no training caption"):
    sm.clip_probabilities({"hexagon": 2, "star": 2}, caps)


def test_cached_latents_draw_with_the_given_probabilities():
  """`probs` draws clip i with probability probs[i] (a clip with probability 0 never comes up); None
  draws as before."""
  import ml_collections

  config = ml_collections.ConfigDict(dict(seed=1, batch_size=256, drop_caption=0.0, base="unused"))
  latents = np.arange(4, dtype=np.float32).reshape(4, 1)
  ids = np.arange(1, 5)
  states = np.arange(5, dtype=np.float32).reshape(5, 1, 1)

  def picks(probs, count=8):
    batches = sm.cached_latents_recipe(
      config, None, None, None, latents, ids, states, "unet", None, probs=probs
    ).batches
    return np.concatenate([np.asarray(next(batches)["latents"])[:, 0] for _ in range(count)])

  drawn = picks(np.array([0.5, 0.25, 0.25, 0.0]))
  freq = np.bincount(drawn.astype(int), minlength=4) / drawn.size
  np.testing.assert_allclose(freq, [0.5, 0.25, 0.25, 0.0], atol=0.03)
  uniform = picks(None, 1)
  again = sm.cached_latents_recipe(config, None, None, None, latents, ids, states, "unet", None)
  np.testing.assert_array_equal(uniform, np.asarray(next(again.batches)["latents"])[:, 0])


def test_wan_recipe_passes_sampler_and_caption_weights(monkeypatch):
  """`sampler="logit_normal"` (with its mean and spread) reaches `wan_loss`; `caption_weights` reach the
  batches (a weight on one shape makes its clips most of the draws); `remat` reaches the loaded
  transformer."""
  config = testing.app_config("default_models.py:wan")
  seen, probs = {}, {}
  real_loss, real_recipe = sm.families.wan_loss, sm.cached_latents_recipe

  def spy_loss(frozen, **kw):
    seen.update(kw)
    return real_loss(frozen, **kw)

  def spy_recipe(*args, **kw):
    probs["p"] = kw.get("probs")
    return real_recipe(*args, **kw)

  loaded = {}
  real_load = sm.md_wan.load_pipeline

  def spy_load(*args, **kw):
    loaded.update(kw)
    return real_load(*args, **kw)

  monkeypatch.setattr(sm.families, "wan_loss", spy_loss)
  monkeypatch.setattr(sm, "cached_latents_recipe", spy_recipe)
  monkeypatch.setattr(sm.md_wan, "load_pipeline", spy_load)
  assert config.recipe_options.remat == "dots"  # the shipped recipe's (models/shapes-wan/README.md)
  config.steps = 30
  with config.unlocked():  # options the variant does not set
    config.recipe_options.update(
      base=str(MODEL), num_clips=8, batch_size=2, sampler="logit_normal", logit_mean=0.5,
      logit_std=0.8, caption_weights={"star": 100.0},
    )  # fmt: skip
  recipe = sm.wan_recipe(config)
  assert loaded["remat"] == "dots"
  assert seen["sampler"] == "logit_normal"
  assert (seen["logit_mean"], seen["logit_std"]) == (0.5, 0.8)
  p = probs["p"]
  assert p.shape == (8,) and abs(p.sum() - 1) < 1e-12
  assert set(np.round(p / p.min(), 6)) <= {1.0, 100.0}  # a star clip is 100 times as likely
  _, metrics = recipe.step(recipe.state, next(recipe.batches))
  assert np.isfinite(float(metrics["loss"]))
  plain = testing.app_config("default_models.py:wan")  # neither option: as shipped
  plain.steps = 30
  plain.recipe_options.update(base=str(MODEL), num_clips=8, batch_size=2)
  seen.clear()
  sm.wan_recipe(plain)
  assert seen["sampler"] == "shifted" and "logit_mean" not in seen
  assert probs["p"] is None


def test_wan_recipe_refuses_a_bad_sampler_before_encoding(monkeypatch):
  """An unknown sampler, or the logit-normal settings without that sampler, fail by name before the
  pipeline is loaded or any clip encoded."""
  config = testing.app_config("default_models.py:wan")
  monkeypatch.setattr(sm.md_wan, "load_pipeline", lambda *a, **k: pytest.fail("loaded"))
  with config.unlocked():
    config.recipe_options.sampler = "cosine"
  with pytest.raises(ValueError, match=r"recipe_options.sampler='cosine'; expected one of"):
    sm.wan_recipe(config)
  with config.unlocked():
    config.recipe_options.sampler = "shifted"
    config.recipe_options.logit_std = 0.5
  with pytest.raises(ValueError, match=r"\['logit_std'\] are the logit_normal sampler's"):
    sm.wan_recipe(config)


# Slow since 2026-12-07 (about 31 s): see test_sharding.py for the default suite's sharded-step check.
@pytest.mark.slow
def test_wan_recipe_splits_each_batch_over_data_devices():
  """`data_devices=2` (the shipped recipe's, on two CPU devices): the state sits replicated on two
  devices, and a step gives the loss and parameters of the same step on one device."""
  config = testing.app_config("default_models.py:wan")
  assert config.recipe_options.data_devices == 2 and config.cpu_devices == 2
  config.steps = 30
  config.recipe_options.update(base=str(MODEL), num_clips=4, batch_size=2)

  def build(n):
    config.recipe_options.data_devices = n
    return sm.wan_recipe(config)

  testing.assert_same_step_on_devices(build)


def test_wan_recipe_refuses_data_devices_it_cannot_use(monkeypatch):
  """Too many devices, a batch they cannot split, or a bad dtype name fail by name before anything is
  loaded."""
  config = testing.app_config("default_models.py:wan")
  monkeypatch.setattr(sm.md_wan, "load_pipeline", lambda *a, **k: pytest.fail("loaded"))
  config.steps = 30
  config.recipe_options.update(base=str(MODEL), num_clips=4, batch_size=2, data_devices=64)
  with pytest.raises(
    ValueError, match=r"data_devices=64, but JAX has \d+ device\(s\).*cpu_devices=64"
  ):
    sm.wan_recipe(config)
  config.recipe_options.update(data_devices=4, batch_size=6)
  with pytest.raises(ValueError, match="data_devices=4 does not divide batch_size=6"):
    sm.wan_recipe(config)
  # A dtype name that is not a floating dtype: refused now, not at the export after the training run.
  config.recipe_options.update(data_devices=1, batch_size=2, export_dtype="bf16")
  with pytest.raises(
    ValueError, match=r"recipe_options.export_dtype='bf16' is not a floating dtype"
  ):
    sm.wan_recipe(config)
  config.recipe_options.export_dtype = "bfloat16"
  with config.unlocked():
    config.recipe_options.compute_dtype = "int8"
  with pytest.raises(
    ValueError, match=r"recipe_options.compute_dtype='int8' is not a floating dtype"
  ):
    sm.wan_recipe(config)


def test_wan_recipe_exports_in_export_dtype(tmp_path):
  """The shipped recipe writes its transformer in bfloat16 (`export_dtype`), which loads as float32
  holding the same values."""
  config = testing.app_config("default_models.py:wan")
  assert config.recipe_options.export_dtype == "bfloat16"
  config.steps = 30
  config.recipe_options.update(base=str(MODEL), num_clips=4, batch_size=2)
  recipe = sm.wan_recipe(config)
  state, _ = recipe.step(recipe.state, next(recipe.batches))
  trained = jax.tree.map(np.asarray, state.params)
  recipe.export(state, tmp_path / "out")
  stored = md_core.open_checkpoint(tmp_path / "out" / "transformer")
  assert {np.asarray(stored[k]).dtype.name for k in stored} == {"bfloat16"}
  got = nnx.state(md_wan.load_pipeline(tmp_path / "out").transformer, nnx.Param)
  want = np.asarray(trained["proj_out"]["kernel"].value)
  got_leaf = np.asarray(got["proj_out"]["kernel"].value)
  assert got_leaf.dtype == np.float32
  np.testing.assert_array_equal(got_leaf, want.astype(jnp.bfloat16).astype(np.float32))


def test_app_start_makes_the_cpu_devices_asked_for():
  """`cpu_devices` in an app config gives JAX's CPU backend that many devices (a fresh process: the
  count is fixed once a backend starts)."""
  import os
  import subprocess
  import sys

  env = dict(os.environ, XLA_FLAGS="", JAX_PLATFORMS="cpu")
  code = (
    "import jax\nfrom md_core import apps\n"
    "mesh = apps.start({'cpu_devices': 2, 'compilation_cache': False})\n"
    "print(len(jax.devices()), mesh.devices.size)"
  )
  out = subprocess.run(
    [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
  )
  assert out.returncode == 0, out.stderr[-2000:]
  assert out.stdout.split()[-2:] == ["2", "2"]
