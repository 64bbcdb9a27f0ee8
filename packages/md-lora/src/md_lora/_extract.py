"""LoRA extraction (truncated SVD of a finetune's deltas) and saving in the diffusers / PEFT format."""

from __future__ import annotations

import collections
import json
import os
import re
from collections.abc import Iterable
from typing import Any, NamedTuple

import jax.numpy as jnp
import numpy as np
from flax import nnx

import md_core
from md_core import KeyMap, Target
from md_lora._adapter import Adapter, LoRAWeight, Site
from md_lora._load import _PERMUTATIONS


class Extraction(NamedTuple):
  """What `extract_lora` found."""

  adapter: Adapter
  energy: dict[Site, float]  # the fraction of the delta's squared Frobenius norm the rank keeps


def _flat_params(model_or_state: Any) -> dict[tuple, tuple[Any, tuple | None]]:
  state = nnx.state(model_or_state) if isinstance(model_or_state, nnx.Module) else model_or_state
  out = {}
  for path, var in nnx.to_flat_state(state):
    value = var.get_value() if hasattr(var, "get_value") else var.value
    out[tuple(path)] = (value, md_core.logical_axes(var))
  return out


def extract_lora(
  base: Any, finetuned: Any, rank: int, *, atol: float = 0.0, kernels: str = "kernel"
) -> Extraction:
  """Extracts a rank-`rank` LoRA from `finetuned - base` by truncated SVD, per adapted weight and layer.

  Every parameter whose name matches `kernels` with two or more axes (a linear `(in, out)` or a conv `(*k, in, out)`
  kernel; stacked ones per layer, by their leading `layers` logical axis) whose delta exceeds `atol` is
  factored: `delta.reshape(-1, out) ≈ U S Vᵀ`, `down = U √S`, `up = √S Vᵀ`, scale 1.

  Args:
    base, finetuned: two NNX modules (or states) of the same architecture.
    rank: the rank kept (smaller layers keep their full rank).
    atol: deltas whose largest entry is at most this are left out.
    kernels: a regex over parameter names (the last path part) to factor.

  Returns:
    `Extraction(adapter, energy)`.
  """
  if rank < 1:
    raise ValueError(f"rank={rank} must be at least 1")
  a, b = _flat_params(base), _flat_params(finetuned)
  if set(a) != set(b):
    diff = sorted(str(p) for p in set(a) ^ set(b))[:5]
    raise ValueError(f"base and finetuned have different parameters (e.g. {diff})")
  weights, energy = {}, {}
  for path, (w0, axes) in a.items():
    w1 = b[path][0]
    if not re.fullmatch(kernels, str(path[-1])) or np.ndim(w0) < 2:
      continue
    if tuple(np.shape(w0)) != tuple(np.shape(w1)):
      raise ValueError(f"{md_core.path_str(path)}: shapes {np.shape(w0)} and {np.shape(w1)} differ")
    stacked = bool(axes) and axes[0] == "layers"
    delta = jnp.asarray(w1, jnp.float32) - jnp.asarray(w0, jnp.float32)
    layers = range(delta.shape[0]) if stacked else [None]
    for layer in layers:
      d = delta[layer] if layer is not None else delta
      if d.ndim < 2 or float(jnp.max(jnp.abs(d))) <= atol:
        continue
      m = np.asarray(d, np.float64).reshape(-1, d.shape[-1])
      u, s, vt = np.linalg.svd(m, full_matrices=False)
      k = min(rank, s.size)
      root = np.sqrt(s[:k])
      down = (u[:, :k] * root).reshape(tuple(d.shape[:-1]) + (k,)).astype(np.float32)
      up = (root[:, None] * vt[:k]).astype(np.float32)
      site = Site(path, layer)
      weights[site] = LoRAWeight(down, up, 1.0)
      total = float(np.sum(s**2))
      energy[site] = float(np.sum(s[:k] ** 2) / total) if total > 0 else 1.0
  adapter = Adapter(weights, {}, "extracted", "peft")
  return Extraction(adapter, energy)


def _torch_factors(w: LoRAWeight, target: Target) -> tuple[np.ndarray, np.ndarray]:
  """md-layout `(down, up)` → torch `lora_A` `[r, in, *k]`, `lora_B` `[out, r, *1]` (scale folded in)."""
  down = np.asarray(w.down, np.float32)
  up = np.asarray(w.up, np.float32) * np.float32(w.scale)
  if target.layout == "identity":
    return up, down
  perm = _PERMUTATIONS[target.layout]
  inverse = tuple(int(i) for i in np.argsort(perm))
  a = np.transpose(down, inverse)
  b = up.T.reshape(up.shape[1:] + (up.shape[0],) + (1,) * (a.ndim - 2))
  return np.ascontiguousarray(a), np.ascontiguousarray(b)


def save_peft(
  adapter: Adapter,
  path: str | os.PathLike,
  convert_key: KeyMap,
  reference_names: Iterable[str],
  *,
  prefix: str = "unet",
  also: Iterable[tuple[Adapter, KeyMap, Iterable[str], str]] = (),
) -> dict[Site, str]:
  """Writes an adapter as a diffusers / PEFT LoRA file (`<prefix>.<module>.lora_A.weight`…).

  md's paths are turned back into the reference's module names by mapping `reference_names` (the base
  checkpoint's tensor names, e.g. its `.weight` keys) through `convert_key`. Scales are folded into
  `lora_B`; the header's `lora_adapter_metadata` gives `r`, `lora_alpha = r` and per-module patterns, as
  diffusers' `save_lora_weights` writes them, so `load_lora_weights` reads the file with scale 1. A DoRA
  adapter with peft's rule (per-output magnitudes) adds `<module>.lora_magnitude_vector` (`[out]`, a
  conv's `[1, out, 1, 1]` as peft keeps it) and `use_dora` in the metadata.

  `also`: more components' adapters for the same file, each `(adapter, convert_key, reference_names,
  prefix)` (e.g. a text encoder's under `text_encoder.` beside the UNet's, as diffusers'
  `save_lora_weights(unet_lora_layers=..., text_encoder_lora_layers=...)` writes them).

  Returns:
    `{Site: module name}` as written (for `adapter`).

  Raises:
    ValueError: a site no reference name maps to, or one reached through a split (fused) tensor; a DoRA
      adapter with LyCORIS' rule or per-input norms, or with plain sites beside DoRA ones (peft's config
      has one `use_dora` for all); a second component without a prefix of its own.
  """
  tensors, written, packed = _peft_part(adapter, convert_key, reference_names, prefix)
  for other, other_key, other_names, other_prefix in also:
    if other_prefix == prefix or not other_prefix:
      raise ValueError(
        f"save_peft: another component's prefix {other_prefix!r} must differ from {prefix!r} (and not "
        "be empty)"
      )
    more, _, more_packed = _peft_part(other, other_key, other_names, other_prefix)
    tensors.update(more)
    packed.update(more_packed)
  meta = {"format": "pt", "lora_adapter_metadata": json.dumps(packed, sort_keys=True)}
  md_core.save_safetensors(path, tensors, metadata=meta)
  return written


def _peft_part(
  adapter: Adapter, convert_key: KeyMap, reference_names: Iterable[str], prefix: str
) -> tuple[dict[str, np.ndarray], dict[Site, str], dict[str, Any]]:
  """One component's PEFT tensors, `{Site: module}` and its prefixed `lora_adapter_metadata` entries."""
  inverse: dict[Site, tuple[str, Target]] = {}
  for name in reference_names:
    if not name.endswith(".weight"):
      continue
    targets = convert_key(name)
    if targets is None:
      continue
    for t in (targets,) if isinstance(targets, Target) else targets:
      inverse[Site(tuple(t.path), t.layer)] = (name[: -len(".weight")], t)
  if adapter.dora:
    for site, w in adapter.weights.items():
      m = None if w.magnitude is None else np.shape(w.magnitude)
      if m is None or w.dora_rule != "peft" or any(d != 1 for d in m[:-1]):
        why = "no magnitude" if m is None else f"{w.dora_rule!r} norms of shape {m}"
        raise ValueError(
          f"{adapter.source}: {str(site)!r} has {why}; save_peft writes DoRA adapters whose every site "
          "has peft's per-output magnitudes"
        )
  if adapter.oft or adapter.glora or adapter.ia3:
    kind = (
      "an OFT adapter (rotations" if adapter.oft else "a GLoRA / IA3 adapter (through the weight"
    )
    raise ValueError(
      f"{adapter.source}: {kind}, not low-rank factors); save_peft writes plain LoRA factors only: "
      "merge it (md_lora.merge) instead"
    )
  tensors, written, ranks = {}, {}, {}
  for site, w in adapter.weights.items():
    if site not in inverse:
      raise ValueError(
        f"{str(site)!r}: no reference tensor name maps to it; cannot name it in PEFT"
      )
    module, target = inverse[site]
    if target.split is not None:
      raise ValueError(
        f"{str(site)!r} comes from a fused tensor {module!r}; not writable per module"
      )
    a, b = _torch_factors(w, target)
    key = f"{prefix}.{module}" if prefix else module
    tensors[f"{key}.lora_A.weight"], tensors[f"{key}.lora_B.weight"] = a, b
    if adapter.dora:  # peft keeps a conv's norms as [1, out, 1, 1], a linear's as [out]
      m = np.asarray(w.magnitude, np.float32).reshape(-1)
      if m.shape[0] != b.shape[0]:
        raise ValueError(f"{str(site)!r}: {m.shape[0]} DoRA magnitudes for {b.shape[0]} outputs")
      shape = (1, m.shape[0]) + (1,) * (a.ndim - 2) if a.ndim > 2 else m.shape
      tensors[f"{key}.lora_magnitude_vector"] = np.ascontiguousarray(m.reshape(shape))
    written[site], ranks[module] = module, a.shape[0]
  r = collections.Counter(ranks.values()).most_common(1)[0][0] if ranks else 0
  other = {m: k for m, k in ranks.items() if k != r}
  config = {
    "r": r,
    "lora_alpha": r,
    "target_modules": sorted(ranks),
    "rank_pattern": other,
    "alpha_pattern": other,
  }
  if adapter.dora:
    config["use_dora"] = True
  packed = {f"{prefix}.{k}" if prefix else k: v for k, v in config.items()}
  return tensors, written, packed
