"""What every family pipeline's call resolves the same way: the prompt or its precomputed embeddings,
the negative prompt (one, or one per prompt), the guidance rows, and the output type, each with one
wording of its errors.

    import md_core.call as mdc
    mdc.check_output_type(output_type)
    embeds = mdc.resolve_prompt(prompt, prompt_embeds, encode=self.encode_prompt, given=as_f32)
    neg = mdc.resolve_negative(negative_prompt, negative_prompt_embeds, embeds, encode=..., given=...)
    context = mdc.guidance_rows(embeds, neg, num_videos_per_prompt)  # [negative; positive]
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from md_core.pipeline import as_prompts

OUTPUT_TYPES = ("np", "latent")


def check_output_type(output_type: str, allowed: Sequence[str] = OUTPUT_TYPES) -> None:
  """Raises a ValueError naming the allowed output types when `output_type` is not one of them."""
  if output_type not in allowed:
    names = [repr(a) for a in allowed]
    expected = names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"
    raise ValueError(f"output_type={output_type!r}: expected {expected}")


def resolve_prompt(
  prompt: str | Sequence[str] | None,
  embeds: Any,
  *,
  encode: Callable[[list[str]], Any],
  given: Callable[[Any], Any],
  what: str = "prompt",
) -> Any:
  """`encode(prompts)` for a prompt (a string or a list), or `given(embeds)` for precomputed embeddings.

  Raises:
    ValueError: neither or both were passed.
    TypeError: a prompt that is neither a string nor a list of strings.
  """
  prompts = as_prompts(prompt, what)
  if embeds is None:
    if not prompts:
      raise ValueError(f"pass {what} (a string or a list) or {what}_embeds")
    return encode(prompts)
  if prompts:
    raise ValueError(f"pass either {what} or {what}_embeds, not both")
  return given(embeds)


def _first(tree: Any) -> jax.Array:
  return jax.tree.leaves(tree)[0]


def resolve_negative(
  negative_prompt: str | Sequence[str] | None,
  negative_embeds: Any,
  positive: Any,
  *,
  encode: Callable[[list[str]], Any],
  given: Callable[[Any], Any],
) -> Any:
  """The negative rows matching `positive` (its embeddings, the first leaf `[B, S, D]`): `given(
  negative_embeds)`, or `encode(prompts)` of the negative prompt (default the empty prompt; one is used
  for every prompt, else one per prompt).

  Raises:
    ValueError: a count of negative prompts that is neither 1 nor B, or negative embeddings of another
      shape than the prompt's.
  """
  want = _first(positive).shape
  if negative_embeds is not None:
    neg = given(negative_embeds)
  else:
    b = want[0]
    negs = as_prompts(negative_prompt, "negative_prompt") or [""]
    if len(negs) == 1 and b > 1:
      negs = negs * b
    if len(negs) != b:
      raise ValueError(f"negative_prompt has {len(negs)} entries for {b} prompts; give 1 or {b}")
    neg = encode(negs)
  got = _first(neg).shape
  if got != want:
    raise ValueError(f"negative_prompt_embeds {got} and prompt_embeds {want} must have one shape")
  return neg


def guidance_rows(positive: Any, negative: Any, per_prompt: int) -> Any:
  """The loop's text rows: each prompt's rows repeated `per_prompt` times, negative rows first
  (`[negative; positive]`) when `negative` is not None. `positive` and `negative` are pytrees of
  `[B, ...]` arrays (e.g. embeddings and their mask)."""
  rows = jax.tree.map(lambda a: jnp.repeat(a, per_prompt, axis=0), positive)
  if negative is None:
    return rows
  neg = jax.tree.map(lambda a: jnp.repeat(a, per_prompt, axis=0), negative)
  return jax.tree.map(lambda n, p: jnp.concatenate([n, p], axis=0), neg, rows)
