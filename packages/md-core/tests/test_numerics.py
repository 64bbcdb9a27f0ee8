"""md_core.torch_linspace_f32: torch's float32 linspace rounding, and its one-point case."""

import numpy as np

import md_core


def test_one_point_is_start():
  # torch.linspace(start, end, steps=1) is [start].
  got = md_core.torch_linspace_f32(0.25, 1.0, 1)
  assert got.dtype == np.float32
  np.testing.assert_array_equal(got, np.array([0.25], np.float32))


def test_ends_are_exact_and_points_float32():
  got = md_core.torch_linspace_f32(0.0, 1.0, 7)
  assert got.dtype == np.float32 and got.shape == (7,)
  assert got[0] == 0.0 and got[-1] == 1.0
  assert np.all(np.diff(got) > 0)
