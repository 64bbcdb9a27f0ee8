"""LoRA on the SD / SDXL UNet or the Flux.1 transformer and its CLIP text encoders trained together
(md_train.text_encoders_lora_loss, train_dreambooth_lora.py's / _sdxl.py's / _flux.py's `--train_text_encoder`)
against torch + peft autograd (tools/fixtures/train_lora_text_step.py): the tiny SD, SDXL and Flux.1 dev
pipelines, r 4, alpha 8 on the denoiser's default targets and the text encoders' q/k/v/out projections, the
fixture's factors in md's slots; the prompt embeddings (SDXL: both encoders' penultimate states and the pooled
projection; Flux: CLIP's pooled output, the frozen T5's states cached) computed inside the step from token
ids. Loss within 1e-5, every factor's gradient of every model within 1e-4; the export (every component
in one file) is the file diffusers' `load_lora_weights` was checked on, and `Pipeline.load_lora` reads every
component back into the trained slot values."""

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
from md_core.testing import fixture_path, load_arrays

RANK, ALPHA = 4, 8.0
TEXT_TARGETS = ("q_proj", "k_proj", "v_proj", "out_proj")
SCHED = dict(beta_schedule="scaled_linear", beta_start=0.00085, beta_end=0.012)
ENCODERS = {
  "sd": ("text_encoder",),
  "sdxl": ("text_encoder", "text_encoder_2"),
  "flux": ("text_encoder",),
}
DENOISER = {
  "sd": "unet",
  "sdxl": "unet",
  "flux": "transformer",
}  # Flux: CLIP trains, its T5 stays frozen


def _pipeline(kind):
  if kind == "flux":
    return md_flux.load_pipeline(fixture_path("flux_pipeline") / "dev")
  return md_sd.load_pipeline(fixture_path("sd_pipeline") / kind)


def _flat(state):
  return {
    tuple(p): np.asarray(v[...] if isinstance(v, nnx.Variable) else v)
    for p, v in nnx.to_flat_state(state)
  }


@pytest.fixture(scope="module", params=list(ENCODERS))
def setup(request):
  kind = request.param
  ref = load_arrays(fixture_path("train_lora_text_step") / f"{kind}.npz")
  pipe = _pipeline(kind)
  folder = pathlib.Path(pipe.source)
  parts = {}
  for component in (DENOISER[kind],) + ENCODERS[kind]:
    model, keymap = getattr(pipe, component), pipe.lora_key_map(component)
    names = list(md_core.open_checkpoint(folder / component))
    targets = None if component == DENOISER[kind] else TEXT_TARGETS
    lora = mdt.add_lora(
      model, mdt.LoRAConfig(rank=RANK, alpha=ALPHA, targets=targets), convert_key=keymap,
      reference_names=names, family="flux" if kind == "flux" else "sd",
    )  # fmt: skip
    frozen, params = mdt.split_lora(model)
    tensors = {}
    for k in ref:
      if k.startswith(f"{component}/a/"):
        module = k.split("/", 2)[2]
        tensors[f"{module}.lora_A.weight"] = ref[k]
        tensors[f"{module}.lora_B.weight"] = ref[f"{component}/b/{module}"]
    adapter = md_lora.load_lora(tensors, keymap, model, config={"r": RANK, "lora_alpha": ALPHA})
    params = mdt.load_lora_factors(lora, params, adapter)
    parts[component] = dict(
      model=model, keymap=keymap, names=names, lora=lora, frozen=frozen, params=params
    )
  main = parts[DENOISER[kind]]
  if kind == "flux":
    family_loss = mtf.flux_loss(main["frozen"], guidance=3.5)
  else:
    family_loss = mtf.sd_loss(main["frozen"], alphas_cumprod=mdsch.ddpm(**SCHED).alphas_cumprod)
  denoiser = mdt.lora_loss(family_loss, main["lora"])
  encoders = {e: (parts[e]["lora"], parts[e]["frozen"]) for e in ENCODERS[kind]}
  if kind == "sd":  # the one-encoder form
    loss_fn = mdt.text_encoder_lora_loss(denoiser, *encoders["text_encoder"])
  else:
    embeds = mdt.sdxl_prompt_embeds if kind == "sdxl" else mdt.flux_prompt_embeds
    loss_fn = mdt.text_encoders_lora_loss(denoiser, encoders, embeds)
  params = {"denoiser": main["params"], **{e: parts[e]["params"] for e in ENCODERS[kind]}}
  batch = {
    "latents": jnp.asarray(ref["latents"]).transpose(0, 2, 3, 1),
    "noise": jnp.asarray(ref["noise"]).transpose(0, 2, 3, 1),
    **{k: jnp.asarray(ref[k], jnp.int32) for k in mdt.TOKEN_KEYS if k in ref},
    **{k: jnp.asarray(ref[k]) for k in ("timesteps", "sigmas", "time_ids") if k in ref},
  }
  if "encoder_hidden_states" in ref:  # Flux: the frozen T5's states, cached in the batch
    batch["encoder_hidden_states"] = jnp.asarray(ref["encoder_hidden_states"])
  step = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))
  (loss, _), grads = step(params, batch, jax.random.key(0))
  return dict(kind=kind, ref=ref, parts=parts, loss=loss, grads=grads, params=params)


def test_targets_are_the_peft_modules(setup):
  ref = setup["ref"]
  for component, part in setup["parts"].items():
    modules = sorted(k.split("/", 2)[2] for k in ref if k.startswith(f"{component}/a/"))
    assert sorted(part["lora"].modules) == modules, component
  assert len(setup["parts"]["text_encoder"]["lora"].modules) == 8  # 2 layers x q, k, v, out


def test_step_matches_peft_on_both_models(setup):
  """The loss, every lora_A / lora_B gradient of the UNet and the text encoders, and their global norm."""
  ref, grads = setup["ref"], setup["grads"]
  np.testing.assert_allclose(float(setup["loss"]), ref["loss"], atol=1e-5, rtol=0)
  np.testing.assert_allclose(float(optax.tree.norm(grads)), ref["grad_norm"], atol=1e-4)
  worst = {}
  for component, part in setup["parts"].items():
    flat = _flat(grads["denoiser" if component == DENOISER[setup["kind"]] else component])
    worst[component] = 0.0
    for module, (path, layer) in part["lora"].modules.items():
      parts = tuple(int(p) if p.isdigit() else p for p in path.split("."))
      want_a, want_b = md_lora.lora_factors(
        ref[f"{component}/grad_a/{module}"], ref[f"{component}/grad_b/{module}"],
        part["keymap"](module + ".weight"),
      )  # fmt: skip
      for name, want in (("lora_a", want_a), ("lora_b", want_b)):
        got = flat[parts + (name,)]
        got = got if layer is None else got[layer]
        chex.assert_trees_all_close(got, want, atol=1e-4, rtol=0, custom_message=module)
        worst[component] = max(worst[component], float(np.abs(got - want).max()))
    # every encoder's factors really get gradients (its LoRA changes the prompt embeddings; SDXL's
    # text_encoder only through its first layer: hidden_states[-2] of two layers)
    assert max(float(np.abs(v).max()) for v in flat.values()) > 1e-4, component
  print(
    f"{setup['kind']}: loss err {abs(float(setup['loss']) - ref['loss']):.1e}, max grad err {worst}"
  )


def test_export_is_the_file_diffusers_read_and_the_pipeline_loads_it(setup, tmp_path):
  """save_lora(..., also=[text encoders]) writes the one file diffusers' load_lora_weights gave the peft
  models' output from (max abs 0.0, the fixture's README); `Pipeline.load_lora` puts every component's
  factors into its slots as trained (b at alpha / r)."""
  kind, parts = setup["kind"], setup["parts"]
  name = DENOISER[kind]
  main = parts[name]
  path = tmp_path / "pytorch_lora_weights.safetensors"
  also = [
    (p["lora"], p["params"], p["keymap"], p["names"], e) for e, p in parts.items() if e != name
  ]
  mdt.save_lora(
    main["lora"], main["params"], path, convert_key=main["keymap"], reference_names=main["names"],
    prefix=name, also=also,
  )  # fmt: skip
  got = md_core.SafetensorsFile(path)
  want = md_core.SafetensorsFile(
    fixture_path("train_lora_text_step") / "md_export" / f"{kind}_{name}_text_lora.safetensors"
  )
  assert sorted(got) == sorted(want)
  assert {k.split(".")[0] for k in got} == {name, *ENCODERS[kind]}
  for k in want:
    np.testing.assert_array_equal(np.asarray(got[k]), np.asarray(want[k]), err_msg=k)
  assert got.metadata == want.metadata

  pipe = _pipeline(kind)
  pipe.load_lora(path, name="trained", max_rank=RANK)
  for component, part in parts.items():
    slots = _flat(nnx.state(getattr(pipe, component)))
    for p, v in _flat(part["params"]).items():
      want = v * np.float32(part["lora"].scale) if p[-1] == "lora_b" else v
      np.testing.assert_allclose(slots[p], want, atol=1e-7, rtol=0, err_msg=f"{component} {p}")


def test_text_encoder_loss_errors(tmp_path):
  """A batch of cached states (no input_ids) and a second component under the same prefix are named."""
  folder = fixture_path("sd_pipeline") / "sd"
  pipe = md_sd.load_pipeline(folder)
  names = list(md_core.open_checkpoint(folder / "text_encoder"))
  keymap = pipe.lora_key_map("text_encoder")
  lora = mdt.add_lora(
    pipe.text_encoder, mdt.LoRAConfig(rank=2, targets=TEXT_TARGETS), convert_key=keymap,
    reference_names=names,
  )  # fmt: skip
  frozen, params = mdt.split_lora(pipe.text_encoder)
  loss_fn = mdt.text_encoder_lora_loss(lambda p, b, k: (0.0, {}), lora, frozen)
  batch = {"latents": jnp.zeros((1, 4, 4, 4)), "encoder_hidden_states": jnp.zeros((1, 16, 16))}
  with pytest.raises(ValueError, match="the batch has no input_ids"):
    loss_fn({"denoiser": {}, "text_encoder": params}, batch, jax.random.key(0))
  with pytest.raises(ValueError, match="another component's prefix 'text_encoder' must differ"):
    mdt.save_lora(
      lora, params, tmp_path / "x.safetensors", convert_key=keymap, reference_names=names,
      prefix="text_encoder", also=[(lora, params, keymap, names, "text_encoder")],
    )  # fmt: skip
