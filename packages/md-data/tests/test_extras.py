import sys

import numpy as np
import pytest

import md_data as mdd


def test_tfrecord_reader_names_its_extra(tmp_path, monkeypatch):
  mdd.write_tfrecord(tmp_path / "a.tfrecord", [mdd.latent_example(np.zeros(2), np.zeros((1, 2)))])
  monkeypatch.setitem(sys.modules, "tensorflow", None)  # as if not installed
  with pytest.raises(ImportError, match=r"pip install 'md-data\[tfrecord\]'"):
    mdd.read_latent_records(tmp_path, batch_size=1)


def test_grain_pipeline_names_its_extra(monkeypatch):
  monkeypatch.setitem(sys.modules, "grain", None)
  source = mdd.ShapesSource(count=2)  # sources of pictures need no grain
  with pytest.raises(ImportError, match=r"pip install 'md-data\[grain\]'"):
    mdd.GrainIterator(source, batch_size=1)
