"""md-data: datasets and input pipelines for md.

The shapes dataset and its analyser; MaxDiffusion's TFRecord layouts (tf.data reader, TensorFlow-free
writer); the grain pipeline over folders and ArrayRecord files; synthetic batches; per-process batches as
global arrays; cached-latent shards for apps/prepare_data.
"""

from md_data._analyse import Analysis, Scores, analyse, score
from md_data._example import decode_example, encode_example, parse_tensor, serialize_tensor
from md_data._global import DATA_AXES, BatchSizes, GlobalBatches, batch_sizes
from md_data._grain import GrainIterator, stack_batch
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
  grammar_summary,
  parse_caption,
  prompt_warning,
  split,
  vocabulary,
)
from md_data._prepare import ShardReport, shard_name, write_latent_shards
from md_data._render import render_shape
from md_data._shapes import ShapesBatch, ShapesConfig, ShapesIterator, ShapesSample, shapes_sample
from md_data._sources import (
  ArrayRecordSource,
  FolderSource,
  ShapesSource,
  TFRecordImageSource,
  write_array_record,
)
from md_data._synthetic import FAMILY_SHAPES, SyntheticConfig, SyntheticIterator
from md_data._tfrecord import (
  CAPTION_FEATURES,
  IMAGE_FEATURE,
  LATENT_FEATURES,
  TIMESTEPS_FEATURE,
  TFRecordIterator,
  image_example,
  iter_tfrecord,
  latent_example,
  read_image_records,
  read_latent_records,
  write_tfrecord,
)

__all__ = [
  "BACKGROUNDS",
  "CAPTION_FEATURES",
  "COLOURS",
  "DATA_AXES",
  "DIRECTIONS",
  "FAMILY_SHAPES",
  "HELD_OUT",
  "IMAGE_FEATURE",
  "LATENT_FEATURES",
  "POSITIONS",
  "POSITION_PHRASES",
  "SHAPES",
  "SPLITS",
  "TIMESTEPS_FEATURE",
  "Analysis",
  "ArrayRecordSource",
  "BatchSizes",
  "Caption",
  "FolderSource",
  "GlobalBatches",
  "GrainIterator",
  "Scores",
  "ShapeLabel",
  "ShapesBatch",
  "ShapesConfig",
  "ShapesIterator",
  "ShapesSample",
  "ShapesSource",
  "ShardReport",
  "SyntheticConfig",
  "SyntheticIterator",
  "TFRecordImageSource",
  "TFRecordIterator",
  "analyse",
  "batch_sizes",
  "caption",
  "grammar_summary",
  "decode_example",
  "encode_example",
  "image_example",
  "iter_tfrecord",
  "latent_example",
  "parse_caption",
  "prompt_warning",
  "parse_tensor",
  "read_image_records",
  "read_latent_records",
  "score",
  "serialize_tensor",
  "shapes_sample",
  "render_shape",
  "shard_name",
  "split",
  "stack_batch",
  "vocabulary",
  "write_array_record",
  "write_latent_shards",
  "write_tfrecord",
]
