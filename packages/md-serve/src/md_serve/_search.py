"""Inference-time search: spend more denoiser calls on one prompt, keep the sample a verifier scores best.

Three searches over what the sampler does not fix:
- `random`: rounds of fresh initial noises, the pool doubling each round (1, 2, 4, ...), until the budget
  of samples is spent; the first candidate is the request's own seed.
- `zero_order`: from the seed's noise, each round tries `neighbours` points near the current best (a step
  of size `step_size` on the Gaussian's sphere, `(x + λ·ε) / sqrt(1 + λ²)`) and moves when one is better.
- `path`: the initial noise fixed, search over the noise a stochastic scheduler injects along the path
  (EulerAncestral by default): each candidate is another sampler seed.

A verifier has `score(images, prompts) -> [N] floats` (higher is better). `ShapesVerifier` is md-data's
shapes analyser (agreement with a shapes-grammar caption); `ClipVerifier` is the CLIP cosine of image and
prompt with a local CLIP checkpoint. Budget = samples generated; each sample costs `pipe.last_calls`
denoiser calls, and `SearchResult.history` records (denoiser calls so far, best score so far).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, Protocol

import numpy as np

from md_serve._models import noise_spec

METHODS = ("random", "zero_order", "path")


class Verifier(Protocol):
  """Scores samples against their prompts; higher is better."""

  def score(self, images: np.ndarray, prompts: Sequence[str]) -> np.ndarray:
    """Args: images `[N, H, W, 3]` (or videos `[N, F, H, W, 3]`) in [0, 1]; N prompts. Returns `[N]`."""
    ...


class SearchResult(NamedTuple):
  """The best sample a search found.

  Attributes:
    images: `[n, H, W, 3]` (or `[n, F, H, W, 3]`): the best sample(s), best first.
    scores: `[n]` their verifier scores.
    latents: the best sample's initial noise (the pipeline's `latents=` layout, one row).
    seed: the sampler seed of the best sample.
    samples: how many samples were generated.
    calls: denoiser calls spent (samples × the loop's calls per sample).
    history: `[(calls so far, best score so far)]` after each round.
  """

  images: np.ndarray
  scores: np.ndarray
  latents: np.ndarray
  seed: int
  samples: int
  calls: int
  history: tuple[tuple[int, float], ...]


class ShapesVerifier:
  """md-data's shapes analyser as a verifier: the share of the caption's attributes (colour, shape,
  position, background, direction) the analyser sees in each sample (`md_data.score`)."""

  def score(self, images: np.ndarray, prompts: Sequence[str]) -> np.ndarray:
    import md_data  # noqa: PLC0415

    out = []
    for image, prompt in zip(images, prompts, strict=True):
      s = md_data.score([np.asarray(image)], [prompt])
      rates = [
        r for r in (s.colour, s.shape, s.position, s.direction, s.background) if r is not None
      ]
      out.append(float(np.mean(rates)) if rates else 0.0)
    return np.asarray(out, np.float32)


class ClipVerifier:
  """CLIP score: the cosine of the projected image and prompt embeddings (needs md-text and a local CLIP
  folder with `tokenizer/`, a `CLIPTextModelWithProjection` and a `CLIPVisionModelWithProjection`).

  Args:
    source: the CLIP folder (or a diffusers folder holding these components).
    text_subfolder: the text encoder's folder.
    image_subfolder: the image encoder's folder.
  """

  def __init__(
    self,
    source: Any,
    *,
    text_subfolder: str = "text_encoder",
    image_subfolder: str = "image_encoder",
    tokenizer_subfolder: str = "tokenizer",
  ):
    import md_text  # noqa: PLC0415

    self._md_text = md_text
    self.text = md_text.load_clip_text(
      source, subfolder=text_subfolder, with_projection=True, progress=False
    )
    self.vision = md_text.load_clip_vision(
      source, subfolder=image_subfolder, with_projection=True, progress=False
    )
    self.tokenizer = md_text.load_tokenizer(source, subfolder=tokenizer_subfolder)
    self.image_size = int(self.vision.config.image_size)

  def score(self, images: np.ndarray, prompts: Sequence[str]) -> np.ndarray:
    images = np.asarray(images, np.float32)
    if images.ndim == 5:  # videos: the middle frame
      images = images[:, images.shape[1] // 2]
    pixels = self._md_text.clip_image_preprocess(
      list((np.clip(images, 0, 1) * 255).astype(np.uint8)), size=self.image_size
    )
    if pixels.shape[1] == 3:
      pixels = self._md_text.nchw_to_nhwc(pixels)
    tokens = self._md_text.tokenize(self.tokenizer, list(prompts))
    t = np.array(self.text(tokens.ids, attention_mask=tokens.mask).text_embeds, np.float32)
    v = np.array(self.vision(pixels).image_embeds, np.float32)
    t /= np.linalg.norm(t, axis=-1, keepdims=True) + 1e-8
    v /= np.linalg.norm(v, axis=-1, keepdims=True) + 1e-8
    return np.sum(t * v, axis=-1)


def _sphere_step(x: np.ndarray, eps: np.ndarray, size: float) -> np.ndarray:
  """A point near `x` that is still a standard normal draw: `(x + λ ε) / sqrt(1 + λ²)`."""
  return (x + size * eps) / math.sqrt(1.0 + size * size)


def search(
  pipe: Any,
  prompt: str,
  verifier: Verifier,
  budget: int,
  *,
  method: str = "random",
  seed: int = 0,
  n: int = 1,
  height: int | None = None,
  width: int | None = None,
  num_frames: int | None = None,
  neighbours: int = 4,
  step_size: float = 0.5,
  path_scheduler: str = "EulerAncestralDiscreteScheduler",
  max_batch: int = 4,
  pad: bool = True,
  callback: Callable[[int, int, float], Any] | None = None,
  **call_kwargs: Any,
) -> SearchResult:
  """Generates up to `budget` samples for `prompt` and returns the `n` the verifier scores best.

  Args:
    pipe: an md pipeline with per-row noise (md-sd, md-wan, md-flux, LTX-Video; `md_serve.noise_spec`).
    prompt: the prompt.
    verifier: `score(images, prompts) -> [N]`.
    budget: samples to generate (at least `n`); budget 1 is the plain seed-`seed` sample.
    method: "random", "zero_order" or "path" (module docstring).
    seed: the first candidate's noise seed (and the sampler seed, except in `path`).
    n: samples to return.
    height: pixels (default: the pipeline's default size).
    width: pixels.
    num_frames: frames (video pipelines).
    neighbours: `zero_order`: candidates per round.
    step_size: `zero_order`: λ, the neighbourhood's size.
    path_scheduler: `path`: the stochastic scheduler (the pipeline must take `scheduler=`).
    max_batch: rows per pipeline call.
    pad: pad every call to `max_batch` rows (one compiled shape; the padding rows are not candidates and
      their calls are not counted).
    callback: `callback(samples, budget, best score)` after each round.
    **call_kwargs: passed to every pipeline call (`num_inference_steps`, `guidance_scale`, `loras`...).

  Returns:
    `SearchResult`.

  Raises:
    ValueError: an unknown method, a budget below `n`, or a pipeline without per-row noise.
  """
  if method not in METHODS:
    raise ValueError(f"search: method={method!r}; expected one of {METHODS}")
  if int(budget) < max(1, n):
    raise ValueError(f"search: budget={budget} must be at least n={n} (and 1)")
  spec = noise_spec(pipe)
  if spec is None:
    raise ValueError(f"search: {type(pipe).__name__} has no per-row noise md-serve knows")
  if height is None or width is None:
    size = pipe.default_size or 512
    height, width = height or size, width or size
  frames = num_frames or 1
  kwargs = dict(call_kwargs, height=height, width=width, progress=False)
  if spec.kind == "video":
    kwargs["num_frames"] = frames
  if method == "path":
    kwargs.setdefault("scheduler", path_scheduler)
  rows: list[tuple[float, np.ndarray, np.ndarray, int]] = []  # (score, image, latents, seed)
  calls, history = 0, []

  def run(latents: np.ndarray, sampler_seeds: list[int]) -> list[tuple[float, np.ndarray, int]]:
    nonlocal calls
    out = []
    # One call per sampler seed (the seed is per call); rows of one call share it.
    for s in sorted(set(sampler_seeds)):
      idx = [i for i, t in enumerate(sampler_seeds) if t == s]
      for lo in range(0, len(idx), max_batch):
        part = idx[lo : lo + max_batch]
        lat = latents[part]
        if pad and len(part) < max_batch:  # one batch shape: one compiled program for every round
          lat = np.concatenate([lat, np.zeros((max_batch - len(part), *lat.shape[1:]), lat.dtype)])
        images = np.asarray(pipe([prompt] * len(lat), latents=lat, seed=s, **kwargs))[: len(part)]
        calls += int(pipe.last_calls) * len(part)
        scores = np.asarray(verifier.score(images, [prompt] * len(part)), np.float64)
        out += [(float(sc), img, i) for sc, img, i in zip(scores, images, part)]
    return out

  def noise(s: int) -> np.ndarray:
    return spec.draw(s, 1, height, width, frames)

  spent, round_ = 0, 0
  rng = np.random.default_rng(seed)
  current = noise(seed)
  while spent < budget:
    left = budget - spent
    if method == "random":
      pool = min(2**round_, left)
      lat = np.concatenate([noise(seed + spent + i) for i in range(pool)])
      seeds = [seed] * pool
    elif method == "zero_order":
      pool = 1 if round_ == 0 else min(neighbours, left)
      if round_ == 0:
        lat = current
      else:
        eps = rng.standard_normal((pool, *current.shape[1:])).astype(np.float32)
        lat = np.stack([_sphere_step(current[0], e, step_size) for e in eps]).astype(np.float32)
      seeds = [seed] * pool
    else:  # path: the same initial noise, other sampler seeds
      pool = min(2**round_, left)
      lat = np.concatenate([current] * pool)
      seeds = [seed + spent + i for i in range(pool)]
    results = run(lat, seeds)
    for score, image, i in results:
      rows.append((score, image, lat[i : i + 1], seeds[i]))
    best = max(rows, key=lambda r: r[0])
    if method == "zero_order":
      current = best[2]
    spent += pool
    round_ += 1
    history.append((calls, best[0]))
    if callback is not None:
      callback(spent, int(budget), best[0])
  ranked = sorted(rows, key=lambda r: -r[0])[:n]
  return SearchResult(
    images=np.stack([r[1] for r in ranked]),
    scores=np.asarray([r[0] for r in ranked], np.float32),
    latents=ranked[0][2],
    seed=int(ranked[0][3]),
    samples=spent,
    calls=calls,
    history=tuple(history),
  )
