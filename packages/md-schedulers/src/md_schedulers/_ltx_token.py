"""Flow-match Euler with per-token noise levels: the sampler of LTX-Video's and LTX-2's conditioning.

Conditioning tokens (an image as the first latent frame, keyframes, a video prefix) are marked by a mask
`c` in [0, 1] over the sample's tokens (1: fully conditioned). The schedule is flow-match Euler's
(`flow_match_euler`'s options and `init` arguments); what differs is which tokens move and by how much:

- `rule="keep"` (LTX-2, LTX-Video image-to-video): tokens with `c > 0.5` keep their value, the others take
  the schedule's Euler step `x + (sigma_next - sigma) v`. The model sees the timestep `t (1 - c)`.
- `rule="per_token"` (LTX-Video's condition pipeline, the reference's `per_token_timesteps`): each token
  sits at its own noise level `min(t, (1 - c) T) / T` and steps to the next lower sigma of the schedule;
  tokens the schedule has not reached yet (`t / T >= 1 - c`) stay. With `c = 0` everywhere this is the
  reference's unconditioned path (sigmas from the timesteps, `T = num_train_timesteps`).

The mask rides in the state (`tables["conditioning"]`, `[B, *tokens]`) and applies to the sample whose
leading axes are `[B, *tokens]` with one trailing channel axis. Other leaves of a multi-modality sample
(LTX-2's audio, a different rank) take the plain Euler step; pass `init(..., shape=...)` with every leaf's
shape to have a mask that fits no leaf, or several, refused.

Conditioning noise (LTX-Video's `image_cond_noise_scale`): before each model call the reference resets the
hard-conditioned tokens (`c = 1`) to their clean latents plus fresh noise, `clean + s * eps_i * (t_i /
1000)^2`. Given `init(..., cond_latents=, cond_noise=, cond_noise_scale=)`, `step` does this at the end of
each call for the next one (the last call adds none), and `ltx_token_noised(state, sample)` does it for
the first call, before the loop.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from md_schedulers import _base, _flow_match

LTX_TOKEN_RULES = ("keep", "per_token")


def _fits(mask_shape: tuple[int, ...], sample_shape: tuple[int, ...]) -> bool:
  return len(sample_shape) == len(mask_shape) + 1 and tuple(sample_shape[:-1]) == tuple(mask_shape)


def _is_shape(v: Any) -> bool:
  return isinstance(v, tuple | list) and all(isinstance(d, int | np.integer) for d in v)


def ltx_token_timesteps(
  t: jax.Array, conditioning: jax.Array, *, rule: str = "keep", num_train_timesteps: int = 1000
) -> jax.Array:
  """The per-token timesteps the model sees: `[R]` row timesteps and a `[R, *tokens]` mask →
  `[R, *tokens]` (`t (1 - c)` for "keep", `min(t, (1 - c) T)` for "per_token")."""
  t = jnp.asarray(t, jnp.float32).reshape((-1,) + (1,) * (conditioning.ndim - 1))
  c = jnp.asarray(conditioning, jnp.float32)
  if rule == "keep":
    return t * (1 - c)
  if rule == "per_token":
    return jnp.minimum(t, (1 - c) * float(num_train_timesteps))
  raise ValueError(f"rule={rule!r}: expected one of {LTX_TOKEN_RULES}")


def _noised(tables: dict, timesteps: jax.Array, i, sample: jax.Array) -> jax.Array:
  """The sample with its hard-conditioned tokens set to call `i`'s noised clean latents."""
  c = tables["conditioning"]
  hard = (c > 1.0 - 1e-6)[..., None]
  t = timesteps[i].astype(jnp.float32)
  # The reference's order of operations: clean + scale * eps * (t / 1000)^2.
  noised = (
    tables["cond_latents"]
    + tables["cond_noise_scale"][i] * tables["cond_noise"][i] * (t / 1000.0) ** 2
  )
  return jnp.where(hard, noised.astype(sample.dtype), sample)


def ltx_token_noised(state: _base.SchedulerState, sample: jax.Array) -> jax.Array:
  """The sample the first model call sees: with conditioning noise (`init(..., cond_noise=...)`), the
  hard-conditioned tokens (`c = 1`) set to `clean + s * eps * (t / 1000)^2` of the state's current call;
  otherwise `sample` unchanged. Later calls get theirs from `step`."""
  if "cond_noise" not in state.tables:
    return sample
  return _noised(state.tables, state.timesteps, state.step, sample)


def ltx_token_euler(*, rule: str = "keep", **config: Any) -> _base.Scheduler:
  """Flow-match Euler where conditioning tokens keep their value or move at their own noise level.

  Args:
    rule: "keep" or "per_token" (see the module docstring).
    **config: flow-match Euler's options (`FlowMatchEulerDiscreteScheduler`'s config; deterministic:
      `stochastic_sampling` must be False).

  Returns:
    A Scheduler; `init(num_inference_steps=None, *, sigmas=None, timesteps=None, mu=None,
    conditioning=None, shape=None, cond_latents=None, cond_noise=None, cond_noise_scale=0.0)`:
    `conditioning` `[B, *tokens]` (None: every token moves, plain flow-match Euler), `shape` the sample's
    shape or a pytree of the leaves' shapes to check it against; `cond_latents` `[B, *tokens, C]` the
    clean conditioning latents and `cond_noise` `[num_calls, B, *tokens, C]` the standard-normal noise of
    each call, for the conditioning noise (see the module docstring; with a `cond_noise_scale`).
  """
  name = "LTXTokenEulerScheduler"
  if rule not in LTX_TOKEN_RULES:
    raise ValueError(f"{name}: rule={rule!r}; expected one of {LTX_TOKEN_RULES}")
  cfg = _base.merge_config(name, _flow_match.FLOW_MATCH_EULER_DEFAULTS, config)
  if cfg["stochastic_sampling"]:
    raise ValueError(f"{name} is deterministic: stochastic_sampling=True is not supported")
  _base.check_choice(name, "time_shift_type", cfg["time_shift_type"], ("exponential", "linear"))
  _base.convert_sigmas(cfg, np.ones(2), 2)
  n_train = float(cfg["num_train_timesteps"])

  def init(
    num_inference_steps=None,
    *,
    sigmas=None,
    timesteps=None,
    mu=None,
    conditioning=None,
    shape=None,
    cond_latents=None,
    cond_noise=None,
    cond_noise_scale=0.0,
    dtype=jnp.float32,
  ):
    del dtype
    ts, s = _flow_match.flow_sigmas(
      cfg, num_inference_steps, sigmas=sigmas, timesteps=timesteps, mu=mu
    )
    tables = {}
    if conditioning is not None:
      c = np.asarray(conditioning, np.float32)
      if c.ndim < 2:
        raise ValueError(f"{name}: conditioning must be [B, *tokens], got shape {c.shape}")
      if shape is not None:
        leaves = jax.tree.leaves(shape, is_leaf=_is_shape)
        fits = [tuple(v) for v in leaves if _fits(c.shape, tuple(v))]
        if len(fits) != 1:
          raise ValueError(
            f"{name}: conditioning {c.shape} must fit exactly one sample leaf ([B, *tokens, C]); "
            f"the leaves are {[tuple(v) for v in leaves]}"
          )
      tables["conditioning"] = c
    if (cond_latents is None) != (cond_noise is None):
      raise ValueError(f"{name}: conditioning noise needs both cond_latents and cond_noise")
    if cond_noise is not None:
      if conditioning is None:
        raise ValueError(f"{name}: conditioning noise needs the conditioning mask")
      clean, eps = np.asarray(cond_latents, np.float32), np.asarray(cond_noise, np.float32)
      if not _fits(tables["conditioning"].shape, clean.shape):
        raise ValueError(
          f"{name}: cond_latents {clean.shape} must be [B, *tokens, C] for the conditioning mask "
          f"{tables['conditioning'].shape}"
        )
      if eps.shape != (len(ts), *clean.shape):
        raise ValueError(
          f"{name}: cond_noise must be [num_calls, B, *tokens, C] = {(len(ts), *clean.shape)}, got "
          f"{eps.shape}"
        )
      tables["cond_latents"], tables["cond_noise"] = clean, eps
      tables["cond_noise_scale"] = np.full((len(ts),), cond_noise_scale, np.float32)
    return _base.make_state(timesteps=ts, sigmas=s, tables=tables)

  def step(state, model_output, sample, key=None, *, noise=None):
    del key, noise
    i = state.step
    dtype = sample.dtype
    x = sample.astype(jnp.float32)
    v = model_output.astype(jnp.float32)
    c = state.tables.get("conditioning")
    if c is None or not _fits(c.shape, sample.shape):
      moved = x + (state.sigmas[i + 1] - state.sigmas[i]) * v
    elif rule == "keep":
      moved = x + (state.sigmas[i + 1] - state.sigmas[i]) * v
      moved = jnp.where(c[..., None] > 0.5, x, moved)
    else:
      t = state.timesteps[i].astype(jnp.float32)
      current = jnp.minimum(t, (1 - c) * n_train) / n_train  # each token's noise level
      levels = state.sigmas.reshape((-1,) + (1,) * c.ndim)
      nxt = jnp.max((levels < current[None] - 1e-6) * levels, axis=0)  # the next lower level
      moved = x + (current - nxt)[..., None] * (-v)
      reached = (t / n_train - 1e-6 < (1 - c))[..., None]
      moved = jnp.where(reached, moved, x)
    if "cond_noise" in state.tables and c is not None and _fits(c.shape, sample.shape):
      # The next call's conditioning noise (none after the last call).
      last = state.timesteps.shape[0] - 1
      nxt = jnp.minimum(i + 1, last)
      moved = jnp.where(i < last, _noised(state.tables, state.timesteps, nxt, moved), moved)
    return moved.astype(dtype), state._replace(step=i + 1)

  return _base.Scheduler(name, cfg, init, step, _base.identity_scale, False, None)
