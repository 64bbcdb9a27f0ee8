"""Logical axis names → mesh axes.

Layers name the dimensions of their parameters and activations logically (`embed`, `heads`, `mlp`,
...); a rule set maps those names to mesh axes, so the same model runs on any mesh by changing the
rules, never the layers.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

MeshAxes = str | tuple[str, ...] | None
Rules = tuple[tuple[str, MeshAxes], ...]

DEFAULT_RULES: Rules = (
  # Batches: split over every replica (data) and every parameter shard (fsdp).
  ("batch", ("data", "fsdp")),
  ("activation_batch", ("data", "fsdp")),
  # Sequences (tokens, latent patches, frames) over the context axis.
  ("activation_length", "context"),
  ("length", "context"),
  # Attention heads and MLP features over the tensor axis (Megatron-style).
  ("activation_heads", "tensor"),
  ("heads", "tensor"),
  ("activation_kv", None),
  ("kv", None),
  ("activation_embed", None),
  ("activation_mlp", "tensor"),
  ("activation_vocab", "tensor"),
  # Parameters: the model dimension is split by fsdp, features by tensor.
  ("embed", "fsdp"),
  ("mlp", "tensor"),
  ("vocab", "tensor"),
  # Scanned layer stacks keep their layer axis whole: each step of the scan reads one slice.
  ("layers", None),
  ("conv_in", None),
  ("conv_out", "tensor"),
  ("norm", None),
)


def replace_rules(
  overrides: Rules | Sequence[tuple[str, MeshAxes]], base: Rules = DEFAULT_RULES
) -> Rules:
  """A rule set where `overrides` replace every rule of `base` for the logical names they mention.

  Args:
    overrides: rules to use instead; their order is kept and they come first.
    base: the rules to start from.

  Returns:
    The overrides followed by the rules of `base` for logical names not in `overrides`.
  """
  overrides = _check_rules(overrides)
  replaced = {name for name, _ in overrides}
  return overrides + tuple(rule for rule in _check_rules(base) if rule[0] not in replaced)


def _check_rules(rules) -> Rules:
  checked = []
  for rule in rules:
    if not (isinstance(rule, tuple | list) and len(rule) == 2 and isinstance(rule[0], str)):
      raise TypeError(f"a logical axis rule must be a (logical_name, mesh_axes) pair, got {rule!r}")
    name, axes = rule
    if isinstance(axes, list):
      axes = tuple(axes)
    if not (axes is None or isinstance(axes, str) or all(isinstance(a, str) for a in axes)):
      raise TypeError(
        f"rule for {name!r}: mesh axes must be None, a mesh axis name or a tuple of them, got "
        f"{axes!r}"
      )
    checked.append((name, axes))
  return tuple(checked)


def _as_tuple(axes: MeshAxes) -> tuple[str, ...]:
  if axes is None:
    return ()
  if isinstance(axes, str):
    return (axes,)
  return tuple(axes)


def _mesh_shape(mesh) -> Mapping[str, int] | None:
  if mesh is None:
    return None
  shape = getattr(mesh, "shape", None)
  if not isinstance(shape, Mapping):
    raise TypeError(f"mesh must be a jax.sharding.Mesh or AbstractMesh, got {type(mesh).__name__}")
  return shape


def logical_to_spec(
  names: Sequence[str | None],
  *,
  rules: Rules | None = None,
  mesh: Mesh | jax.sharding.AbstractMesh | None = None,
  shape: Sequence[int] | None = None,
) -> PartitionSpec:
  """Maps logical dimension names to a `PartitionSpec`.

  For each dimension, in order, the rules for its logical name are tried in rule order, and the
  first one whose mesh axes are not already taken by an earlier dimension is used. A logical name of
  None is replicated.

  With a `mesh`, mesh axes of size 1 are dropped (they shard nothing). With a `mesh` and a `shape`,
  a mesh axis is also dropped when its size does not divide the dimension (after the axes kept
  before it), so tiny test models replicate instead of failing; when a rule keeps no axis at all the
  next rule for the name is tried.

  Args:
    names: one logical name (or None) per dimension.
    rules: the rule set; `DEFAULT_RULES` by default.
    mesh: optional mesh (concrete or abstract) whose axis sizes decide what is dropped.
    shape: optional array shape, one entry per name; ignored without `mesh`.

  Returns:
    A `PartitionSpec` with one entry per dimension.

  Raises:
    ValueError: an unknown logical name, a rule naming an axis the mesh lacks, or `shape` of another
      rank.
    TypeError: `names` is a string or holds something other than strings and None.
  """
  rules = DEFAULT_RULES if rules is None else _check_rules(rules)
  if isinstance(names, str):
    raise TypeError(
      f"names must be a sequence of logical names, one per dimension, got the string {names!r}"
    )
  names = tuple(names)
  for name in names:
    if name is not None and not isinstance(name, str):
      raise TypeError(f"logical names must be strings or None, got {name!r} in {names}")
  sizes = _mesh_shape(mesh)
  if shape is not None:
    shape = tuple(int(d) for d in shape)
    if len(shape) != len(names):
      raise ValueError(
        f"got {len(names)} logical names {names} for an array of rank {len(shape)} {shape}"
      )

  by_name: dict[str, list[tuple[str, ...] | None]] = {}
  for name, axes in rules:
    by_name.setdefault(name, []).append(None if axes is None else _as_tuple(axes))

  used: set[str] = set()
  spec: list[MeshAxes] = []
  for dim, name in enumerate(names):
    if name is None:
      spec.append(None)
      continue
    if name not in by_name:
      raise ValueError(
        f"unknown logical axis name {name!r} in {names}; the rules know: "
        f"{', '.join(sorted(by_name))}"
      )
    chosen: tuple[str, ...] = ()
    for axes in by_name[name]:
      if axes is None or not axes:
        break  # An explicit "replicate" rule ends the search.
      if used.intersection(axes):
        continue
      missing = [axis for axis in axes if sizes is not None and axis not in sizes]
      if missing:
        raise ValueError(
          f"rule {name!r} -> {axes} names mesh axes {missing} that the mesh lacks (it has "
          f"{tuple(sizes)})"
        )
      kept = _fit(axes, sizes, None if shape is None else shape[dim])
      if kept:
        chosen = kept
        break
    used.update(chosen)
    spec.append(None if not chosen else chosen[0] if len(chosen) == 1 else chosen)
  return PartitionSpec(*spec)


def _fit(
  axes: tuple[str, ...], sizes: Mapping[str, int] | None, dim: int | None
) -> tuple[str, ...]:
  """The axes of `axes` that shard a dimension of size `dim`, greedily in order."""
  if sizes is None:
    return axes
  kept = []
  product = 1
  for axis in axes:
    size = sizes[axis]
    if size == 1:
      continue
    if dim is not None and dim % (product * size):
      continue
    kept.append(axis)
    product *= size
  return tuple(kept)


def logical_to_sharding(
  names: Sequence[str | None],
  mesh: Mesh,
  *,
  rules: Rules | None = None,
  shape: Sequence[int] | None = None,
) -> NamedSharding:
  """`NamedSharding` on `mesh` for logical dimension names; see `logical_to_spec`.

  Args:
    names: one logical name (or None) per dimension.
    mesh: the device mesh.
    rules: the rule set; `DEFAULT_RULES` by default.
    shape: optional array shape for the divisibility fallback.

  Returns:
    The `NamedSharding`.
  """
  if not isinstance(mesh, Mesh):
    raise TypeError(f"logical_to_sharding needs a jax.sharding.Mesh, got {type(mesh).__name__}")
  return NamedSharding(mesh, logical_to_spec(names, rules=rules, mesh=mesh, shape=shape))


def _is_names_leaf(x) -> bool:
  return (
    x is None
    or isinstance(x, PartitionSpec)
    or (isinstance(x, tuple) and all(n is None or isinstance(n, str) for n in x))
  )


def logical_tree_to_sharding(
  names_tree: Any,
  mesh: Mesh,
  *,
  rules: Rules | None = None,
  shapes: Any = None,
) -> Any:
  """`logical_to_sharding` over a pytree, e.g. the logical specs of a model's parameters.

  Leaves of `names_tree` are tuples of logical names, `PartitionSpec`s holding logical names (what
  `flax.nnx.get_partition_spec` returns for parameters annotated with `sharding_names`), or None
  (replicated). A `PartitionSpec` shorter than its array leaves the remaining dimensions whole, as in
  jax; a tuple must name every dimension.

  Args:
    names_tree: the pytree of logical names.
    mesh: the device mesh.
    rules: the rule set; `DEFAULT_RULES` by default.
    shapes: optional pytree with the same structure (down to the leaves of `names_tree`) whose
      leaves have a `.shape` (arrays, `jax.ShapeDtypeStruct`s) or are shape tuples; enables the
      divisibility fallback.

  Returns:
    A pytree of `NamedSharding`s with the structure of `names_tree`.
  """

  def one(names, shape=None):
    if shape is not None and hasattr(shape, "shape"):
      shape = shape.shape
    if names is None:
      names = ()
      if shape is not None:
        names = (None,) * len(shape)
    elif isinstance(names, PartitionSpec):
      entries = tuple(names)
      for entry in entries:
        if entry is not None and not isinstance(entry, str):
          raise TypeError(
            f"a PartitionSpec of logical names holds one name or None per dimension, got {names}"
          )
      if shape is not None and len(entries) < len(shape):
        entries += (None,) * (len(shape) - len(entries))
      names = entries
    return logical_to_sharding(names, mesh, rules=rules, shape=shape)

  if shapes is None:
    return jax.tree.map(one, names_tree, is_leaf=_is_names_leaf)
  return jax.tree.map(one, names_tree, shapes, is_leaf=_is_names_leaf)


def _context_mesh():
  get = getattr(jax.sharding, "get_abstract_mesh", None)
  if get is None:
    return None
  mesh = get()
  if mesh is None or getattr(mesh, "empty", True):
    return None
  return mesh


def with_logical_constraint(
  x: jax.Array,
  names: Sequence[str | None],
  *,
  mesh: Mesh | None = None,
  rules: Rules | None = None,
) -> jax.Array:
  """`jax.lax.with_sharding_constraint` from logical names.

  Uses `mesh`, else the mesh set with `jax.sharding.set_mesh`; without either it returns `x`
  unchanged, so layers can call it unconditionally. The shape of `x` decides which mesh axes divide
  its dimensions.

  Args:
    x: the array (inside or outside jit).
    names: one logical name (or None) per dimension of `x`.
    mesh: optional mesh; the context mesh by default.
    rules: the rule set; `DEFAULT_RULES` by default.

  Returns:
    `x` constrained to the sharding the rules ask for.
  """
  if mesh is None:
    context = _context_mesh()
    if context is None:
      # Still check the names so that a typo fails on one device too.
      logical_to_spec(names, rules=rules, shape=x.shape)
      return x
    spec = logical_to_spec(names, rules=rules, mesh=context, shape=x.shape)
    return jax.lax.with_sharding_constraint(x, spec)
  spec = logical_to_spec(names, rules=rules, mesh=mesh, shape=x.shape)
  return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))
