"""Request bodies: OpenAI-style generation requests checked field by field into `GenRequest`.

Every problem is a `RequestError` naming the field (`param`), which the server answers with a 400 JSON body.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
from collections.abc import Mapping
from typing import Any

import md_cache
from md_serve._models import ServedModel

_FIELDS = {
  "prompt": "the text to generate from (required)",
  "model": "a model name from /v1/models (default: the first)",
  "n": "images or videos to make (default 1)",
  "size": '"WxH" in pixels (default: the model\'s)',
  "response_format": '"b64_json" (default) or "url"',
  "negative_prompt": "text to steer away from",
  "steps": "denoising steps",
  "guidance": "classifier-free guidance scale",
  "seed": "random seed of the initial noise (default 0)",
  "scheduler": "a diffusers scheduler class name",
  "cache": "an md-cache step cache policy name (see CACHES)",
  "cache_options": "options of the cache policy: numbers, or names the operator registered",
  "loras": 'adapters from the registry: [{"name": ..., "scale": ...}]',
  "num_frames": "video frames (videos only)",
  "video_format": '"mp4" (default) or "gif" (videos only)',
  "search": '{"budget": int, "method": "random" | "zero_order" | "path"}: inference-time search',
  "wait": "true (default): answer with the result; false: answer 202 with the job at once",
  "user": "ignored (OpenAI clients send it)",
}
_FORMATS = ("b64_json", "url")
_VIDEO_FORMATS = ("mp4", "gif")
_VIDEO_ONLY = ("num_frames", "video_format")
_METHODS = ("random", "zero_order", "path")
MAX_RATIOS = 1000  # inline MagCache ratios a request may send
MAX_COEFFICIENTS = 16  # inline TeaCache polynomial coefficients


def _num(kind: type, low: float, high: float) -> tuple:
  return (kind, low, high)


# The step caches a request may ask for and each one's options. A number option is (type, low, high);
# a tuple of strings is a choice; "ratios" and "coefficients" are inline lists of finite numbers or a
# name (ratios: one the operator registered on the model; coefficients: md_cache.TEACACHE_COEFFICIENTS).
# No option is ever a path: a request names no file of the server.
CACHES: dict[str, dict[str, Any]] = {
  "first_block_cache": {"threshold": _num(float, 0, 10)},
  "magcache": {
    "mag_ratios": "ratios",
    "threshold": _num(float, 0, 10),
    "max_skip_steps": _num(int, 0, 1000),
    "retention_ratio": _num(float, 0, 1),
    "calibrate": bool,
  },
  "taylorseer": {
    "interval": _num(int, 1, 1000),
    "warmup_steps": _num(int, 0, 1000),
    "stop_step": _num(int, 0, 1000),
    "max_order": _num(int, 0, 4),
    "factors_dtype": ("float32", "bfloat16", "float16"),
  },
  "teacache": {"threshold": _num(float, 0, 10), "coefficients": "coefficients"},
  "faster_cache": {
    "interval": _num(int, 1, 1000),
    "alpha_low": _num(float, 0, 10),
    "alpha_high": _num(float, 0, 10),
  },
  "deepcache": {"interval": _num(int, 1, 1000), "start": _num(int, 0, 1000)},
  "sencache": {
    "epsilon": _num(float, 0, 100),
    "max_reuse": _num(int, 0, 1000),
    "warmup_steps": _num(int, 0, 1000),
    "nocache_start_ratio": _num(float, 0, 1),
    "nocache_end_ratio": _num(float, 0, 1),
    "alpha_x": _num(float, 0, 100),
    "alpha_t": _num(float, 0, 100),
  },
}


class RequestError(ValueError):
  """A bad request: `param` names the field, the message says what was expected."""

  def __init__(self, param: str, message: str, status: int = 400):
    super().__init__(message)
    self.param, self.status = param, status


@dataclasses.dataclass(frozen=True)
class GenRequest:
  """One checked generation request."""

  kind: str
  model: str
  prompt: str
  n: int
  height: int
  width: int
  num_frames: int
  steps: int
  guidance: float
  seed: int
  negative_prompt: str | None = None
  scheduler: str | None = None
  cache: str | None = None
  cache_options: tuple = ()
  loras: tuple[tuple[str, float], ...] = ()
  response_format: str = "b64_json"
  video_format: str = "mp4"
  search: tuple = ()
  wait: bool = True

  def bucket(self) -> tuple:
    """Requests with equal buckets run in one batched call (same shapes, settings and adapters)."""
    return (
      self.model, self.height, self.width, self.num_frames, self.steps, self.guidance,
      self.negative_prompt, self.scheduler, self.cache, self.cache_options, self.loras,
    )  # fmt: skip


def _int(body: Mapping, key: str, default: int, low: int, high: int | None = None) -> int:
  value = body.get(key, default)
  if isinstance(value, bool) or not isinstance(value, int):
    raise RequestError(key, f"{key} must be an integer, got {value!r}")
  if value < low or (high is not None and value > high):
    span = f"{low}..{high}" if high is not None else f">= {low}"
    raise RequestError(key, f"{key}={value} is out of range: expected {span}")
  return value


def _str(body: Mapping, key: str, default: str | None = None) -> str | None:
  value = body.get(key, default)
  if value is not None and not isinstance(value, str):
    raise RequestError(key, f"{key} must be a string, got {type(value).__name__}")
  return value


def _is_number(value: Any) -> bool:
  return not isinstance(value, bool) and isinstance(value, int | float)


def _numbers(param: str, value: list, limit: int) -> tuple[float, ...]:
  """A non-empty list of at most `limit` finite numbers, as floats."""
  if not value or len(value) > limit:
    raise RequestError(param, f"{param} must hold 1 to {limit} numbers, got {len(value)}")
  for i, v in enumerate(value):
    if not _is_number(v) or not math.isfinite(float(v)) or abs(float(v)) > 1e30:
      raise RequestError(param, f"{param}[{i}] must be a finite number, got {v!r}")
  return tuple(float(v) for v in value)


def _cache_options(name: str, options: Any, model: ServedModel) -> tuple:
  """The checked options of cache policy `name`, as sorted (key, value) pairs (lists become tuples)."""
  if not isinstance(options, dict):
    raise RequestError("cache_options", "cache_options must be an object")
  takes = CACHES[name]
  out = {}
  for key, value in options.items():
    param = f"cache_options.{key}"
    if key not in takes:
      raise RequestError(param, f"{name} takes the options {sorted(takes)}, not {key!r}")
    kind = takes[key]
    if kind == "ratios":
      if isinstance(value, str):
        if value not in model.mag_ratios:
          raise RequestError(
            param,
            f"{param} names no ratio set registered on {model.name} (registered: "
            f"{sorted(model.mag_ratios)}); or give the ratios inline: a list of at most "
            f"{MAX_RATIOS} numbers",
          )
        value = model.mag_ratios[value]
      elif isinstance(value, list):
        value = _numbers(param, value, MAX_RATIOS)
      else:
        raise RequestError(
          param,
          f"{param} must be a list of numbers or a registered name, got {type(value).__name__}",
        )
    elif kind == "coefficients":
      if isinstance(value, str):
        if value not in md_cache.TEACACHE_COEFFICIENTS:
          raise RequestError(
            param, f"{param}: {value!r} is not one of {sorted(md_cache.TEACACHE_COEFFICIENTS)}"
          )
      elif isinstance(value, list):
        value = _numbers(param, value, MAX_COEFFICIENTS)
      else:
        raise RequestError(param, f"{param} must be a list of numbers or a name")
    elif kind is bool:
      if not isinstance(value, bool):
        raise RequestError(param, f"{param} must be true or false, got {value!r}")
    elif isinstance(kind, tuple) and isinstance(kind[0], str):
      if value not in kind:
        raise RequestError(param, f"{param} must be one of {kind}, got {value!r}")
    else:
      typ, low, high = kind
      ok = _is_number(value) and (typ is float or isinstance(value, int))
      if not ok or not math.isfinite(float(value)) or not low <= value <= high:
        what = "an integer" if typ is int else "a number"
        raise RequestError(param, f"{param} must be {what} in {low}..{high}, got {value!r}")
      value = typ(value)
    out[key] = value
  return tuple(sorted(out.items()))


def _nearest(value: int, multiple: int) -> str:
  low = max(multiple, value // multiple * multiple)
  return str(low) if low >= value else f"{low} or {low + multiple}"


def parse_size(text: Any, model: ServedModel) -> tuple[int, int]:
  """`"WxH"` → (height, width), checked against the model's multiple and pixel limit."""
  if not isinstance(text, str) or not re.fullmatch(r"\s*\d+\s*[xX]\s*\d+\s*", text):
    raise RequestError("size", f'size must be "WxH" (e.g. "512x512"), got {text!r}')
  w, h = (int(v) for v in re.split(r"[xX]", text))
  m = model.multiple
  for name, v in (("width", w), ("height", h)):
    if v < m or v % m:
      raise RequestError(
        "size",
        f"size {text!r}: {name} {v} is not a positive multiple of {m} for {model.name}; the nearest "
        f"valid {name}: {_nearest(v, m)}",
      )
  if w * h > model.max_pixels:
    raise RequestError(
      "size", f"size {text!r} is {w * h} pixels; {model.name} takes at most {model.max_pixels}"
    )
  return h, w


def parse_request(
  body: Any,
  kind: str,
  models: Mapping[str, ServedModel],
  *,
  max_n: int = 8,
  max_budget: int = 64,
) -> GenRequest:
  """Checks a decoded JSON body for `POST /v1/{images,videos}/generations`.

  Raises:
    RequestError: naming the first bad field (unknown fields get the nearest known one).
  """
  if not isinstance(body, dict):
    raise RequestError("body", f"the body must be a JSON object, got {type(body).__name__}")
  for key in body:
    if key not in _FIELDS or (key in _VIDEO_ONLY and kind != "video"):
      near = difflib.get_close_matches(str(key), list(_FIELDS), n=1)
      hint = f" (did you mean {near[0]!r}?)" if near else ""
      raise RequestError(key, f"unknown field {key!r}{hint}; known: {sorted(_FIELDS)}")
  prompt = _str(body, "prompt")
  if not prompt or not prompt.strip():
    raise RequestError("prompt", "prompt is required and must be a non-empty string")
  of_kind = [m for m in models.values() if m.kind == kind]
  if not of_kind:
    raise RequestError("model", f"this server has no {kind} model; models: {sorted(models)}", 404)
  name = _str(body, "model", of_kind[0].name)
  if name not in models or models[name].kind != kind:
    names = sorted(m.name for m in of_kind)
    raise RequestError(
      "model", f"model {name!r} is not a {kind} model here; {kind} models: {names}"
    )
  model = models[name]
  h, w = parse_size(body["size"], model) if "size" in body else model.default_size
  frames = 1
  if kind == "video":
    frames = _int(body, "num_frames", model.num_frames, 1, model.max_frames)
    t = model.spec.temporal if model.spec else 1
    if (frames - 1) % t:
      raise RequestError("num_frames", f"num_frames={frames} must be 1 + a multiple of {t}")
  fmt = _str(body, "response_format", "b64_json")
  if fmt not in _FORMATS:
    raise RequestError("response_format", f"response_format must be one of {_FORMATS}, got {fmt!r}")
  video_format = _str(body, "video_format", "mp4")
  if video_format not in _VIDEO_FORMATS:
    raise RequestError(
      "video_format", f"video_format must be one of {_VIDEO_FORMATS}, got {video_format!r}"
    )
  guidance = body.get("guidance", 5.0)
  if not _is_number(guidance) or not math.isfinite(float(guidance)) or not 0 <= guidance <= 100:
    raise RequestError("guidance", f"guidance must be a number in 0..100, got {guidance!r}")
  scheduler = _str(body, "scheduler")
  if scheduler is not None and "scheduler" not in model.params:
    raise RequestError("scheduler", f"{model.name} takes no scheduler choice")
  cache = _str(body, "cache")
  if cache is not None and cache not in CACHES:
    near = difflib.get_close_matches(cache, list(CACHES), n=1)
    hint = f" (did you mean {near[0]!r}?)" if near else ""
    raise RequestError("cache", f"cache {cache!r} is not a policy{hint}; known: {sorted(CACHES)}")
  options = body.get("cache_options", {})
  if not isinstance(options, dict):
    raise RequestError("cache_options", "cache_options must be an object")
  if options and not cache:
    raise RequestError("cache_options", "cache_options given without cache")
  cache_options = _cache_options(cache, options, model) if cache else ()
  loras = body.get("loras", [])
  if not isinstance(loras, list):
    raise RequestError("loras", 'loras must be a list of {"name": str, "scale": number}')
  picked = []
  for i, item in enumerate(loras):
    if isinstance(item, str):
      item = {"name": item}
    if not isinstance(item, dict) or set(item) - {"name", "scale"}:
      raise RequestError(f"loras[{i}]", 'each LoRA is {"name": str, "scale": number}')
    lname, scale = item.get("name"), item.get("scale", 1.0)
    if not isinstance(lname, str) or lname not in model.loras:
      raise RequestError(
        f"loras[{i}].name",
        f"unknown LoRA {lname!r} for {model.name}; loaded: {sorted(model.loras)}",
      )
    if not _is_number(scale) or not math.isfinite(float(scale)) or abs(scale) > 100:
      raise RequestError(f"loras[{i}].scale", f"scale must be a number in -100..100, got {scale!r}")
    picked.append((lname, float(scale)))
  search = body.get("search")
  search_t: tuple = ()
  if search is not None:
    if not isinstance(search, dict) or set(search) - {"budget", "method"}:
      raise RequestError("search", 'search is {"budget": int, "method": "random"|...}')
    try:
      budget = _int(search, "budget", 8, 1, max_budget)
    except RequestError as e:
      raise RequestError("search.budget", f"search.{e}") from None
    method = search.get("method", "random")
    if method not in _METHODS:
      raise RequestError("search.method", f"search.method must be one of {_METHODS}")
    if model.spec is None:
      raise RequestError("search", f"{model.name} has no per-row noise: search is not available")
    search_t = (("budget", budget), ("method", method))
  wait = body.get("wait", True)
  if not isinstance(wait, bool):
    raise RequestError("wait", "wait must be true or false")
  return GenRequest(
    kind=kind,
    model=name,
    prompt=prompt,
    n=_int(body, "n", 1, 1, max_n),
    height=h,
    width=w,
    num_frames=frames,
    steps=_int(body, "steps", min(20, model.max_steps), 1, model.max_steps),
    guidance=float(guidance),
    seed=_int(body, "seed", 0, 0, 2**31 - 1),
    negative_prompt=_str(body, "negative_prompt"),
    scheduler=scheduler,
    cache=cache,
    cache_options=cache_options,
    loras=tuple(picked),
    response_format=fmt,
    video_format=video_format,
    search=search_t,
    wait=wait,
  )
