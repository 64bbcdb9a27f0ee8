"""Losses, targets, samplers and weights against closed forms."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import md_schedulers as mdsch
import md_train as mdt

ACP = mdsch.ddpm(beta_schedule="scaled_linear", beta_start=0.00085, beta_end=0.012).alphas_cumprod


def _arrays():
  k1, k2 = jax.random.split(jax.random.key(0))
  return jax.random.normal(k1, (3, 4, 4, 2)), jax.random.normal(k2, (3, 4, 4, 2))


def test_diffusion_loss_is_the_weighted_mse():
  pred, target = _arrays()
  per = np.mean((np.asarray(pred) - np.asarray(target)) ** 2, axis=(1, 2, 3))
  assert float(mdt.diffusion_loss(pred, target)) == pytest.approx(per.mean(), rel=1e-6)
  w = jnp.asarray([0.5, 2.0, 0.0])
  got = float(mdt.diffusion_loss(pred, target, w))
  assert got == pytest.approx((per * np.asarray(w)).mean(), rel=1e-6)
  assert mdt.diffusion_loss(pred.astype(jnp.bfloat16), target).dtype == jnp.float32
  with pytest.raises(ValueError, match="target"):
    mdt.diffusion_loss(pred, target[:2])
  with pytest.raises(ValueError, match="one per example"):
    mdt.diffusion_loss(pred, target, jnp.ones(2))


def test_element_weights_weigh_single_errors():
  pred, target = _arrays()
  err = (np.asarray(pred) - np.asarray(target)) ** 2
  m = np.random.default_rng(0).uniform(0, 3, (3, 4, 4, 1)).astype(np.float32)  # one per pixel
  w = jnp.asarray([0.5, 2.0, 1.0])
  got = float(mdt.diffusion_loss(pred, target, w, jnp.asarray(m)))
  want = ((err * m).mean(axis=(1, 2, 3)) * np.asarray(w)).mean()
  assert got == pytest.approx(want, rel=1e-6)
  ones = mdt.diffusion_loss(pred, target, element_weights=jnp.ones((1, 1, 1, 1)))
  assert float(ones) == pytest.approx(float(mdt.diffusion_loss(pred, target)), rel=1e-6)
  for bad in ((3, 4, 4), (3, 2, 4, 1), (2, 4, 4, 2)):
    with pytest.raises(ValueError, match=r"element_weights have shape \(" + str(bad[0])):
      mdt.diffusion_loss(pred, target, element_weights=jnp.ones(bad))


def test_targets():
  x0, noise = _arrays()
  t = jnp.asarray([0, 500, 999])
  a = np.asarray(ACP)[np.asarray(t)][:, None, None, None]
  eps = mdt.diffusion_inputs("epsilon", x0, noise, t, alphas_cumprod=ACP)
  np.testing.assert_allclose(eps.noisy, np.sqrt(a) * x0 + np.sqrt(1 - a) * noise, atol=1e-6)
  np.testing.assert_array_equal(eps.target, noise)
  v = mdt.diffusion_inputs("v_prediction", x0, noise, t, alphas_cumprod=ACP)
  np.testing.assert_allclose(v.target, np.sqrt(a) * noise - np.sqrt(1 - a) * x0, atol=1e-6)
  s = jnp.asarray([0.0, 0.5, 1.0])
  flow = mdt.diffusion_inputs("flow", x0, noise, s)
  np.testing.assert_allclose(flow.noisy[0], x0[0])
  np.testing.assert_allclose(flow.noisy[2], noise[2])
  np.testing.assert_allclose(flow.target, noise - x0, atol=1e-6)
  with pytest.raises(ValueError, match="alphas_cumprod"):
    mdt.diffusion_inputs("epsilon", x0, noise, t)
  with pytest.raises(ValueError, match="prediction_type"):
    mdt.diffusion_inputs("sample", x0, noise, t, alphas_cumprod=ACP)


def test_samplers():
  t = mdt.uniform_timesteps(jax.random.key(1), 4096, 1000)
  assert t.dtype == jnp.int32 and int(t.min()) >= 0 and int(t.max()) <= 999
  assert abs(float(t.mean()) - 499.5) < 20
  key = jax.random.key(2)
  for sampler in mdt.FLOW_SAMPLERS:
    s = mdt.flow_sigmas(key, 4096, sampler=sampler, shift=3.0)
    assert s.shape == (4096,) and s.dtype == jnp.float32
    assert float(s.min()) > 0 and float(s.max()) <= 1
  # Logit-normal(0, 1) is symmetric about 1/2; a shift > 1 moves uniform sigmas toward noise.
  assert abs(float(mdt.flow_sigmas(key, 4096).mean()) - 0.5) < 0.02
  shifted = mdt.flow_sigmas(key, 4096, sampler="shifted", shift=5.0)
  assert float(shifted.mean()) > 0.7
  with pytest.raises(ValueError, match="sampler"):
    mdt.flow_sigmas(key, 2, sampler="cosmap")


def test_min_snr_weights():
  t = jnp.asarray([10, 300, 900])
  acp = np.asarray(ACP)[np.asarray(t)]
  snr = acp / (1 - acp)
  np.testing.assert_allclose(
    mdt.min_snr_weights(ACP, t, 5.0), np.minimum(snr, 5.0) / snr, rtol=1e-5
  )
  np.testing.assert_allclose(
    mdt.min_snr_weights(ACP, t, 5.0, "v_prediction"), np.minimum(snr, 5.0) / (snr + 1), rtol=1e-5
  )


def test_biased_uniform_timesteps():
  key = jax.random.key(3)
  later = mdt.uniform_timesteps(key, 4096, bias="later", bias_portion=0.5)
  assert later.dtype == jnp.int32 and int(later.max()) <= 999
  assert float((later >= 750).mean()) > 0.55  # half the batch from the last quarter, plus its share
  ranged = mdt.uniform_timesteps(
    key, 4096, bias="range", bias_portion=1.0, bias_begin=200, bias_end=300
  )
  assert 200 <= int(ranged.min()) and int(ranged.max()) < 300
  with pytest.raises(ValueError, match="bias options"):
    mdt.uniform_timesteps(key, 2, bias_portion=0.5)


def test_flow_training_table():
  """N sigmas from 1 to 0.003/1.002, shifted; bell weights over 1000 σ with minimum 0 and mean 1."""
  table = mdt.flow_training_table(1000, shift=5.0)
  s = np.linspace(1.0, 0.003 / 1.002, 1000)
  want = 5 * s / (1 + 4 * s)
  np.testing.assert_allclose(table.sigmas, want, rtol=0, atol=1e-6)  # float32
  np.testing.assert_allclose(table.timesteps, want * 1000, rtol=0, atol=1e-3)
  bell = np.exp(-2 * ((want * 1000 - 500) / 1000) ** 2)
  bell = bell - bell.min()
  np.testing.assert_allclose(table.weights, bell * 1000 / bell.sum(), rtol=1e-4, atol=1e-6)
  assert float(table.weights.mean()) == pytest.approx(1.0, rel=1e-5)
  sigmas, weights = mdt.table_lookup(table, jnp.asarray([1000.0, table.timesteps[400] + 0.01]))
  np.testing.assert_allclose(sigmas, [table.sigmas[0], table.sigmas[400]])
  np.testing.assert_allclose(weights, [table.weights[0], table.weights[400]])


def test_offset_noise_adds_one_draw_per_example_and_channel():
  import md_train.families as mtf

  noise = jax.random.normal(jax.random.key(1), (64, 4, 5, 3))
  out = np.asarray(mtf.offset_noise(jax.random.key(2), noise, 0.5))
  shift = out - np.asarray(noise)
  np.testing.assert_allclose(shift, shift[:, :1, :1, :] * np.ones_like(shift), atol=1e-6)
  assert 0.35 < shift[:, 0, 0, :].std() < 0.65  # 0.5 times a standard normal (192 draws)
  assert abs(np.corrcoef(shift[:, 0, 0, 0], shift[:, 0, 0, 1])[0, 1]) < 0.35  # channels apart
  np.testing.assert_array_equal(mtf.offset_noise(jax.random.key(2), noise, 0.0), noise)
  video = jnp.zeros((2, 3, 4, 4, 8), jnp.bfloat16)  # [B, F, H, W, C]: constant over F, H and W
  moved = mtf.offset_noise(jax.random.key(3), video, 1.0)
  assert moved.dtype == jnp.bfloat16
  moved = np.asarray(moved, np.float32)
  assert np.ptp(moved, axis=(1, 2, 3)).max() == 0.0
  assert np.abs(moved).max() > 0


def test_sd_loss_noise_offset_is_the_plain_loss_on_offset_noise():
  # With `noise_offset`, sd_loss is the plain loss (parity-tested against diffusers in test_parity.py)
  # on the batch's noise plus `offset_noise`'s per-channel shift, which is how diffusers' scripts apply
  # `--noise_offset`; noise_offset=0 is the plain loss.
  import md_sd
  import md_train.families as mtf
  from md_core.testing import fixture_path, load_arrays

  unet = md_sd.load_unet(fixture_path("unet") / "sd1", subfolder=None, progress=False)
  frozen, params = mdt.split_trainable(unet)
  ref = load_arrays(fixture_path("train_step") / "sd.npz")
  nhwc = lambda x: jnp.asarray(x).transpose(0, 2, 3, 1)  # noqa: E731
  batch = {
    "latents": nhwc(ref["latents"]),
    "noise": nhwc(ref["noise"]),
    "timesteps": jnp.asarray(ref["timesteps"]),
    "encoder_hidden_states": jnp.asarray(ref["encoder_hidden_states"]),
  }
  key = jax.random.key(0)
  plain = mtf.sd_loss(frozen, alphas_cumprod=ACP)
  offset = mtf.sd_loss(frozen, alphas_cumprod=ACP, noise_offset=0.1)
  zero = mtf.sd_loss(frozen, alphas_cumprod=ACP, noise_offset=0.0)

  @jax.jit
  def run(params):
    shifted = mtf.offset_noise(jax.random.fold_in(jax.random.split(key)[0], 1), batch["noise"], 0.1)
    return (
      offset(params, batch, key)[0],
      plain(params, dict(batch, noise=shifted), key)[0],
      plain(params, batch, key)[0],
      zero(params, batch, key)[0],
    )

  got, want, base, off = (float(x) for x in run(params))
  assert got == pytest.approx(want, abs=1e-6)
  assert abs(got - base) > 1e-4  # the offset changes the loss
  assert off == base


def test_wan22_expert_ranges_are_diffsynths_boundaries():
  """The split of the shift-5 table at Wan 2.2's boundaries: DiffSynth's A14B scripts train the
  high-noise expert on the table's first 0.417 (T2V, boundary 0.875) or 0.358 (I2V, 0.9) of entries."""
  table = mdt.flow_training_table(1000, shift=5.0)
  for ratio, fraction in ((0.875, 0.417), (0.9, 0.358)):
    lo, k = mdt.expert_range(table, ratio, "high")
    assert lo == 0 and abs(k - fraction * 1000) <= 1, (ratio, k)
    assert mdt.expert_range(table, ratio, "low") == (k, 1000)
    assert float(table.timesteps[k - 1]) >= ratio * 1000 > float(table.timesteps[k])
  with pytest.raises(ValueError, match="expected one of"):
    mdt.expert_range(table, 0.875, "middle")
  with pytest.raises(ValueError, match="leaves an expert no training timestep"):
    mdt.expert_range(table, 1.5, "high")


def test_wan_loss_draws_only_the_experts_entries():
  """With `table_range`, the drawn σ are the table entries of the key's draw inside the range: the loss
  equals the loss with those σ given (bell weights of the same entries)."""
  from flax import nnx

  import md_train.families as mtf

  class Stub(nnx.Module):
    def __init__(self):
      self.w = nnx.Param(jnp.full((), 0.5))

    def __call__(self, x, t, ctx, image, layout):
      return x * self.w[...] + (t / 1000)[:, None, None, None, None] + ctx.mean()

  frozen, params = mdt.split_trainable(Stub())
  table = mdt.flow_training_table(1000, shift=5.0)
  rng = np.random.default_rng(0)
  batch = {
    "latents": jnp.asarray(rng.normal(size=(4, 2, 4, 4, 3)), jnp.float32),
    "encoder_hidden_states": jnp.asarray(rng.normal(size=(4, 3, 8)), jnp.float32),
  }
  for expert in ("high", "low"):
    lo, hi = mdt.expert_range(table, 0.875, expert)
    loss_fn = mtf.wan_loss(frozen, table=table, table_range=(lo, hi))
    for seed in range(3):
      key = jax.random.key(seed)
      idx = jax.random.randint(jax.random.split(key)[1], (4,), lo, hi)
      assert bool(jnp.all((idx >= lo) & (idx < hi)))
      drawn, _ = loss_fn(params, batch, key)
      given, _ = loss_fn(params, dict(batch, sigmas=table.sigmas[idx]), key)
      np.testing.assert_allclose(float(drawn), float(given), rtol=1e-6)
  with pytest.raises(ValueError, match="table_range needs a table"):
    mtf.wan_loss(frozen, table_range=(0, 10))
  with pytest.raises(ValueError, match="not a non-empty range"):
    mtf.wan_loss(frozen, table=table, table_range=(10, 10))
