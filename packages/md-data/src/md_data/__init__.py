"""md-data: datasets and input pipelines for md. This part: the procedural shapes dataset and its analyser."""

from md_data._analyse import Analysis, Scores, analyse, score
from md_data._grammar import (
  BACKGROUNDS,
  COLOURS,
  DIRECTIONS,
  HELD_OUT,
  POSITION_PHRASES,
  POSITIONS,
  SHAPES,
  SPLITS,
  Caption,
  ShapeLabel,
  caption,
  parse_caption,
  split,
  vocabulary,
)
from md_data._shapes import ShapesBatch, ShapesConfig, ShapesIterator, ShapesSample, shapes_sample

__all__ = [
  "BACKGROUNDS",
  "COLOURS",
  "DIRECTIONS",
  "HELD_OUT",
  "POSITION_PHRASES",
  "POSITIONS",
  "SHAPES",
  "SPLITS",
  "Analysis",
  "Caption",
  "Scores",
  "ShapeLabel",
  "ShapesBatch",
  "ShapesConfig",
  "ShapesIterator",
  "ShapesSample",
  "analyse",
  "caption",
  "parse_caption",
  "score",
  "shapes_sample",
  "split",
  "vocabulary",
]
