"""Adapters at run time and the pipeline LoRA API (`pipe.load_lora`, `set_adapters`, `unload_lora`,
`fuse_lora`, `unfuse_lora`), shared by every family through `md_core.pipeline.Pipeline`.

At run time an adapter's factors sit in the denoiser's LoRA slots (`md_core.add_lora_slots`: zero-padded
`[.., in, max_rank]` / `[.., max_rank, out]` beside each Dense and Conv kernel), which travel into the
compiled programs with the rest of the module state: loading, swapping, rescaling or disabling adapters
changes the slots' values, never their shapes, so nothing recompiles. Slots are added at the first
run-time load (every Dense and Conv of the component unless `targets=` narrows them; `max_rank=` is the
rank all adapters used at once share). Fusing merges adapters into the weights (`md_lora.merge`, on the
weights' devices, in their dtype) and takes them out of the slots; unfusing subtracts them again.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
import pathlib
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import md_core
from md_lora._adapter import Adapter, GLoRAWeight, IA3Weight, OFTWeight
from md_lora._load import load_lora
from md_lora._merge import _value, merge, unmerge

DEFAULT_MAX_RANK = 64


def to_slots(
  adapter: Adapter, scale: float = 1.0, state: Any = None
) -> dict[str, list[md_core.LoRASlotWeight]]:
  """An adapter as run-time slot weights: `{layer path: [md_core.LoRASlotWeight(a, b, scale, layer)]}`.

  A site `(…, layer, "kernel")` becomes the slot of the Dense / Conv at `…layer` (dotted path); a site of
  a scanned stack keeps its `layer` index. `scale` multiplies the file's alpha / r.

  A DoRA site needs the model's `state` (its base kernels): the layer's output is `g · (x @ W + Δx)`, so
  the slot weight carries the per-output factor `g` (`md_core.LoRASlotWeight.gain`, for the layer's gain slot) and
  its `b` times `g`; peft's rule: `g = m / ||W + kΔ||` with `Δ` at the user's scale k; LyCORIS':
  `g = k (m / (||W + Δ|| + eps) - 1) + 1` with `Δ` at the file's scale (the merged weights, run lazily).

  Raises:
    ValueError: a site that is not the kernel of a layer (e.g. a plain parameter kept in the reference's
      layout), an OFT / BOFT site (a rotation), a DoRA site with norms along the input axis or on a
      quantized kernel (merge such adapters: `md_lora.merge`, `pipe.fuse_lora`), or a DoRA adapter
      without `state`.
  """
  flat = _check_runtime(adapter, state)
  gains = _dora_gains(adapter, float(scale), flat) if adapter.dora else {}
  out: dict[str, list[md_core.LoRASlotWeight]] = {}
  for site, w in adapter.weights.items():
    path = ".".join(str(p) for p in site.path[:-1])
    if w.magnitude is None:
      out.setdefault(path, []).append(
        md_core.LoRASlotWeight(w.down, w.up, scale * w.scale, site.layer)
      )
      continue
    factor, gain = gains[site]
    up = np.asarray(w.up, np.float32) * gain
    out.setdefault(path, []).append(md_core.LoRASlotWeight(w.down, up, factor, site.layer, gain))
  return out


def _check_runtime(adapter: Adapter, state: Any) -> dict | None:
  """Raises what keeps `adapter` out of run-time slots (see `to_slots`), computing nothing; returns the
  flat state a DoRA adapter's gains are computed from (None for a plain adapter)."""
  if adapter.oft:
    rotated = [str(site) for site, w in adapter.weights.items() if isinstance(w, OFTWeight)]
    raise ValueError(
      f"{adapter.source}: {len(rotated)} site(s) are OFT / BOFT rotations (e.g. {rotated[0]!r}), "
      "which run-time LoRA slots cannot hold (a rotation of the weight, not a "
      "low-rank delta); merge it: pipe.load_lora(..., fuse=True) or md_lora.merge"
    )
  if adapter.glora or adapter.ia3:
    kind = "GLoRA" if adapter.glora else "IA3"
    mixed = [
      str(site) for site, w in adapter.weights.items() if isinstance(w, GLoRAWeight | IA3Weight)
    ]
    raise ValueError(
      f"{adapter.source}: {len(mixed)} site(s) are LyCORIS {kind} (e.g. {mixed[0]!r}), a delta through "
      "the weight itself, which run-time LoRA slots cannot hold; merge it: "
      "pipe.load_lora(..., fuse=True) or md_lora.merge"
    )
  bad = [str(site) for site in adapter.weights if site.path[-1] != "kernel"]
  if bad:
    raise ValueError(
      f"{adapter.source}: {len(bad)} adapted parameter(s) are not layer kernels and have no run-time "
      f"LoRA slot: {bad[:5]}; merge this adapter instead (pipe.load_lora(..., fuse=True) or "
      "md_lora.merge)"
    )
  if not adapter.dora:
    return None
  if state is None:
    raise ValueError(
      f"{adapter.source}: a DoRA adapter at run time needs the model's state (its base kernels): "
      "to_slots(adapter, scale, state)"
    )
  state = nnx.state(state) if isinstance(state, nnx.Module) else state
  flat = {tuple(p): v for p, v in nnx.to_flat_state(state)}
  for site, w in adapter.weights.items():
    if w.magnitude is None:
      continue
    m = np.shape(w.magnitude)
    if any(d != 1 for d in m[:-1]) or (m and m[-1] == 1 and math.prod(m) > 1):
      raise ValueError(
        f"{adapter.source}: {str(site)!r}: DoRA norms along the layer's input axis (LyCORIS' "
        "wd_on_out=False) rescale its inputs, which run-time slots cannot hold; merge this adapter "
        "(pipe.load_lora(..., fuse=True) or md_lora.merge)"
      )
    if site.path[:-1] + ("kernel_scale",) in flat:
      raise ValueError(
        f"{adapter.source}: {str(site)!r} is a quantized kernel; a DoRA adapter at run time needs its "
        "float weights: merge it before quantizing"
      )
  return flat


def _dora_gains(adapter: Adapter, scale: float, flat: dict) -> dict[Any, tuple[float, np.ndarray]]:
  """`{site: (scale of Δ, per-output factor g)}` for an adapter's DoRA sites (see `to_slots`), computed
  by one jitted program on the base kernels' devices: only the factors and the `[out]` gains travel, the
  kernels stay where they are (sharded kernels stay sharded)."""
  sites = [(site, w) for site, w in adapter.weights.items() if w.magnitude is not None]
  paths = tuple(dict.fromkeys(site.path for site, _ in sites))
  spec = tuple((paths.index(site.path), site.layer, w.dora_rule) for site, w in sites)
  got = _gain_program(spec)(
    [_value(flat[p]) for p in paths],
    [w.down for _, w in sites],
    [w.up for _, w in sites],
    [w.magnitude for _, w in sites],
    jnp.asarray([w.scale for _, w in sites], jnp.float32),
    jnp.float32(scale),
  )
  got = jax.device_get(got)
  return {
    site: (scale * w.scale if w.dora_rule == "peft" else w.scale, np.asarray(g, np.float32))
    for (site, w), g in zip(sites, got)
  }


@functools.lru_cache(maxsize=16)
def _gain_program(spec: tuple):
  """The gains program for one adapter's DoRA sites: `spec` holds each site's (kernel index, layer of a
  scanned stack or None, rule); the user's scale is an input, so rescaling reuses the program."""

  def gains(kernels, downs, ups, magnitudes, file_scales, scale):
    out = []
    for i, (k, layer, rule) in enumerate(spec):
      w = kernels[k] if layer is None else kernels[k][layer]
      w = w.astype(jnp.float32)
      delta = jnp.tensordot(
        downs[i].astype(jnp.float32), ups[i].astype(jnp.float32), 1,
        precision=jax.lax.Precision.HIGHEST,
      )  # fmt: skip
      m = magnitudes[i].astype(jnp.float32).reshape(-1)
      axes = tuple(range(w.ndim - 1))
      if rule == "peft":  # Δ at the user's scale inside the norm
        v = w + (scale * file_scales[i]) * delta
        out.append(m / jnp.sqrt(jnp.sum(v * v, axis=axes)))
      else:  # LyCORIS: Δ at the file's scale, the user's scale interpolates the rescaling
        v = w + file_scales[i] * delta
        g = m / (jnp.sqrt(jnp.sum(v * v, axis=axes)) + jnp.finfo(jnp.float32).eps)
        out.append(scale * (g - 1.0) + 1.0)
    return out

  return jax.jit(gains)


def apply_runtime(state: Any, adapters: Sequence[tuple[Adapter, float]]) -> Any:
  """A module state with `(adapter, scale)` pairs in its LoRA slots (all others zero); see `to_slots`
  (DoRA adapters need gain slots: `md_core.add_lora_slots(..., gain=True)`)."""
  return md_core.set_lora(state, [to_slots(a, s, state) for a, s in adapters])


# --- the pipeline API ------------------------------------------------------------------------------------


@dataclasses.dataclass
class _Entry:
  adapters: dict[str, Adapter]  # component → the file read against it
  scales: dict[str, float]  # component → the user's scale
  active: bool = True
  fused: dict[str, float] | None = None  # the scales it is merged into the weights with
  # DoRA components fused: {component: {parameter path: what the fuse added}}, subtracted by the unfuse
  # (a DoRA rescaling cannot be unmerged from its factors).
  added: dict[str, dict[tuple, Any]] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class _Registry:
  entries: dict[str, _Entry] = dataclasses.field(default_factory=dict)
  max_rank: int = DEFAULT_MAX_RANK
  targets: Any = None
  slots: dict[str, frozenset[str]] = dataclasses.field(
    default_factory=dict
  )  # component → slot paths


def _registry(pipe: Any) -> _Registry:
  reg = getattr(pipe, "_lora_registry", None)
  if reg is None:
    reg = _Registry()
    pipe._lora_registry = reg
  return reg


def _components(pipe: Any, component: str | Sequence[str] | None, keys: Sequence[str]) -> list[str]:
  """The components a file goes to: `component`, or the denoisers and every optional component
  (`pipe.lora_prefixes`: the text encoders) whose prefix the file's keys carry; a file that holds
  nothing but optional components' keys adapts only those."""
  optional = _optional(pipe)
  known = [c for c in pipe.lora_components if getattr(pipe, c, None) is not None]
  if not known:
    raise ValueError(f"{type(pipe).__name__} has no component LoRAs apply to")
  if component is None:
    held = [c for c in known if c in optional and _prefix_of(keys, optional[c])]
    main = [c for c in known if c not in optional]
    everything = tuple(p for c in held for p in optional[c])
    if held and all(k.startswith(everything) for k in keys):
      main = []
    return main + held
  wanted = [component] if isinstance(component, str) else list(component)
  bad = [c for c in wanted if c not in known]
  if bad:
    main = [c for c in known if c not in optional]
    extra = [c for c in known if c in optional]
    also = f" (and {extra} where a file holds their keys)" if extra else ""
    raise ValueError(f"component {bad[0]!r}: LoRAs apply to {main}{also} of {type(pipe).__name__}")
  return wanted


def _optional(pipe: Any) -> dict[str, tuple[str, ...]]:
  """`{component: key prefixes}` of the components a file adapts only where it holds their keys."""
  return {c: tuple(p) for c, p in dict(getattr(pipe, "lora_prefixes", None) or {}).items()}


def _prefix_of(keys: Sequence[str], prefixes: Sequence[str]) -> str | None:
  """The first of `prefixes` that some key starts with."""
  return next((p for p in prefixes if any(k.startswith(p) for k in keys)), None)


def _keys(file: Any) -> list[str]:
  if isinstance(file, Mapping):
    return list(file)
  return list(md_core.SafetensorsFile(pathlib.Path(file)))  # names the file when it is missing


def _scale(value: Any, what: str) -> float:
  if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
    raise TypeError(f"{what}: scale {value!r} is not a finite number")
  return float(value)


def _scales(value: Any, components: Sequence[str], what: str) -> dict[str, float]:
  """A scale (the same for every component) or `{component: scale}` (every component named)."""
  if isinstance(value, Mapping):
    extra = sorted(set(value) - set(components))
    missing = [c for c in components if c not in value]
    if extra or missing:
      raise ValueError(
        f"{what}: per-component scales {dict(value)} must name exactly {list(components)}"
        + (f" (unknown: {extra})" if extra else "")
        + (f" (missing: {missing})" if missing else "")
      )
    return {c: _scale(value[c], f"{what} [{c}]") for c in components}
  s = _scale(value, what)
  return {c: s for c in components}


def _slot_paths(pipe: Any, component: str) -> frozenset[str]:
  """The layer paths with slots (read once per component; walking the module graph is slow)."""
  reg = _registry(pipe)
  paths = reg.slots.get(component)
  if not paths:
    paths = reg.slots[component] = frozenset(md_core.lora_paths(getattr(pipe, component)))
  return paths


def _has_slots(pipe: Any, component: str) -> bool:
  return bool(_slot_paths(pipe, component))


def _ensure_slots(pipe: Any, component: str, gain: bool = False) -> None:
  """Slots on `component` (added at the first run-time load; again, with gain slots, at the first DoRA
  one: one more compile)."""
  if not _has_slots(pipe, component) or (gain and not md_core.lora_gains(getattr(pipe, component))):
    reg = _registry(pipe)
    paths = pipe.add_lora_slots(reg.max_rank, component=component, targets=reg.targets, gain=gain)
    reg.slots[component] = frozenset(paths)


def _check_fits(pipe: Any, component: str, adapter: Adapter) -> None:
  """Every site of `adapter` has a slot in `component` (else: which ones, and what to do)."""
  slots = _slot_paths(pipe, component)
  layers = {".".join(str(p) for p in site.path[:-1]) for site in adapter.weights}
  missing = sorted(p for p in layers if p not in slots)
  if missing:
    raise ValueError(
      f"{adapter.source}: {len(missing)} layer(s) of {component} it adapts have no run-time LoRA slot "
      f"(slots were added at the first run-time load, targets={_registry(pipe).targets!r}): "
      f"{missing[:5]}; load it with fuse=True, or give the first load targets= that cover it"
    )


def _rebuild(pipe: Any) -> None:
  """Writes the active, unfused adapters into every component's slots."""
  reg = _registry(pipe)
  for component in pipe.lora_components:
    if getattr(pipe, component, None) is None:
      continue
    pairs = [
      (e.adapters[component], e.scales[component])
      for e in reg.entries.values()
      if e.active and e.fused is None and component in e.adapters
    ]
    if pairs:
      _ensure_slots(pipe, component, gain=any(a.dora for a, _ in pairs))
      for adapter, _ in pairs:
        _check_fits(pipe, component, adapter)
    elif not _has_slots(pipe, component):
      continue
    module, splits = pipe.splits_of(component)
    state = splits[0].state if splits else nnx.state(module)
    try:
      pipe.set_lora([to_slots(a, s, state) for a, s in pairs], component=component)
    except ValueError as e:
      raise ValueError(
        f"{e}; the adapters active at once share the slots of max_rank={md_core.lora_rank(getattr(pipe, component))}"
        " (set max_rank= at the first load_lora, or fuse some adapters)"
      ) from None


def load(pipe, file, name, scale, component, fuse, max_rank, targets, read_options) -> str:
  """`pipe.load_lora(file, name=, scale=, component=, fuse=, max_rank=, targets=, **read_options)`: see
  `md_lora.LoRAPipeline.load_lora`."""
  reg = _registry(pipe)
  name = pathlib.Path(file).stem if name is None else str(name)
  if name in reg.entries:
    raise ValueError(
      f"a LoRA named {name!r} is loaded already ({_sources(reg.entries[name])}); unload_lora({name!r}) "
      "first or pass another name="
    )
  keys = _keys(file)
  components = _components(pipe, component, keys)
  scales = _scales(scale, components, f"load_lora({str(file)!r})")
  if max_rank is not None or targets is not None:
    if any(_has_slots(pipe, c) for c in components):
      have = md_core.lora_rank(getattr(pipe, components[0]))
      if max_rank is not None and int(max_rank) != have:
        raise ValueError(
          f"load_lora: max_rank={max_rank}, but the slots hold rank {have} already (set at the first "
          "load; changing them would recompile): unload every LoRA and load again with a new pipeline"
        )
    if max_rank is not None:
      if isinstance(max_rank, bool) or not isinstance(max_rank, int) or max_rank < 1:
        raise ValueError(f"load_lora: max_rank must be a positive int, got {max_rank!r}")
      reg.max_rank = int(max_rank)
    if targets is not None:
      reg.targets = targets
  optional = _optional(pipe)
  adapters = {}
  for c in components:
    options = dict(read_options)
    if c in optional and options.get("prefix") is None:
      options["prefix"] = _prefix_of(keys, optional[c])  # e.g. "text_encoder_2." / "lora_te2_"
    adapters[c] = load_lora(file, pipe.lora_key_map(c), getattr(pipe, c), **options)
  entry = _Entry(adapters, scales)
  if fuse:
    _fuse(pipe, entry)
    reg.entries[name] = entry
    return name
  for c, adapter in adapters.items():
    _check_runtime(adapter, getattr(pipe, c))  # refused before the entry is added; computes nothing
    if _has_slots(pipe, c):
      _check_fits(pipe, c, adapter)
  reg.entries[name] = entry
  try:
    _rebuild(pipe)
  except ValueError:
    del reg.entries[name]
    _rebuild(pipe)
    raise
  return name


def _sources(entry: _Entry) -> str:
  return ", ".join(sorted({a.source for a in entry.adapters.values()}))


def _names(reg: _Registry, names: str | Sequence[str] | None, what: str) -> list[str]:
  if names is None:
    return list(reg.entries)
  names = [names] if isinstance(names, str) else list(names)
  for n in names:
    if n not in reg.entries:
      raise ValueError(f"{what}: no LoRA named {n!r}; loaded: {list(reg.entries)}")
  return names


def set_adapters(pipe: Any, adapters: Mapping[str, Any] | Sequence[str] | str) -> None:
  """`pipe.set_adapters`: see `md_lora.LoRAPipeline.set_adapters`."""
  reg = _registry(pipe)
  if isinstance(adapters, str):
    adapters = {adapters: 1.0}
  elif not isinstance(adapters, Mapping):
    adapters = dict.fromkeys(adapters, 1.0)
  _names(reg, list(adapters), "set_adapters")
  new = {}
  for n, value in adapters.items():
    entry = reg.entries[n]
    if entry.fused is not None:
      raise ValueError(f"set_adapters: {n!r} is fused into the weights; unfuse_lora() first")
    new[n] = _scales(value, list(entry.adapters), f"set_adapters({n!r})")
  old = {n: (e.active, e.scales) for n, e in reg.entries.items()}
  for n, entry in reg.entries.items():
    if entry.fused is None:
      entry.active = n in new
      entry.scales = new.get(n, entry.scales)
  try:
    _rebuild(pipe)
  except ValueError:
    for n, (active, scales) in old.items():
      reg.entries[n].active, reg.entries[n].scales = active, scales
    _rebuild(pipe)
    raise


def unload(pipe: Any, name: str | Sequence[str] | None = None) -> None:
  """`pipe.unload_lora`: see `md_lora.LoRAPipeline.unload_lora`."""
  reg = _registry(pipe)
  for n in _names(reg, name, "unload_lora"):
    entry = reg.entries[n]
    if entry.fused is not None:
      _unfuse(pipe, entry)
    del reg.entries[n]
  _rebuild(pipe)


def _merged(pipe: Any, entry: _Entry, scales: Mapping[str, float], fn) -> None:
  for c, adapter in entry.adapters.items():
    module, splits = pipe.splits_of(c)
    state = splits[0].state if splits else nnx.state(module)
    new = fn(c, state, adapter, scales[c])
    nnx.update(module, new)
    for split in splits:
      split.state = new


def _fuse(pipe: Any, entry: _Entry) -> None:
  def fuse_one(component, state, adapter, scale):
    new = merge(state, [(adapter, scale)])
    if adapter.dora:  # keep what the fuse added to each weight it touched, for the unfuse
      paths = {site.path for site in adapter.weights}
      before, after = dict(nnx.to_flat_state(state)), dict(nnx.to_flat_state(new))
      entry.added[component] = {
        p: _value(after[p]) - _value(before[p]) for p in before if tuple(p) in paths
      }
    return new

  _merged(pipe, entry, entry.scales, fuse_one)
  entry.fused = dict(entry.scales)


def _unfuse(pipe: Any, entry: _Entry) -> None:
  def unfuse_one(component, state, adapter, scale):
    added = entry.added.pop(component, None)
    if added is None:
      return unmerge(state, [(adapter, scale)])
    flat = [
      (p, v.replace(_value(v) - added[p]) if p in added else v) for p, v in nnx.to_flat_state(state)
    ]
    return nnx.from_flat_state(flat)

  _merged(pipe, entry, entry.fused, unfuse_one)
  entry.fused = None


def fuse(pipe: Any, names: str | Sequence[str] | None = None) -> None:
  """`pipe.fuse_lora`: see `md_lora.LoRAPipeline.fuse_lora`."""
  reg = _registry(pipe)
  for n in _names(reg, names, "fuse_lora"):
    entry = reg.entries[n]
    if entry.active and entry.fused is None:
      _fuse(pipe, entry)
  _rebuild(pipe)


def unfuse(pipe: Any, names: str | Sequence[str] | None = None) -> None:
  """`pipe.unfuse_lora`: see `md_lora.LoRAPipeline.unfuse_lora`."""
  reg = _registry(pipe)
  for n in reversed(_names(reg, names, "unfuse_lora")):
    entry = reg.entries[n]
    if entry.fused is not None:
      _unfuse(pipe, entry)
  _rebuild(pipe)


def status(pipe: Any) -> dict[str, dict[str, Any]]:
  """`pipe.loras`: `{name: {"source", "scales", "active", "fused"}}` in load order."""
  reg = _registry(pipe)
  return {
    n: {
      "source": _sources(e),
      "scales": dict(e.scales),
      "active": e.active,
      "fused": e.fused is not None,
    }
    for n, e in reg.entries.items()
  }
