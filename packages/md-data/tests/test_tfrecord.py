import json

import numpy as np
import pytest
import tensorflow as tf  # noqa: E402  (a dev dependency: missing, the suite must fail, not skip)

import md_data as mdd


def _latents(i):
  rng = np.random.default_rng(i)
  return rng.normal(size=(4, 4, 3)).astype(np.float32), rng.normal(size=(6, 8)).astype(np.float32)


@pytest.fixture(scope="module")
def latent_folder(tmp_path_factory):
  folder = tmp_path_factory.mktemp("latents")
  for shard in range(3):
    mdd.write_tfrecord(
      folder / f"train-{shard}.tfrecord",
      (mdd.latent_example(*_latents(10 * shard + i)) for i in range(4)),
    )
  return folder


@pytest.mark.parametrize(
  "array",
  [
    np.arange(24, dtype=np.float32).reshape(2, 3, 4),
    np.array(2.5, np.float32),
    np.zeros((0, 3), np.float32),
    np.arange(-3, 3, dtype=np.int64),
    np.ones((2, 2), np.uint8),
  ],
  ids=["f32", "scalar", "empty", "i64", "u8"],
)
def test_serialize_tensor_is_tensorflows(array):
  ours = mdd.serialize_tensor(array)
  assert ours == tf.io.serialize_tensor(tf.constant(array)).numpy()
  np.testing.assert_array_equal(mdd.parse_tensor(ours), array)
  assert mdd.parse_tensor(ours).dtype == array.dtype


def test_example_round_trips_through_tensorflow():
  ours = mdd.encode_example(
    {"latents": b"\x00\x01", "timesteps": 999, "neg": np.array([-5, 7]), "f": 0.25, "text": "é"}
  )
  parsed = tf.train.Example.FromString(ours).features.feature
  assert parsed["latents"].bytes_list.value == [b"\x00\x01"]
  assert list(parsed["timesteps"].int64_list.value) == [999]
  assert list(parsed["neg"].int64_list.value) == [-5, 7]
  assert list(parsed["f"].float_list.value) == [0.25]
  assert parsed["text"].bytes_list.value == ["é".encode()]
  back = mdd.decode_example(tf.train.Example.FromString(ours).SerializeToString())
  np.testing.assert_array_equal(back["neg"], [-5, 7])
  assert back["text"] == ["é".encode()]


def test_framing_is_tensorflows(tmp_path):
  path = tmp_path / "tf.tfrecord"
  with tf.io.TFRecordWriter(str(path)) as writer:
    for record in (b"", b"x", bytes(range(256)) * 9):
      writer.write(record)
  assert list(mdd.iter_tfrecord(path)) == [b"", b"x", bytes(range(256)) * 9]
  mdd.write_tfrecord(tmp_path / "md.tfrecord", [b"", b"x", bytes(range(256)) * 9])
  assert (tmp_path / "md.tfrecord").read_bytes() == path.read_bytes()


def test_image_record_source(tmp_path):
  pixels = mdd.shapes_sample(mdd.ShapesConfig(size=32), 0, 0).pixels
  mdd.write_tfrecord(tmp_path / "a.tfrecord", [mdd.image_example(pixels, "a red star")])
  source = mdd.TFRecordImageSource(tmp_path, image_size=32)
  assert len(source) == 1 and source[0]["captions"] == "a red star"
  np.testing.assert_allclose(source[0]["pixels"], np.round(pixels * 255) / 255, atol=1e-6)
  mdd.write_tfrecord(tmp_path / "b.tfrecord", [mdd.encode_example({"image": b"x"})])
  with pytest.raises(ValueError, match=r"b\.tfrecord: record 0 has no feature 'text'"):
    mdd.TFRecordImageSource(tmp_path)


def test_latent_records_read_back_in_maxdiffusion_layout(latent_folder):
  # MaxDiffusion's own parser: FixedLenFeature strings, then tf.io.parse_tensor(float32).
  spec = {k: tf.io.FixedLenFeature([], tf.string) for k in mdd.LATENT_FEATURES}
  record = next(iter(tf.data.TFRecordDataset(str(latent_folder / "train-0.tfrecord"))))
  parsed = tf.io.parse_single_example(record, spec)
  want = _latents(0)
  np.testing.assert_array_equal(tf.io.parse_tensor(parsed["latents"], tf.float32).numpy(), want[0])
  got = tf.io.parse_tensor(parsed["encoder_hidden_states"], tf.float32).numpy()
  np.testing.assert_array_equal(got, want[1])


def test_unshuffled_batches_in_file_order(latent_folder):
  it = mdd.read_latent_records(latent_folder, batch_size=4, seed=None, repeat=False)
  batches = list(it)
  assert len(batches) == 3
  # Files interleave (cycle 4): record i of each file in turn.
  first = np.stack([_latents(10 * s)[0] for s in range(3)] + [_latents(1)[0]])
  np.testing.assert_array_equal(batches[0]["latents"], first)
  assert batches[0]["encoder_hidden_states"].shape == (4, 6, 8)
  assert "timesteps" not in batches[0]


def test_shuffle_is_seeded_and_restore_continues_bitwise(latent_folder):
  a = mdd.read_latent_records(latent_folder, batch_size=5, seed=3)
  run = [next(a) for _ in range(6)]  # past one epoch (12 records)
  b = mdd.read_latent_records(latent_folder, batch_size=5, seed=3)
  for _ in range(2):
    next(b)
  saved = json.loads(json.dumps(b.state()))
  c = mdd.read_latent_records(latent_folder, batch_size=5, seed=3)
  c.restore(saved)
  for want in run[2:]:
    got = next(c)
    np.testing.assert_array_equal(got["latents"], want["latents"])
  other = next(mdd.read_latent_records(latent_folder, batch_size=5, seed=4))
  assert not np.array_equal(other["latents"], run[0]["latents"])


def test_files_split_between_processes(latent_folder):
  parts = [
    mdd.read_latent_records(
      latent_folder, batch_size=2, seed=None, process_index=i, process_count=2, repeat=False
    )
    for i in range(2)
  ]
  assert [len(p.files) for p in parts] == [2, 1]
  assert sorted(parts[0].files + parts[1].files) == sorted(str(p) for p in latent_folder.iterdir())
  with pytest.raises(ValueError, match="3 files cannot be split over 4 processes"):
    mdd.read_latent_records(latent_folder, batch_size=2, process_index=0, process_count=4)


def test_eval_records_carry_timesteps(tmp_path):
  mdd.write_tfrecord(
    tmp_path / "eval.tfrecord",
    (mdd.latent_example(*_latents(i), timesteps=100 * i) for i in range(3)),
  )
  batch = next(mdd.read_latent_records(tmp_path, batch_size=3, seed=None))
  np.testing.assert_array_equal(batch["timesteps"], [0, 100, 200])
  assert batch["timesteps"].dtype == np.int64


def test_image_records_resize_and_captions(tmp_path):
  pixels = [mdd.shapes_sample(mdd.ShapesConfig(size=32), 0, i).pixels for i in range(3)]
  wide = np.concatenate([pixels[2], pixels[2]], axis=1)  # 32 x 64: resized then centre-cropped
  images = [pixels[0], pixels[1], wide]
  captions = ["a", "b", "c"]
  mdd.write_tfrecord(
    tmp_path / "images.tfrecord", (mdd.image_example(x, c) for x, c in zip(images, captions))
  )
  batch = next(mdd.read_image_records(tmp_path, batch_size=3, seed=None, image_size=32))
  assert batch["captions"] == captions
  assert batch["pixels"].shape == (3, 32, 32, 3) and batch["pixels"].dtype == np.float32
  np.testing.assert_allclose(batch["pixels"][0], np.round(pixels[0] * 255) / 255, atol=1e-6)


def test_missing_feature_names_file_and_feature(tmp_path):
  bad = tmp_path / "bad.tfrecord"
  mdd.write_tfrecord(bad, [mdd.encode_example({"latents": mdd.serialize_tensor(np.zeros(2))})])
  with pytest.raises(
    ValueError, match=r"bad\.tfrecord: a record has no feature 'encoder_hidden_states'"
  ):
    mdd.read_latent_records(tmp_path, batch_size=1)


def test_folder_errors(tmp_path):
  with pytest.raises(FileNotFoundError, match="does not exist"):
    mdd.read_latent_records(tmp_path / "nowhere", batch_size=1)
  (tmp_path / "half.tfrecord.tmp").write_bytes(b"")  # an unfinished write is not a record file
  with pytest.raises(ValueError, match="holds no record files"):
    mdd.read_latent_records(tmp_path, batch_size=1)
  with pytest.raises(ValueError, match="batch_size must be a positive int"):
    mdd.read_latent_records(tmp_path, batch_size=0)
