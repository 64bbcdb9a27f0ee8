"""Key maps: pure functions from a reference checkpoint's tensor names to md parameter paths and layouts."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Sequence

import numpy as np

Path = tuple[str | int, ...]

# How a reference tensor is laid out relative to md's parameter (torch → JAX conventions).
_PERMUTATIONS: dict[str, tuple[int, ...] | None] = {
  "identity": None,
  "linear": (1, 0),  # (out, in) → (in, out)
  "conv1d": (2, 1, 0),  # (O, I, W) → (W, I, O)
  "conv2d": (2, 3, 1, 0),  # (O, I, H, W) → (H, W, I, O)
  "conv3d": (2, 3, 4, 1, 0),  # (O, I, D, H, W) → (D, H, W, I, O)
}
LAYOUTS = tuple(_PERMUTATIONS)


@dataclasses.dataclass(frozen=True)
class Target:
  """Where one reference tensor (or a part of it) goes.

  Attributes:
    path: the parameter's path in md's module, e.g. `("blocks", 0, "attn", "to_q", "kernel")`.
    layout: one of `LAYOUTS`; how to permute the reference tensor's axes.
    split: `(index, parts, axis)`: take part `index` of `parts` equal parts along `axis` of the reference
      tensor (before the layout permutation), for fused tensors such as a qkv projection.
    layer: for a stacked (scanned) parameter, the position along its leading `layers` axis.
  """

  path: Path
  layout: str = "identity"
  split: tuple[int, int, int] | None = None
  layer: int | None = None

  def __post_init__(self):
    if self.layout not in _PERMUTATIONS:
      raise ValueError(f"unknown layout {self.layout!r}; expected one of {LAYOUTS}")


KeyMap = Callable[[str], "Target | Sequence[Target] | None"]


def _split_shape(shape: tuple[int, ...], split: tuple[int, int, int] | None) -> tuple[int, ...]:
  if split is None:
    return shape
  index, parts, axis = split
  if axis >= len(shape) or shape[axis] % parts or not 0 <= index < parts:
    raise ValueError(f"cannot take part {index} of {parts} along axis {axis} of shape {shape}")
  return shape[:axis] + (shape[axis] // parts,) + shape[axis + 1 :]


def target_shape(shape: tuple[int, ...], target: Target) -> tuple[int, ...]:
  """The shape a reference tensor of `shape` has once converted for `target` (without reading it)."""
  shape = _split_shape(tuple(shape), target.split)
  perm = _PERMUTATIONS[target.layout]
  if perm is None:
    return shape
  if len(shape) != len(perm):
    raise ValueError(f"layout {target.layout!r} takes a {len(perm)}-d tensor, got shape {shape}")
  return tuple(shape[p] for p in perm)


def convert(array: np.ndarray, target: Target) -> np.ndarray:
  """Applies `target`'s split and layout permutation to a reference tensor (numpy view where possible)."""
  if target.split is not None:
    index, parts, axis = target.split
    _split_shape(array.shape, target.split)
    size = array.shape[axis] // parts
    array = np.take(array, np.arange(index * size, (index + 1) * size), axis=axis)
  perm = _PERMUTATIONS[target.layout]
  if perm is not None:
    if array.ndim != len(perm):
      raise ValueError(
        f"layout {target.layout!r} takes a {len(perm)}-d tensor, got shape {array.shape}"
      )
    array = np.transpose(array, perm)
  return array


def path_str(path: Path) -> str:
  """`("blocks", 0, "kernel")` → `"blocks/0/kernel"`: the form allow-lists and dtype patterns match on."""
  return "/".join(str(p) for p in path)


def rule_keymap(rules: Sequence[tuple[str, str, str]]) -> KeyMap:
  """A key map from regex rules, tried in order; the first full match wins.

  Each rule is `(pattern, path_template, layout)`; the template is a '/'-separated path where `{1}`, `{2}` …
  stand for the pattern's groups, and purely numeric parts become list indices:

      rule_keymap([(r"blocks\\.(\\d+)\\.attn\\.to_q\\.weight", "blocks/{1}/attn/to_q/kernel", "linear")])

  A name no rule matches maps to None (unknown).
  """
  compiled = [(re.compile(p), t, layout) for p, t, layout in rules]

  def convert_key(name: str) -> Target | None:
    for pattern, template, layout in compiled:
      m = pattern.fullmatch(name)
      if m:
        text = template.format(None, *m.groups())
        return Target(tuple(int(p) if p.isdigit() else p for p in text.split("/")), layout)
    return None

  return convert_key


def torch_module_keymap(prefix_map: Sequence[tuple[str, str, str]]) -> KeyMap:
  """A key map for torch modules named by prefix: `(torch_prefix, md_path, kind)`.

  `kind` is "linear", "conv1d", "conv2d", "conv3d" (`.weight` → `kernel` with that layout, `.bias` → `bias`),
  "norm" (`.weight` → `scale`, `.bias` → `bias`) or "embedding" (`.weight` → `embedding`). Prefixes may be
  regexes with groups, referenced as `{1}`… in `md_path`.
  """
  rules = []
  for torch_prefix, md_path, kind in prefix_map:
    md_path = md_path.rstrip("/") + "/" if md_path else ""
    if kind in ("linear", "conv1d", "conv2d", "conv3d"):
      rules += [
        (rf"{torch_prefix}\.weight", f"{md_path}kernel", kind),
        (rf"{torch_prefix}\.bias", f"{md_path}bias", "identity"),
      ]
    elif kind == "norm":
      rules += [
        (rf"{torch_prefix}\.weight", f"{md_path}scale", "identity"),
        (rf"{torch_prefix}\.bias", f"{md_path}bias", "identity"),
      ]
    elif kind == "embedding":
      rules += [(rf"{torch_prefix}\.weight", f"{md_path}embedding", "identity")]
    else:
      raise ValueError(f"unknown module kind {kind!r} for {torch_prefix!r}")
  return rule_keymap(rules)
