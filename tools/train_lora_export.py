"""Writes md's PEFT export of the train_lora_step fixtures' LoRAs, for the diffusers check.

    uv run python tools/train_lora_export.py          # main workspace (JAX); then
    bash tools/make_fixtures.sh train_lora_step       # diffusers loads these files and compares

For the tiny SD 1.x UNet, Wan 2.1 and Flux.1 dev transformers: md_train.add_lora with the fixture's settings (r 4,
alpha 8, the default attention targets), the fixture's lora_A and non-zero lora_B in the slots
(md_train.load_lora_factors), then md_train.save_lora into
tests/fixtures/train_lora_step/md_export/{sd_unet,wan_transformer,flux_transformer}_lora.safetensors; and the Wan
DoRA case (`wan_dora`: LoRAConfig(dora=True), the fixture's moved magnitudes in the gain slots) into
md_export/wan_transformer_dora.safetensors.
tests/test_train_lora.py checks that md still writes exactly these files.
"""

import pathlib

import numpy as np

import md_core
import md_flux
import md_lora
import md_sd
import md_train as mdt
import md_wan

ROOT = pathlib.Path(__file__).resolve().parents[1]
FIX = ROOT / "tests" / "fixtures"
RANK, ALPHA = 4, 8.0


def export(name: str, out: pathlib.Path) -> pathlib.Path:
  """md's export of fixture `name` (`sd`, `wan`, `flux` or `wan_dora`) written to `out`."""
  family, dora = name.split("_")[0], name.endswith("_dora")
  if family == "sd":
    folder = FIX / "unet" / "sd1"
    model = md_sd.load_unet(folder, subfolder=None, progress=False)
    keymap, prefix = md_sd.unet_key_map(model.cfg), "unet"
  elif family == "flux":
    folder = FIX / "flux_transformer" / "dev"
    model = md_flux.load_flux(folder)
    keymap, prefix = md_flux.convert_key, "transformer"
  else:
    folder = FIX / "wan_transformer" / "t2v" / "transformer"
    model = md_wan.load_transformer(folder, subfolder=None)
    keymap, prefix = md_wan.convert_key, "transformer"
  names = list(md_core.open_checkpoint(folder))
  lora = mdt.add_lora(
    model, mdt.LoRAConfig(rank=RANK, alpha=ALPHA, dora=dora), convert_key=keymap,
    reference_names=names, family=family,
  )  # fmt: skip
  _, params = mdt.split_lora(model)
  with np.load(FIX / "train_lora_step" / f"{name}.npz") as ref:
    tensors = {}
    for k in ref.files:
      if k.startswith("a/"):
        tensors[f"{prefix}.{k[2:]}.lora_A.weight"] = ref[k]
        tensors[f"{prefix}.{k[2:]}.lora_B.weight"] = ref["b/" + k[2:]]
        if dora:
          tensors[f"{prefix}.{k[2:]}.lora_magnitude_vector"] = ref["m/" + k[2:]]
  adapter = md_lora.load_lora(tensors, keymap, model, config={"r": RANK, "lora_alpha": ALPHA})
  params = mdt.load_lora_factors(lora, params, adapter)
  out.parent.mkdir(parents=True, exist_ok=True)
  mdt.save_lora(lora, params, out, convert_key=keymap, reference_names=names, prefix=prefix)
  return out


def export_text(kind: str, out: pathlib.Path) -> pathlib.Path:
  """md's export of the denoiser + text-encoder(s) LoRA fixture `kind` (`sd`, `sdxl`, `flux`), written to
  `out`."""
  if kind == "flux":
    folder = FIX / "flux_pipeline" / "dev"
    pipe, denoiser = md_flux.load_pipeline(folder), "transformer"
  else:
    folder = FIX / "sd_pipeline" / kind
    pipe, denoiser = md_sd.load_pipeline(folder), "unet"
  parts = []
  text = ("q_proj", "k_proj", "v_proj", "out_proj")
  encoders = ("text_encoder", "text_encoder_2") if kind == "sdxl" else ("text_encoder",)
  with np.load(FIX / "train_lora_text_step" / f"{kind}.npz") as ref:
    for component, targets in [(denoiser, None)] + [(e, text) for e in encoders]:
      model, keymap = getattr(pipe, component), pipe.lora_key_map(component)
      names = list(md_core.open_checkpoint(folder / component))
      lora = mdt.add_lora(
        model, mdt.LoRAConfig(rank=RANK, alpha=ALPHA, targets=targets), convert_key=keymap,
        reference_names=names, family="flux" if kind == "flux" else "sd",
      )  # fmt: skip
      tensors = {}
      for k in ref.files:
        if k.startswith(f"{component}/a/"):
          module = k.split("/", 2)[2]
          tensors[f"{module}.lora_A.weight"] = ref[k]
          tensors[f"{module}.lora_B.weight"] = ref[f"{component}/b/{module}"]
      adapter = md_lora.load_lora(tensors, keymap, model, config={"r": RANK, "lora_alpha": ALPHA})
      params = mdt.load_lora_factors(lora, mdt.split_lora(model)[1], adapter)
      parts.append((lora, params, keymap, names, component))
  out.parent.mkdir(parents=True, exist_ok=True)
  (lora, params, keymap, names, prefix), *also = parts
  mdt.save_lora(
    lora, params, out, convert_key=keymap, reference_names=names, prefix=prefix, also=also
  )
  return out


def main() -> None:
  for name, file in (
    ("sd", "sd_unet_lora.safetensors"),
    ("wan", "wan_transformer_lora.safetensors"),
    ("flux", "flux_transformer_lora.safetensors"),
    ("wan_dora", "wan_transformer_dora.safetensors"),
  ):
    path = export(name, FIX / "train_lora_step" / "md_export" / file)
    print(f"wrote {path.relative_to(ROOT)} ({path.stat().st_size} bytes)")
  for kind, file in (
    ("sd", "sd_unet_text_lora.safetensors"),
    ("sdxl", "sdxl_unet_text_lora.safetensors"),
    ("flux", "flux_transformer_text_lora.safetensors"),
  ):
    path = export_text(kind, FIX / "train_lora_text_step" / "md_export" / file)
    print(f"wrote {path.relative_to(ROOT)} ({path.stat().st_size} bytes)")


if __name__ == "__main__":
  main()
