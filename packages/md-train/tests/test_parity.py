"""One training step against PyTorch autograd (tools/fixtures/train_step.py): the loss of diffusers' training
scripts within 1e-5 and the gradients within 1e-4 for SD 1.x (epsilon, v, Min-SNR-γ), SDXL, Flux.1 dev and
Wan 2.1, LTX-Video (tools/fixtures/train_step_ltx.py: LTX-Video-Trainer's loss, with and without
first-frame conditioning), and AdamW (+ global-norm clipping) steps against torch.optim.AdamW within 1e-5."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import md_core
import md_flux
import md_ltx
import md_schedulers as mdsch
import md_sd
import md_train as mdt
import md_train.families as mtf
import md_wan
from md_core.testing import fixture_path, load_arrays

LOSS_TOL, GRAD_TOL, ADAM_TOL = 1e-5, 1e-4, 1e-5


def _ref(name):
  return load_arrays(fixture_path("train_step") / f"{name}.npz")


def _flat(state):
  return {
    tuple(p): np.asarray(v[...] if isinstance(v, nnx.Variable) else v)
    for p, v in nnx.to_flat_state(state)
  }


def _check_grads(grads, ref, prefix, keymap):
  """Every reference gradient under `prefix` against md's, through the family's key map (layout and
  stacked layer); returns the largest error."""
  flat, worst, names = _flat(grads), 0.0, [k for k in ref if k.startswith(prefix)]
  assert len(names) >= 8
  for key in names:
    targets = keymap(key[len(prefix) :])
    for target in [targets] if isinstance(targets, md_core.Target) else targets:  # fused: parts
      got = flat[target.path]
      got = got if target.layer is None else got[target.layer]
      want = md_core.convert(ref[key], target)
      assert np.abs(want).max() > 0, key  # the parameter takes part in the loss
      chex.assert_trees_all_close(got, want, atol=GRAD_TOL, rtol=0, custom_message=key)
      worst = max(worst, float(np.abs(got - want).max()))
  return worst


def _nhwc(x):
  return jnp.asarray(x).transpose(0, 2, 3, 1)


SCHED = dict(beta_schedule="scaled_linear", beta_start=0.00085, beta_end=0.012)
SD_KINDS = {
  "eps": dict(prediction_type="epsilon"),
  "v": dict(prediction_type="v_prediction"),
  "eps_snr": dict(prediction_type="epsilon", snr_gamma=5.0),
}


def _sd_batch(ref):
  return {
    "latents": _nhwc(ref["latents"]),
    "noise": _nhwc(ref["noise"]),
    "timesteps": jnp.asarray(ref["timesteps"]),
    "encoder_hidden_states": jnp.asarray(ref["encoder_hidden_states"]),
  }


@functools.cache
def _sd(kind):
  """One SD loss and its gradients (the UNet's backward is the slow compile here: one kind each)."""
  unet = md_sd.load_unet(fixture_path("unet") / "sd1", subfolder=None, progress=False)
  frozen, params = mdt.split_trainable(unet)
  ref = _ref("sd")
  loss_fn = mtf.sd_loss(frozen, alphas_cumprod=mdsch.ddpm(**SCHED).alphas_cumprod, **SD_KINDS[kind])
  return unet, mdt.loss_and_grads(loss_fn, params, _sd_batch(ref)), ref


# SNR-weighted epsilon runs by default (the epsilon target and the Min-SNR weights against diffusers);
# the plain epsilon and v-prediction rows, each a compile of the UNet's backward of its own, under
# `-m slow` (their targets and weights are checked against closed forms in test_losses.py).
@pytest.mark.parametrize(
  "kind", [pytest.param(k, marks=[] if k == "eps_snr" else [pytest.mark.slow]) for k in SD_KINDS]
)
def test_sd_loss_and_grads_match_torch(kind):
  unet, out, ref = _sd(kind)
  (loss, _), grads = out
  np.testing.assert_allclose(float(loss), ref[f"loss_{kind}"], atol=LOSS_TOL, rtol=0)
  np.testing.assert_allclose(
    float(optax.tree.norm(grads)), ref[f"grad_norm_{kind}"], atol=GRAD_TOL, rtol=0
  )
  _check_grads(grads, ref, f"grad_{kind}/", md_sd.unet_key_map(unet.cfg))


def test_sdxl_loss_and_grads_match_torch():
  """train_text_to_image_sdxl.py's epsilon loss, with the added text embeds and time ids."""
  unet = md_sd.load_unet(fixture_path("unet") / "sdxl", subfolder=None, progress=False)
  frozen, params = mdt.split_trainable(unet)
  ref = _ref("sdxl")
  loss_fn = mtf.sd_loss(frozen, alphas_cumprod=mdsch.ddpm(**SCHED).alphas_cumprod)
  batch = _sd_batch(ref)
  batch["added_cond_kwargs"] = {k: jnp.asarray(ref[k]) for k in ("text_embeds", "time_ids")}
  (loss, _), grads = mdt.loss_and_grads(loss_fn, params, batch)
  np.testing.assert_allclose(float(loss), ref["loss"], atol=LOSS_TOL, rtol=0)
  np.testing.assert_allclose(float(optax.tree.norm(grads)), ref["grad_norm"], atol=GRAD_TOL)
  _check_grads(grads, ref, "grad/", md_sd.unet_key_map(unet.cfg))


def test_flux_loss_and_grads_match_torch():
  model = md_flux.load_flux(fixture_path("flux_transformer") / "dev")
  frozen, params = mdt.split_trainable(model)
  ref = _ref("flux")
  assert np.all(ref["guidance"] == 3.5)
  loss_fn = mtf.flux_loss(frozen, guidance=3.5)
  batch = {
    k: jnp.asarray(ref[k])
    for k in ("sigmas", "encoder_hidden_states", "pooled_projections", "txt_ids")
  }
  batch.update(latents=_nhwc(ref["latents"]), noise=_nhwc(ref["noise"]))
  (loss, _), grads = mdt.loss_and_grads(loss_fn, params, batch)
  np.testing.assert_allclose(float(loss), ref["loss"], atol=LOSS_TOL, rtol=0)
  np.testing.assert_allclose(float(optax.tree.norm(grads)), ref["grad_norm"], atol=GRAD_TOL)
  _check_grads(grads, ref, "grad/", md_flux.convert_key)


@pytest.fixture(scope="module")
def wan():
  model = md_wan.load_transformer(fixture_path("wan_transformer") / "t2v")
  frozen, params = mdt.split_trainable(model)
  ref = _ref("wan")
  bfhwc = lambda x: jnp.asarray(x).transpose(0, 2, 3, 4, 1)  # noqa: E731
  batch = {
    "latents": bfhwc(ref["latents"]),
    "noise": bfhwc(ref["noise"]),
    "sigmas": jnp.asarray(ref["sigmas"]),
    "encoder_hidden_states": jnp.asarray(ref["encoder_hidden_states"]),
  }
  return frozen, params, ref, batch


def test_wan_loss_and_grads_match_torch(wan):
  frozen, params, ref, batch = wan
  (loss, _), grads = mdt.loss_and_grads(mtf.wan_loss(frozen), params, batch)
  np.testing.assert_allclose(float(loss), ref["loss"], atol=LOSS_TOL, rtol=0)
  np.testing.assert_allclose(float(optax.tree.norm(grads)), ref["grad_norm"], atol=GRAD_TOL)
  _check_grads(grads, ref, "grad/", md_wan.convert_key)


def _bfhwc(x):
  return jnp.asarray(x).transpose(0, 2, 3, 4, 1)


@pytest.mark.parametrize("case", ["i2v", "ti2v"])
def test_conditioned_wan_loss_and_grads_match_torch(case):
  """DiffSynth's image-conditioned Wan losses (tools/fixtures/train_step_wan_cond.py): I2V's condition
  channels and CLIP tokens; TI2V's clean first frame at timestep 0, left out of the loss."""
  ref = load_arrays(fixture_path("train_step_wan_cond") / f"{case}.npz")
  model = md_wan.load_transformer(fixture_path("wan_transformer") / case)
  frozen, params = mdt.split_trainable(model)
  batch = {
    "latents": _bfhwc(ref["latents"]),
    "noise": _bfhwc(ref["noise"]),
    "sigmas": jnp.asarray(ref["sigmas"]),
    "encoder_hidden_states": jnp.asarray(ref["encoder_hidden_states"]),
  }
  if case == "i2v":
    batch["condition"] = _bfhwc(ref["condition"])
    batch["encoder_hidden_states_image"] = jnp.asarray(ref["encoder_hidden_states_image"])
  loss_fn = mtf.wan_loss(frozen, clean_first_frame=case == "ti2v")
  (loss, _), grads = mdt.loss_and_grads(loss_fn, params, batch)
  np.testing.assert_allclose(float(loss), ref["loss"], atol=LOSS_TOL, rtol=0)
  np.testing.assert_allclose(float(optax.tree.norm(grads)), ref["grad_norm"], atol=GRAD_TOL)
  _check_grads(grads, ref, "grad/", md_wan.convert_key)


def test_conditioned_wan_loss_errors():
  model = md_wan.load_transformer(fixture_path("wan_transformer") / "ti2v")
  frozen, params = mdt.split_trainable(model)
  one = {"latents": jnp.zeros((1, 1, 4, 4, 6)), "encoder_hidden_states": jnp.zeros((1, 9, 16))}
  with pytest.raises(ValueError, match="clean_first_frame: latents .* have one frame"):
    mtf.wan_loss(frozen, clean_first_frame=True)(params, one, jax.random.key(0))
  bad = dict(one, latents=jnp.zeros((1, 3, 4, 4, 6)), condition=jnp.zeros((1, 2, 4, 4, 2)))
  with pytest.raises(ValueError, match=r"condition has shape \(1, 2, 4, 4, 2\); it must match"):
    mtf.wan_loss(frozen)(params, bad, jax.random.key(0))


def test_wan_frame_sigmas_equal_to_the_clip_sigma_give_the_torch_loss(wan):
  """Per-frame noise levels (`frame_sigmas`, what `frame_noise` draws) all equal to the clip's σ are the
  plain loss, which matches the torch reference step."""
  frozen, params, ref, batch = wan
  frames = batch["latents"].shape[1] // frozen.merge(params).cfg.patch_size[0]
  same = dict(batch, frame_sigmas=jnp.repeat(batch["sigmas"][:, None], frames, axis=1))
  (loss, _), grads = mdt.loss_and_grads(mtf.wan_loss(frozen), params, same)
  np.testing.assert_allclose(float(loss), ref["loss"], atol=LOSS_TOL, rtol=0)
  np.testing.assert_allclose(float(optax.tree.norm(grads)), ref["grad_norm"], atol=GRAD_TOL)


def test_wan_frame_sigmas_noise_each_frame_at_its_own_level(wan):
  """Distinct per-frame σ: the loss is the model's MSE on frames noised one by one, each frame's tokens
  at that frame's timestep (built here frame by frame, independently of the loss's own code)."""
  frozen, params, _, batch = wan
  model = frozen.merge(params)
  x0, noise, text = (np.asarray(batch[k]) for k in ("latents", "noise", "encoder_hidden_states"))
  b, f, h, w, _ = x0.shape
  assert model.cfg.patch_size[0] == 1 and f >= 2
  per_frame = np.linspace(0.1, 0.9, b * f, dtype=np.float32).reshape(b, f)
  noisy = np.empty_like(x0)
  for i in range(b):
    for j in range(f):
      noisy[i, j] = (1 - per_frame[i, j]) * x0[i, j] + per_frame[i, j] * noise[i, j]
  per_frame_tokens = (h // model.cfg.patch_size[1]) * (w // model.cfg.patch_size[2])
  timestep = np.stack(
    [np.concatenate([[1000 * s] * per_frame_tokens for s in row]) for row in per_frame]
  )
  pred = np.asarray(
    model(jnp.asarray(noisy), jnp.asarray(timestep), jnp.asarray(text), layout="BFHWC")
  )
  expected = np.mean((pred - (noise - x0)) ** 2)
  loss, _ = mtf.wan_loss(frozen)(
    params, dict(batch, frame_sigmas=jnp.asarray(per_frame)), jax.random.key(0)
  )
  np.testing.assert_allclose(float(loss), expected, rtol=1e-5)
  # frame_noise=1 draws distinct levels per frame, so the loss differs from the shared-σ one
  drawn, _ = mtf.wan_loss(frozen, frame_noise=1.0)(params, batch, jax.random.key(3))
  shared, _ = mtf.wan_loss(frozen)(params, batch, jax.random.key(3))
  assert abs(float(drawn) - float(shared)) > 1e-3


def test_wan_frame_noise_errors(wan):
  frozen, params, _, batch = wan
  with pytest.raises(ValueError, match=r"frame_noise=1.5 is not a fraction"):
    mtf.wan_loss(frozen, frame_noise=1.5)
  with pytest.raises(ValueError, match="does not combine with a table, a weighting"):
    mtf.wan_loss(frozen, frame_noise=0.5, weighting="batch_bell")
  bad = dict(batch, frame_sigmas=jnp.zeros((batch["latents"].shape[0], 99)))
  with pytest.raises(
    ValueError, match=r"frame_sigmas has shape \(\d+, 99\); expected one σ per latent"
  ):
    mtf.wan_loss(frozen)(params, bad, jax.random.key(0))


@pytest.fixture(scope="module")
def ltx():
  model = md_ltx.load_transformer(fixture_path("ltx_transformer") / "transformer", subfolder=None)
  frozen, params = mdt.split_trainable(model)
  ref = load_arrays(fixture_path("train_step_ltx") / "ltx.npz")
  bfhwc = lambda x: jnp.asarray(x).transpose(0, 2, 3, 4, 1)  # noqa: E731
  batch = {
    "latents": bfhwc(ref["latents"]),
    "noise": bfhwc(ref["noise"]),
    **{
      k: jnp.asarray(ref[k]) for k in ("sigmas", "encoder_hidden_states", "encoder_attention_mask")
    },
  }
  return frozen, params, ref, batch


@pytest.mark.parametrize("case", ["plain", "first_frame"])
def test_ltx_loss_and_grads_match_torch(ltx, case):
  """LTX-Video-Trainer's loss: integer timesteps round(1000 σ) (σ = 0.3456 gives 346), the caption mask,
  rotary scales (8 / 24, 32, 32); `first_frame` noises the first frame to 1e-5 and masks it out."""
  frozen, params, ref, batch = ltx
  batch = dict(batch, first_frame=case == "first_frame")
  loss_fn = mtf.ltx_loss(frozen, frame_rate=24)
  (loss, _), grads = mdt.loss_and_grads(loss_fn, params, batch)
  np.testing.assert_allclose(float(loss), ref[f"{case}/loss"], atol=LOSS_TOL, rtol=0)
  np.testing.assert_allclose(
    float(optax.tree.norm(grads)), ref[f"{case}/grad_norm"], atol=GRAD_TOL, rtol=0
  )
  _check_grads(grads, ref, f"{case}/grad/", md_ltx.convert_key)


def test_ltx_first_frame_changes_the_loss(ltx):
  """The two reference cases differ (so each checks its own path), and a drawn conditioning with
  probability 1 is the given one."""
  frozen, params, ref, batch = ltx
  assert abs(float(ref["plain/loss"]) - float(ref["first_frame/loss"])) > 1e-3
  loss, _ = mtf.ltx_loss(frozen, first_frame_conditioning_p=1.0)(params, batch, jax.random.key(0))
  np.testing.assert_allclose(float(loss), ref["first_frame/loss"], atol=LOSS_TOL, rtol=0)


def test_ltx_loss_refuses_bad_options_and_latents(ltx):
  frozen, params, _, batch = ltx
  with pytest.raises(ValueError, match="sampler='beta'; expected one of"):
    mtf.ltx_loss(frozen, sampler="beta")
  with pytest.raises(ValueError, match="first_frame_conditioning_p=1.5 is not a probability"):
    mtf.ltx_loss(frozen, first_frame_conditioning_p=1.5)
  flat = dict(batch, latents=batch["latents"][:, 0], noise=batch["noise"][:, 0])
  with pytest.raises(ValueError, match=r"\[B, F, H, W, C\], got shape \(2, 4, 4, 8\)"):
    mtf.ltx_loss(frozen)(params, flat, jax.random.key(0))


def test_ltx_sigma_shift_is_the_trainers_line():
  """0.95 at 1024 tokens, 2.05 at 4096, linear between and beyond (LTX-Video-Trainer's sampler)."""
  assert mtf.ltx_sigma_shift(1024) == pytest.approx(0.95)
  assert mtf.ltx_sigma_shift(4096) == pytest.approx(2.05)
  assert mtf.ltx_sigma_shift(2560) == pytest.approx(1.5)
  assert mtf.ltx_sigma_shift(48) < 0.95


def test_adamw_steps_match_torch():
  """Two steps of clip_grad_norm_(0.05) + torch.optim.AdamW(lr 1e-3, weight decay 1e-2) on the SD
  reference gradients (the clipping is active: their norm is far above 0.05)."""
  ref = _ref("sd")
  names = [k.removeprefix("adamw_param/") for k in ref if k.startswith("adamw_param/")]
  params = {n: jnp.asarray(ref[f"adamw_param/{n}"]) for n in names}
  grads = {n: jnp.asarray(ref[f"adamw_grad/{n}"]) for n in names}
  assert float(optax.tree.norm(grads)) > 0.5
  opt = mdt.make_optimizer(learning_rate=1e-3, weight_decay=1e-2, max_grad_norm=0.05)
  opt_state, update = opt.tx.init(params), jax.jit(opt.tx.update)
  for k in (1, 2):
    updates, opt_state = update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    want = {n: ref[f"adamw_step{k}/{n}"] for n in names}
    chex.assert_trees_all_close(params, want, atol=ADAM_TOL, rtol=0)
    moved = max(float(np.abs(want[n] - ref[f"adamw_param/{n}"]).max()) for n in names)
    assert moved > 1e-4 * k  # the step is much larger than the tolerance


def test_train_step_matches_torch(wan):
  """train_step's loss and grad norm are the reference's; the step moves the parameters by AdamW."""
  frozen, params, ref, batch = wan
  opt = mdt.make_optimizer(learning_rate=1e-3)
  before = _flat(params)
  state = mdt.init_state(jax.tree.map(jnp.copy, params), opt, rng=0)
  state, metrics = mdt.train_step(state, batch, mtf.wan_loss(frozen), opt)
  np.testing.assert_allclose(float(metrics["loss"]), ref["loss"], atol=LOSS_TOL, rtol=0)
  np.testing.assert_allclose(float(metrics["grad_norm"]), ref["grad_norm"], atol=GRAD_TOL)
  assert float(metrics["lr"]) == pytest.approx(1e-3)
  assert int(state.step) == 1
  after = _flat(state.params)
  # Adam's first step moves every parameter with a non-zero gradient by about lr.
  moved = max(float(np.abs(after[p] - before[p]).max()) for p in before)
  assert 5e-4 < moved < 2e-3
