"""The Scheduler contract and the host-side schedule helpers every scheduler family shares.

A scheduler is a NamedTuple of pure functions (optax style). `init` runs once on the host with numpy and
returns a `SchedulerState` whose arrays hold everything a step needs: the timesteps fed to the model, the
noise levels, per-call coefficient tables and the buffers a multistep solver carries. `step` reads the call
index from the state, so a whole sampling loop is one `jax.lax.fori_loop`/`scan` that compiles once.

Numerics: the training schedule (betas, cumulative alphas) is built in float32 the way the reference builds
it (float32 betas, products accumulated in float64 then rounded), so the timesteps and sigmas md feeds to the
model are the reference's values; coefficients derived from them are computed in float64 and rounded once.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from md_core import torch_linspace_f32


class SchedulerState(NamedTuple):
  """What a scheduler carries from one model call to the next.

  Attributes:
    step: (), int32. Index of the next model call (0 … `num_calls - 1`).
    timesteps: [num_calls], int32 or float32. The timestep fed to the model at each call.
    sigmas: [num_calls + 1], float32. Noise level at each call and after the last one (schedulers
      without sigmas in the reference hold sqrt((1 - alphā) / alphā) of their timesteps).
    init_noise_sigma: (), float32. Scale of the initial noise.
    tables: per-call coefficient arrays, each [num_calls, …], float32.
    memory: carried buffers (history of model outputs, previous sample, …), each shaped like the sample
      with a leading history axis where needed.
  """

  step: jax.Array
  timesteps: jax.Array
  sigmas: jax.Array
  init_noise_sigma: jax.Array
  tables: dict[str, jax.Array]
  memory: dict[str, jax.Array]


class Scheduler(NamedTuple):
  """A noise scheduler: pure functions over a `SchedulerState`.

  Attributes:
    name: the reference class name (`"EulerDiscreteScheduler"`, …).
    config: the resolved configuration (every option with its value).
    init: `init(num_inference_steps=None, *, shape=None, dtype=jnp.float32, **kwargs) -> SchedulerState`.
      Host-side; `shape` is the sample shape, required by schedulers that carry buffers. Keyword arguments
      the family accepts: `timesteps`, `sigmas`, `mu`, `original_inference_steps`, `strength`.
    step: `step(state, model_output, sample, key=None, *, noise=None) -> (prev_sample, state)`. Pure and
      jittable. Stochastic schedulers draw noise from `key`, or use `noise` (shaped like the sample).
    scale_model_input: `scale_model_input(state, sample) -> sample` for the current call.
    stochastic: whether `step` needs a key or noise.
    alphas_cumprod: [num_train_timesteps] float32 training schedule (None for flow-matching schedulers).
  """

  name: str
  config: Mapping[str, Any]
  init: Callable[..., SchedulerState]
  step: Callable[..., tuple[jax.Array, SchedulerState]]
  scale_model_input: Callable[[SchedulerState, jax.Array], jax.Array]
  stochastic: bool
  alphas_cumprod: np.ndarray | None


def num_calls(state: SchedulerState) -> int:
  """How many model calls the state's schedule makes (static)."""
  return int(state.timesteps.shape[0])


def current_timestep(state: SchedulerState) -> jax.Array:
  """The timestep to feed the model at the current call."""
  return state.timesteps[state.step]


def identity_scale(state: SchedulerState, sample: jax.Array) -> jax.Array:
  """`scale_model_input` of schedulers that feed the sample unchanged."""
  del state
  return sample


def sigma_scale(state: SchedulerState, sample: jax.Array) -> jax.Array:
  """`scale_model_input` of the k-diffusion style schedulers: sample / sqrt(sigma² + 1)."""
  sigma = state.sigmas[state.step]
  return sample / (sigma**2 + 1) ** 0.5


def make_state(
  *,
  timesteps: np.ndarray,
  sigmas: np.ndarray,
  init_noise_sigma: float = 1.0,
  tables: Mapping[str, np.ndarray] | None = None,
  memory: Mapping[str, jax.Array] | None = None,
) -> SchedulerState:
  """Builds a state on the host: integer timesteps become int32, everything else float32."""
  ts = np.asarray(timesteps)
  ts = ts.astype(np.int32) if np.issubdtype(ts.dtype, np.integer) else ts.astype(np.float32)
  return SchedulerState(
    step=jnp.zeros((), jnp.int32),
    timesteps=jnp.asarray(ts),
    sigmas=jnp.asarray(np.asarray(sigmas, np.float32)),
    init_noise_sigma=jnp.asarray(np.float32(init_noise_sigma)),
    tables={k: jnp.asarray(np.asarray(v, np.float32)) for k, v in (tables or {}).items()},
    memory=dict(memory or {}),
  )


def zeros_memory(
  shape: Sequence[int] | None, dtype, name: str, **buffers: int
) -> dict[str, jax.Array]:
  """Zero buffers: `buffers` maps a name to a history length (0 means one sample-shaped array)."""
  if shape is None:
    raise ValueError(
      f"{name} carries a history of model outputs: pass init(..., shape=sample.shape)"
    )
  out = {}
  for key, length in buffers.items():
    full = tuple(shape) if length == 0 else (length, *shape)
    out[key] = jnp.zeros(full, dtype)
  return out


def draw_noise(
  key: jax.Array | None, noise: jax.Array | None, like: jax.Array, name: str
) -> jax.Array:
  """The noise a stochastic step adds: `noise` when given, else a normal draw from `key`."""
  if noise is not None:
    if noise.shape != like.shape:
      raise ValueError(f"{name}: noise has shape {noise.shape}, expected the sample's {like.shape}")
    return noise.astype(jnp.float32)
  if key is None:
    raise ValueError(f"{name} is stochastic: pass step(..., key=PRNGKey) or step(..., noise=array)")
  return jax.random.normal(key, like.shape, jnp.float32)


# ----------------------------------------------------------------------------- training schedule


def betas_for_alpha_bar(n: int, max_beta: float = 0.999, kind: str = "cosine") -> np.ndarray:
  """Betas that make alphā follow a closed form (`cosine` is the squaredcos_cap_v2 schedule)."""
  if kind == "cosine":
    fn = lambda t: math.cos((t + 0.008) / 1.008 * math.pi / 2) ** 2
  elif kind == "exp":
    fn = lambda t: math.exp(t * -12.0)
  else:
    raise ValueError(f"alpha-bar transform {kind!r} not supported; expected 'cosine' or 'exp'")
  betas = [min(1 - fn((i + 1) / n) / fn(i / n), max_beta) for i in range(n)]
  return np.asarray(betas, np.float32)


def rescale_zero_terminal_snr(betas: np.ndarray) -> np.ndarray:
  """Rescales betas so the last timestep has zero SNR (Lin et al. 2023), in float32."""
  alphas = np.float32(1.0) - betas
  sqrt_ab = np.sqrt(np.cumprod(alphas.astype(np.float64)).astype(np.float32))
  first, last = sqrt_ab[0].copy(), sqrt_ab[-1].copy()
  sqrt_ab = (sqrt_ab - last) * (first / (first - last))
  ab = sqrt_ab**2
  alphas = np.concatenate([ab[:1], ab[1:] / ab[:-1]])
  return (np.float32(1.0) - alphas).astype(np.float32)


def train_betas(
  cfg: Mapping[str, Any], allowed: Sequence[str] = ("linear", "scaled_linear", "squaredcos_cap_v2")
) -> np.ndarray:
  """The float32 betas of a config (`trained_betas` wins over `beta_schedule`)."""
  n = int(cfg["num_train_timesteps"])
  if cfg.get("trained_betas") is not None:
    return np.asarray(cfg["trained_betas"], np.float32)
  kind = cfg.get("beta_schedule", "linear")
  if kind not in allowed:
    raise ValueError(
      f"beta_schedule={kind!r} is not supported here; expected one of {list(allowed)}"
    )
  start, end = float(cfg["beta_start"]), float(cfg["beta_end"])
  if kind == "linear":
    return torch_linspace_f32(start, end, n)
  if kind == "scaled_linear":
    return torch_linspace_f32(start**0.5, end**0.5, n) ** 2
  if kind == "squaredcos_cap_v2":
    return betas_for_alpha_bar(n)
  return betas_for_alpha_bar(n, kind="exp")


def train_alphas_cumprod(
  cfg: Mapping[str, Any],
  *,
  zero_snr_floor: bool = False,
  allowed: Sequence[str] = ("linear", "scaled_linear", "squaredcos_cap_v2"),
) -> np.ndarray:
  """alphā_t for t = 0 … num_train_timesteps - 1, float32.

  Args:
    cfg: scheduler config with the beta options.
    zero_snr_floor: with `rescale_betas_zero_snr`, replace the last alphā (exactly 0) by 2**-24 so the
      sigma there stays finite, as the sigma-based reference schedulers do.
    allowed: the beta schedules this scheduler accepts.
  """
  betas = train_betas(cfg, allowed)
  if cfg.get("rescale_betas_zero_snr", False):
    betas = rescale_zero_terminal_snr(betas)
  alphas = np.float32(1.0) - betas
  # The reference accumulates the float32 product in float64 and rounds once.
  acp = np.cumprod(alphas.astype(np.float64)).astype(np.float32)
  if zero_snr_floor and cfg.get("rescale_betas_zero_snr", False):
    acp[-1] = np.float32(2.0**-24)
  return acp


def train_sigmas(alphas_cumprod: np.ndarray) -> np.ndarray:
  """sqrt((1 - alphā) / alphā), float32, indexed by training timestep."""
  a = alphas_cumprod
  with np.errstate(divide="ignore"):  # a zero-SNR schedule ends at alphā = 0: sigma = inf there
    return (((np.float32(1.0) - a) / a) ** np.float32(0.5)).astype(np.float32)


# ----------------------------------------------------------------------------- schedules


def spaced_timesteps(
  spacing: str,
  num_train: int,
  n: int,
  steps_offset: int = 0,
  *,
  extra: bool = False,
  dtype=np.int64,
) -> np.ndarray:
  """Descending inference timesteps with the reference's `timestep_spacing` rules.

  Args:
    spacing: `linspace`, `leading` or `trailing`.
    num_train: number of training timesteps.
    n: number of inference steps.
    steps_offset: added to `leading` timesteps.
    extra: the DPM-Solver / UniPC variant, which spaces n + 1 points and drops the last.
    dtype: int64 for the discrete schedulers, float32 for the sigma-based ones.
  """
  if spacing == "linspace":
    if extra:
      return np.linspace(0, num_train - 1, n + 1).round()[::-1][:-1].copy().astype(dtype)
    if dtype == np.float32:
      return np.linspace(0, num_train - 1, n, dtype=np.float32)[::-1].copy()
    return np.linspace(0, num_train - 1, n).round()[::-1].copy().astype(dtype)
  if spacing == "leading":
    ratio = num_train // (n + 1 if extra else n)
    ts = (np.arange(0, n + 1 if extra else n) * ratio).round()[::-1]
    ts = (ts[:-1] if extra else ts).copy().astype(dtype)
    ts += steps_offset
    # The offset can push the first timestep past the table the discrete schedulers index (the
    # sigma-based ones interpolate, clamping, as the reference does).
    if np.issubdtype(ts.dtype, np.integer) and len(ts) and ts[0] >= num_train:
      most = max(
        k for k in range(1, n + 1)
        if (k if extra else k - 1) * (num_train // (k + 1 if extra else k)) + steps_offset < num_train
      )  # fmt: skip
      raise ValueError(
        f"num_inference_steps={n} with timestep_spacing='leading' and steps_offset={steps_offset} "
        f"starts at timestep {int(ts[0])}, past num_train_timesteps={num_train}: at most {most} "
        "steps, or timestep_spacing='trailing'"
      )
    return ts
  if spacing == "trailing":
    ratio = num_train / n
    ts = np.round(np.arange(num_train, 0, -ratio)).astype(dtype)
    ts -= 1
    return ts
  raise ValueError(
    f"timestep_spacing={spacing!r} is not supported; expected 'linspace', 'leading' or 'trailing'"
  )


def check_steps(n: int | None, num_train: int, name: str) -> int:
  """Validates a step count against the training schedule."""
  if n is None:
    raise ValueError(f"{name}.init needs num_inference_steps (or custom timesteps/sigmas)")
  if not isinstance(n, (int, np.integer)) or n < 1:
    raise ValueError(f"{name}: num_inference_steps must be a positive int, got {n!r}")
  if n > num_train:
    raise ValueError(
      f"{name}: num_inference_steps={n} cannot exceed num_train_timesteps={num_train}"
    )
  return int(n)


def sigma_to_t(sigmas: np.ndarray, log_sigmas: np.ndarray) -> np.ndarray:
  """Fractional training timestep of each sigma, interpolating linearly in log sigma."""
  sigmas = np.asarray(sigmas)
  log_sigma = np.log(np.maximum(sigmas, 1e-10)).reshape(-1)
  dists = log_sigma[None, :] - log_sigmas[:, None]
  low = np.cumsum(dists >= 0, axis=0).argmax(axis=0).clip(max=log_sigmas.shape[0] - 2)
  lo, hi = log_sigmas[low], log_sigmas[low + 1]
  w = np.clip((lo - log_sigma) / (lo - hi), 0, 1)
  return ((1 - w) * low + w * (low + 1)).reshape(sigmas.shape)


def karras_sigmas(sigma_min: float, sigma_max: float, n: int, rho: float = 7.0) -> np.ndarray:
  """Karras et al. (2022) noise levels, descending, float64."""
  ramp = np.linspace(0, 1, n)
  lo, hi = sigma_min ** (1 / rho), sigma_max ** (1 / rho)
  return (hi + ramp * (lo - hi)) ** rho


def exponential_sigmas(sigma_min: float, sigma_max: float, n: int) -> np.ndarray:
  """Noise levels evenly spaced in log sigma, descending, float64."""
  return np.exp(np.linspace(math.log(sigma_max), math.log(sigma_min), n))


def beta_sigmas(sigma_min: float, sigma_max: float, n: int, a: float = 0.6, b: float = 0.6):
  """Noise levels at the quantiles of a Beta(a, b) distribution (needs scipy)."""
  try:
    import scipy.stats
  except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError("use_beta_sigmas needs scipy: pip install scipy") from e
  ppf = [scipy.stats.beta.ppf(t, a, b) for t in 1 - np.linspace(0, 1, n)]
  return np.array([sigma_min + p * (sigma_max - sigma_min) for p in ppf])


def convert_sigmas(cfg: Mapping[str, Any], sigmas: np.ndarray, n: int) -> tuple[np.ndarray, bool]:
  """Applies `use_karras_sigmas` / `use_exponential_sigmas` / `use_beta_sigmas`; returns (sigmas, changed)."""
  chosen = [
    k for k in ("use_karras_sigmas", "use_exponential_sigmas", "use_beta_sigmas") if cfg.get(k)
  ]
  if len(chosen) > 1:
    raise ValueError(
      f"only one of use_karras_sigmas, use_exponential_sigmas, use_beta_sigmas may be set; "
      f"got {chosen}"
    )
  if not chosen:
    return sigmas, False
  lo = cfg.get("sigma_min")
  hi = cfg.get("sigma_max")
  lo = float(sigmas[-1]) if lo is None else lo
  hi = float(sigmas[0]) if hi is None else hi
  fn = {
    "use_karras_sigmas": karras_sigmas,
    "use_exponential_sigmas": exponential_sigmas,
    "use_beta_sigmas": beta_sigmas,
  }[chosen[0]]
  return fn(lo, hi, n), True


def time_shift(kind: str, mu: float, t: np.ndarray) -> np.ndarray:
  """Resolution-dependent shift of flow sigmas: exp(mu) / (exp(mu) + 1/t - 1) (or mu for `linear`)."""
  if kind == "exponential":
    return math.exp(mu) / (math.exp(mu) + (1 / t - 1) ** 1.0)
  if kind == "linear":
    return mu / (mu + (1 / t - 1) ** 1.0)
  raise ValueError(f"time_shift_type={kind!r} is not supported; expected 'exponential' or 'linear'")


def stretch_to_terminal(t: np.ndarray, terminal: float) -> np.ndarray:
  """Stretches a descending flow schedule so it ends at `terminal`."""
  one_minus = 1 - t
  scale = one_minus[-1] / (1 - terminal)
  return 1 - one_minus / scale


# ----------------------------------------------------------------------------- step helpers


def threshold(x0: jax.Array, ratio: float, max_value: float) -> jax.Array:
  """Dynamic thresholding (Imagen): clip each batch element to its `ratio` quantile of |x0|, rescale."""
  b = x0.shape[0]
  flat = x0.reshape(b, -1).astype(jnp.float32)
  s = jnp.quantile(jnp.abs(flat), ratio, axis=1)
  s = jnp.clip(s, 1.0, max_value)[:, None]
  return (jnp.clip(flat, -s, s) / s).reshape(x0.shape).astype(x0.dtype)


def postprocess_x0(cfg: Mapping[str, Any], x0: jax.Array) -> jax.Array:
  """Thresholding or clipping of a predicted clean sample, as the config asks."""
  if cfg.get("thresholding"):
    return threshold(x0, cfg["dynamic_thresholding_ratio"], cfg["sample_max_value"])
  if cfg.get("clip_sample"):
    r = cfg["clip_sample_range"]
    return jnp.clip(x0, -r, r)
  return x0


def check_choice(name: str, key: str, value: Any, allowed: Sequence[Any]) -> None:
  """Raises a ValueError naming the option when `value` is not one of `allowed`."""
  if value not in allowed:
    raise ValueError(f"{name}: {key}={value!r} is not supported; expected one of {list(allowed)}")


def merge_config(
  name: str, defaults: Mapping[str, Any], overrides: Mapping[str, Any]
) -> dict[str, Any]:
  """Defaults updated by `overrides`; an option the scheduler does not have is an error."""
  unknown = sorted(set(overrides) - set(defaults))
  if unknown:
    raise TypeError(f"{name}: unknown options {unknown}; known: {sorted(defaults)}")
  cfg = dict(defaults)
  cfg.update(overrides)
  return cfg


def split_prediction(
  pred: str, sample: jax.Array, model_output: jax.Array, sqrt_a: jax.Array, sqrt_b: jax.Array
) -> tuple[jax.Array, jax.Array]:
  """(x0, epsilon) from a model output, given sqrt(alphā) and sqrt(1 - alphā) at the timestep."""
  if pred == "epsilon":
    return (sample - sqrt_b * model_output) / sqrt_a, model_output
  if pred == "sample":
    return model_output, (sample - sqrt_a * model_output) / sqrt_b
  if pred == "v_prediction":
    return sqrt_a * sample - sqrt_b * model_output, sqrt_a * model_output + sqrt_b * sample
  raise ValueError(
    f"prediction_type={pred!r} is not supported; expected 'epsilon', 'sample' or 'v_prediction'"
  )


ALPHA_BAR_DEFAULTS: dict[str, Any] = {
  "num_train_timesteps": 1000,
  "beta_start": 0.0001,
  "beta_end": 0.02,
  "beta_schedule": "linear",
  "trained_betas": None,
  "prediction_type": "epsilon",
  "timestep_spacing": "leading",
  "steps_offset": 0,
  "rescale_betas_zero_snr": False,
}

THRESHOLD_DEFAULTS: dict[str, Any] = {
  "clip_sample": True,
  "clip_sample_range": 1.0,
  "thresholding": False,
  "dynamic_thresholding_ratio": 0.995,
  "sample_max_value": 1.0,
}
