"""Loading a Stable Diffusion 1.x / 2.x / XL diffusers folder (with ControlNets), or a single UNet file, as
md modules."""

from __future__ import annotations

import os
import pathlib
from collections.abc import Mapping, Sequence
from typing import Any

import jax
from flax import nnx

import md_core
import md_schedulers as mdsch
import md_text
import md_vae
from md_core import pipeline as mdp
from md_sd._config import UNetConfig
from md_sd._pipeline import _KINDS, StableDiffusionPipeline
from md_sd._unet import UNet2DConditionModel
from md_sd._weights import load_controlnet, load_unet, unet_key_map

_CONTROLNET_CLASSES = ("ControlNetModel", "MultiControlNetModel")


def _controlnet_folders(
  root: pathlib.Path, index: Mapping[str, Any]
) -> tuple[list[pathlib.Path], bool]:
  """The ControlNet folders a pipeline's model_index.json names, and whether they are a
  MultiControlNetModel: `controlnet/` for a ControlNetModel; `controlnet/`, `controlnet_1/`, … for a
  MultiControlNetModel (diffusers' layout for several)."""
  entry = index.get("controlnet")
  if not (isinstance(entry, list) and len(entry) == 2 and entry[1] is not None):
    return [], False
  cls = entry[1]
  if cls not in _CONTROLNET_CLASSES:
    raise ValueError(
      f"{root / 'model_index.json'}: controlnet is a {cls!r}; md loads {list(_CONTROLNET_CLASSES)}"
    )
  folders = [mdp.component(root, "controlnet", index)]
  if cls == "MultiControlNetModel":
    while (root / f"controlnet_{len(folders)}").is_dir():
      folders.append(root / f"controlnet_{len(folders)}")
  return folders, cls == "MultiControlNetModel"


@mdp.with_quantization
def load_pipeline(
  source: str | os.PathLike,
  *,
  controlnet: str | os.PathLike | Sequence[str | os.PathLike] | None = None,
  unet_file: str | os.PathLike | None = None,
  mesh: jax.sharding.Mesh | None = None,
  dtype: Any = None,
  rules: Any = None,
  revision: str | None = None,
  progress: bool = False,
) -> StableDiffusionPipeline:
  """Loads an SD 1.x / 2.x / XL diffusers pipeline as md modules.

  Args:
    source: a local diffusers pipeline folder (with `model_index.json`) or a hub id
      (`"stable-diffusion-v1-5/stable-diffusion-v1-5"`, `"stabilityai/stable-diffusion-xl-base-1.0"`),
      resolved through md-core (the hub cache; downloads when online).
    controlnet: a ControlNet folder or hub id (e.g. `"lllyasviel/sd-controlnet-canny"`), or a list of them
      (used together, as the reference's `MultiControlNetModel`); the pipeline then needs `control_image`.
      Default: the ControlNet(s) the folder's model_index.json names (a saved `*ControlNet*Pipeline`:
      `controlnet/`, and `controlnet_1/`, … for a `MultiControlNetModel`), else none. Components md does
      not run (`safety_checker`, `feature_extractor`, `image_encoder`) are not loaded.
      The SDXL refiner (`"stabilityai/stable-diffusion-xl-refiner-1.0"`, no `text_encoder`) loads as any
      other source and then needs `image` or `image_latents`.
    unet_file: a UNet-only safetensors file (diffusers tensor names) loaded over the base UNet's config,
      e.g. SDXL-Lightning's `sdxl_lightning_4step_unet.safetensors`.
    mesh: place every parameter on this mesh by its logical axes (and split the batch over data × fsdp).
    dtype: parameter dtype of the UNet and ControlNet (default float32); text encoders and the VAE stay
      float32 (the reference upcasts the VAE).
    rules: md-sharding logical axis rules (default: `md_sharding.DEFAULT_RULES`).
    revision: hub revision.
    progress: progress bars while loading tensors.
    quantization: quantize the denoiser(s) after loading: "int8" (weight-only), "int8-dynamic"
      (weights and activations) or "fp8" (e4m3 weight-only); None keeps the loaded dtype
      (`md_core.quantize`).

  Returns:
    A `StableDiffusionPipeline`; call it to generate images.

  Raises:
    FileNotFoundError: no such folder or hub id, or a component folder is missing (named).
    md_core.SafetensorsError: a truncated or corrupt weights file.
    md_core.WeightLoadError: weights that do not fit their config.
    ValueError: a pipeline class md does not implement.
  """
  root = md_core.resolve_source(source, revision=revision)
  index, cls = mdp.read_index(root, sorted(_KINDS), "SD pipeline")
  kind = _KINDS[cls]
  names = ["unet", "vae", "text_encoder", "tokenizer", "scheduler"]
  if kind == "sdxl":
    names += ["text_encoder_2", "tokenizer_2"]
    # The SDXL refiner ships only the second encoder: model_index.json lists the first as [null, null].
    for name in ("text_encoder", "tokenizer"):
      if name in index and not mdp.listed(index, name):
        names.remove(name)
  folders = {name: mdp.component(root, name, index) for name in names}
  listed = _controlnet_folders(root, index) if controlnet is None else None
  kw = dict(mesh=mesh, rules=rules, progress=progress)
  if unet_file is None:
    unet = load_unet(folders["unet"], subfolder=None, dtype=dtype, **kw)
  else:
    unet = load_unet_file(unet_file, folders["unet"] / "config.json", dtype=dtype, **kw)
  vae = md_vae.load_vae_kl(folders["vae"], subfolder=None, **kw)
  te = tok = None
  if "text_encoder" in folders:
    te = md_text.load_clip_text(
      folders["text_encoder"], subfolder=None, with_projection=False, **kw
    )
    tok = md_text.load_tokenizer(folders["tokenizer"], subfolder=None)
  te2 = tok2 = None
  if kind == "sdxl":
    te2 = md_text.load_clip_text(
      folders["text_encoder_2"], subfolder=None, with_projection=True, **kw
    )
    tok2 = md_text.load_tokenizer(folders["tokenizer_2"], subfolder=None)
  net = None
  if isinstance(controlnet, (list, tuple)):
    if not controlnet:
      raise ValueError("controlnet is an empty list; pass a folder / hub id or a list of them")
    net = [load_controlnet(c, subfolder=None, dtype=dtype, **kw) for c in controlnet]
  elif controlnet is not None:
    net = load_controlnet(controlnet, subfolder=None, dtype=dtype, **kw)
  elif listed is not None:
    folders_cn, multi = listed
    nets = [load_controlnet(f, subfolder=None, dtype=dtype, **kw) for f in folders_cn]
    net = nets if multi else nets[0] if nets else None
  sched_cfg = mdsch.read_config(folders["scheduler"])
  mdsch.from_config(sched_cfg)  # fail now, not at the first call, on a scheduler md lacks
  return StableDiffusionPipeline(
    kind=kind,
    unet=unet,
    vae=vae,
    text_encoder=te,
    tokenizer=tok,
    scheduler_config=sched_cfg,
    text_encoder_2=te2,
    tokenizer_2=tok2,
    controlnet=net,
    force_zeros_for_empty_prompt=bool(index.get("force_zeros_for_empty_prompt", True)),
    requires_aesthetics_score=bool(index.get("requires_aesthetics_score", False)),
    mesh=mesh,
    source=str(source),
  )


def resolve_file(path: str | os.PathLike) -> pathlib.Path:
  """A local file, or `org/name/path/in/repo` on the hub (the hub cache; downloaded when online)."""
  local = pathlib.Path(path).expanduser()
  if local.is_file():
    return local
  parts = str(path).split("/")
  if local.exists() or len(parts) < 3 or str(path).startswith((".", "/")):
    raise FileNotFoundError(f"{path}: no such file (a local file, or org/name/file on the hub)")
  import huggingface_hub

  repo, filename = "/".join(parts[:2]), "/".join(parts[2:])
  try:
    return pathlib.Path(
      huggingface_hub.hf_hub_download(
        repo,
        filename,
        cache_dir=str(md_core.hub_cache_dir()),
        local_files_only=md_core.hub_offline(),
      )
    )
  except Exception as e:  # noqa: BLE001 - huggingface_hub raises many kinds; all mean "not available"
    how = (
      "HF_HUB_OFFLINE=1: only the cache is read"
      if md_core.hub_offline()
      else "the hub could not provide it"
    )
    raise FileNotFoundError(
      f"{path}: file {filename!r} of hub repo {repo!r} is not available ({how}; {type(e).__name__}); "
      f"download it (`hf download {repo} {filename}`) or pass a local file"
    ) from None


def load_unet_file(
  path: str | os.PathLike,
  config: str | os.PathLike,
  *,
  mesh: jax.sharding.Mesh | None = None,
  dtype: Any = None,
  rules: Any = None,
  progress: bool = False,
) -> UNet2DConditionModel:
  """Loads a UNet-only safetensors file (diffusers names) with the config of a base UNet (`config.json`),
  as SDXL-Lightning and similar distilled UNets ship.

  Args:
    path: a local safetensors file, or `org/name/file.safetensors` on the hub.
    config: the base UNet's `config.json`.
    mesh: place parameters on this mesh.
    dtype: parameter dtype.
    rules: md-sharding logical axis rules.
    progress: progress bar while loading.

  Raises:
    FileNotFoundError: no such file.
    md_core.SafetensorsError: a truncated or corrupt file.
    md_core.WeightLoadError: tensors that do not fit the base config.
  """
  path = resolve_file(path)
  cfg = UNetConfig.from_json(config)
  checkpoint = md_core.open_checkpoint(path)
  return md_core.load_weights(
    lambda: UNet2DConditionModel(cfg, rngs=nnx.Rngs(0), dtype=dtype),
    checkpoint,
    unet_key_map(cfg),
    dtype=dtype,
    mesh=mesh,
    rules=rules,
    progress=progress,
  )
