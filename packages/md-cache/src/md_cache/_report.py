"""What a cached run did."""

from __future__ import annotations

from typing import Any

import numpy as np


def computed_steps(state: Any) -> np.ndarray:
  """Per step, whether the policy computed it (`[num_steps]` bool), from a final cache state."""
  if not hasattr(state, "computed"):
    raise TypeError(f"{type(state).__name__} is not an md-cache state")
  return np.asarray(state.computed, bool)
