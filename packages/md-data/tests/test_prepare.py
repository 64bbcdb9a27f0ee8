import numpy as np
import pytest

import md_data as mdd

SOURCE = mdd.ShapesSource(mdd.ShapesConfig(size=24), seed=0, count=5)
calls = []


def _encode(pixels, captions):
  """A stand-in encoder: 2x2 mean pooling, and the caption lengths as states."""
  calls.append(len(captions))
  b, h, w, c = pixels.shape
  latents = pixels.reshape(b, h // 2, 2, w // 2, 2, c).mean((2, 4))
  states = np.array([[len(t)] * 3 for t in captions], np.float32)[:, None]
  return latents, states


def _want(i):
  return _encode(SOURCE[i]["pixels"][None], [SOURCE[i]["captions"]])


def test_shards_hold_every_example_in_order(tmp_path):
  calls.clear()
  report = mdd.write_latent_shards(SOURCE, _encode, tmp_path, records_per_shard=2, batch_size=2)
  assert calls == [2, 2, 2]  # the last, short batch is padded: one shape for a jitted encoder
  assert report.written == [mdd.shard_name("data", k, 3) for k in range(3)] and report.records == 5
  records = [mdd.decode_example(r) for f in report.written for r in mdd.iter_tfrecord(tmp_path / f)]
  assert len(records) == 5
  for i, r in enumerate(records):
    latents, states = _want(i)
    np.testing.assert_allclose(mdd.parse_tensor(r["latents"][0]), latents[0], rtol=1e-6)
    np.testing.assert_array_equal(mdd.parse_tensor(r["encoder_hidden_states"][0]), states[0])


def test_rerun_skips_complete_shards_and_rewrites_lost_ones(tmp_path):
  first = mdd.write_latent_shards(SOURCE, _encode, tmp_path, records_per_shard=2, batch_size=2)
  kept, lost = tmp_path / first.written[0], tmp_path / first.written[1]
  data, stamp = lost.read_bytes(), kept.stat().st_mtime_ns
  lost.unlink()
  (tmp_path / f"{lost.name}.tmp").write_bytes(b"an interrupted write")
  again = mdd.write_latent_shards(SOURCE, _encode, tmp_path, records_per_shard=2, batch_size=2)
  assert again.written == [lost.name] and again.skipped == [first.written[0], first.written[2]]
  assert lost.read_bytes() == data and kept.stat().st_mtime_ns == stamp
  assert not (tmp_path / f"{lost.name}.tmp").exists()
  with pytest.raises(ValueError, match="holds shards of another split"):
    mdd.write_latent_shards(SOURCE, _encode, tmp_path, records_per_shard=4)


def test_eval_timesteps_and_channels_first(tmp_path):
  report = mdd.write_latent_shards(
    SOURCE,
    _encode,
    tmp_path,
    indices=[3, 4],
    timesteps=[10, 500],
    channels_first=True,
    prefix="eval",
  )
  records = [mdd.decode_example(r) for r in mdd.iter_tfrecord(tmp_path / report.written[0])]
  assert [int(r["timesteps"][0]) for r in records] == [10, 500]
  np.testing.assert_allclose(
    mdd.parse_tensor(records[0]["latents"][0]), np.moveaxis(_want(3)[0][0], -1, 0), rtol=1e-6
  )


def test_corrupt_and_truncated_records_are_named(tmp_path):
  path = tmp_path / "r.tfrecord"
  mdd.write_tfrecord(path, [b"abc", b"defg"])
  assert list(mdd.iter_tfrecord(path)) == [b"abc", b"defg"]
  raw = bytearray(path.read_bytes())
  raw[13] ^= 1
  (tmp_path / "bad.tfrecord").write_bytes(bytes(raw))
  with pytest.raises(ValueError, match=r"bad\.tfrecord: corrupt record at byte 0"):
    list(mdd.iter_tfrecord(tmp_path / "bad.tfrecord"))
  (tmp_path / "cut.tfrecord").write_bytes(path.read_bytes()[:-3])
  with pytest.raises(ValueError, match=r"cut\.tfrecord: truncated record at byte 19"):
    list(mdd.iter_tfrecord(tmp_path / "cut.tfrecord"))
