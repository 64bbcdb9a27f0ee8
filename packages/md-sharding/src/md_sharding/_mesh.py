"""Device meshes from `ici_*` / `dcn_*` parallelism settings.

A mesh has the four axes of `AXES`. Each axis size is the product of an ICI factor (devices inside
one slice, joined by the fast interconnect) and a DCN factor (slices, or processes, joined by the
data-centre network).
"""

from __future__ import annotations

import dataclasses
import difflib
import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np

try:
  from jax.experimental import mesh_utils
except ImportError:  # pragma: no cover -- jax has talked of retiring the experimental module.
  mesh_utils = None

AXES: tuple[str, ...] = ("data", "fsdp", "context", "tensor")

_ICI_FIELDS = tuple(f"ici_{axis}_parallelism" for axis in AXES)
_DCN_FIELDS = tuple(f"dcn_{axis}_parallelism" for axis in AXES)


@dataclasses.dataclass(frozen=True)
class MeshConfig:
  """Parallelism per mesh axis, inside a slice (`ici_*`) and across slices (`dcn_*`).

  One value per group may be -1: it is filled so that the group's product equals the number of
  devices per slice (ICI) or the number of slices (DCN). The default puts every device on `fsdp`.

  Attributes:
    ici_data_parallelism: replicas of the model inside a slice (pure data parallelism).
    ici_fsdp_parallelism: devices inside a slice that shard parameters and the batch (ZeRO-3 style).
    ici_context_parallelism: devices inside a slice that shard the sequence (context parallelism).
    ici_tensor_parallelism: devices inside a slice that shard heads and MLP features (tensor
      parallelism).
    dcn_data_parallelism: the same four factors across slices / processes.
    dcn_fsdp_parallelism: see `dcn_data_parallelism`.
    dcn_context_parallelism: see `dcn_data_parallelism`.
    dcn_tensor_parallelism: see `dcn_data_parallelism`.
    allow_split_physical_axes: let `jax.experimental.mesh_utils` split physical TPU axes when a
      requested shape does not map onto the torus otherwise.
  """

  ici_data_parallelism: int = 1
  ici_fsdp_parallelism: int = -1
  ici_context_parallelism: int = 1
  ici_tensor_parallelism: int = 1
  dcn_data_parallelism: int = 1
  dcn_fsdp_parallelism: int = 1
  dcn_context_parallelism: int = 1
  dcn_tensor_parallelism: int = 1
  allow_split_physical_axes: bool = False

  def __post_init__(self):
    for name in _ICI_FIELDS + _DCN_FIELDS:
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise TypeError(f"MeshConfig.{name} must be an int, got {value!r} ({type(value).__name__})")
      if value != -1 and value < 1:
        raise ValueError(
          f"MeshConfig.{name} must be a positive int or -1 (fill automatically), got {value}"
        )
      object.__setattr__(self, name, int(value))
    if not isinstance(self.allow_split_physical_axes, bool | np.bool_):
      raise TypeError(
        "MeshConfig.allow_split_physical_axes must be a bool, got "
        f"{self.allow_split_physical_axes!r} ({type(self.allow_split_physical_axes).__name__})"
      )

  @property
  def ici(self) -> tuple[int, ...]:
    """The `ici_*` values in `AXES` order."""
    return tuple(getattr(self, name) for name in _ICI_FIELDS)

  @property
  def dcn(self) -> tuple[int, ...]:
    """The `dcn_*` values in `AXES` order."""
    return tuple(getattr(self, name) for name in _DCN_FIELDS)

  @classmethod
  def from_dict(cls, mapping: Mapping[str, Any] | Any) -> MeshConfig:
    """Reads the mesh settings out of a larger config.

    Keys that are `MeshConfig` fields are taken; other keys are ignored (a whole app config may be
    passed), except keys that look like mesh settings (`ici_*` / `dcn_*`) but are not fields: those
    are typos and fail.

    Args:
      mapping: a dict, an `ml_collections.ConfigDict`, or anything with `keys()` and `__getitem__`.

    Returns:
      The `MeshConfig`.

    Raises:
      TypeError: `mapping` is not a mapping, or a value has the wrong type.
      ValueError: an unknown `ici_*` / `dcn_*` key, or a value out of range.
    """
    if not (hasattr(mapping, "keys") and hasattr(mapping, "__getitem__")):
      raise TypeError(
        "MeshConfig.from_dict expects a dict or ml_collections.ConfigDict, got "
        f"{type(mapping).__name__}"
      )
    fields = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key in mapping.keys():
      if key in fields:
        kwargs[key] = mapping[key]
      elif isinstance(key, str) and key.startswith(("ici_", "dcn_")):
        close = difflib.get_close_matches(key, fields, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ValueError(
          f"unknown mesh setting {key!r}{hint} (known mesh settings: {', '.join(fields)})"
        )
    return cls(**kwargs)


def fill_parallelism(
  values: Sequence[int], num_devices: int, *, group: str, names: Sequence[str] | None = None
) -> tuple[int, ...]:
  """Replaces the (at most one) -1 in `values` so that their product equals `num_devices`.

  Args:
    values: parallelism per axis; positive ints and at most one -1.
    num_devices: the product the filled values must have.
    group: what the values are, for error messages (e.g. "ici" or "dcn").
    names: optional names of the values (e.g. `ici_fsdp_parallelism`), for error messages.

  Returns:
    The values with the -1 filled in.

  Raises:
    ValueError: more than one -1, a value that is neither positive nor -1, or a product that cannot
      match.
  """
  values = tuple(int(v) for v in values)
  if names is not None and len(names) != len(values):
    raise ValueError(f"fill_parallelism: got {len(values)} values but {len(names)} names")
  if names is None:
    shown = str(values)
  else:
    shown = "(" + ", ".join(f"{n}={v}" for n, v in zip(names, values)) + ")"
  if num_devices < 1:
    raise ValueError(
      f"{group} parallelism {shown}: the device count must be positive, got {num_devices}"
    )
  bad = [v for v in values if v != -1 and v < 1]
  if bad:
    raise ValueError(
      f"{group} parallelism {shown}: each value must be a positive int or -1, got {bad}"
    )
  unknown = values.count(-1)
  if unknown > 1:
    raise ValueError(
      f"{group} parallelism {shown} has {unknown} values of -1; at most one can be filled "
      "automatically. "
      f"Set all but one of them to explicit sizes whose product divides {num_devices}."
    )
  known = math.prod(v for v in values if v != -1)
  if unknown == 1:
    if num_devices % known:
      raise ValueError(
        f"{group} parallelism {shown}: the product of the explicit values ({known}) does not "
        "divide the "
        f"{num_devices} devices, so -1 cannot be filled. Use explicit values whose product is one "
        "of "
        f"{_divisors(num_devices)}."
      )
    return tuple(num_devices // known if v == -1 else v for v in values)
  if known != num_devices:
    raise ValueError(
      f"{group} parallelism {shown} has product {known}, but there are {num_devices} devices. Make "
      "the "
      f"product {num_devices}, or set one value to -1 to fill it automatically."
    )
  return values


def _divisors(n: int) -> list[int]:
  return [d for d in range(1, n + 1) if n % d == 0]


def make_mesh(
  config: MeshConfig | Mapping[str, Any] | None = None,
  *,
  devices: Sequence[jax.Device] | None = None,
) -> jax.sharding.Mesh:
  """Builds the `(data, fsdp, context, tensor)` mesh.

  The DCN factors split the devices into granules: TPU slices (devices with `slice_index`), else
  processes, else (one process, devices without slices, e.g. virtual CPU devices) equal contiguous
  chunks of `devices`. When the DCN product is a multiple of the natural granule count, each natural
  granule is chunked further. Inside a granule the ICI factors lay devices out with
  `mesh_utils.create_device_mesh`.

  Args:
    config: a `MeshConfig`, a mapping for `MeshConfig.from_dict`, or None for all devices on `fsdp`.
    devices: the devices to use; all devices (`jax.devices()`) by default.

  Returns:
    A `jax.sharding.Mesh` with axis names `AXES`, every axis of type `AxisType.Auto`, and shape
    `dcn * ici` per axis.

  Raises:
    ValueError: the settings do not fit the devices (the message says which product is wrong).
  """
  if config is None:
    config = MeshConfig()
  elif not isinstance(config, MeshConfig):
    config = MeshConfig.from_dict(config)
  devices = list(jax.devices() if devices is None else np.asarray(devices, dtype=object).ravel())
  if not devices:
    raise ValueError("make_mesh: got an empty device list")

  granules, kind = _natural_granules(devices)
  if -1 in config.dcn:
    dcn = fill_parallelism(config.dcn, len(granules), group="dcn (slices)", names=_DCN_FIELDS)
  else:
    dcn = config.dcn
  num_slices = math.prod(dcn)

  if num_slices == 1:
    ici = fill_parallelism(config.ici, len(devices), group="ici", names=_ICI_FIELDS)
    array = _device_grid(ici, devices, config.allow_split_physical_axes)
    return _mesh(array)

  if num_slices % len(granules):
    raise ValueError(
      f"dcn parallelism ({_show(_DCN_FIELDS, dcn)}) asks for {num_slices} slices, but the "
      f"devices form {len(granules)} {'slices' if kind == 'slice' else 'processes'}; the dcn "
      f"product must be a multiple of {len(granules)}."
    )
  if len(devices) % num_slices:
    raise ValueError(
      f"dcn parallelism ({_show(_DCN_FIELDS, dcn)}) asks for {num_slices} slices, which does not "
      f"divide the {len(devices)} devices; use a dcn product among {_divisors(len(devices))}."
    )
  if len({len(g) for g in granules}) > 1:
    raise ValueError(
      f"make_mesh: the {'slices' if kind == 'slice' else 'processes'} hold different numbers of "
      f"devices ({sorted({len(g) for g in granules})}); a hybrid mesh needs equal ones"
    )
  per_slice = len(devices) // num_slices
  ici = fill_parallelism(
    config.ici, per_slice, group=f"ici (devices per slice, {num_slices} slices)", names=_ICI_FIELDS
  )
  split = num_slices // len(granules)
  if split == 1 and mesh_utils is not None:
    # The slices (or processes) are real: let jax order the devices inside each one.
    array = mesh_utils.create_hybrid_device_mesh(
      ici,
      dcn,
      devices,
      process_is_granule=kind == "process",
      allow_split_physical_axes=config.allow_split_physical_axes,
    )
    return _mesh(array)
  slices = [g[i * per_slice : (i + 1) * per_slice] for g in granules for i in range(split)]
  per_slice_arrays = [_device_grid(ici, s, config.allow_split_physical_axes) for s in slices]
  return _mesh(_assemble(per_slice_arrays, dcn, ici))


def _device_grid(
  shape: Sequence[int], devices: Sequence[jax.Device], allow_split: bool
) -> np.ndarray:
  """The devices of one slice laid out in `shape`, following the topology where jax knows it."""
  if mesh_utils is not None:
    return mesh_utils.create_device_mesh(shape, devices, allow_split_physical_axes=allow_split)
  return jax.make_mesh(shape, AXES, devices=devices, **_axis_types_kwargs(len(AXES))).devices


def _has_slices(devices: Sequence[jax.Device]) -> bool:
  return all(getattr(d, "slice_index", None) is not None for d in devices)


def _natural_granules(devices: Sequence[jax.Device]) -> tuple[list[list[jax.Device]], str]:
  """Devices grouped by TPU slice, else by process; each group keeps the order of `devices`.

  Returns:
    The groups, sorted by key, and what they are ("slice" or "process").
  """
  if _has_slices(devices) and len({d.slice_index for d in devices}) > 1:
    kind = "slice"
  else:
    kind = "process"
  attr = f"{kind}_index"
  groups: dict[int, list[jax.Device]] = {}
  for d in devices:
    groups.setdefault(getattr(d, attr), []).append(d)
  return [groups[k] for k in sorted(groups)], kind


def _assemble(
  per_slice: Sequence[np.ndarray], dcn: Sequence[int], ici: Sequence[int]
) -> np.ndarray:
  """Lays slice meshes out on the dcn grid: index = dcn index * ici size + ici index, per axis."""
  stacked = np.stack(per_slice).reshape(*dcn, *ici)  # [d0, d1, d2, d3, i0, i1, i2, i3]
  n = len(dcn)
  order = [k for axis in range(n) for k in (axis, n + axis)]  # [d0, i0, d1, i1, ...]
  return stacked.transpose(order).reshape([d * i for d, i in zip(dcn, ici)])


def _show(names: Sequence[str], values: Sequence[int]) -> str:
  return ", ".join(f"{n}={v}" for n, v in zip(names, values))


def _axis_types_kwargs(num_axes: int) -> dict[str, Any]:
  # jax changed the default axis type across releases, so the type is always passed explicitly. The
  # enum has been spelled `AxisType` (current) and `AxisTypes` (early 2025 releases).
  axis_type = getattr(jax.sharding, "AxisType", None) or getattr(jax.sharding, "AxisTypes", None)
  if axis_type is None:
    return {}
  return {"axis_types": (axis_type.Auto,) * num_axes}


def _mesh(array: np.ndarray) -> jax.sharding.Mesh:
  return jax.sharding.Mesh(array, AXES, **_axis_types_kwargs(len(AXES)))
