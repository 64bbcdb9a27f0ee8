import itertools

import pytest

import md_data as mdd


def test_split_partitions_the_combinations():
  train, held, every = mdd.split("train"), mdd.split("held_out"), mdd.split("all")
  assert set(held) == set(mdd.HELD_OUT)
  assert not set(train) & set(held)
  assert set(train) | set(held) == set(every) == set(itertools.product(mdd.COLOURS, mdd.SHAPES))
  # Every colour and every shape is still seen in training.
  assert {c for c, _ in train} == set(mdd.COLOURS)
  assert {s for _, s in train} == set(mdd.SHAPES)


def test_unknown_split():
  with pytest.raises(ValueError, match="unknown split 'test'.*'train', 'held_out', 'all'"):
    mdd.split("test")


@pytest.mark.parametrize("colour, shape", mdd.split("all"))
def test_caption_round_trip(colour, shape):
  for background in mdd.BACKGROUNDS:
    for position in mdd.POSITIONS:
      label = mdd.ShapeLabel(colour, shape, background, position=position)
      assert mdd.parse_caption(mdd.caption(label)) == mdd.Caption(*label)
    for direction in mdd.DIRECTIONS:
      label = mdd.ShapeLabel(colour, shape, background, direction=direction)
      assert mdd.parse_caption(mdd.caption(label)) == mdd.Caption(*label)


def test_caption_words():
  label = mdd.ShapeLabel("blue", "square", "white", position="top left")
  assert mdd.caption(label) == "a blue square in the top left on a white background"
  label = mdd.ShapeLabel("red", "circle", "black", direction="right")
  assert mdd.caption(label) == "a red circle moving right on a black background"


def test_short_forms():
  assert mdd.parse_caption("a green triangle moving up") == mdd.Caption(
    "green", "triangle", direction="up"
  )
  assert mdd.parse_caption("Yellow star.") == mdd.Caption("yellow", "star")
  assert mdd.parse_caption("a purple diamond, in the centre, on a grey background") == mdd.Caption(
    "purple", "diamond", "gray", "center"
  )
  assert mdd.parse_caption("a red circle on a white background") == mdd.Caption(
    "red", "circle", "white"
  )
  assert mdd.parse_caption("a red circle at the bottom") == mdd.Caption(
    "red", "circle", position="bottom"
  )


def test_unknown_word_names_it_and_the_vocabulary():
  with pytest.raises(ValueError, match=r"unknown word 'hexagon'.*knows only \(.*'circle'"):
    mdd.parse_caption("a red hexagon in the center")


@pytest.mark.parametrize(
  "text, match",
  [
    ("a circle", "expected a colour .* got 'circle'"),
    ("a red", "expected a shape .* got the end"),
    ("a red circle moving", "expected a direction .*left, right, up, down.* got the end"),
    ("a red circle in the top top", "expected 'on'.* got 'top'"),
    ("a red circle on a red background", "expected a background colour .* got 'red'"),
    ("a red circle on a black background moving", "expected the end of the caption at word 8"),
  ],
)
def test_misplaced_word(text, match):
  with pytest.raises(ValueError, match=match):
    mdd.parse_caption(text)


def test_bad_labels():
  with pytest.raises(ValueError, match="label colour 'pink' is not one of"):
    mdd.caption(mdd.ShapeLabel("pink", "circle", "black", position="top"))
  with pytest.raises(ValueError, match="exactly one of position"):
    mdd.caption(mdd.ShapeLabel("red", "circle", "black"))
  with pytest.raises(TypeError, match="a caption is a str"):
    mdd.parse_caption(None)


@pytest.mark.parametrize(
  "prompt, kind",
  [
    ("a green triangle moving up on a black background", "video"),
    ("A red circle, in the top left, on a white background.", "image"),
    ("a purple star on a gray background", None),
    ("a blue square at the bottom on a white background", None),
  ],
)
def test_prompt_warning_none_for_what_the_models_draw(prompt, kind):
  assert mdd.prompt_warning(prompt, kind=kind) is None


@pytest.mark.parametrize(
  "prompt, kind, reason",
  [
    ("a cat surfing", "video", "unknown word 'cat'"),
    ("a green triangle moving up", "video", "no background"),
    (
      "a red circle in the top left on a blue background",
      "image",
      "'blue' where the grammar expects a background colour",
    ),
    ("red red", None, "'red' where the grammar expects a shape"),
    (
      "a red circle in the top left on a white background",
      "video",
      "a position, where the video model",
    ),
    ("a red circle moving up on a white background", "image", "a direction, where the image model"),
  ],
)
def test_prompt_warning_says_why_and_names_the_grammar(prompt, kind, reason):
  warning = mdd.prompt_warning(prompt, kind=kind)
  assert "\n" not in warning
  assert warning.startswith(f"prompt {prompt!r} is outside") and reason in warning
  for word in (*mdd.COLOURS, *mdd.SHAPES, *mdd.BACKGROUNDS):
    assert word in warning
  assert all(d in warning for d in mdd.DIRECTIONS) == (kind != "image")
  assert ("top left" in warning.split("They know")[1]) == (kind != "video")
  example = warning.split('e.g. "')[1].rstrip('"')
  assert mdd.prompt_warning(example, kind=kind) is None  # the example it gives is drawable


def test_prompt_warning_rejects_an_unknown_kind():
  with pytest.raises(ValueError, match="kind='audio'; expected 'image', 'video' or None"):
    mdd.prompt_warning("a red circle on a white background", kind="audio")
