"""Small host-side numerics that reproduce the reference's rounding (constants of shapes, NumPy)."""

import numpy as np


def torch_linspace_f32(start: float, end: float, n: int) -> np.ndarray:
  """`torch.linspace(start, end, n, dtype=torch.float32)` bit for bit.

  A float32 step; each point `start + i * step` (or `end - (n - 1 - i) * step` in the second half) rounded
  once, as torch's fused multiply-add gives. NumPy's float32 `linspace` rounds differently (1 ulp off on
  some points). One point is `[start]`, as torch gives.
  """
  if n == 1:
    return np.array([start], np.float32)
  s, e = np.float32(start), np.float32(end)
  step = (e - s) / np.float32(max(n - 1, 1))
  i = np.arange(n, dtype=np.float64)
  out = np.where(i < n // 2, float(s) + float(step) * i, float(e) - float(step) * (n - 1 - i))
  return out.astype(np.float32)
