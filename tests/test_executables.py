"""Ahead-of-time executables (md_core.ExecutableStore): a pipeline's programs compiled once per argument
signature, written to a folder and read back by later pipelines and processes without tracing or
compiling; outputs bitwise equal to the plain jitted path. The tiny Wan fixture pipeline throughout."""

import json
import os
import subprocess
import sys
import textwrap
import warnings

import numpy as np
import pytest

import md_core
import md_serve
import md_wan
from md_core import _executables, apps, testing

FOLDER = testing.fixture_path("wan_pipeline") / "t2v"
CALL = dict(height=16, width=16, num_frames=5, num_inference_steps=2, guidance_scale=4.0, seed=3)


def _video(pipe, **overrides):
  return np.asarray(pipe("a red circle", "", **(CALL | overrides)))


@pytest.fixture(scope="module")
def plain():
  return _video(md_wan.load_pipeline(FOLDER))


def test_programs_compile_once_then_load_in_a_fresh_process(tmp_path, plain):
  store = md_core.ExecutableStore(tmp_path / "exe")
  pipe = md_wan.load_pipeline(FOLDER)
  pipe.use_executables(store)
  first = _video(pipe)
  np.testing.assert_array_equal(first, plain)  # the same executable XLA would run
  compiled = store.stats["compiled"]
  assert compiled >= 3 and store.stats["loaded"] == 0  # text encoder, denoising loop, VAE decode
  assert len(store.files()) == compiled
  _video(pipe)  # the same shapes again: the executables in memory
  assert store.stats["compiled"] == compiled and store.stats["loaded"] == 0

  again = md_wan.load_pipeline(FOLDER)  # another pipeline of the same model, in this process
  again.use_executables(store.folder)
  np.testing.assert_array_equal(_video(again), plain)
  assert again._executables.stats == {"compiled": 0, "loaded": compiled, "unstored": 0}

  script = textwrap.dedent(
    f"""
    import json, sys
    import jax
    import numpy as np
    import md_core, md_wan
    jax.config.update("jax_default_matmul_precision", "highest")  # as md_core.pytest_plugin: a program setting
    store = md_core.set_executable_store({str(store.folder)!r})
    pipe = md_wan.load_pipeline({str(FOLDER)!r})
    video = np.asarray(pipe("a red circle", "", **{CALL!r}))
    np.save({str(tmp_path / "fresh.npy")!r}, video)
    print(json.dumps(store.stats))
    """
  )
  out = subprocess.run(
    # this process's XLA flags (its 8 host devices): other flags or devices would be other executables
    [sys.executable, "-c", script], env=testing.app_env(XLA_FLAGS=os.environ.get("XLA_FLAGS", "")),
    capture_output=True, text=True,
    timeout=300, cwd=testing.repo_root(),
  )  # fmt: skip
  assert out.returncode == 0, out.stderr[-2000:]
  stats = json.loads(out.stdout.strip().splitlines()[-1])
  assert stats == {"compiled": 0, "loaded": compiled, "unstored": 0}
  np.testing.assert_array_equal(np.load(tmp_path / "fresh.npy"), plain)


def test_each_signature_gets_its_own_executable(tmp_path):
  store = md_core.ExecutableStore(tmp_path)
  pipe = md_wan.load_pipeline(FOLDER)
  pipe.use_executables(store)
  _video(pipe)
  one = set(store.files())
  wider = _video(pipe, width=32)  # new latent shapes: a new loop and decode, the same text encoder
  two = set(store.files())
  assert one < two and len(two - one) == 2
  np.testing.assert_array_equal(wider, _video(md_wan.load_pipeline(FOLDER), width=32))
  _video(pipe, num_inference_steps=3)  # another step count: another loop program
  assert len(set(store.files()) - two) >= 1


def test_a_file_that_does_not_load_is_compiled_again(tmp_path, plain):
  store = md_core.ExecutableStore(tmp_path)
  pipe = md_wan.load_pipeline(FOLDER)
  pipe.use_executables(store)
  _video(pipe)
  files = store.files()
  for f in files:
    f.write_bytes(b"not an executable")
  fresh = md_wan.load_pipeline(FOLDER)
  fresh.use_executables(store)
  with pytest.warns(UserWarning, match=r"\.jaxexe did not load .*compiling it again"):
    video = _video(fresh)
  np.testing.assert_array_equal(video, plain)
  assert store.stats["compiled"] == 2 * len(files)
  assert all(f.read_bytes() != b"not an executable" for f in files)  # rewritten


class _Planted:
  """A pickle that, when loaded, runs code (here: touches a marker file)."""

  def __init__(self, marker):
    self.marker = str(marker)

  def __reduce__(self):
    return (open, (self.marker, "w"))


def test_a_planted_pickle_never_runs(tmp_path, plain):
  import pickle

  store = md_core.ExecutableStore(tmp_path / "exe")
  pipe = md_wan.load_pipeline(FOLDER)
  pipe.use_executables(store)
  _video(pipe)
  assert (store.folder / "manifest.json").is_file()
  assert oct(store.folder.stat().st_mode & 0o777) == "0o700"
  marker = tmp_path / "ran"
  for f in store.files():
    f.write_bytes(pickle.dumps(_Planted(marker)))  # same names, planted content
  fresh = md_wan.load_pipeline(FOLDER)
  fresh.use_executables(md_core.ExecutableStore(store.folder))
  with pytest.warns(UserWarning, match=r"SHA-256 is not the one manifest.json records"):
    np.testing.assert_array_equal(_video(fresh), plain)
  assert not marker.exists()
  # A folder others can write is not read at all (nor written), even with a matching manifest.
  os.chmod(store.folder, 0o777)
  for f in store.files():
    f.write_bytes(pickle.dumps(_Planted(marker)))
  again = md_core.ExecutableStore(store.folder)
  other = md_wan.load_pipeline(FOLDER)
  other.use_executables(again)
  with pytest.warns(UserWarning, match=r"not reading .* writable by other users \(mode 777\)"):
    np.testing.assert_array_equal(_video(other), plain)
  assert not marker.exists() and again.stats["loaded"] == 0


def test_a_folder_that_cannot_be_written_warns_and_still_answers(tmp_path, plain):
  blocker = tmp_path / "file"
  blocker.write_text("a file where the folder should be")
  pipe = md_wan.load_pipeline(FOLDER)
  pipe.use_executables(blocker / "exe")
  with pytest.warns(UserWarning, match=r"could not write .*file/exe/.*\.jaxexe"):
    video = _video(pipe)
  np.testing.assert_array_equal(video, plain)


def test_keys_without_a_stable_text_run_unstored(tmp_path):
  import jax
  import jax.numpy as jnp

  store = md_core.ExecutableStore(tmp_path)
  pipe = md_wan.load_pipeline(FOLDER)
  pipe.use_executables(store)

  class Opaque:  # repr names its address: a new key in every process
    pass

  fn = pipe.jit(("double", Opaque()), lambda: jax.jit(lambda x: 2 * x))
  np.testing.assert_array_equal(fn(jnp.arange(3.0)), [0.0, 2.0, 4.0])
  assert store.stats == {"compiled": 0, "loaded": 0, "unstored": 1} and not store.files()
  # A program with a static argument (a compiled call takes none): jax.jit runs it, nothing is stored.
  scale = pipe.jit("scale", lambda: jax.jit(lambda x, k: k * x, static_argnames="k"))
  np.testing.assert_array_equal(scale(jnp.arange(3.0), k=3), [0.0, 3.0, 6.0])
  np.testing.assert_array_equal(scale(jnp.arange(3.0), k=3), [0.0, 3.0, 6.0])
  assert store.stats == {"compiled": 0, "loaded": 0, "unstored": 3} and not store.files()
  # A program's own error comes through as it does without a store.
  add = pipe.jit("add", lambda: jax.jit(lambda x, y: x + y))
  with pytest.raises(TypeError, match="add got incompatible shapes"):
    add(jnp.ones(3), jnp.ones(4))
  assert _executables.stable_repr(("loop", 3, {"shift": 1.0})) == "('loop', 3, {'shift': 1.0})"
  assert _executables.stable_repr(Opaque()) is None
  with pytest.raises(TypeError, match="leaf of type str has no executable signature"):
    _executables.signature(("text",), {})


def test_fingerprint_follows_the_model_and_its_settings(tmp_path):
  a, b = md_wan.load_pipeline(FOLDER), md_wan.load_pipeline(FOLDER)
  assert a.fingerprint() == b.fingerprint()
  assert " at 0x" not in a.fingerprint()
  b.scheduler_config = dict(b.scheduler_config, flow_shift=7.0)  # a setting a program may bake in
  assert a.fingerprint() != b.fingerprint()
  b.use_executables(tmp_path / "unused")  # no program runs: the folder is never made
  assert not (tmp_path / "unused").exists()
  assert "WanVideoPipeline" in a.fingerprint().splitlines()[0]


def test_process_default_store_and_per_pipeline_opt_out(tmp_path, monkeypatch, plain):
  try:
    monkeypatch.setenv("MD_EXECUTABLES", str(tmp_path / "env"))
    apps.configure_jax(compilation_cache=False, executables=True)
    store = _executables.default_store()
    assert store is not None and store.folder == tmp_path / "env"
    np.testing.assert_array_equal(_video(md_wan.load_pipeline(FOLDER)), plain)
    assert store.stats["compiled"] >= 3
    off = md_wan.load_pipeline(FOLDER)
    off.use_executables(None)
    before = dict(store.stats)
    _video(off)
    assert store.stats == before
    apps.configure_jax(compilation_cache=False, executables=tmp_path / "named")
    assert _executables.default_store().folder == tmp_path / "named"
    md_core.set_executable_store(None)
    apps.configure_jax(compilation_cache=False, executables="false")  # an app flag's text
    assert _executables.default_store() is None
    apps.configure_jax(compilation_cache=False, executables="True")
    assert _executables.default_store().folder == tmp_path / "env"  # not a folder named "True"
  finally:
    md_core.set_executable_store(None)
  assert _executables.default_store() is None


def test_serve_warm_up_leaves_no_compile_for_the_buckets(tmp_path):
  import md_serve._jobs as jobs

  def queue():
    pipe = md_wan.load_pipeline(FOLDER)
    pipe.use_executables(tmp_path)
    model = md_serve.ServedModel("wan-tiny", pipe, default_size=(16, 16), num_frames=5)
    return md_serve.JobQueue({"wan-tiny": model}, max_batch=2, batch_buckets=(1, 2))

  q = queue()
  rows = q.warm_up({"steps": 2})
  assert [(r["model"], r["bucket"]) for r in rows] == [("wan-tiny", 1), ("wan-tiny", 2)]
  assert rows[0]["compiles"] >= 3  # text encoder, loop, decode (and small programs)
  assert not q.jobs and q.stats["succeeded"] == 0  # the warm-up's jobs are not listed or counted
  request = md_serve.parse_request(
    {"prompt": "a blue square", "n": 2, "steps": 2}, "video", q.models, max_n=2
  )
  before = jobs.compile_count()
  job = q.submit(request)
  job.done.wait(120)
  assert job.status == "succeeded" and jobs.compile_count() == before
  q.shutdown("finish")

  second = queue()  # a server started again: its programs come from the executables folder
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    rows = second.warm_up({"steps": 2})
  assert [r["compiles"] for r in rows] == [0, 0]
  assert second.models["wan-tiny"].pipe._executables.stats["compiled"] == 0
  second.shutdown("finish")


def test_serve_warm_up_reports_a_failed_request():
  pipe = md_wan.load_pipeline(FOLDER)
  model = md_serve.ServedModel("wan-tiny", pipe, default_size=(16, 16), num_frames=5)
  q = md_serve.JobQueue({"wan-tiny": model}, max_batch=1, batch_buckets=(1,))
  with pytest.raises(md_serve.RequestError, match="num_frames"):
    q.warm_up({"num_frames": 4})
  q.shutdown("finish")


def test_programs_on_a_mesh_load_onto_its_devices(tmp_path):
  """A pipeline sharded over 8 devices (fsdp 2 x context 2 x tensor 2): the executables are written with
  their devices and read back onto them; a second pipeline's video equals the first's bit for bit."""
  import md_sharding as mds

  mesh = mds.make_mesh(
    mds.MeshConfig(ici_fsdp_parallelism=2, ici_context_parallelism=2, ici_tensor_parallelism=2)
  )
  store = md_core.ExecutableStore(tmp_path)
  call = dict(CALL, width=32)
  first = md_wan.load_pipeline(FOLDER, mesh=mesh, attention="ulysses_ring")
  first.use_executables(store)
  want = first("a red circle", "", **call)
  assert len(want.sharding.device_set) == 8
  compiled = store.stats["compiled"]
  second = md_wan.load_pipeline(FOLDER, mesh=mesh, attention="ulysses_ring")
  second.use_executables(store.folder)
  got = second("a red circle", "", **call)
  assert second._executables.stats == {"compiled": 0, "loaded": compiled, "unstored": 0}
  assert got.sharding == want.sharding
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
