"""Meshes from ici/dcn settings on the 8 virtual CPU devices."""

import itertools

import jax
import ml_collections
import numpy as np
import pytest

import md_sharding as mds


def _ids(mesh: jax.sharding.Mesh) -> np.ndarray:
  return np.vectorize(lambda d: d.id)(mesh.devices)


def _check_axes(mesh: jax.sharding.Mesh) -> None:
  assert mesh.axis_names == ("data", "fsdp", "context", "tensor")
  assert mesh.axis_types == (jax.sharding.AxisType.Auto,) * 4
  assert sorted(_ids(mesh).reshape(-1).tolist()) == [d.id for d in jax.devices()]


def test_axes_constant():
  assert mds.AXES == ("data", "fsdp", "context", "tensor")


@pytest.mark.parametrize(
  "settings, shape",
  [
    (dict(ici_data_parallelism=8, ici_fsdp_parallelism=1), (8, 1, 1, 1)),
    (dict(ici_data_parallelism=2, ici_fsdp_parallelism=2, ici_context_parallelism=2), (2, 2, 2, 1)),
    (dict(ici_fsdp_parallelism=2, ici_context_parallelism=4), (1, 2, 4, 1)),
    (dict(ici_fsdp_parallelism=1, ici_context_parallelism=8), (1, 1, 8, 1)),
    (dict(ici_fsdp_parallelism=1, ici_tensor_parallelism=8), (1, 1, 1, 8)),
    # One -1 is filled from the device count, wherever it is.
    (dict(ici_data_parallelism=-1, ici_fsdp_parallelism=2, ici_tensor_parallelism=2), (2, 2, 1, 2)),
    (
      dict(ici_fsdp_parallelism=1, ici_context_parallelism=2, ici_tensor_parallelism=-1),
      (1, 1, 2, 4),
    ),
  ],
)
def test_ici_mesh_shapes(settings, shape):
  mesh = mds.make_mesh(mds.MeshConfig(**settings))
  assert mesh.devices.shape == shape
  assert dict(mesh.shape) == dict(zip(mds.AXES, shape))
  _check_axes(mesh)
  # On CPU the devices are laid out in id order (no torus to optimise for).
  np.testing.assert_array_equal(_ids(mesh), np.arange(8).reshape(shape))


def test_default_puts_every_device_on_fsdp():
  for config in (None, mds.MeshConfig(), {}):
    mesh = mds.make_mesh(config)
    assert mesh.devices.shape == (1, 8, 1, 1)
    _check_axes(mesh)


def test_mapping_and_config_dict():
  settings = {"ici_data_parallelism": 2, "ici_tensor_parallelism": 2, "learning_rate": 1e-4}
  assert mds.make_mesh(settings).devices.shape == (2, 2, 1, 2)
  config = ml_collections.ConfigDict(settings)
  assert mds.MeshConfig.from_dict(config) == mds.MeshConfig(
    ici_data_parallelism=2, ici_tensor_parallelism=2
  )
  assert mds.make_mesh(config).devices.shape == (2, 2, 1, 2)


def test_subset_of_devices():
  devices = jax.devices()[4:]
  mesh = mds.make_mesh({"ici_data_parallelism": 2}, devices=devices)
  assert mesh.devices.shape == (2, 2, 1, 1)
  np.testing.assert_array_equal(_ids(mesh), np.arange(4, 8).reshape(2, 2, 1, 1))


def test_hybrid_mesh_dcn_data_times_ici_fsdp():
  mesh = mds.make_mesh(dict(dcn_data_parallelism=2, ici_fsdp_parallelism=4))
  assert mesh.devices.shape == (2, 4, 1, 1)
  _check_axes(mesh)
  # Two virtual slices of four consecutive devices; data index = slice.
  np.testing.assert_array_equal(_ids(mesh), np.arange(8).reshape(2, 4, 1, 1))


def test_hybrid_mesh_interleaves_dcn_and_ici_on_one_axis():
  # fsdp = dcn 2 x ici 2 and data = ici 2: fsdp index = slice * 2 + ici fsdp index.
  mesh = mds.make_mesh(
    dict(dcn_fsdp_parallelism=2, ici_data_parallelism=2, ici_fsdp_parallelism=-1)
  )
  assert mesh.devices.shape == (2, 4, 1, 1)
  _check_axes(mesh)
  ids = _ids(mesh)
  for data, fsdp in itertools.product(range(2), range(4)):
    slice_index, ici_fsdp = divmod(fsdp, 2)
    # Slice s holds devices 4s..4s+3 laid out (ici data, ici fsdp) in id order.
    assert ids[data, fsdp, 0, 0] == 4 * slice_index + 2 * data + ici_fsdp


def test_hybrid_mesh_on_two_axes():
  mesh = mds.make_mesh(
    dict(
      dcn_data_parallelism=2,
      dcn_tensor_parallelism=2,
      ici_fsdp_parallelism=1,
      ici_context_parallelism=2,
    )
  )
  assert mesh.devices.shape == (2, 1, 2, 2)
  ids = _ids(mesh)
  for data, context, tensor in itertools.product(range(2), range(2), range(2)):
    # Slices are numbered row-major over the dcn grid (data, tensor); each holds 2 devices.
    slice_index = data * 2 + tensor
    assert ids[data, 0, context, tensor] == 2 * slice_index + context


def test_dcn_fill_uses_the_slice_count():
  # One process and no TPU slices: -1 on a dcn axis fills to 1 (one slice).
  mesh = mds.make_mesh(dict(dcn_data_parallelism=-1, ici_data_parallelism=2))
  assert mesh.devices.shape == (2, 4, 1, 1)


def test_fill_parallelism():
  assert mds.fill_parallelism([1, -1, 1, 1], 8, group="ici") == (1, 8, 1, 1)
  assert mds.fill_parallelism([2, -1, 2, 1], 8, group="ici") == (2, 2, 2, 1)
  assert mds.fill_parallelism([-1, 1], 6, group="dcn") == (6, 1)
  assert mds.fill_parallelism([2, 4], 8, group="ici") == (2, 4)


def test_fill_parallelism_two_unknowns():
  with pytest.raises(ValueError, match=r"ici parallelism \(-1, -1, 1, 1\) has 2 values of -1"):
    mds.fill_parallelism([-1, -1, 1, 1], 8, group="ici")


def test_fill_parallelism_product_mismatch():
  with pytest.raises(
    ValueError, match=r"has product 4, but there are 8 devices.*set one value to -1"
  ):
    mds.fill_parallelism([2, 2, 1, 1], 8, group="ici")
  with pytest.raises(
    ValueError, match=r"\(3\) does not divide the 8 devices.*one of \[1, 2, 4, 8\]"
  ):
    mds.fill_parallelism([3, -1], 8, group="ici")
  with pytest.raises(ValueError, match=r"positive int or -1, got \[0\]"):
    mds.fill_parallelism([0, -1], 8, group="ici")


def test_make_mesh_errors_name_the_settings():
  with pytest.raises(ValueError, match=r"ici_data_parallelism=-1, ici_fsdp_parallelism=-1"):
    mds.make_mesh(dict(ici_data_parallelism=-1))
  with pytest.raises(ValueError, match=r"ici_tensor_parallelism=4\) has product 8.*are 4 devices"):
    mds.make_mesh(dict(ici_fsdp_parallelism=2, ici_tensor_parallelism=4), devices=jax.devices()[:4])
  with pytest.raises(ValueError, match=r"has product 16, but there are 8 devices"):
    mds.make_mesh(dict(ici_fsdp_parallelism=16))
  # Per slice there are 4 devices, not 8.
  with pytest.raises(ValueError, match=r"devices per slice, 2 slices.*product 8, but there are 4"):
    mds.make_mesh(dict(dcn_data_parallelism=2, ici_fsdp_parallelism=8))
  with pytest.raises(ValueError, match=r"asks for 3 slices, which does not divide the 8 devices"):
    mds.make_mesh(dict(dcn_data_parallelism=3))
  with pytest.raises(ValueError, match=r"empty device list"):
    mds.make_mesh(devices=[])


def test_config_validation():
  with pytest.raises(ValueError, match=r"did you mean 'ici_fsdp_parallelism'"):
    mds.MeshConfig.from_dict({"ici_fsdp_paralelism": 2})
  with pytest.raises(ValueError, match=r"unknown mesh setting 'dcn_pipeline_parallelism'"):
    mds.make_mesh({"dcn_pipeline_parallelism": 2})
  with pytest.raises(
    ValueError,
    match=r"ici_data_parallelism must be a positive int or -1 \(fill automatically\), got 0",
  ):
    mds.MeshConfig(ici_data_parallelism=0)
  with pytest.raises(ValueError, match=r"got -2"):
    mds.MeshConfig(dcn_fsdp_parallelism=-2)
  with pytest.raises(TypeError, match=r"ici_tensor_parallelism must be an int, got 2.0"):
    mds.MeshConfig(ici_tensor_parallelism=2.0)
  with pytest.raises(TypeError, match=r"must be an int, got True"):
    mds.MeshConfig(ici_tensor_parallelism=True)
  with pytest.raises(TypeError, match=r"expects a dict or ml_collections.ConfigDict, got list"):
    mds.MeshConfig.from_dict([("ici_data_parallelism", 2)])


def test_config_is_frozen_and_exposes_groups():
  config = mds.MeshConfig(ici_data_parallelism=2, dcn_fsdp_parallelism=2)
  assert config.ici == (2, -1, 1, 1)
  assert config.dcn == (1, 2, 1, 1)
  with pytest.raises(AttributeError):
    config.ici_data_parallelism = 4
