"""Cache settings for apps and servers: `--config.cache=<policy>` with the policy's keyword arguments under
`--config.cache_options.*`, the cache a pipeline gets from them, and what the cached run did.

Each policy's options are read from its factory's signature (its keyword arguments whose annotation starts
with a scalar type), so a new policy is one entry in `POLICIES`. What a pipeline contributes comes from
the family contract (`md_core.pipeline.Pipeline`): `block_stacks` (whether its denoiser runs transformer
blocks through `md_core.scan_layers`), `cache_defaults` (e.g. its TeaCache polynomial) and `family`.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import ml_collections
import numpy as np
from ml_collections import config_dict

from md_cache._deepcache import deepcache
from md_cache._faster_cache import FasterCacheState, faster_cache
from md_cache._first_block import first_block_cache
from md_cache._magcache import calibrated_branches, calibrated_ratios, magcache
from md_cache._published import PUBLISHED_MAG_RATIOS
from md_cache._sencache import sencache
from md_cache._taylorseer import taylorseer
from md_cache._teacache import teacache
from md_core import apps


class Policy(NamedTuple):
  """One md-cache policy as a setting: its factory and the denoisers it applies to."""

  factory: Callable[..., Any]
  # "any" denoiser; "blocks": one whose transformer blocks run through md_core.scan_layers;
  # "unet": a UNet's deep branch (md-sd).
  needs: str = "any"


POLICIES: dict[str, Policy] = {
  "first_block_cache": Policy(first_block_cache, "blocks"),
  "magcache": Policy(magcache, "blocks"),
  "teacache": Policy(teacache, "blocks"),
  "taylorseer": Policy(taylorseer),
  "faster_cache": Policy(faster_cache),
  "sencache": Policy(sencache),
  "deepcache": Policy(deepcache, "unet"),
}

_SCALARS = {"bool": bool, "int": int, "float": float, "str": str}


def options_of(factory: Callable[..., Any]) -> dict[str, type]:
  """`{keyword: type}` of the settable arguments of a policy factory: those whose annotation's first
  union member is `bool`, `int`, `float` or `str` (a sequence-only argument is left to code)."""
  out = {}
  for name, param in inspect.signature(factory).parameters.items():
    annotation = param.annotation
    text = annotation if isinstance(annotation, str) else getattr(annotation, "__name__", "")
    for part in str(text).split("|"):
      if part.strip() in _SCALARS:
        out[name] = _SCALARS[part.strip()]
        break
  return out


def _all_options() -> dict[str, type]:
  out: dict[str, type] = {}
  for name, policy in POLICIES.items():
    for key, kind in options_of(policy.factory).items():
      if out.setdefault(key, kind) is not kind:
        raise TypeError(
          f"md-cache option {key!r} is {out[key].__name__} and {kind.__name__} ({name})"
        )
  return out


#: Every policy option an app config offers, with its type.
OPTIONS: dict[str, type] = _all_options()


def add_cache_config(config: Any) -> Any:
  """Adds `config.cache` (None or an md-cache policy name) and `config.cache_options` (the policies'
  keyword arguments, each None until set) to an app config and returns it."""
  config.cache = config_dict.placeholder(str)
  config.cache_options = ml_collections.ConfigDict(
    {k: config_dict.placeholder(t) for k, t in OPTIONS.items()}
  )
  return config


def _applies(policy: Policy, block_stacks: bool) -> bool:
  return policy.needs == "any" or (policy.needs == "blocks") == bool(block_stacks)


def make_cache(config: Any, pipeline: Any) -> Any:
  """The md-cache policy `config.cache` names with the set `config.cache_options`, for a pipeline's
  `cache=` (None when `config.cache` is unset).

  Args:
    config: an app / request config with `cache` and `cache_options` (`add_cache_config`).
    pipeline: the family's pipeline class (or one instance): its `family`, `block_stacks` and
      `cache_defaults` (options used where the config sets none, e.g. TeaCache's polynomial).

  Raises:
    ValueError: an unknown policy (with the list), options the policy does not take, a policy that does
      not apply to the pipeline's denoiser (naming the ones that do), or the policy's own refusal
      (e.g. MagCache without ratios).
  """
  name = config.get("cache")
  if not name:
    return None
  if name not in POLICIES:
    hint = apps.suggest(name, list(POLICIES))
    raise ValueError(
      f"--config.cache={name!r} is not an md-cache policy; expected one of "
      f"{sorted(POLICIES)}" + (f" (did you mean {hint!r}?)" if hint else "")
    )
  policy, family = POLICIES[name], pipeline.family
  blocks = pipeline.block_stacks
  if not _applies(policy, blocks):
    fits = sorted(k for k, p in POLICIES.items() if _applies(p, blocks) and p.needs != "any")
    anywhere = sorted(k for k, p in POLICIES.items() if p.needs == "any")
    if policy.needs == "blocks":
      raise ValueError(
        f"--config.cache={name}: a block-level cache needs transformer block stacks, and the {family} "
        f"UNet has none; these apply to any denoiser: {sorted(fits + anywhere)}"
      )
    raise ValueError(
      f"--config.cache={name} caches a UNet's deep branch, and {family} has a transformer; block "
      f"caches apply: {fits}, and any of {anywhere}"
    )
  takes = list(options_of(policy.factory))
  options = {k: v for k, v in dict(config.cache_options).items() if v is not None}
  extra = sorted(set(options) - set(takes))
  if extra:
    raise ValueError(f"--config.cache_options: {name} takes {takes}, not {extra}")
  for key, value in dict(pipeline.cache_defaults.get(name, {})).items():
    options.setdefault(key, value)
  if (
    name == "magcache"
    and "mag_ratios" in options
    and options["mag_ratios"] not in PUBLISHED_MAG_RATIOS  # a published list's name, not a file
  ):
    options["mag_ratios"] = apps.repo_path(options["mag_ratios"], apps.config_file())
  return policy.factory(**options)


def cache_report(pipe: Any) -> dict:
  """What the last call's cache did, for settings.json: the steps it computed (empty without one),
  and the denoiser calls made (`pipe.last_cache`, `pipe.last_calls`)."""
  state, calls = pipe.last_cache, pipe.last_calls
  out: dict[str, Any] = {"denoiser_calls": None if calls is None else int(np.asarray(calls))}
  computed = getattr(state, "computed", None)
  if computed is not None:
    computed = np.asarray(computed, bool)
    out["steps_computed"] = int(computed.sum())
    out["steps_reused"] = int((~computed).sum())
    if isinstance(state, FasterCacheState):  # a CFG cache: steps that ran the negative rows
      out["computed"] = "unconditional branch"
  if getattr(state, "calibration", None) is not None and getattr(state, "prev", None) is not None:
    # MagCache calibration: the list to pass back (the positive branch's where the reference calls the
    # branches separately and so records one list per branch), which one it is, and every list.
    branches = calibrated_branches(state)
    out["mag_ratios"] = [float(r) for r in calibrated_ratios(state)]
    out["mag_ratios_branch"] = "positive" if "positive" in branches else branches[0]
    if len(branches) > 1:
      out["mag_ratios_per_branch"] = {
        b: [float(r) for r in calibrated_ratios(state, b)] for b in branches
      }
  return out


def cache_line(name: str | None, report: Mapping[str, Any]) -> str:
  """One line for the end of a run: steps computed vs reused (empty without a cache)."""
  if not name or "steps_computed" not in report:
    return ""
  done, reused = report["steps_computed"], report["steps_reused"]
  what = f" ({report['computed']})" if "computed" in report else ""
  return f"cache {name}{what}: {done} of {done + reused} steps computed, {reused} reused"
