"""LoRA fine-tuning: md_core's run-time LoRA slots as the only trainable state, the base frozen.

`add_lora` picks the layers (by the reference's module names, as peft's `target_modules` does, or by
md's layer paths), gives them `md_core.add_lora_slots` slots of the LoRA's rank and initialises them as
peft does (`lora_A` kaiming-uniform(a=√5) or gaussian, `lora_B` zero); `split_lora` splits the module
into its frozen part and the slots; `lora_loss` wraps a family loss so the slots' `b` carries the
`alpha / r` scale (the trainable `b` is peft's `lora_B`, so the gradients and the optimizer see the
same numbers as peft's); `save_lora` writes the adapter as a diffusers / PEFT safetensors file
(`pytorch_lora_weights.safetensors`, `unet.` / `transformer.` prefixes) that `Pipeline.load_lora` and
diffusers' `load_lora_weights` read.

    lora = mdt.add_lora(unet, mdt.LoRAConfig(rank=4), convert_key=md_sd.unet_key_map(unet.cfg),
                        reference_names=names, family="sd")
    frozen, params = mdt.split_lora(unet)
    loss_fn = mdt.lora_loss(mtf.sd_loss(frozen, alphas_cumprod=acp), lora)
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import md_core
from md_train._step import Frozen, LossFn, split_trainable

# The modules diffusers' LoRA scripts adapt by default (their `target_modules`).
DEFAULT_TARGETS = {
  # train_text_to_image_lora.py / train_dreambooth_lora.py
  "sd": ("to_k", "to_q", "to_v", "to_out.0"),
  # train_dreambooth_lora_flux.py
  "flux": (
    "attn.to_k", "attn.to_q", "attn.to_v", "attn.to_out.0", "attn.add_k_proj", "attn.add_q_proj",
    "attn.add_v_proj", "attn.to_add_out", "ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj",
    "ff_context.net.2",
  ),
  # the attention projections of self- and cross-attention (as for SD)
  "wan": ("to_k", "to_q", "to_v", "to_out.0"),
}  # fmt: skip
LORA_INITS = ("kaiming", "gaussian")  # peft's `init_lora_weights=True` and `"gaussian"`


@dataclasses.dataclass(frozen=True)
class LoRAConfig:
  """What to train: peft's `LoraConfig(r, lora_alpha, target_modules, init_lora_weights, use_rslora,
  use_dora)`.

  Attributes:
    rank: r.
    alpha: lora_alpha (None: `rank`, scale 1); the delta is `alpha / rank · B A`.
    rslora: rank-stabilised LoRA (peft's `use_rslora`): the delta is `alpha / sqrt(rank) · B A`.
    targets: module names matched as peft matches `target_modules` (a name equal to the module's or
      a `.`-separated suffix of it: `to_q`, `attn1.to_q`, `to_out.0`), reference (diffusers) names
      first, else md's layer paths (`blocks.attn1.to_q`); None: the family's `DEFAULT_TARGETS`.
    init: `kaiming` (peft's default: lora_A kaiming-uniform(a=√5), i.e. U(±1/√fan_in)) or `gaussian`
      (lora_A ~ N(0, 1/r)); lora_B starts at zero either way.
    seed: the initialisation's PRNG seed.
    dora: weight-decomposed LoRA (peft's `use_dora`): each adapted weight is rescaled per output to a
      trained magnitude `m`, `W' = m / ||W + s B A|| · (W + s B A)` (the norm over every axis but the
      output one, held constant in the gradient as peft does); `m` starts at `||W||`.
  """

  rank: int = 4
  alpha: float | None = None
  targets: tuple[str, ...] | None = None
  init: str = "kaiming"
  seed: int = 0
  rslora: bool = False
  dora: bool = False

  def __post_init__(self):
    if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 1:
      raise ValueError(f"lora.rank={self.rank!r} must be a positive int")
    if self.alpha is not None and (
      isinstance(self.alpha, bool) or not isinstance(self.alpha, (int, float)) or self.alpha <= 0
    ):
      raise ValueError(f"lora.alpha={self.alpha!r} must be a positive number (or None: the rank)")
    if self.init not in LORA_INITS:
      raise ValueError(f"lora.init={self.init!r}; expected one of {LORA_INITS}")
    if not isinstance(self.rslora, bool):
      raise ValueError(f"lora.rslora={self.rslora!r} must be True or False")
    if not isinstance(self.dora, bool):
      raise ValueError(f"lora.dora={self.dora!r} must be True or False")
    if isinstance(self.targets, str):
      object.__setattr__(self, "targets", _split_names(self.targets))
    elif self.targets is not None:
      object.__setattr__(self, "targets", tuple(str(t) for t in self.targets))
    if self.targets is not None and not self.targets:
      raise ValueError("lora.targets is empty; name modules (e.g. 'to_q,to_k') or pass None")

  @classmethod
  def from_options(cls, options: Mapping[str, Any]) -> LoRAConfig:
    """From a recipe's `lora` options (`rank`, `alpha`, `targets` as a list or a comma string,
    `init`, `seed`, `rslora`, `dora`); unknown keys are refused with the nearest known one."""
    known = [f.name for f in dataclasses.fields(cls)]
    for key in options:
      if key not in known:
        near = difflib.get_close_matches(key, known, n=1)
        hint = f"; did you mean {near[0]!r}?" if near else ""
        raise ValueError(f"lora option {key!r} is unknown (known: {known}){hint}")
    opts = dict(options)
    if "alpha" in opts and opts["alpha"] is not None:
      opts["alpha"] = float(opts["alpha"])
    return cls(**opts)


def _split_names(text: str) -> tuple[str, ...]:
  return tuple(t.strip() for t in text.split(",") if t.strip())


class LoRA(NamedTuple):
  """The LoRA `add_lora` added: rank, alpha, and the reference module each slot layer stands for.

  Attributes:
    rank, alpha: as trained; `scale = alpha / rank` (`alpha / sqrt(rank)` with `rslora`).
    modules: `{reference module name: (md layer path, layer index or None)}`, e.g.
      `"blocks.1.attn1.to_q": ("blocks.attn1.to_q", 1)` for a scanned stack.
    rslora: rank-stabilised scale.
    dora: DoRA: the slots' `lora_gain` holds each layer's trained magnitude (`lora_loss` turns it into
      the per-output factor the model reads).
  """

  rank: int
  alpha: float
  modules: dict[str, tuple[str, int | None]]
  rslora: bool = False
  dora: bool = False

  @property
  def scale(self) -> float:
    return self.alpha / (math.sqrt(self.rank) if self.rslora else self.rank)

  @property
  def paths(self) -> list[str]:
    """The md layer paths with slots."""
    return sorted({p for p, _ in self.modules.values()})


def _matches(name: str, target: str) -> bool:
  return name == target or name.endswith("." + target)


def _resolve(
  module: nnx.Module,
  targets: tuple[str, ...],
  convert_key: md_core.KeyMap,
  reference_names: Iterable[str],
) -> dict[str, tuple[str, int | None]]:
  """Reference module names → (md layer path, layer), for the modules `targets` select."""
  layers = md_core.lora_layers(module)
  modules = sorted({n[: -len(".weight")] for n in reference_names if n.endswith(".weight")})
  chosen: dict[str, tuple[str, int | None]] = {}
  for target in targets:
    hits = [m for m in modules if _matches(m, target)]
    if not hits:  # md's layer paths
      md_hits = [p for p in layers if _matches(p, target)]
      if not md_hits:
        sample = sorted({m.rsplit(".", 1)[-1] for m in modules})[:12]
        raise ValueError(
          f"lora target {target!r} matches no module of the model (neither a reference module name "
          f"nor an md layer path); module names end in e.g. {sample}"
        )
      names = {}
      for m in modules:
        t = convert_key(m + ".weight")
        if isinstance(t, md_core.Target) and ".".join(map(str, t.path[:-1])) in md_hits:
          names[m] = t
      hits = sorted(names)
    for m in hits:
      t = convert_key(m + ".weight")
      if not isinstance(t, md_core.Target):
        raise ValueError(
          f"lora target {target!r}: module {m!r} maps to {t!r}, not one md layer (a fused or "
          "unmapped weight has no LoRA slot of its own)"
        )
      path = ".".join(str(p) for p in t.path[:-1])
      if t.path[-1] != "kernel" or path not in layers or t.split is not None:
        raise ValueError(
          f"lora target {target!r}: module {m!r} is md parameter {md_core.path_str(t.path)} "
          f"(layout {t.layout}, split {t.split}), not the kernel of a Dense / Conv layer"
        )
      chosen[m] = (path, t.layer)
  # A scanned stack has one slot for all its layers: every layer of it must be chosen.
  by_path: dict[str, set] = {}
  for path, layer in chosen.values():
    by_path.setdefault(path, set()).add(layer)
  for path, got in by_path.items():
    kernel = layers[path].kernel.get_value()
    axes = md_core.logical_axes(layers[path].kernel) or ()
    if got != {None}:
      n = kernel.shape[0]
      if not (axes and axes[0] == "layers") or got != set(range(n)):
        raise ValueError(
          f"lora targets {targets!r} select layers {sorted(got)} of the scanned stack {path!r} "
          f"({n} layers); md trains a stack's LoRA on all of its layers: name the module without "
          "its layer index (e.g. 'attn1.to_q')"
        )
  return chosen


def _init_a(key: jax.Array, shape: tuple[int, ...], n_lead: int, rank: int, init: str) -> jax.Array:
  """lora_A in md's layout `[*lead, *k, in, r]`: peft's kaiming-uniform(a=√5) bound is 1/√fan_in
  (fan_in = in · prod(k), torch's for a `[r, in, *k]` weight); gaussian: N(0, 1/r)."""
  fan_in = int(np.prod(shape[n_lead:-1]))
  if init == "gaussian":
    return jax.random.normal(key, shape, jnp.float32) / rank
  bound = 1.0 / math.sqrt(fan_in)
  return jax.random.uniform(key, shape, jnp.float32, -bound, bound)


def add_lora(
  module: nnx.Module,
  config: LoRAConfig,
  *,
  convert_key: md_core.KeyMap,
  reference_names: Iterable[str],
  family: str | None = None,
  dtype: Any = jnp.float32,
) -> LoRA:
  """Adds trainable LoRA slots to `module` (in place) and initialises them as peft does.

  Args:
    module: an md denoiser (or any md module) without LoRA slots.
    config: rank, alpha, targets, init and seed.
    convert_key: the family's diffusers key map (`md_sd.unet_key_map(cfg)`, `md_wan.convert_key`,
      `md_flux.convert_key`): reference module names → md layers.
    reference_names: the tensor names of the reference checkpoint (its `.weight` keys name the
      modules), e.g. `md_core.open_checkpoint(folder)`.
    family: `sd`, `flux` or `wan`: the default targets when `config.targets` is None.
    dtype: the slots' dtype.

  Returns:
    The `LoRA` (rank, alpha, the reference module of every slot layer), for `lora_loss` / `save_lora`.

  Raises:
    ValueError: slots already present, no targets (and no family), a target that matches nothing
      (with some module names), one that is not a plain layer kernel (fused), or a subset of the
      layers of a scanned stack.
  """
  if md_core.lora_paths(module):
    raise ValueError(
      f"{type(module).__name__} has LoRA slots already ({md_core.lora_paths(module)[:3]}…); "
      "add_lora takes a module without them"
    )
  targets = config.targets
  if targets is None:
    if family not in DEFAULT_TARGETS:
      raise ValueError(
        f"lora.targets is None and family={family!r} has no default targets "
        f"(families: {sorted(DEFAULT_TARGETS)}); name the modules"
      )
    targets = DEFAULT_TARGETS[family]
  modules = _resolve(module, tuple(targets), convert_key, list(reference_names))
  paths = sorted({p for p, _ in modules.values()})
  md_core.add_lora_slots(
    module, config.rank, targets=lambda p: p in paths, dtype=dtype, gain=config.dora
  )
  layers = md_core.lora_layers(module)
  key = jax.random.key(config.seed)
  for i, path in enumerate(paths):
    layer = layers[path]
    a = layer.lora_a.get_value()
    n_lead = layer.lora_b.get_value().ndim - 2
    new = _init_a(jax.random.fold_in(key, i), a.shape, n_lead, config.rank, config.init)
    _set_like(layer.lora_a, new)
    if config.dora:  # peft's magnitude starts at the base weight's norms (lora_B is zero)
      _set_like(layer.lora_gain, _weight_norms(layer.kernel.get_value(), n_lead))
  alpha = float(config.rank if config.alpha is None else config.alpha)
  return LoRA(config.rank, alpha, modules, config.rslora, config.dora)


def _set_like(variable: nnx.Variable, value: jax.Array) -> None:
  """Sets a slot to `value` in the slot's dtype and placement."""
  old = variable.get_value()
  value = jnp.asarray(value).astype(old.dtype)
  sharding = getattr(old, "sharding", None)
  variable.set_value(jax.device_put(value, sharding) if sharding is not None else value)


def _weight_norms(w: jax.Array, n_lead: int) -> jax.Array:
  """The float32 L2 norms of a kernel `[*lead, *k, in, out]` per output (over every axis but the
  leading layer axes and the output one): `[*lead, out]`."""
  w = jnp.asarray(w).astype(jnp.float32)
  return jnp.sqrt(jnp.sum(w * w, axis=tuple(range(n_lead, w.ndim - 1))))


def split_lora(module: nnx.Module) -> tuple[Frozen, Any]:
  """(the frozen part: graph, parameters and the rest; the trainable LoRA slots) of a module with
  slots (`add_lora`)."""
  if not md_core.lora_paths(module):
    raise ValueError(f"{type(module).__name__} has no LoRA slots; call add_lora first")
  return split_trainable(module, md_core.LoRASlot)


def _scaled(params: Any, scale: float) -> Any:
  """The slots as the model reads them: `b` times the LoRA scale (the trainable `b` is peft's
  lora_B)."""

  def scale_b(path, x):
    # The state's last dict key names the variable (a Variable's own `.value` may follow it).
    keys = [k.key for k in path if isinstance(k, jax.tree_util.DictKey)]
    return x * jnp.asarray(scale, x.dtype) if keys and keys[-1] == "lora_b" else x

  return jax.tree_util.tree_map_with_path(scale_b, params)


def _dora_slots(params: Any, scale: float, kernels: Mapping[str, jax.Array]) -> Any:
  """DoRA's slots as the model reads them, from the trainable (a, b, magnitude m): with `V = W + s a b`
  and `n = ||V||` per output (held constant in the gradient, peft's `weight_norm.detach()`), the layer's
  base output is multiplied by `g = m / n` (`lora_gain`) and its LoRA branch reads `s b g`, so the
  layer computes `x (g V) + bias`, peft's DoRA forward."""
  leaves, treedef = jax.tree_util.tree_flatten_with_path(params)
  named = [tuple(k.key for k in path if isinstance(k, jax.tree_util.DictKey)) for path, _ in leaves]
  values = dict(zip(named, (x for _, x in leaves)))
  gains: dict[tuple, jax.Array] = {}

  def gain(layer: tuple) -> jax.Array:
    if layer not in gains:
      a, b, m = (values[layer + (n,)] for n in ("lora_a", "lora_b", "lora_gain"))
      w = kernels[".".join(str(p) for p in layer)].astype(jnp.float32)
      n_lead = b.ndim - 2
      # b over the kernel's window axes (a conv's `[*k, in, r]` lora_a against its `[r, out]` lora_b)
      b_full = b.reshape(b.shape[:n_lead] + (1,) * (a.ndim - b.ndim) + b.shape[n_lead:])
      delta = jnp.matmul(
        a.astype(jnp.float32), b_full.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST
      )
      norms = jax.lax.stop_gradient(_weight_norms(w + scale * delta, n_lead))
      gains[layer] = m.astype(jnp.float32) / norms
    return gains[layer]

  out = []
  for name, (_, x) in zip(named, leaves):
    kind, layer = name[-1], name[:-1]
    if kind == "lora_gain":
      x = gain(layer).astype(x.dtype)
    elif kind == "lora_b":
      x = (x * scale * gain(layer)[..., None, :]).astype(x.dtype)
    out.append(x)
  return jax.tree_util.tree_unflatten(treedef, out)


def _frozen_kernels(frozen: Frozen, paths: Iterable[str]) -> dict[str, jax.Array]:
  """The base kernels of the slot layers `paths`, from a `split_lora` frozen part."""
  flat = {}
  for state in frozen.rest:
    flat.update({tuple(p): v for p, v in nnx.to_flat_state(state)})
  out = {}
  for path in paths:
    key = tuple(_path_parts(path)) + ("kernel",)
    if key not in flat:
      raise ValueError(f"DoRA: the frozen part holds no kernel at {path!r}")
    v = flat[key]
    out[path] = v.get_value() if hasattr(v, "get_value") else v
  return out


def _slot_view(lora: LoRA, frozen: Frozen | None) -> Callable[[Any], Any]:
  """The map from the trainable slots to the slots as the model reads them (`b` at the LoRA scale;
  DoRA's gains from the frozen kernels)."""
  scale = lora.scale
  if not lora.dora:
    return lambda params: _scaled(params, scale)
  if frozen is None:
    raise ValueError("a DoRA LoRA needs the frozen part (its base kernels): frozen=")
  kernels = _frozen_kernels(frozen, lora.paths)
  return lambda params: _dora_slots(params, scale, kernels)


def lora_loss(loss_fn: LossFn, lora: LoRA, frozen: Frozen | None = None) -> LossFn:
  """`loss_fn` (a family loss over a `split_lora` frozen part) of the trainable slots: `b` enters the
  model as `alpha / r · b`, peft's `scaling`. A DoRA `lora` also needs `frozen` (its base kernels:
  the magnitudes rescale `W + s b a`, see `LoRAConfig.dora`)."""
  try:
    view = _slot_view(lora, frozen)
  except ValueError as e:
    raise ValueError(f"lora_loss: {e}") from None

  def wrapped(params, batch, key):
    return loss_fn(view(params), batch, key)

  return wrapped


def sd_prompt_embeds(models: Mapping[str, nnx.Module], batch: Mapping[str, Any]) -> dict[str, Any]:
  """SD 1.x / 2.x's prompt embeddings from the batch's `input_ids` (train_dreambooth_lora.py's
  `encode_prompt`: `text_encoder(input_ids)[0]`, the last hidden state)."""
  model = models["text_encoder"]
  return {
    "encoder_hidden_states": model(batch["input_ids"], output_hidden_states=False).last_hidden_state
  }


def sdxl_prompt_embeds(
  models: Mapping[str, nnx.Module], batch: Mapping[str, Any]
) -> dict[str, Any]:
  """SDXL's from `input_ids` and `input_ids_2` (train_dreambooth_lora_sdxl.py's `encode_prompt`): each
  encoder's `hidden_states[-2]` concatenated, and text_encoder_2's projected pooled output as
  `text_embeds`."""
  o1 = models["text_encoder"](batch["input_ids"], output_hidden_states=True)
  o2 = models["text_encoder_2"](batch["input_ids_2"], output_hidden_states=True)
  states = jnp.concatenate([o1.hidden_states[-2], o2.hidden_states[-2]], axis=-1)
  return {"encoder_hidden_states": states, "text_embeds": o2.text_embeds}


def flux_prompt_embeds(
  models: Mapping[str, nnx.Module], batch: Mapping[str, Any]
) -> dict[str, Any]:
  """Flux.1's pooled embedding from the batch's CLIP `input_ids` (train_dreambooth_lora_flux.py's
  `--train_text_encoder` trains CLIP only: the frozen T5's states stay the batch's
  `encoder_hidden_states`)."""
  model = models["text_encoder"]
  return {"pooled_projections": model(batch["input_ids"], output_hidden_states=False).pooler_output}


TOKEN_KEYS = ("input_ids", "input_ids_2")  # the batch's token ids, consumed by the text encoders


def text_encoders_lora_loss(
  loss_fn: LossFn,
  encoders: Mapping[str, tuple[LoRA, Frozen]],
  encode: Callable[[Mapping[str, nnx.Module], Mapping[str, Any]], Mapping[str, Any]],
) -> LossFn:
  """`loss_fn` (a denoiser's loss, e.g. `lora_loss(sd_loss(...), ...)`) with LoRAs on text encoders
  trained beside it (train_dreambooth_lora*.py's `--train_text_encoder`).

  The parameters are `{"denoiser": the denoiser's, <encoder name>: its slots, ...}`; each step runs the
  encoders (`encoders[name]`: its LoRA and `split_lora` frozen part, the slots as `lora_loss` gives
  them) through `encode(models, batch)` (`sd_prompt_embeds`, `sdxl_prompt_embeds`), whose entries
  replace the batch's token ids (`TOKEN_KEYS`) for `loss_fn`.
  """
  views = {name: (_slot_view(lora, frozen), frozen) for name, (lora, frozen) in encoders.items()}

  def wrapped(params, batch, key):
    if "input_ids" not in batch:
      raise ValueError(
        f"text_encoder_lora_loss: the batch has no input_ids (keys {sorted(batch)}); the text encoders "
        "train on token ids, not cached encoder_hidden_states"
      )
    models = {name: frozen.merge(view(params[name])) for name, (view, frozen) in views.items()}
    rest = {k: v for k, v in batch.items() if k not in TOKEN_KEYS}
    return loss_fn(params["denoiser"], {**rest, **encode(models, batch)}, key)

  return wrapped


def text_encoder_lora_loss(loss_fn: LossFn, lora: LoRA, frozen: Frozen) -> LossFn:
  """`text_encoders_lora_loss` for SD 1.x / 2.x's one text encoder: parameters `{"denoiser",
  "text_encoder"}`, the batch's `input_ids` encoded by `sd_prompt_embeds`."""
  return text_encoders_lora_loss(loss_fn, {"text_encoder": (lora, frozen)}, sd_prompt_embeds)


def _slot_values(params: Any) -> dict[str, tuple[np.ndarray, np.ndarray, np.ndarray | None]]:
  """`{layer path: (a, b, gain or None)}` of the slots, as float32 host arrays."""
  flat = {tuple(p): v for p, v in nnx.to_flat_state(params)}

  def value(x):
    return np.asarray(jax.device_get(x.get_value() if hasattr(x, "get_value") else x), np.float32)

  out = {}
  for p, v in flat.items():
    if p[-1] == "lora_a":
      gain = flat.get(p[:-1] + ("lora_gain",))
      out[".".join(str(x) for x in p[:-1])] = (
        value(v),
        value(flat[p[:-1] + ("lora_b",)]),
        None if gain is None else value(gain),
      )
  return out


def lora_adapter(lora: LoRA, params: Any, *, source: str = "md_train") -> Any:
  """The trained slots as an `md_lora.Adapter` (one site per reference module, scale alpha / r; a DoRA
  site's magnitude per output, peft's rule)."""
  import md_lora

  values = _slot_values(params)
  weights, names = {}, {}
  for module, (path, layer) in sorted(lora.modules.items()):
    if path not in values:
      raise ValueError(f"{module!r}: the parameters hold no LoRA slot at {path!r}")
    a, b, m = values[path]
    if layer is not None:
      a, b, m = a[layer], b[layer], None if m is None else m[layer]
    site = md_lora.Site(tuple(_path_parts(path)) + ("kernel",), layer)
    if lora.dora:
      if m is None:
        raise ValueError(
          f"{module!r}: a DoRA LoRA, but the parameters hold no magnitude at {path!r}"
        )
      # md_lora's magnitudes broadcast against the weight (md layout `[*k, in, out]`)
      weights[site] = md_lora.LoRAWeight(
        a, b, lora.scale, magnitude=m.reshape((1,) * (a.ndim - 1) + m.shape), dora_rule="peft"
      )
    else:
      weights[site] = md_lora.LoRAWeight(a, b, lora.scale)
    names[site] = module
  return md_lora.Adapter(weights, names, source, "peft")


def _path_parts(path: str) -> list[str | int]:
  return [int(p) if p.isdigit() else p for p in path.split(".")]


def load_lora_factors(lora: LoRA, params: Any, adapter: Any) -> Any:
  """`params` (the slots) holding an adapter's factors for every module of `lora` (e.g. a PEFT file
  read by `md_lora.load_lora`, to continue training it): `a = down`, `b = up · adapter scale / lora
  scale`, so the model's delta is the adapter's.

  A DoRA `lora` takes a peft-rule DoRA adapter (its magnitudes into the `lora_gain` slots), a plain one
  a plain adapter.

  Raises:
    ValueError: an adapter that misses a module of `lora`, adapts others, or has another rank; a DoRA
      adapter for a plain LoRA or the other way round.
  """
  if getattr(adapter, "dora", False) and not lora.dora:
    raise ValueError(
      f"{adapter.source}: a DoRA adapter; continue it with a DoRA LoRA (lora.dora=True), this one is "
      "plain (no magnitudes)"
    )
  if lora.dora and not getattr(adapter, "dora", False):
    raise ValueError(
      f"{adapter.source}: a plain LoRA adapter (no magnitudes); the LoRA being trained is DoRA"
    )
  if getattr(adapter, "oft", False):
    raise ValueError(
      f"{adapter.source}: an OFT adapter (rotations); training continues plain LoRA factors only"
    )
  if getattr(adapter, "glora", False) or getattr(adapter, "ia3", False):
    raise ValueError(
      f"{adapter.source}: a GLoRA / IA3 adapter (through the weight itself); training continues plain "
      "LoRA factors only"
    )
  by_site = {(tuple(s.path[:-1]), s.layer): w for s, w in adapter.weights.items()}
  want = {(tuple(_path_parts(p)), layer): m for m, (p, layer) in lora.modules.items()}
  missing = sorted(m for k, m in want.items() if k not in by_site)
  extra = sorted(str(s) for s in adapter.weights if (tuple(s.path[:-1]), s.layer) not in want)
  if missing or extra:
    raise ValueError(
      f"{adapter.source}: the adapter does not cover the trained modules: missing {missing[:5]}, "
      f"extra {extra[:5]}"
    )
  flat = {tuple(p): v for p, v in nnx.to_flat_state(params)}
  updates: dict[tuple, np.ndarray] = {}
  for (parts, layer), module in want.items():
    w = by_site[(parts, layer)]
    if w.rank != lora.rank:
      raise ValueError(f"{adapter.source}: {module!r} has rank {w.rank}, the LoRA {lora.rank}")
    values = [("lora_a", w.down), ("lora_b", np.asarray(w.up) * (w.scale / lora.scale))]
    if lora.dora:
      values.append(("lora_gain", _output_magnitude(adapter.source, module, w)))
    for name, value in values:
      key = parts + (name,)
      if key not in updates:
        updates[key] = np.array(jax.device_get(flat[key].get_value()), np.float32)
      if layer is None:
        updates[key][...] = value
      else:
        updates[key][layer] = value
  out = jax.tree.map(lambda x: x, params)
  flat_out = {tuple(p): v for p, v in nnx.to_flat_state(out)}
  for key, value in updates.items():
    old = flat_out[key].get_value()
    new = jnp.asarray(value, old.dtype)
    sharding = getattr(old, "sharding", None)
    flat_out[key].set_value(jax.device_put(new, sharding) if sharding is not None else new)
  return out


def _output_magnitude(source: str, module: str, w: Any) -> np.ndarray:
  """A DoRA site's magnitudes `[out]` (peft's rule, per output), or a ValueError naming the module."""
  if w.magnitude is None:
    raise ValueError(f"{source}: {module!r} has no DoRA magnitude; the LoRA being trained is DoRA")
  m = np.asarray(w.magnitude, np.float32)
  if w.dora_rule != "peft" or any(d != 1 for d in m.shape[:-1]):
    raise ValueError(
      f"{source}: {module!r} is a DoRA site with {w.dora_rule!r} norms of shape {m.shape}; training "
      "continues peft's per-output magnitudes only"
    )
  return m.reshape(-1)


def save_lora(
  lora: LoRA,
  params: Any,
  path: str | os.PathLike,
  *,
  convert_key: md_core.KeyMap,
  reference_names: Iterable[str],
  prefix: str,
  also: Sequence[tuple[LoRA, Any, md_core.KeyMap, Iterable[str], str]] = (),
) -> Any:
  """Writes the trained adapter as a diffusers / PEFT LoRA file (`md_lora.save_peft`):
  `<prefix>.<module>.lora_A.weight` / `.lora_B.weight` (the scale folded into lora_B, `lora_alpha = r`
  in the header's `lora_adapter_metadata`), which `Pipeline.load_lora` and diffusers'
  `load_lora_weights` read. `prefix`: `unet` (SD) or `transformer` (Flux, Wan). `also`: other components'
  LoRAs for the same file, each `(lora, params, convert_key, reference_names, prefix)`, e.g. the text
  encoder's under `text_encoder` (`text_encoder_lora_loss`)."""
  import md_lora

  more = [(lora_adapter(lo, pa), ck, list(rn), px) for lo, pa, ck, rn, px in also]
  md_lora.save_peft(
    lora_adapter(lora, params), path, convert_key, reference_names, prefix=prefix, also=more
  )
  return path


def lora_parameter_count(params: Any) -> int:
  """The number of trainable LoRA values."""
  return int(sum(np.prod(np.shape(x)) for x in jax.tree.leaves(params)))
