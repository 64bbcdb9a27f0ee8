"""LoRA fine-tuning (md_train.add_lora / split_lora / lora_loss / save_lora) against torch + peft
autograd (tools/fixtures/train_lora_step.py): one step of the tiny SD 1.x UNet and Wan 2.1 transformer
with peft's LoRA on the attention projections (r 4, alpha 8), the same lora_A: loss within 1e-5, every
LoRA gradient within 1e-4, at peft's init (lora_B = 0) and with non-zero lora_B; the Wan transformer also with
rank-stabilised LoRA (peft's `use_rslora`: alpha / sqrt(r)) and with DoRA (peft's `use_dora`: the magnitudes'
initial values and gradients too). Then the PEFT export:
md's file equals the one diffusers was checked on (tools/train_lora_export.py), reads back into the same
slots, and a short `fit` of the `sd15-lora-tiny` recipe as DoRA exports a file that `Pipeline.load_lora` runs."""

import pathlib

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import md_core
import md_flux
import md_lora
import md_schedulers as mdsch
import md_sd
import md_train as mdt
import md_train.families as mtf
import md_wan
from md_core.testing import fixture_path, load_arrays

LOSS_TOL, GRAD_TOL = 1e-5, 1e-4
RANK, ALPHA = 4, 8.0
SCHED = dict(beta_schedule="scaled_linear", beta_start=0.00085, beta_end=0.012)
EXPORTS = {
  "sd": "sd_unet_lora.safetensors",
  "wan": "wan_transformer_lora.safetensors",
  "flux": "flux_transformer_lora.safetensors",
  "wan_dora": "wan_transformer_dora.safetensors",
}


def _ref(name):
  return load_arrays(fixture_path("train_lora_step") / f"{name}.npz")


def _nhwc(x):
  return jnp.asarray(x).transpose(0, 2, 3, 1)


def _bfhwc(x):
  return jnp.asarray(x).transpose(0, 2, 3, 4, 1)


def _peft_tensors(ref, prefix, b_key):
  """The fixture's factors as a PEFT state dict (lora_B from `b_key`, or zeros; DoRA magnitudes moved
  with it, else peft's initial ones)."""
  out = {}
  for k in ref:
    if k.startswith("a/"):
      m = k[2:]
      out[f"{prefix}.{m}.lora_A.weight"] = ref[k]
      b = ref[f"b/{m}"]
      out[f"{prefix}.{m}.lora_B.weight"] = b if b_key == "b" else np.zeros_like(b)
      if f"m/{m}" in ref:
        out[f"{prefix}.{m}.lora_magnitude_vector"] = ref[
          f"m/{m}" if b_key == "b" else f"m_init/{m}"
        ]
  return out


def _model(name):
  if name == "sd":
    folder = fixture_path("unet") / "sd1"
    model = md_sd.load_unet(folder, subfolder=None, progress=False)
    return model, md_sd.unet_key_map(model.cfg), folder, "unet"
  if name == "flux":
    folder = fixture_path("flux_transformer") / "dev"
    return md_flux.load_flux(folder), md_flux.convert_key, folder, "transformer"
  folder = fixture_path("wan_transformer") / "t2v" / "transformer"
  model = md_wan.load_transformer(folder, subfolder=None)
  return model, md_wan.convert_key, folder, "transformer"


def _loss(name, frozen):
  if name == "sd":
    return mtf.sd_loss(frozen, alphas_cumprod=mdsch.ddpm(**SCHED).alphas_cumprod)
  if name == "flux":
    return mtf.flux_loss(frozen, guidance=3.5)
  return mtf.wan_loss(frozen)


def _batch(name, ref):
  if name == "sd":
    return {
      "latents": _nhwc(ref["latents"]),
      "noise": _nhwc(ref["noise"]),
      "timesteps": jnp.asarray(ref["timesteps"]),
      "encoder_hidden_states": jnp.asarray(ref["encoder_hidden_states"]),
    }
  if name == "flux":
    assert np.all(ref["guidance"] == 3.5)
    keys = ("sigmas", "encoder_hidden_states", "pooled_projections", "txt_ids")
    return {
      **{k: jnp.asarray(ref[k]) for k in keys},
      "latents": _nhwc(ref["latents"]),
      "noise": _nhwc(ref["noise"]),
    }
  return {
    "latents": _bfhwc(ref["latents"]),
    "noise": _bfhwc(ref["noise"]),
    "sigmas": jnp.asarray(ref["sigmas"]),
    "encoder_hidden_states": jnp.asarray(ref["encoder_hidden_states"]),
  }


@pytest.fixture(scope="module", params=["sd", "wan", "flux", "wan_rslora", "wan_dora"])
def case(request):
  """One family: the model with md's LoRA, the fixture's factors in its slots (lora_B zero and
  moved), both steps' (loss, grads) from one compiled program."""
  name = request.param
  family = name.split("_")[0]
  rslora, dora = name.endswith("_rslora"), name.endswith("_dora")
  ref = _ref(name)
  model, keymap, folder, prefix = _model(family)
  names = list(md_core.open_checkpoint(folder))
  lora = mdt.add_lora(
    model, mdt.LoRAConfig(rank=RANK, alpha=ALPHA, rslora=rslora, dora=dora), convert_key=keymap,
    reference_names=names, family=family,
  )  # fmt: skip
  assert lora.scale == (ALPHA / 2 if rslora else ALPHA / RANK)  # alpha / sqrt(4), alpha / 4
  frozen, params = mdt.split_lora(model)
  initial = _flat(params)
  config = {"r": RANK, "lora_alpha": ALPHA, "use_rslora": rslora}
  factors = {
    kind: mdt.load_lora_factors(
      lora,
      params,
      md_lora.load_lora(_peft_tensors(ref, prefix, kind), keymap, model, config=config),
    )
    for kind in ("init", "b")
  }
  loss_fn = mdt.lora_loss(_loss(family, frozen), lora, frozen)
  batch = _batch(family, ref)

  @jax.jit
  def run(factors, batch):
    key = jax.random.key(0)
    return {k: jax.value_and_grad(loss_fn, has_aux=True)(p, batch, key) for k, p in factors.items()}

  return dict(
    name=name, ref=ref, model=model, keymap=keymap, names=names, lora=lora, frozen=frozen,
    params=params, factors=factors, out=run(factors, batch), prefix=prefix, batch=batch,
    initial=initial,
  )  # fmt: skip


def _flat(state):
  return {
    tuple(p): np.asarray(v[...] if isinstance(v, nnx.Variable) else v)
    for p, v in nnx.to_flat_state(state)
  }


def test_targets_are_the_peft_modules(case):
  """add_lora's default targets select exactly the modules peft's target_modules selected."""
  ref, lora = case["ref"], case["lora"]
  assert sorted(lora.modules) == sorted(k[2:] for k in ref if k.startswith("a/"))
  total = sum(ref[k].size + ref["b/" + k[2:]].size for k in ref if k.startswith("a/"))
  total += sum(ref[k].size for k in ref if k.startswith("m/"))  # DoRA magnitudes train too
  assert mdt.lora_parameter_count(case["params"]) == total


def _check_lora_grads(case, grads, prefix):
  """Every LoRA gradient against peft's through the family's key map; returns the largest error."""
  ref, flat, worst = case["ref"], _flat(grads), 0.0
  for module, (path, layer) in case["lora"].modules.items():
    parts = tuple(int(p) if p.isdigit() else p for p in path.split("."))
    target = case["keymap"](module + ".weight")
    want_a, want_b = md_lora.lora_factors(
      ref[f"{prefix}a/{module}"] if f"{prefix}a/{module}" in ref else np.zeros_like(ref[f"a/{module}"]),
      ref[f"{prefix}b/{module}"],
      target,
    )  # fmt: skip
    wants = [("lora_a", want_a), ("lora_b", want_b)]
    if f"{prefix}m/{module}" in ref:  # DoRA: peft's magnitude gradient, [out] per layer
      wants.append(("lora_gain", _magnitude(ref[f"{prefix}m/{module}"], target, want_b)))
    for name, want in wants:
      got = flat[parts + (name,)]
      got = got if layer is None else got[layer]
      chex.assert_trees_all_close(got, want, atol=GRAD_TOL, rtol=0, custom_message=module)
      worst = max(worst, float(np.abs(got - want).max()))
  return worst


def _magnitude(m, target, up):
  """A peft magnitude vector `[out]` in md's order (`up`: the layer's md-layout lora_b `[r, out]`)."""
  shape = (1,) * (up.ndim - 1) + (up.shape[-1],)
  from md_lora._load import magnitude_of

  return magnitude_of(np.asarray(m), target, shape).reshape(-1)


def test_lora_step_at_init_matches_peft(case):
  """peft's initialisation (lora_B = 0): the base model's loss; only lora_B gets a gradient."""
  (loss, _), grads = case["out"]["init"]
  np.testing.assert_allclose(float(loss), case["ref"]["loss_init"], atol=LOSS_TOL, rtol=0)
  worst = _check_lora_grads(case, grads, "grad_init_")
  assert all(float(np.abs(v).max()) == 0 for p, v in _flat(grads).items() if p[-1] == "lora_a")
  if case["lora"].dora:  # md's own initial magnitudes are peft's (the base weights' norms)
    for module, (path, layer) in case["lora"].modules.items():
      parts = tuple(int(p) if p.isdigit() else p for p in path.split("."))
      got = case["initial"][parts + ("lora_gain",)]
      want = case["ref"][f"m_init/{module}"]
      np.testing.assert_allclose(got if layer is None else got[layer], want, rtol=1e-6, atol=0)
  assert max(float(np.abs(case["ref"][k]).max()) for k in case["ref"] if "grad_init_b" in k) > 1e-3
  print(
    f"{case['name']} init: loss err {abs(float(loss) - case['ref']['loss_init']):.1e}, grad {worst:.1e}"
  )


def test_lora_step_matches_peft(case):
  """Non-zero lora_B: loss, every lora_A / lora_B gradient and their global norm."""
  (loss, _), grads = case["out"]["b"]
  ref = case["ref"]
  np.testing.assert_allclose(float(loss), ref["loss"], atol=LOSS_TOL, rtol=0)
  assert abs(float(loss) - float(ref["loss_init"])) > 1e-3  # the LoRA moves the loss
  np.testing.assert_allclose(float(optax.tree.norm(grads)), ref["grad_norm"], atol=GRAD_TOL)
  worst = _check_lora_grads(case, grads, "grad_")
  print(
    f"{case['name']}: loss err {abs(float(loss) - ref['loss']):.1e}, max grad err {worst:.1e} "
    f"(max grad {max(float(np.abs(ref[k]).max()) for k in ref if k.startswith('grad_a') or k.startswith('grad_b')):.2f})"
  )


def test_export_is_the_file_diffusers_read(case, tmp_path):
  """save_lora writes the file diffusers' load_lora_adapter was checked on (output 0.0 from peft's, see
  tests/fixtures/train_lora_step/README.md), and md_lora reads it back into the same slots."""
  name, lora, params = case["name"], case["lora"], case["factors"]["b"]
  path = tmp_path / "pytorch_lora_weights.safetensors"
  mdt.save_lora(
    lora, params, path, convert_key=case["keymap"], reference_names=case["names"],
    prefix=case["prefix"],
  )  # fmt: skip
  got = md_core.SafetensorsFile(path)
  assert all(k.startswith(case["prefix"] + ".") for k in got)
  if lora.dora:  # the magnitudes beside the factors, peft's conv-free `[out]`
    assert sum(k.endswith(".lora_magnitude_vector") for k in got) == len(lora.modules)
  if name in EXPORTS:  # the rsLoRA case has no diffusers-checked file: its read-back below
    want = md_core.SafetensorsFile(fixture_path("train_lora_step") / "md_export" / EXPORTS[name])
    assert sorted(got) == sorted(want)
    for k in want:
      np.testing.assert_array_equal(np.asarray(got[k]), np.asarray(want[k]), err_msg=k)
  # Read back: the slots md's run time fills equal the trained slots as the model sees them.
  adapter = md_lora.load_lora(path, case["keymap"], case["model"])
  state = nnx.state(case["model"])
  slots = md_core.set_lora(state, md_lora.to_slots(adapter, 1.0, state))
  if lora.dora:  # the slots md_train's loss gives the model: gains m / ||W + s b a|| and s b g
    from md_train._lora import _dora_slots, _frozen_kernels

    kernels = _frozen_kernels(case["frozen"], lora.paths)
    trained = _flat(_dora_slots(params, lora.scale, kernels))
  else:
    trained = {
      p: v * np.float32(lora.scale) if p[-1] == "lora_b" else v for p, v in _flat(params).items()
    }
  loaded = {p: v for p, v in _flat(slots).items() if p[-1] in ("lora_a", "lora_b", "lora_gain")}
  assert sorted(loaded) == sorted(trained)
  for p, v in trained.items():
    np.testing.assert_allclose(loaded[p], v, atol=1e-6 if lora.dora else 0, rtol=0, err_msg=str(p))
  again = mdt.load_lora_factors(lora, params, adapter)
  chex.assert_trees_all_close(_flat(again), _flat(params), atol=1e-7, rtol=0)


def _train_config(variant):
  """The variant's recipe options of apps/configs/train.py (on one device)."""
  import importlib.util

  import ml_collections

  path = md_core.testing.repo_root() / "apps" / "configs" / "train.py"
  spec = importlib.util.spec_from_file_location("_train_config", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  _, options = module.VARIANTS[variant]
  return ml_collections.ConfigDict(dict(seed=0, recipe_options=options))


def test_sd15_dora_recipe_fits_and_the_pipeline_runs_it(tmp_path):
  """`sd15-lora-tiny` with `lora.dora=True` (the app's `--config.recipe_options.lora.dora=True`): 2 steps
  move only the slots (factors and magnitudes; the UNet's parameters stay the source file's), the export
  is a PEFT file under `unet.` with `lora_magnitude_vector`s, and `Pipeline.load_lora` fills its slots
  with DoRA's run-time form of the trained values, checked in NumPy: gain `g = m / ||W + s a b||` (per
  output, over the input axis) and `s b g` in lora_b. (Plain LoRA variants end to end:
  packages/md-train/tests/test_recipes_families.py.)"""
  from md_train import recipes

  config = _train_config("sd15-lora-tiny")
  config.recipe_options.lora.dora = True
  recipe = recipes.sd15_tiny(config)
  start = _flat(recipe.state.params)
  assert sorted({p[-1] for p in start}) == ["lora_a", "lora_b", "lora_gain"]
  state = mdt.fit(recipe, steps=2)
  trained = _flat(state.params)
  for kind in ("lora_b", "lora_gain"):  # lora_b leaves zero, the magnitudes their initial norms
    moved = max(float(np.abs(trained[p] - start[p]).max()) for p in start if p[-1] == kind)
    assert moved > 1e-4, kind
  file = recipe.export(state, tmp_path)
  assert file == tmp_path / "unet" / "pytorch_lora_weights.safetensors"
  keys = list(md_core.SafetensorsFile(file))
  assert keys and all(k.startswith("unet.") and ".lora_" in k for k in keys)
  assert 3 * sum(k.endswith(".lora_magnitude_vector") for k in keys) == len(keys)

  model = pathlib.Path(md_core.testing.repo_root()) / "tests/fixtures/sd_pipeline/sd"
  pipe = md_sd.load_pipeline(model)
  pipe.load_lora(file, name="trained", max_rank=4, targets=("to_q", "to_k", "to_v", "to_out"))
  slots = _flat(nnx.state(pipe.unet))
  scale = np.float32(4.0 / 4)  # alpha / r of the variant
  layers = {p[:-1] for p in trained}
  for layer in layers:
    a, b, m = (trained[layer + (n,)] for n in ("lora_a", "lora_b", "lora_gain"))
    w = slots[layer + ("kernel",)].astype(np.float64)
    g = m / np.linalg.norm(w + scale * (a.astype(np.float64) @ b), axis=-2)
    np.testing.assert_allclose(slots[layer + ("lora_gain",)], g, atol=1e-6, rtol=0)
    np.testing.assert_allclose(slots[layer + ("lora_b",)], scale * b * g[..., None, :], atol=1e-6)
    np.testing.assert_array_equal(slots[layer + ("lora_a",)], a)
  # The base stayed the source checkpoint's.
  base = md_sd.load_unet(model / "unet", subfolder=None, progress=False)
  for p, v in _flat(nnx.state(base, nnx.Param)).items():
    np.testing.assert_array_equal(slots[p], v, err_msg=str(p))


def test_lora_option_errors():
  with pytest.raises(ValueError, match="lora option 'rnk' is unknown.*did you mean 'rank'"):
    mdt.LoRAConfig.from_options({"rnk": 4})
  with pytest.raises(ValueError, match="lora.rank=0 must be a positive int"):
    mdt.LoRAConfig(rank=0)
  with pytest.raises(ValueError, match="lora.init='xavier'"):
    mdt.LoRAConfig(init="xavier")
  with pytest.raises(ValueError, match="lora.rslora='yes' must be True or False"):
    mdt.LoRAConfig.from_options({"rslora": "yes"})
  unet = md_sd.load_unet(fixture_path("unet") / "sd1", subfolder=None, progress=False)
  names = list(md_core.open_checkpoint(fixture_path("unet") / "sd1"))
  keymap = md_sd.unet_key_map(unet.cfg)
  with pytest.raises(ValueError, match="lora target 'to_qq' matches no module"):
    mdt.add_lora(unet, mdt.LoRAConfig(targets="to_qq"), convert_key=keymap, reference_names=names)
  with pytest.raises(ValueError, match="family=None has no default targets"):
    mdt.add_lora(unet, mdt.LoRAConfig(), convert_key=keymap, reference_names=names)
  with pytest.raises(ValueError, match="not the kernel of a Dense / Conv layer"):
    mdt.add_lora(unet, mdt.LoRAConfig(targets="norm1"), convert_key=keymap, reference_names=names)
  with pytest.raises(ValueError, match="has no LoRA slots; call add_lora first"):
    mdt.split_lora(unet)
  # md's layer paths work as targets too; a second add_lora is refused.
  lora = mdt.add_lora(
    unet, mdt.LoRAConfig(targets=("mid_block.attentions.0.proj_in",)), convert_key=keymap,
    reference_names=names,
  )  # fmt: skip
  assert lora.modules == {
    "mid_block.attentions.0.proj_in": ("mid_block.attentions.0.proj_in", None)
  }
  with pytest.raises(ValueError, match="has LoRA slots already"):
    mdt.add_lora(unet, mdt.LoRAConfig(targets="to_q"), convert_key=keymap, reference_names=names)


def test_wan_stack_subset_is_refused():
  model, keymap, folder, _ = _model("wan")
  names = list(md_core.open_checkpoint(folder))
  with pytest.raises(
    ValueError, match=r"select layers \[1\] of the scanned stack 'blocks.attn1.to_q'"
  ):
    mdt.add_lora(
      model,
      mdt.LoRAConfig(targets="blocks.1.attn1.to_q"),
      convert_key=keymap,
      reference_names=names,
    )


def test_kaiming_init_is_peft_s():
  """lora_A ~ U(±1/√fan_in) (peft's kaiming_uniform_(a=√5)), per layer of a stack, from the seed."""
  model, keymap, folder, _ = _model("wan")
  names = list(md_core.open_checkpoint(folder))
  mdt.add_lora(
    model, mdt.LoRAConfig(rank=4, seed=3), convert_key=keymap, reference_names=names, family="wan"
  )
  _, params = mdt.split_lora(model)
  flat = _flat(params)
  a = flat[("blocks", "attn1", "to_q", "lora_a")]  # [layers, in, r]
  bound = 1 / np.sqrt(a.shape[1])
  assert np.abs(a).max() <= bound and np.abs(a).max() > 0.8 * bound
  assert not np.array_equal(a[0], a[1])
  np.testing.assert_allclose(a.var(), bound**2 / 3, rtol=0.3)


def test_conv_and_linear_lora_export_round_trips(tmp_path):
  """A LoRA on conv layers (the SD UNet's 3x3 `conv1` and 1x1 `proj_in`) and linear ones exports in
  PEFT's conv layout (lora_A `[r, in, kh, kw]`, lora_B `[out, r, 1, 1]`) and reads back into the same
  slots (no compilation: host arrays only)."""
  folder = fixture_path("unet") / "sd1"
  unet = md_sd.load_unet(folder, subfolder=None, progress=False)
  names = list(md_core.open_checkpoint(folder))
  keymap = md_sd.unet_key_map(unet.cfg)
  lora = mdt.add_lora(
    unet, mdt.LoRAConfig(rank=2, alpha=3.0, targets=("conv1", "proj_in", "ff.net.2")),
    convert_key=keymap, reference_names=names,
  )  # fmt: skip
  _, params = mdt.split_lora(unet)
  rng = np.random.default_rng(0)
  leaves, treedef = jax.tree.flatten(params)
  params = jax.tree.unflatten(
    treedef, [rng.normal(0, 0.1, np.shape(x)).astype(np.float32) for x in leaves]
  )
  path = tmp_path / "lora.safetensors"
  mdt.save_lora(lora, params, path, convert_key=keymap, reference_names=names, prefix="unet")
  tensors = md_core.SafetensorsFile(path)
  a = tensors["unet.down_blocks.0.resnets.0.conv1.lora_A.weight"]
  b = tensors["unet.down_blocks.0.resnets.0.conv1.lora_B.weight"]
  assert a.shape[0] == 2 and a.shape[2:] == (3, 3) and b.shape[1:] == (2, 1, 1)
  adapter = md_lora.load_lora(path, keymap, unet)
  assert len(adapter.weights) == len(lora.modules)
  again = mdt.load_lora_factors(lora, mdt.split_lora(unet)[1], adapter)
  chex.assert_trees_all_close(_flat(again), _flat(params), atol=1e-6, rtol=0)


@pytest.mark.parametrize(
  "fixture, file, match",
  [
    (
      "lora_dora",
      "unet_dora.safetensors",
      r"a DoRA adapter; continue it with a DoRA LoRA \(lora.dora=True\), this one is plain",
    ),
    ("lora_oft", "oft.safetensors", r"an OFT adapter \(rotations\); training continues plain LoRA"),
  ],
)
def test_continued_training_refuses_dora_and_oft(fixture, file, match):
  """Continued plain-LoRA training takes plain LoRA factors; a DoRA file (magnitudes) or an OFT file
  (rotations) is refused by name before any factor is read."""
  folder = fixture_path("lora_extract") / "base"
  unet = md_sd.load_unet(folder, subfolder=None, progress=False)
  keymap = md_sd.unet_key_map(unet.cfg)
  adapter = md_lora.load_lora(fixture_path(fixture) / file, keymap, unet)
  lora = mdt.add_lora(
    unet, mdt.LoRAConfig(rank=2, alpha=2.0, targets=("to_q",)), convert_key=keymap,
    reference_names=list(md_core.open_checkpoint(folder)),
  )  # fmt: skip
  with pytest.raises(ValueError, match=match):
    mdt.load_lora_factors(lora, mdt.split_lora(unet)[1], adapter)


def test_dora_file_continues_with_peft_s_forward_on_linears_and_convs(tmp_path):
  """A peft DoRA file (tests/fixtures/lora_dora: r 2, alpha 4 on the attention projections and the
  resnets' 3x3 convs) continues in a DoRA LoRA of the same modules: its magnitudes fill the gain slots,
  the slots lora_loss gives the model (linears and convs) equal md_lora's run-time DoRA slots (checked
  against peft's DoRA model there, packages/md-lora/tests/test_dora.py), and save_lora → load_lora →
  load_lora_factors gives the same trainable values back."""
  from md_train._lora import _dora_slots, _frozen_kernels

  folder = fixture_path("lora_extract") / "base"
  unet = md_sd.load_unet(folder, subfolder=None, progress=False)
  keymap = md_sd.unet_key_map(unet.cfg)
  names = list(md_core.open_checkpoint(folder))
  adapter = md_lora.load_lora(fixture_path("lora_dora") / "unet_dora.safetensors", keymap, unet)
  state = nnx.state(nnx.clone(unet))
  lora = mdt.add_lora(
    unet, mdt.LoRAConfig(rank=2, alpha=4.0, dora=True, targets=("to_q", "to_k", "to_v", "to_out.0",
    "conv1", "conv2")), convert_key=keymap, reference_names=names,
  )  # fmt: skip
  frozen, params = mdt.split_lora(unet)
  params = mdt.load_lora_factors(lora, params, adapter)
  model_slots = _flat(_dora_slots(params, lora.scale, _frozen_kernels(frozen, lora.paths)))
  runtime = md_lora.to_slots(adapter, 1.0, state)
  assert sorted(runtime) == lora.paths and any(p.endswith("conv1") for p in runtime)
  for path, (w,) in runtime.items():
    parts = tuple(int(p) if p.isdigit() else p for p in path.split("."))
    np.testing.assert_allclose(model_slots[parts + ("lora_gain",)], w.gain, atol=1e-6, rtol=1e-6)
    b = np.asarray(w.b) * np.float32(w.scale)
    np.testing.assert_allclose(model_slots[parts + ("lora_b",)], b, atol=1e-6, err_msg=path)
    np.testing.assert_array_equal(model_slots[parts + ("lora_a",)], w.a)
  path = tmp_path / "pytorch_lora_weights.safetensors"
  mdt.save_lora(lora, params, path, convert_key=keymap, reference_names=names, prefix="unet")
  again = mdt.load_lora_factors(lora, params, md_lora.load_lora(path, keymap, unet))
  chex.assert_trees_all_close(_flat(again), _flat(params), atol=1e-6, rtol=0)


def test_dora_errors(tmp_path):
  """DoRA's bad settings, each by name: a non-bool option, a loss without the frozen kernels, a plain
  file continued as DoRA, and md_lora.save_peft of LyCORIS-rule norms."""
  with pytest.raises(ValueError, match="lora.dora='yes' must be True or False"):
    mdt.LoRAConfig.from_options({"dora": "yes"})
  folder = fixture_path("lora_extract") / "base"
  unet = md_sd.load_unet(folder, subfolder=None, progress=False)
  keymap = md_sd.unet_key_map(unet.cfg)
  names = list(md_core.open_checkpoint(folder))
  lora = mdt.add_lora(
    unet, mdt.LoRAConfig(rank=2, dora=True, targets=("to_q",)), convert_key=keymap,
    reference_names=names,
  )  # fmt: skip
  frozen, params = mdt.split_lora(unet)
  with pytest.raises(ValueError, match="a DoRA LoRA needs the frozen part"):
    mdt.lora_loss(lambda p, b, k: 0.0, lora)
  plain = md_lora.load_lora(fixture_path("lora_dora") / "unet_dora.safetensors", keymap, unet)
  plain = md_lora.Adapter(
    {s: w._replace(magnitude=None) for s, w in plain.weights.items()}, plain.names, "plain.safetensors",
    "peft",
  )  # fmt: skip
  with pytest.raises(ValueError, match="plain.safetensors: a plain LoRA adapter"):
    mdt.load_lora_factors(lora, params, plain)
  lyco = mdt.lora_adapter(lora, params)
  lyco = md_lora.Adapter(
    {s: w._replace(dora_rule="lycoris") for s, w in lyco.weights.items()},
    lyco.names,
    "lyco",
    "peft",
  )
  with pytest.raises(ValueError, match="'lycoris' norms of shape .*peft's per-output magnitudes"):
    md_lora.save_peft(lyco, tmp_path / "x.safetensors", keymap, names, prefix="unet")
