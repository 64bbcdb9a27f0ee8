"""md-cache: step and block caches for md's sampling loop, optax style.

Each policy factory returns an `md_schedulers.StepCache` for a pipeline's `cache=`; its thresholds are
traced values in the loop state, so changing them never recompiles. App / server settings (the option
table, `make_cache`, the report) are `md_cache.settings`.
"""

from md_cache._common import prepare
from md_cache._deepcache import DeepCacheState, deepcache
from md_cache._faster_cache import FasterCacheState, faster_cache
from md_cache._first_block import FirstBlockCacheState, first_block_cache
from md_cache._magcache import (
  MagCacheState,
  calibrated_branches,
  calibrated_ratios,
  load_mag_ratios,
  magcache,
  resample_ratios,
  save_mag_ratios,
)
from md_cache._published import PUBLISHED_MAG_RATIOS, published_mag_ratios
from md_cache._report import computed_steps
from md_cache._sencache import SenCacheState, sencache
from md_cache._taylorseer import TaylorSeerState, taylorseer
from md_cache._teacache import TEACACHE_COEFFICIENTS, TeaCacheState, teacache

__all__ = [
  "DeepCacheState",
  "FasterCacheState",
  "FirstBlockCacheState",
  "MagCacheState",
  "PUBLISHED_MAG_RATIOS",
  "TEACACHE_COEFFICIENTS",
  "SenCacheState",
  "TaylorSeerState",
  "TeaCacheState",
  "calibrated_branches",
  "calibrated_ratios",
  "computed_steps",
  "deepcache",
  "faster_cache",
  "first_block_cache",
  "load_mag_ratios",
  "magcache",
  "prepare",
  "published_mag_ratios",
  "resample_ratios",
  "save_mag_ratios",
  "sencache",
  "taylorseer",
  "teacache",
]
