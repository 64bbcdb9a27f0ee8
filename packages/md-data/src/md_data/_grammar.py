"""The shapes vocabulary, the held-out split and the caption grammar.

A caption names one shape, then where it is (images) or where it goes (videos), then the background::

  caption    := ["a" | "an"] COLOUR SHAPE [place] [background]
  place      := ("in" | "at" | "on") "the" POSITION | "moving" DIRECTION
  background := "on" ["a" | "an"] BACKGROUND "background"

`caption(label)` writes the full form ("a red circle in the top left on a black background");
`parse_caption` also reads the short forms a user types ("a green triangle moving up").
"""

from __future__ import annotations

import re
from typing import NamedTuple

import numpy as np

# Shape colours, RGB in [0, 1]. Chosen far from each other and from every background (the analyser names
# the nearest one), so a colour never disappears into its background.
COLOURS: dict[str, tuple[float, float, float]] = {
  "red": (0.9, 0.1, 0.1),
  "green": (0.1, 0.75, 0.2),
  "blue": (0.15, 0.3, 0.95),
  "yellow": (0.95, 0.85, 0.1),
  "purple": (0.6, 0.15, 0.85),
}
BACKGROUNDS: dict[str, tuple[float, float, float]] = {
  "black": (0.0, 0.0, 0.0),
  "white": (1.0, 1.0, 1.0),
  "gray": (0.45, 0.45, 0.45),
}
SHAPES: tuple[str, ...] = ("circle", "square", "triangle", "diamond", "star")
# The 3×3 grid, row-major from the top left; `POSITION_PHRASES` gives each cell's words in a caption.
POSITIONS: tuple[str, ...] = (
  "top left",
  "top",
  "top right",
  "left",
  "center",
  "right",
  "bottom left",
  "bottom",
  "bottom right",
)
POSITION_PHRASES: dict[str, str] = {
  "top left": "in the top left",
  "top": "at the top",
  "top right": "in the top right",
  "left": "on the left",
  "center": "in the center",
  "right": "on the right",
  "bottom left": "in the bottom left",
  "bottom": "at the bottom",
  "bottom right": "in the bottom right",
}
DIRECTIONS: tuple[str, ...] = ("left", "right", "up", "down")

# Colour × shape combinations never drawn for training: one per colour and one per shape, so every colour and
# every shape is still seen in training (with four partners each). Models are tested on them for composition.
HELD_OUT: frozenset[tuple[str, str]] = frozenset(
  {
    ("red", "star"),
    ("green", "circle"),
    ("blue", "triangle"),
    ("yellow", "diamond"),
    ("purple", "square"),
  }
)
SPLITS: tuple[str, ...] = ("train", "held_out", "all")


def split(name: str) -> tuple[tuple[str, str], ...]:
  """The colour × shape combinations of a split, in a fixed order.

  Args:
    name: "train" (every combination but `HELD_OUT`), "held_out" (exactly `HELD_OUT`) or "all".

  Returns:
    `(colour, shape)` pairs, colours in `COLOURS` order, shapes in `SHAPES` order.

  Raises:
    ValueError: for an unknown split name.
  """
  if name not in SPLITS:
    raise ValueError(f"unknown split {name!r}; expected one of {SPLITS}")
  pairs = [(c, s) for c in COLOURS for s in SHAPES]
  if name == "train":
    return tuple(p for p in pairs if p not in HELD_OUT)
  if name == "held_out":
    return tuple(p for p in pairs if p in HELD_OUT)
  return tuple(pairs)


class ShapeLabel(NamedTuple):
  """What one sample shows: the ground truth a caption is written from.

  `position` is set for images and `direction` for videos; the other one is None.
  """

  colour: str
  shape: str
  background: str
  position: str | None = None
  direction: str | None = None


class Caption(NamedTuple):
  """A parsed caption: each field is None where the caption does not say."""

  colour: str | None = None
  shape: str | None = None
  background: str | None = None
  position: str | None = None
  direction: str | None = None


def caption(label: ShapeLabel) -> str:
  """The full caption of a label, e.g. "a blue square in the top left on a white background"."""
  _check_label(label)
  words = ["a", label.colour, label.shape]
  if label.position is not None:
    words.append(POSITION_PHRASES[label.position])
  if label.direction is not None:
    words += ["moving", label.direction]
  words += ["on a", label.background, "background"]
  return " ".join(words)


def _check_label(label: ShapeLabel) -> None:
  for field, vocab in (("colour", COLOURS), ("shape", SHAPES), ("background", BACKGROUNDS)):
    if getattr(label, field) not in vocab:
      raise ValueError(f"label {field} {getattr(label, field)!r} is not one of {tuple(vocab)}")
  if label.position is not None and label.position not in POSITIONS:
    raise ValueError(f"label position {label.position!r} is not one of {POSITIONS}")
  if label.direction is not None and label.direction not in DIRECTIONS:
    raise ValueError(f"label direction {label.direction!r} is not one of {DIRECTIONS}")
  if (label.position is None) == (label.direction is None):
    raise ValueError(
      f"a label has exactly one of position (image) or direction (video), got {label}"
    )


_ARTICLES = ("a", "an")
_PREPOSITIONS = ("in", "at", "on")
_POSITION_WORDS = ("top", "bottom", "left", "right", "center")
_ALIASES = {"grey": "gray", "centre": "center", "middle": "center"}


def vocabulary() -> tuple[str, ...]:
  """Every word the caption grammar knows, sorted."""
  words = {*_ARTICLES, *_PREPOSITIONS, "the", "moving", "background", *_ALIASES}
  words |= {*COLOURS, *SHAPES, *BACKGROUNDS, *_POSITION_WORDS, *DIRECTIONS}
  return tuple(sorted(words))


def parse_caption(text: str) -> Caption:
  """Reads a caption of the shapes grammar (module docstring) into its parts.

  Args:
    text: e.g. "a red circle moving right on a black background" or "A blue square, in the top left."
      Case, commas and a final full stop are ignored; "grey", "centre" and "middle" are read as "gray"
      and "center".

  Returns:
    A `Caption`; the parts the text leaves out are None.

  Raises:
    ValueError: naming the unknown or misplaced word, what was expected there, and the vocabulary.
  """
  if not isinstance(text, str):
    raise TypeError(f"a caption is a str, got {type(text).__name__}")
  words = [_ALIASES.get(w, w) for w in re.findall(r"[a-z]+", text.lower())]
  unknown = [
    w for w in re.findall(r"[^\s,.]+", text.lower()) if _ALIASES.get(w, w) not in vocabulary()
  ]
  if unknown:
    raise ValueError(
      f"caption {text!r}: unknown word {unknown[0]!r}; the shapes grammar knows only {vocabulary()}"
    )
  pos = 0

  def peek() -> str | None:
    return words[pos] if pos < len(words) else None

  def take(allowed, what: str) -> str:
    nonlocal pos
    w = peek()
    if w not in allowed:
      got = "the end" if w is None else repr(w)
      options = f" ({', '.join(allowed)})" if allowed else ""
      raise ValueError(
        f"caption {text!r}: expected {what}{options} at word {pos + 1}, got {got}; "
        f"grammar: [a] COLOUR SHAPE [in/at/on the POSITION | moving DIRECTION] [on a BACKGROUND background]"
      )
    pos += 1
    return w

  if peek() in _ARTICLES:
    take(_ARTICLES, "an article")
  colour = take(tuple(COLOURS), "a colour")
  shape = take(SHAPES, "a shape")
  position = direction = background = None
  if peek() == "moving":
    take(("moving",), "'moving'")
    direction = take(DIRECTIONS, "a direction")
  elif peek() in _PREPOSITIONS and pos + 1 < len(words) and words[pos + 1] == "the":
    take(_PREPOSITIONS, "a preposition")
    take(("the",), "'the'")
    cell = [take(_POSITION_WORDS, "a position word")]
    if cell[0] in ("top", "bottom") and peek() in ("left", "right"):
      cell.append(take(("left", "right"), "left or right"))
    position = " ".join(cell)
  if peek() is not None:
    take(("on",), "'on'")
    if peek() in _ARTICLES:
      take(_ARTICLES, "an article")
    background = take(tuple(BACKGROUNDS), "a background colour")
    take(("background",), "'background'")
  if peek() is not None:
    take((), "the end of the caption")
  return Caption(colour, shape, background, position, direction)


def grammar_summary(kind: str | None = None) -> str:
  """One line naming what the shapes grammar knows: colours, shapes, directions (videos), positions
  (images) and backgrounds, with an example prompt of `kind` ("image", "video" or None for both)."""
  parts = [f"colours {', '.join(COLOURS)}", f"shapes {', '.join(SHAPES)}"]
  if kind in (None, "video"):
    parts.append(f"directions (videos: moving …) {', '.join(DIRECTIONS)}")
  if kind in (None, "image"):
    parts.append(f"positions (images: in the …) {', '.join(POSITIONS)}")
  parts.append(f"backgrounds {', '.join(BACKGROUNDS)}")
  example = {
    "video": "a green triangle moving up on a black background",
    "image": "a red circle in the top left on a white background",
  }.get(kind, "a red circle in the top left on a white background")
  return "; ".join(parts) + f'; e.g. "{example}"'


def prompt_warning(prompt: str, *, kind: str | None = None) -> str | None:
  """A one-line warning for a prompt md's default shapes models cannot draw, or None for one they can.

  The default models (models/shapes-sd, models/shapes-wan) were trained on captions of this grammar
  only, each naming its background: a prompt with another word, a missing colour, shape or background, a
  position for the video model or a direction for the image model gets a warning that says why and names
  what the grammar knows.

  Args:
    prompt: the prompt as typed.
    kind: "image" (positions), "video" (directions) or None (either).

  Returns:
    None, or one line: the reason, then the grammar's words and an example.

  Raises:
    ValueError: for a `kind` other than "image", "video" or None.
  """
  if kind not in (None, "image", "video"):
    raise ValueError(f"prompt_warning: kind={kind!r}; expected 'image', 'video' or None")
  reason = None
  try:
    parsed = parse_caption(prompt)
  except (TypeError, ValueError) as err:
    unknown = re.search(r"unknown word ('[^']*')", str(err))
    misplaced = re.search(r"expected (.*?)(?: \(.*\))? at word \d+, got ([^;]*)", str(err))
    if unknown:
      reason = f"unknown word {unknown[1]}"
    elif misplaced:
      reason = f"{misplaced[2]} where the grammar expects {misplaced[1]}"
    else:
      reason = "not a caption of the shapes grammar"
  else:
    if parsed.background is None:
      reason = "no background, which every training caption names ('on a black background')"
    elif kind == "video" and parsed.position is not None:
      reason = "a position, where the video model knows motion directions ('moving up')"
    elif kind == "image" and parsed.direction is not None:
      reason = "a direction, where the image model knows positions ('in the top left')"
  if reason is None:
    return None
  return (
    f"prompt {prompt!r} is outside what md's default shapes models draw: {reason}. They know "
    f"{grammar_summary(kind)}"
  )


def palette(names) -> np.ndarray:
  """RGB rows of the named colours (shape colours or backgrounds), `[len(names), 3]` float32."""
  table = {**COLOURS, **BACKGROUNDS}
  return np.asarray([table[n] for n in names], np.float32)
