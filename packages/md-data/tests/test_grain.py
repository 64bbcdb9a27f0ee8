import json

import grain  # noqa: E402  (a dev dependency: missing, the suite must fail, not skip)
import numpy as np
import pytest
from PIL import Image

import md_data as mdd

CONFIG = mdd.ShapesConfig(size=24)


def _save(folder, name, i, caption=True):
  sample = mdd.shapes_sample(CONFIG, 0, i)
  Image.fromarray(np.round(sample.pixels * 255).astype(np.uint8)).save(folder / f"{name}.png")
  if caption:
    (folder / f"{name}.txt").write_text(sample.caption + "\n")
  return sample


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
  root = tmp_path_factory.mktemp("images")
  for i in range(7):
    _save(root, f"img{i}", i)
  return root


def _ids(batches):
  """Which shapes image each example is (captions can repeat; pixels do not)."""
  return [hash(x.tobytes()) for b in batches for x in b["pixels"]]


def test_folder_items_and_sidecar_captions(folder):
  source = mdd.FolderSource(folder)
  assert len(source) == 7
  item = source[3]
  want = mdd.shapes_sample(CONFIG, 0, 3)
  assert item["captions"] == want.caption
  np.testing.assert_allclose(item["pixels"], np.round(want.pixels * 255) / 255, atol=1e-6)


def test_restore_continues_bitwise_and_state_is_json(folder):
  source = mdd.FolderSource(folder)
  shard = grain.sharding.NoSharding()
  run = mdd.GrainIterator(source, batch_size=2, seed=5, shard=shard)
  want = [next(run) for _ in range(8)]  # 16 examples: past two epochs of 7 (6 per epoch)
  first = mdd.GrainIterator(source, batch_size=2, seed=5, shard=shard)
  for _ in range(3):
    next(first)
  saved = json.loads(json.dumps(first.state()))
  resumed = mdd.GrainIterator(source, batch_size=2, seed=5, shard=shard)
  resumed.restore(saved)
  for w in want[3:]:
    got = next(resumed)
    np.testing.assert_array_equal(got["pixels"], w["pixels"])
    assert got["captions"] == w["captions"]
  # A global shuffle: each epoch is a permutation of the source; epochs differ; another seed differs.
  epoch = _ids(want[:3])
  assert len(set(epoch)) == 6 and epoch != _ids(want[3:6])
  other = mdd.GrainIterator(source, batch_size=2, seed=6, shard=shard)
  assert _ids([next(other) for _ in range(3)]) != epoch


def test_process_shards_are_disjoint_and_cover(folder):
  source = mdd.FolderSource(folder)
  parts = []
  for i in range(3):
    shard = grain.sharding.ShardOptions(shard_index=i, shard_count=3)
    it = mdd.GrainIterator(source, batch_size=1, seed=1, shard=shard, num_epochs=1)
    parts.append(_ids(list(it)))
  assert [len(p) for p in parts] == [2, 2, 2]  # 7 examples cut to 6 so every process takes 2 steps
  flat = sum(parts, [])
  assert len(set(flat)) == 6


@pytest.mark.parametrize("kind", ["jsonl", "csv"])
def test_metadata_captions(tmp_path, kind):
  samples = [_save(tmp_path, f"x{i}", i, caption=False) for i in range(3)]
  rows = [{"file_name": f"x{i}.png", "text": s.caption} for i, s in enumerate(samples)]
  if kind == "jsonl":
    (tmp_path / "metadata.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
  else:
    lines = ["file_name,text"] + [f'{r["file_name"]},"{r["text"]}"' for r in rows]
    (tmp_path / "metadata.csv").write_text("\n".join(lines) + "\n")
  source = mdd.FolderSource(tmp_path)
  assert [source[i]["captions"] for i in range(3)] == [s.caption for s in samples]


def test_video_folder_resized(tmp_path):
  clip = mdd.shapes_sample(mdd.ShapesConfig(size=32, frames=5), 0, 0)
  frames = [Image.fromarray(np.round(f * 255).astype(np.uint8)) for f in clip.pixels]
  frames[0].save(tmp_path / "clip.gif", save_all=True, append_images=frames[1:], duration=100)
  (tmp_path / "clip.txt").write_text(clip.caption)
  source = mdd.FolderSource(tmp_path, image_size=24, frames=4)
  item = source[0]
  assert item["pixels"].shape == (4, 24, 24, 3) and item["captions"] == clip.caption
  batch = next(mdd.GrainIterator(source, batch_size=1, shard=grain.sharding.NoSharding()))
  assert batch["pixels"].shape == (1, 4, 24, 24, 3)
  with pytest.raises(ValueError, match="fewer than frames=9"):
    mdd.FolderSource(tmp_path, frames=9)[0]


def test_array_record_latents(tmp_path):
  rng = np.random.default_rng(0)
  want = [(rng.normal(size=(2, 2, 4)), rng.normal(size=(3, 5))) for _ in range(6)]
  for s in range(2):
    mdd.write_array_record(
      tmp_path / f"part-{s}.array_record",
      (mdd.latent_example(*want[3 * s + i], timesteps=3 * s + i) for i in range(3)),
    )
  source = mdd.ArrayRecordSource(tmp_path)
  assert len(source) == 6
  item = source[4]
  np.testing.assert_array_equal(item["latents"], want[4][0].astype(np.float32))
  np.testing.assert_array_equal(item["encoder_hidden_states"], want[4][1].astype(np.float32))
  assert item["timesteps"] == 4
  it = mdd.GrainIterator(source, batch_size=3, seed=0, shard=grain.sharding.NoSharding())
  batch = next(it)
  assert batch["latents"].shape == (3, 2, 2, 4) and batch["timesteps"].shape == (3,)
  assert sorted(batch["timesteps"].tolist() + next(it)["timesteps"].tolist()) == list(range(6))


def test_errors(tmp_path, folder):
  with pytest.raises(FileNotFoundError, match="does not exist"):
    mdd.FolderSource(tmp_path / "nowhere")
  empty = tmp_path / "empty"
  empty.mkdir()
  (empty / "notes.md").write_text("no pictures here")
  with pytest.raises(ValueError, match="holds no images or videos"):
    mdd.FolderSource(empty)
  lonely = tmp_path / "lonely"
  lonely.mkdir()
  _save(lonely, "a", 0)
  _save(lonely, "b", 1, caption=False)
  with pytest.raises(ValueError, match=r"b\.png has no caption: add b\.txt"):
    mdd.FolderSource(lonely)
  meta = tmp_path / "meta"
  meta.mkdir()
  (meta / "metadata.jsonl").write_text('{"file_name": "gone.png", "text": "x"}\n')
  with pytest.raises(ValueError, match="'gone.png' does not exist"):
    mdd.FolderSource(meta)
  broken = tmp_path / "broken"
  broken.mkdir()
  (broken / "bad.png").write_bytes(b"not a png")
  (broken / "bad.txt").write_text("a caption")
  with pytest.raises(ValueError, match=r"bad\.png: cannot decode the image"):
    mdd.FolderSource(broken)[0]
  record = tmp_path / "records"
  mdd.write_array_record(record / "r.array_record", [mdd.encode_example({"latents": b""})])
  with pytest.raises(
    ValueError, match=r"r\.array_record: record 0 has no feature 'encoder_hidden_states'"
  ):
    mdd.ArrayRecordSource(record)[0]
  with pytest.raises(ValueError, match="smaller than batch_size=8"):
    mdd.GrainIterator(mdd.FolderSource(folder), batch_size=8, shard=grain.sharding.NoSharding())
