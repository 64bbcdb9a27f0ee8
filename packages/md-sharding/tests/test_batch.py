"""Global and per-process batch sizes, fractional per-device batch sizes included."""

import pytest

import md_sharding as mds


@pytest.mark.parametrize(
  "per_device, devices, expected",
  [
    (1, 8, 8),
    (3, 8, 24),
    (0.5, 8, 4),
    (0.25, 8, 2),
    (0.125, 8, 1),
    (0.1, 10, 1),  # 0.1 is not exact in binary; the product still counts as 1
    (0.3, 10, 3),
    (2.0, 4, 8),
  ],
)
def test_global_batch_size(per_device, devices, expected):
  got = mds.global_batch_size(per_device, devices)
  assert got == expected and isinstance(got, int)


def test_global_batch_size_defaults_to_all_devices():
  assert mds.global_batch_size(0.25) == 2  # the test session has 8 devices
  assert mds.global_batch_size(2) == 16


@pytest.mark.parametrize(
  "per_device, devices, message",
  [
    (0.3, 8, r"per_device_batch_size=0.3 times num_devices=8 is 2.4, not a whole.*1/8 = 0.125"),
    (0.0625, 8, r"is 0.5, not a whole positive number"),
    (0, 8, r"per_device_batch_size must be positive, got 0"),
    (-1, 8, r"must be positive, got -1"),
    (1, 0, r"num_devices must be a positive int, got 0"),
    (1, 2.0, r"num_devices must be a positive int, got 2.0"),
    ("1", 8, r"per_device_batch_size must be a number, got '1'"),
  ],
)
def test_global_batch_size_errors(per_device, devices, message):
  with pytest.raises(ValueError, match=message):
    mds.global_batch_size(per_device, devices)


def test_per_process_batch_size():
  assert mds.per_process_batch_size(1, 8, 2) == 4
  assert mds.per_process_batch_size(0.5, 8, 2) == 2
  assert mds.per_process_batch_size(0.25, 8, 2) == 1
  assert mds.per_process_batch_size(3, 16, 4) == 12
  assert mds.per_process_batch_size(0.25) == 2  # one process, 8 devices


def test_per_process_batch_size_errors():
  with pytest.raises(
    ValueError, match=r"global batch of 1 examples .* not split evenly over 2 processes"
  ):
    mds.per_process_batch_size(0.125, 8, 2)
  with pytest.raises(ValueError, match=r"global batch of 6 examples .* multiple of 4"):
    mds.per_process_batch_size(0.75, 8, 4)
  with pytest.raises(ValueError, match=r"num_processes must be a positive int, got 0"):
    mds.per_process_batch_size(1, 8, 0)
  with pytest.raises(ValueError, match=r"not a whole positive number"):
    mds.per_process_batch_size(0.3, 8, 2)
