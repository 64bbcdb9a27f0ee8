"""Dreambooth (md_train.recipes.dreambooth_sd / dreambooth_flux / dreambooth_klein, md_train._dreambooth,
the losses' `prior_loss_weight=`): one prior-preservation step of the tiny SD 1.x UNet, the tiny Flux.1 dev
transformer and the tiny Flux.2 Klein transformer against diffusers' train_dreambooth.py /
train_dreambooth_flux.py / train_dreambooth_lora_flux2_klein.py losses by torch autograd
(tools/fixtures/train_dreambooth_step.py: loss within 1e-5, gradients within 1e-4), the instance / class
folders and their errors, class-image generation, the batches' halves and resume, and 2-step runs of the
`dreambooth-lora-tiny` (SD 1.x), `dreambooth-sdxl-lora-tiny`, `dreambooth-flux-lora-tiny` and
`dreambooth-klein-lora-tiny` recipes, each generating its class images with md's own pipeline."""

import importlib.util

import chex
import jax
import ml_collections
import numpy as np
import optax
import pytest
from flax import nnx

import md_core
import md_flux
import md_schedulers as mdsch
import md_sd
import md_train as mdt
import md_train.families as mtf
from md_core.testing import fixture_path, load_arrays, repo_root

LOSS_TOL, GRAD_TOL = 1e-5, 1e-4
SCHED = dict(beta_schedule="scaled_linear", beta_start=0.00085, beta_end=0.012)


def _nhwc(x):
  return np.asarray(x).transpose(0, 2, 3, 1)


def _check_prior_step(what, out, ref, convert_key):
  """One prior-preservation step against the torch reference: loss and its halves within LOSS_TOL, the
  weighting visible, the global gradient norm and every recorded gradient within GRAD_TOL."""
  (loss, aux), grads = out
  np.testing.assert_allclose(float(loss), ref["loss"], atol=LOSS_TOL, rtol=0)
  np.testing.assert_allclose(float(aux["instance_loss"]), ref["instance_loss"], atol=LOSS_TOL)
  np.testing.assert_allclose(float(aux["prior_loss"]), ref["prior_loss"], atol=LOSS_TOL)
  assert abs(float(ref["loss"]) - float(ref["instance_loss"] + ref["prior_loss"])) > 0.1  # weighted
  np.testing.assert_allclose(float(optax.tree.norm(grads)), ref["grad_norm"], atol=GRAD_TOL)
  flat = {tuple(p): np.asarray(v[...]) for p, v in nnx.to_flat_state(grads)}
  names = [k for k in ref if k.startswith("grad/")]
  assert len(names) >= 8
  worst = 0.0
  for key in names:
    targets = convert_key(key[len("grad/") :])
    for target in [targets] if isinstance(targets, md_core.Target) else targets:
      got = flat[target.path] if target.layer is None else flat[target.path][target.layer]
      want = md_core.convert(ref[key], target)
      assert np.abs(want).max() > 0, key
      chex.assert_trees_all_close(got, want, atol=GRAD_TOL, rtol=0, custom_message=key)
      worst = max(worst, float(np.abs(got - want).max()))
  print(f"{what}: loss err {abs(float(loss) - float(ref['loss'])):.1e}, max grad err {worst:.1e}")


def test_prior_preservation_step_matches_torch():
  ref = load_arrays(fixture_path("train_dreambooth_step") / "sd.npz")
  unet = md_sd.load_unet(fixture_path("unet") / "sd1", subfolder=None, progress=False)
  frozen, params = mdt.split_trainable(unet)
  weight = float(ref["prior_loss_weight"])
  loss_fn = mtf.sd_loss(
    frozen, alphas_cumprod=mdsch.ddpm(**SCHED).alphas_cumprod, prior_loss_weight=weight
  )
  batch = {
    "latents": _nhwc(ref["latents"]),
    "noise": _nhwc(ref["noise"]),
    "timesteps": ref["timesteps"],
    "encoder_hidden_states": ref["encoder_hidden_states"],
  }
  out = mdt.loss_and_grads(loss_fn, params, batch)
  _check_prior_step("dreambooth", out, ref, md_sd.unet_key_map(unet.cfg))


def test_flux_prior_preservation_step_matches_torch():
  """train_dreambooth_flux.py with --with_prior_preservation: instance rows first, the loss
  `mse(instance) + 0.5 mse(class)` of the flow target, guidance 3.5."""
  ref = load_arrays(fixture_path("train_dreambooth_step") / "flux.npz")
  frozen, params = mdt.split_trainable(md_flux.load_flux(fixture_path("flux_transformer") / "dev"))
  weight = float(ref["prior_loss_weight"])
  assert np.all(ref["guidance"] == 3.5)
  loss_fn = mtf.flux_loss(frozen, guidance=3.5, prior_loss_weight=weight)
  batch = {k: ref[k] for k in ("sigmas", "encoder_hidden_states", "pooled_projections", "txt_ids")}
  batch.update(latents=_nhwc(ref["latents"]), noise=_nhwc(ref["noise"]))
  out = mdt.loss_and_grads(loss_fn, params, batch)
  _check_prior_step("flux dreambooth", out, ref, md_flux.convert_key)
  loss = out[0][0]
  # Without txt_ids the loss uses the pipeline's zeros (the fixture's are zeros too).
  no_ids = {k: v for k, v in batch.items() if k != "txt_ids"}
  again, _ = loss_fn(params, no_ids, jax.random.key(0))
  np.testing.assert_allclose(float(again), float(loss), atol=1e-6, rtol=0)


def test_klein_prior_preservation_step_matches_torch():
  """train_dreambooth_lora_flux2_klein.py with --with_prior_preservation: instance rows first, the loss
  `mse(instance) + 0.5 mse(class)` of the flow target over the packed token grid, no guidance."""
  ref = load_arrays(fixture_path("train_dreambooth_step") / "klein.npz")
  frozen, params = mdt.split_trainable(
    md_flux.load_flux2(fixture_path("flux2_transformer") / "klein")
  )
  loss_fn = mtf.klein_loss(frozen, prior_loss_weight=float(ref["prior_loss_weight"]))
  batch = {"sigmas": ref["sigmas"], "encoder_hidden_states": ref["encoder_hidden_states"]}
  batch.update(latents=_nhwc(ref["latents"]), noise=_nhwc(ref["noise"]))
  out = mdt.loss_and_grads(loss_fn, params, batch)
  _check_prior_step("klein dreambooth", out, ref, md_flux.convert_key_flux2)


def test_odd_batch_with_prior_preservation_is_refused():
  unet = md_sd.load_unet(fixture_path("unet") / "sd1", subfolder=None, progress=False)
  frozen, params = mdt.split_trainable(unet)
  loss_fn = mtf.sd_loss(
    frozen, alphas_cumprod=mdsch.ddpm(**SCHED).alphas_cumprod, prior_loss_weight=1.0
  )
  batch = {
    "latents": np.zeros((3, 8, 8, 4), np.float32),
    "encoder_hidden_states": np.zeros((3, 6, 16), np.float32),
  }
  with pytest.raises(ValueError, match="the batch of 3 must be instance \\+ class halves"):
    jax.eval_shape(lambda p: loss_fn(p, batch, jax.random.key(0)), params)


def test_instance_folder_errors(tmp_path):
  with pytest.raises(FileNotFoundError, match="instance_dir='.*nowhere'.*is not a folder"):
    mdt.image_files(tmp_path / "nowhere")
  (tmp_path / "empty").mkdir()
  (tmp_path / "empty" / "notes.txt").write_text("no images here")
  with pytest.raises(ValueError, match="instance_dir='.*empty'.*holds no image"):
    mdt.image_files(tmp_path / "empty")
  bad = tmp_path / "bad"
  bad.mkdir()
  (bad / "broken.png").write_bytes(b"not a png")
  files = mdt.image_files(bad)
  with pytest.raises(ValueError, match="instance_dir: cannot read image .*broken.png"):
    mdt.load_images(files, 32)


def test_load_images_crops_and_resizes():
  files = mdt.image_files(fixture_path("train_dreambooth_step") / "instance")
  assert len(files) == 3
  pixels = mdt.load_images(files, 16)
  chex.assert_shape(pixels, (3, 16, 16, 3))
  assert 0 <= pixels.min() and pixels.max() <= 1
  assert pixels[0, 8, 7, 0] > 0.8 and pixels[0, 8, 7, 1] < 0.2  # the red disc


def test_class_images_fill_the_folder(tmp_path):
  """Only the missing class images are generated (batches of `batch_size`, seed per batch)."""
  from md_core import media

  folder = tmp_path / "class"
  media.save_image(folder / "mine.png", np.zeros((8, 8, 3), np.float32))
  calls = []

  def generate(prompts, seed):
    calls.append((list(prompts), seed))
    return np.full((len(prompts), 8, 8, 3), 0.5, np.float32)

  files = mdt.class_images(generate, folder, "a disc", 4, batch_size=2, seed=7)
  assert calls == [(["a disc"] * 2, 7), (["a disc"], 8)]
  assert len(files) == 4 and files[-1].name == "mine.png"
  again = mdt.class_images(generate, folder, "a disc", 3)
  assert len(calls) == 2 and len(again) == 3
  (tmp_path / "file").write_text("x")
  with pytest.raises(FileNotFoundError, match="class_dir=.* is a file"):
    mdt.class_images(generate, tmp_path / "file", "a disc", 1)


def test_batches_halves_and_resume():
  inst = np.arange(3, dtype=np.float32)[:, None, None, None] * np.ones((3, 2, 2, 1), np.float32)
  klass = 10 + np.arange(5, dtype=np.float32)[:, None, None, None] * np.ones((5, 2, 2, 1))
  states = {"encoder_hidden_states": np.ones((4, 2), np.float32)}
  cls_states = {"encoder_hidden_states": np.full((4, 2), 2.0, np.float32)}
  it = mdt.DreamboothBatches(inst, klass, states, cls_states, batch_size=2, seed=1)
  batches = [next(it) for _ in range(3)]
  for b in batches:
    chex.assert_shape(b["latents"], (4, 2, 2, 1))
    ids = np.asarray(b["latents"][:, 0, 0, 0])
    assert np.all(ids[:2] < 10) and np.all(ids[2:] >= 10)  # instance rows first
    np.testing.assert_array_equal(b["encoder_hidden_states"][:, 0, 0], [1, 1, 2, 2])
  seen = sorted(float(x) for b in batches[:2] for x in b["latents"][:2, 0, 0, 0])[:3]
  assert seen == [0, 1, 2]  # every instance image once in the first pass
  it2 = mdt.DreamboothBatches(inst, klass, states, cls_states, batch_size=2, seed=1)
  it2.restore(mdt.DreamboothBatches(inst, klass, states, cls_states, batch_size=2, seed=1).state())
  it2.restore({"step": 2})
  np.testing.assert_array_equal(next(it2)["latents"], batches[2]["latents"])


def _variant(name, **overrides):
  path = repo_root() / "apps" / "configs" / "train.py"
  spec = importlib.util.spec_from_file_location("_train_config_db", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  options = dict(module.VARIANTS[name][1], **overrides)
  return ml_collections.ConfigDict(dict(seed=0, recipe_options=options))


# variant -> (recipe, the LoRA file's key prefixes, the text conditioning in each batch, the latents of one
# 32 px instance + class pair, option overrides). SD 1.x's dreambooth-lora-tiny: with its text encoder
# trained, below (and plain, tests/test_dreambooth_app.py); SDXL's here with both text encoders trained
# (its batches carry both prompts' token ids), Flux.1's with CLIP trained (its T5 states cached).
DREAMBOOTH_LORA = {
  "dreambooth-sdxl-lora-tiny": (
    "dreambooth_sd", {"unet", "text_encoder", "text_encoder_2"},
    {"input_ids", "input_ids_2", "time_ids"}, (2, 4, 4, 4), {"train_text_encoder": True},
  ),
  "dreambooth-flux-lora-tiny": (
    "dreambooth_flux", {"transformer", "text_encoder"}, {"encoder_hidden_states", "input_ids"},
    (2, 4, 4, 4), {"train_text_encoder": True},
  ),
  # Klein: the VAE's latents patchified 2x2 (16 channels), as the pipeline encodes reference images
  "dreambooth-klein-lora-tiny": (
    "dreambooth_klein", {"transformer"}, {"encoder_hidden_states"}, (2, 2, 2, 16), {}
  ),
}  # fmt: skip


@pytest.mark.parametrize("variant", list(DREAMBOOTH_LORA))
def test_dreambooth_lora_recipe_generates_class_images_and_trains(variant, tmp_path):
  from md_train import recipes

  name, prefixes, text, shape, overrides = DREAMBOOTH_LORA[variant]
  config = _variant(
    variant, class_dir=str(tmp_path / "class"), num_class_images=2, class_steps=1, **overrides
  )
  recipe = getattr(recipes, name)(config)
  assert len(mdt.image_files(tmp_path / "class", what="class_dir")) == 2
  batch = next(iter(recipe.batches))
  chex.assert_shape(batch["latents"], shape)  # 1 instance + 1 class, 32 px
  assert set(batch) == {"latents", *text}
  for k in text:  # the instance prompt's row, then the class prompt's
    assert not np.array_equal(batch[k][0], batch[k][1]) or k == "time_ids", k
  recipe.batches.restore({"step": 0})
  state = mdt.fit(recipe, steps=2)
  assert int(state.step) == 2
  file = recipe.export(state, tmp_path / "export")
  assert file.name == "pytorch_lora_weights.safetensors"
  assert {k.split(".")[0] for k in md_core.SafetensorsFile(file)} == prefixes


def test_dreambooth_lora_with_the_text_encoder_trains_both_and_the_pipeline_loads_them(tmp_path):
  """`dreambooth-lora-tiny` with `train_text_encoder=True` (train_dreambooth_lora.py's flag): the batches
  carry the prompts' token ids, two steps move both LoRAs' lora_B, and the export holds `unet.` and
  `text_encoder.` factors that `Pipeline.load_lora` puts into both components' slots as trained. (One
  step of this loss against peft: tests/test_train_lora_text.py.)"""
  from md_train import recipes

  config = _variant(
    "dreambooth-lora-tiny", class_dir=str(tmp_path / "class"), num_class_images=2, class_steps=1,
    train_text_encoder=True,
  )  # fmt: skip
  recipe = recipes.dreambooth_sd(config)
  batch = next(iter(recipe.batches))
  assert set(batch) == {"latents", "input_ids"} and batch["input_ids"].dtype == np.int32
  assert not np.array_equal(batch["input_ids"][0], batch["input_ids"][1])  # instance, class prompt
  recipe.batches.restore({"step": 0})
  assert set(recipe.state.params) == {"denoiser", "text_encoder"}
  state = mdt.fit(recipe, steps=2)
  trained = {}
  for part in ("denoiser", "text_encoder"):
    flat = {tuple(p): np.asarray(v[...]) for p, v in nnx.to_flat_state(state.params[part])}
    assert max(float(np.abs(v).max()) for p, v in flat.items() if p[-1] == "lora_b") > 1e-4, part
    trained[part] = flat
  file = recipe.export(state, tmp_path / "export")
  keys = list(md_core.SafetensorsFile(file))
  assert {k.split(".")[0] for k in keys} == {"unet", "text_encoder"}
  pipe = md_sd.load_pipeline(fixture_path("sd_pipeline") / "sd")
  pipe.load_lora(file, name="db", max_rank=4)
  scale = np.float32(1.0)  # alpha = r in the variant
  for part, module in (("denoiser", pipe.unet), ("text_encoder", pipe.text_encoder)):
    slots = {tuple(p): np.asarray(v[...]) for p, v in nnx.to_flat_state(nnx.state(module))}
    for p, v in trained[part].items():
      want = v * scale if p[-1] == "lora_b" else v
      np.testing.assert_allclose(slots[p], want, atol=1e-7, rtol=0, err_msg=f"{part} {p}")


def test_dreambooth_recipe_option_errors(tmp_path):
  from md_train import recipes

  # The variants leave class_dir empty (the apps fill in <workdir>/class_images); the recipes need one.
  cls = str(tmp_path / "class")

  with pytest.raises(FileNotFoundError, match="instance_dir='.*missing'"):
    recipes.dreambooth_sd(
      _variant("dreambooth-tiny", class_dir=cls, instance_dir=str(tmp_path / "missing"))
    )
  with pytest.raises(ValueError, match="with_prior_preservation needs recipe_options.class_dir"):
    recipes.dreambooth_sd(_variant("dreambooth-tiny", class_dir=""))
  with pytest.raises(ValueError, match="recipe_options.instance_prompt is required"):
    recipes.dreambooth_sd(_variant("dreambooth-tiny", class_dir=cls, instance_prompt=""))
  with pytest.raises(ValueError, match="instance_prompt is required for dreambooth_flux"):
    recipes.dreambooth_flux(
      _variant("dreambooth-flux-lora-tiny", class_dir=cls, instance_prompt="")
    )
  klein = str(fixture_path("flux2_pipeline") / "klein")
  with pytest.raises(ValueError, match="is a Flux2KleinPipeline folder; dreambooth_flux trains"):
    recipes.dreambooth_flux(_variant("dreambooth-flux-lora-tiny", class_dir=cls, model=klein))
  flux = str(fixture_path("flux_pipeline") / "dev")
  with pytest.raises(ValueError, match="is a FluxPipeline folder; dreambooth_klein trains"):
    recipes.dreambooth_klein(_variant("dreambooth-klein-lora-tiny", class_dir=cls, model=flux))
  with pytest.raises(ValueError, match="instance_prompt is required for dreambooth_klein"):
    recipes.dreambooth_klein(
      _variant("dreambooth-klein-lora-tiny", class_dir=cls, instance_prompt="")
    )
  with pytest.raises(ValueError, match="train_text_encoder='yes' must be True or False"):
    recipes.dreambooth_sd(_variant("dreambooth-lora-tiny", class_dir=cls, train_text_encoder="yes"))
  with pytest.raises(ValueError, match="give recipe_options.lora too"):
    recipes.dreambooth_sd(_variant("dreambooth-tiny", class_dir=cls, train_text_encoder=True))
  with pytest.raises(ValueError, match="dreambooth_klein: recipe_options.train_text_encoder=True"):
    recipes.dreambooth_klein(
      _variant("dreambooth-klein-lora-tiny", class_dir=cls, train_text_encoder=True)
    )
