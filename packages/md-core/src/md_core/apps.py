"""What every md app does at start-up: process-wide JAX settings, multihost start, the mesh, a summary."""

from __future__ import annotations

import os
import pathlib
import re
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import jax

_AXES = ("data", "fsdp", "context", "tensor")
_DEFAULT_CACHE = (
  pathlib.Path(os.environ.get("XDG_CACHE_HOME", "~/.cache")).expanduser() / "md" / "jax"
)


# Programs that compile faster than this are not written to the persistent compilation cache
# (`$MD_CACHE_MIN_COMPILE_SECONDS` overrides it). 0: every program, so a second run of a small model
# compiles nothing (bench/warm_start.py: 2.4-10.4 s saved per tiny app run against 0-6.4 s with JAX's
# 1 s default, for caches of 0.1-1.1 MB).
CACHE_MIN_COMPILE_SECONDS = 0.0


_WORDS = {"": False, "false": False, "0": False, "no": False, "true": True, "1": True, "yes": True}


def configure_jax(
  *,
  compilation_cache: str | os.PathLike | None | bool = True,
  executables: str | os.PathLike | None | bool = None,
) -> None:
  """Process-wide settings apps use (libraries never set these).

  Args:
    compilation_cache: a folder for JAX's persistent compilation cache; True for `~/.cache/md/jax`
      (or `$MD_COMPILATION_CACHE`), False/None to leave it off.
    executables: a folder of ahead-of-time executables every pipeline's programs are kept in
      (`md_core.ExecutableStore`, `md_core.set_executable_store`): True for `~/.cache/md/executables` (or
      `$MD_EXECUTABLES`), False/None/"" to leave it off.
  """
  if isinstance(executables, str) and executables.strip().lower() in _WORDS:
    executables = _WORDS[executables.strip().lower()]  # a flag's text: --config.executables=True
  if executables:
    from md_core import _executables  # noqa: PLC0415

    _executables.set_default_store(
      pathlib.Path(os.environ.get("MD_EXECUTABLES", _DEFAULT_CACHE.parent / "executables"))
      if executables is True
      else pathlib.Path(executables)
    )
  jax.config.update("jax_threefry_partitionable", True)
  if compilation_cache:
    folder = (
      pathlib.Path(os.environ.get("MD_COMPILATION_CACHE", _DEFAULT_CACHE))
      if compilation_cache is True
      else pathlib.Path(compilation_cache)
    )
    folder.expanduser().mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(folder.expanduser()))
    jax.config.update(
      "jax_persistent_cache_min_compile_time_secs",
      float(os.environ.get("MD_CACHE_MIN_COMPILE_SECONDS", CACHE_MIN_COMPILE_SECONDS)),
    )


def add_runtime_config(config: Any) -> Any:
  """Adds the settings every app shares to an ml-collections `config` and returns it.

  `config.mesh`: md-sharding's `MeshConfig` fields (`ici_*` / `dcn_*` parallelism per axis; fsdp takes
  the devices left, -1), `config.distributed`: `jax.distributed` start-up (`coordinator_address`,
  `num_processes`, `process_id`; empty / -1: detect or single process), `config.compilation_cache` and
  `config.executables` (see `configure_jax`; executables off by default). `start(config)` reads them back.
  """
  import ml_collections

  mesh = {f"{kind}_{axis}_parallelism": 1 for kind in ("ici", "dcn") for axis in _AXES}
  mesh["ici_fsdp_parallelism"] = -1
  config.mesh = ml_collections.ConfigDict(mesh)
  config.distributed = ml_collections.ConfigDict(
    dict(coordinator_address="", num_processes=-1, process_id=-1)
  )
  config.compilation_cache = True
  config.executables = (
    ""  # e.g. True (~/.cache/md/executables) or a folder: ahead-of-time executables
  )
  return config


def start(config: Mapping[str, Any] | None = None) -> jax.sharding.Mesh:
  """Starts multihost JAX if configured, applies process settings and builds the mesh from `config.mesh`."""
  import md_sharding as mds

  config = config or {}
  cpu_devices = int(config.get("cpu_devices", 0) or 0)
  if cpu_devices > 0:
    # How many devices JAX's CPU backend makes (before any backend starts; a CPU has one by default).
    jax.config.update("jax_num_cpu_devices", cpu_devices)
  dist = dict(config.get("distributed", {}) or {})
  mds.initialize(**{k: v for k, v in dist.items() if v not in (None, "", -1)})
  configure_jax(
    compilation_cache=config.get("compilation_cache", True),
    executables=config.get("executables", None),
  )
  return mds.make_mesh(mds.MeshConfig.from_dict(dict(config.get("mesh", {}) or {})))


def describe_mesh(mesh: jax.sharding.Mesh) -> str:
  """One line per fact: devices, processes, mesh shape by axis."""
  devices = mesh.devices.flatten()
  kinds = sorted({d.device_kind for d in devices})
  shape = ", ".join(f"{name}={size}" for name, size in mesh.shape.items())
  return (
    f"mesh: {shape} ({devices.size} devices: {', '.join(kinds)}; "
    f"{jax.process_count()} process(es), this is process {jax.process_index()})"
  )


def load_checkpoint_onto_mesh(
  source: str | os.PathLike,
  mesh: jax.sharding.Mesh,
  *,
  dtype: Any = "float32",
  progress: bool = True,
) -> str:
  """Reads every tensor of a safetensors checkpoint and places it on `mesh`, each split over `fsdp` along its
  first divisible axis (replicated when none divides). Returns a short report; a smoke test of the I/O path."""
  import time

  import numpy as np

  from md_core import _safetensors
  from md_core import progress as _progress

  start = time.perf_counter()
  path = pathlib.Path(source)
  ckpt = _safetensors.open_checkpoint(path)
  fsdp = mesh.shape.get("fsdp", 1)
  count = nbytes = 0
  sharded = 0
  keys = list(ckpt)
  for key in _progress.track(keys, desc="placing tensors") if progress else keys:
    array = np.asarray(ckpt[key]).astype(dtype)
    axis = next((i for i, d in enumerate(array.shape) if fsdp > 1 and d % fsdp == 0), None)
    spec = [None] * array.ndim
    if axis is not None:
      spec[axis] = "fsdp"
      sharded += 1
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*spec))
    placed = jax.device_put(array, sharding)
    count += placed.size
    nbytes += placed.nbytes
  jax.block_until_ready(placed) if keys else None
  seconds = time.perf_counter() - start
  return (
    f"loaded {len(keys)} tensors ({count:,} values, {nbytes / 2**20:.2f} MiB as {np.dtype(dtype).name}) from "
    f"{ckpt.name} in {seconds:.2f}s; {sharded} split over fsdp={fsdp}, {len(keys) - sharded} replicated"
  )


# --- the app runner: flags → config → checks → one library call -------------------------------------------

# Spellings users bring from diffusers / other tools → md's key (suggested when the key is unknown).
ALIASES = {
  "steps": "num_inference_steps",
  "num_steps": "num_inference_steps",
  "sampling_steps": "num_inference_steps",
  "fps": "frame_rate",
  "cfg": "guidance_scale",
  "cfg_scale": "guidance_scale",
  "guidance": "guidance_scale",
  "scale": "guidance_scale",
  "negative": "negative_prompt",
  "neg_prompt": "negative_prompt",
  "num_images": "num_images_per_prompt",
  "batch_size": "num_images_per_prompt",
  "num_videos": "num_videos_per_prompt",
  "frames": "num_frames",
  "length": "num_frames",
  "torch_dtype": "dtype",
  "precision": "dtype",
  "generator": "seed",
  "sampler": "scheduler",
  "pretrained_model_name_or_path": "model",
  "model_id": "model",
  "checkpoint": "model",
  "init_image": "image",
  "input_image": "image",
  "attn": "attention",
  "attention_backend": "attention",
  "max_length": "max_sequence_length",
}

DTYPES = ("float32", "bfloat16", "float16")
_HELP_FLAGS = ("-h", "--help", "--helpshort", "--helpfull", "-?")


class UsageError(Exception):
  """A mistake in the command line or the config: the app prints `lines` (one per problem) and exits 2."""

  def __init__(self, lines: str | list[str]):
    self.lines = [lines] if isinstance(lines, str) else list(lines)
    super().__init__("\n".join(self.lines))


def _flat(config: Any, prefix: str = "") -> dict[str, Any]:
  out = {}
  for key, value in config.items():
    if hasattr(value, "items"):
      out.update(_flat(value, f"{prefix}{key}."))
    else:
      out[f"{prefix}{key}"] = value
  return out


def suggest(key: str, known: list[str] | tuple[str, ...]) -> str | None:
  """The known key nearest to a mistyped `key` (also for the diffusers spelling of a key), or None."""
  import difflib

  leaf = key.rsplit(".", 1)[-1]
  prefix = key[: len(key) - len(leaf)]
  alias = ALIASES.get(leaf.lower())
  if alias is not None and f"{prefix}{alias}" in known:
    return f"{prefix}{alias}"
  close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
  if close:
    return close[0]
  leaves = {k.rsplit(".", 1)[-1]: k for k in known if k.startswith(prefix)}
  close = difflib.get_close_matches(leaf, list(leaves), n=1, cutoff=0.6)
  return leaves[close[0]] if close else None


class Problems:
  """Collects one-line problems with the settings; `raise_if_any()` raises them together."""

  def __init__(self, config: Any = None):
    self.config = config
    self.lines: list[str] = []

  def add(self, line: str) -> None:
    self.lines.append(line)

  def require(self, ok: bool, line: str) -> bool:
    if not ok:
      self.add(line)
    return ok

  def call(self, fn, *args, prefix: str = "", **kwargs) -> Any:
    """Runs `fn`; a ValueError / TypeError / FileNotFoundError it raises becomes one problem (None returned)."""
    try:
      return fn(*args, **kwargs)
    except (ValueError, TypeError, FileNotFoundError) as e:
      self.add(prefix + str(e).strip().splitlines()[0] if str(e).strip() else f"{prefix}{e!r}")
      return None

  def at_least(self, key: str, low: float, *, optional: bool = False) -> None:
    """`--config.<key>` must be ≥ `low` (None allowed when `optional`)."""
    value = self.config[key]
    if value is None and optional:
      return
    self.require(value is not None and value >= low, f"--config.{key}={value} must be ≥ {low}")

  def positive(self, *keys: str, optional: bool = False) -> None:
    for key in keys:
      value = self.config[key]
      if value is None and optional:
        continue
      self.require(value is not None and value > 0, f"--config.{key}={value} must be positive")

  def fraction(self, key: str, *, low_open: bool = True, high_open: bool = False) -> None:
    value = self.config[key]
    ok = (0 < value if low_open else 0 <= value) and (value < 1 if high_open else value <= 1)
    a, b = "(" if low_open else "[", ")" if high_open else "]"
    self.require(ok, f"--config.{key}={value} must be in {a}0, 1{b}")

  def choice(self, key: str, allowed, *, what: str = "") -> None:
    value = self.config[key]
    self.require(
      value in allowed,
      f"--config.{key}={value!r} is not {what or 'one of'} {', '.join(map(str, allowed))}"
      if not what
      else f"--config.{key}={value!r} is not {what}; choose one of {', '.join(map(str, allowed))}",
    )

  def dtype(self, *keys: str, allowed=DTYPES) -> None:
    for key in keys:
      self.choice(key, allowed, what="a parameter dtype")

  def image(self, key: str, path: str | None = None, *, what: str = "image") -> None:
    """The file at `--config.<key>` (or `path`, one of its comma-separated items) is a readable image."""
    path = self.config[key] if path is None else path
    line = check_image_file(path)
    if line:
      self.add(f"--config.{key}: {what} {path!r} {line}")

  def raise_if_any(self) -> None:
    if self.lines:
      raise UsageError(self.lines)


def check_image_file(path: str | os.PathLike) -> str | None:
  """None when `path` is an image Pillow can read, else what is wrong (mentioning the working folder for a
  relative path that is missing)."""
  p = pathlib.Path(path).expanduser()
  if not p.exists():
    where = "" if p.is_absolute() else f" (relative to the working directory {os.getcwd()})"
    return f"does not exist{where}"
  if not p.is_file():
    return "is not a file"
  from PIL import Image

  try:
    with Image.open(p) as im:
      im.verify()
  except Exception as e:  # noqa: BLE001 - Pillow raises many kinds for a file that is not an image
    return f"cannot be read as an image: {e}"
  return None


def repo_path(value: str, config_file: str | os.PathLike | None) -> str:
  """A relative path from a config file that names a file of the repository (e.g. the tiny fixtures):
  used as given when it exists from the working directory, else resolved against the folder two levels
  above the config file (the repository root for `apps/configs/*.py`). Anything else comes back as is."""
  if not value or pathlib.Path(value).is_absolute() or pathlib.Path(value).exists():
    return value
  if config_file:
    root = pathlib.Path(config_file).resolve().parents[2]
    candidate = root / value
    if candidate.exists():
      return str(candidate)
  return value


def check_source(key: str, value: str) -> str | None:
  """A problem line for a model source that looks like a local path (3+ parts, or starting with `.`,
  `/` or `~`) but does not exist; hub ids `org/name` pass."""
  if not value:
    return f"--config.{key} is empty: give a diffusers folder or hub id"
  p = pathlib.Path(value).expanduser()
  hub = not value.startswith((".", "/", "~")) and (
    len(p.parts) <= 2 or (len(p.parts) == 3 and bool(p.suffix))
  )  # org/name or org/name/file
  if not hub and not p.exists():
    where = "" if p.is_absolute() else f" (relative to the working directory {os.getcwd()})"
    return f"--config.{key}={value!r} does not exist{where}"
  return None


def _config_arg(argv: list[str], name: str) -> str | None:
  for i, arg in enumerate(argv):
    if arg.startswith(f"--{name}="):
      return arg.split("=", 1)[1]
    if arg == f"--{name}" and i + 1 < len(argv):
      return argv[i + 1]
  return None


def _load_config_file(spec: str) -> tuple[Any, Any]:
  """(module, config) for `path.py[:arg]`, raising UsageError with one line when it fails."""
  import importlib.util

  path, _, arg = spec.partition(":")
  if not pathlib.Path(path).is_file():
    raise UsageError(
      f"--config={spec}: no such config file {path!r} (relative to the working directory "
      f"{os.getcwd()})"
    )
  module_spec = importlib.util.spec_from_file_location("_md_app_config", path)
  module = importlib.util.module_from_spec(module_spec)
  try:
    module_spec.loader.exec_module(module)
    config = module.get_config(arg or None)
  except (ValueError, TypeError) as e:
    raise UsageError(f"--config={spec}: {e}") from None
  return module, config


# ml_collections' words for a flag value of the wrong type, and the type each expects.
_CONVERT_ERRORS = (
  (re.compile(r"^(flag --\S+?=.*?): invalid literal for int\(\) with base 10: .*$"), "an int"),
  (re.compile(r"^(flag --\S+?=.*?): could not convert string to float: .*$"), "a number"),
)


def _flag_type_line(line: str) -> str:
  """`flag --config.height=abc: must be an int` for Python's conversion messages; others unchanged."""
  for pattern, expected in _CONVERT_ERRORS:
    if m := pattern.match(line):
      return f"{m.group(1)}: must be {expected}"
  return line


def _help(doc: str, argv: list[str], flag_lines: list[str]) -> str:
  lines = [doc.strip(), "", "Flags:", *flag_lines]
  spec = _config_arg(argv, "config")
  if spec is None:
    lines += ["", "Give --config=<file>.py:<variant> with --help to list the variant's keys."]
    return "\n".join(lines)
  try:
    module, config = _load_config_file(spec)
  except UsageError as e:
    return "\n".join([*lines, "", *e.lines])
  variants = getattr(module, "VARIANTS", None)
  if variants:
    lines += ["", f"Variants of {spec.partition(':')[0]}: {', '.join(variants)}"]
  lines += ["", f"Settings of {spec} (override with --config.<key>=<value>):"]
  lines += [f"  {k} = {v!r}" for k, v in _flat(config).items()]
  return "\n".join(lines)


def parse_flags(
  argv: list[str], *, doc: str = "", fixed: tuple[str, ...] = (), config_flag: str = "config"
) -> list[str]:
  """absl `flags_parser` for md apps: one line per problem on stderr and exit 2 (no help block, no
  traceback) for a usage error; `--help` prints the app's doc, its flags and, with `--config=…`, the
  variants of the file and the keys and values of the chosen one.

  Args:
    argv: the command line.
    doc: the app's docstring.
    fixed: config keys the variant sets (e.g. `variant`, `needs_image`), refused as overrides.
    config_flag: the name of the `DEFINE_config_file` flag.

  Returns:
    The arguments absl leaves (program name first).
  """
  import sys

  from absl import flags

  prog = pathlib.Path(argv[0]).name if argv else "app"
  if prog == "__main__.py":
    prog = pathlib.Path(argv[0]).parent.name
  FLAGS = flags.FLAGS
  try:
    if any(a in _HELP_FLAGS for a in argv[1:]):
      module = sys.modules.get("__main__")
      shown = {f.name: f for f in (FLAGS.get_key_flags_for_module(module) if module else [])}
      shown.update({n: FLAGS[n] for n in ("workdir", "overwrite") if n in FLAGS})
      flag_lines = [f"  --{f.name}: {f.help} (default: {f.default!r})" for f in shown.values()]
      flag_lines.append("  --verbosity: -1 quiet (default), 0 INFO, 1 DEBUG")
      print(_help(doc, argv, flag_lines))
      sys.exit(0)
    spec = _config_arg(argv[1:], config_flag)
    problems = []
    overrides = [a[2:].split("=", 1)[0] for a in argv[1:] if a.startswith(f"--{config_flag}.")]
    if overrides and spec is None:
      raise UsageError(f"--{config_flag}.<key> needs --{config_flag}=<file>.py:<variant>")
    if spec is not None:
      _, config = _load_config_file(spec)
      known = list(_flat(config))
      for name in overrides:
        key = name[len(config_flag) + 1 :]
        if key in fixed:
          problems.append(
            f"--{config_flag}.{key} is set by the variant, not a setting; choose another variant "
            f"(--help --{config_flag}=<file>.py lists them)"
          )
        elif key not in known:
          near = suggest(key, known)
          hint = f"; did you mean --{config_flag}.{near}?" if near else ""
          problems.append(f"--{config_flag}.{key} is not a setting of {spec}{hint}")
    if problems:
      raise UsageError(problems)
    try:
      rest = FLAGS(argv)
    except flags.Error as e:
      raise UsageError(_flag_type_line(str(e).strip().splitlines()[0])) from None
    except (AttributeError, KeyError, ValueError, TypeError) as e:
      raise UsageError(_flag_type_line(str(e).strip().splitlines()[0])) from None
    if len(rest) > 1:
      raise UsageError(
        f"unexpected arguments {rest[1:]}; settings go through --{config_flag}.<key>=<value>"
      )
    if spec is None and FLAGS[config_flag].value is None:
      raise UsageError(f"--{config_flag} is required; --help lists the flags")
  except UsageError as e:
    for line in e.lines:
      print(f"{prog}: {line}", file=sys.stderr)
    sys.exit(2)
  return rest


def quiet(verbosity: int) -> None:
  """Below verbosity 0, hides start-up chatter of libraries (INFO logs, transformers' advice, TF/XLA
  C++ logs). Set before those libraries are imported."""
  import logging

  if verbosity >= 0:
    return
  for name, value in (
    ("TF_CPP_MIN_LOG_LEVEL", "2"),
    ("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1"),
    ("TRANSFORMERS_VERBOSITY", "error"),
  ):
    if not os.environ.get(name):
      os.environ[name] = value
  for name in ("jax", "jax._src.xla_bridge", "md_attention"):
    logging.getLogger(name).setLevel(logging.WARNING)


class _Interrupts:
  """Ctrl-C / SIGTERM: the main thread stops with KeyboardInterrupt where Python runs; when it is held in
  a compiled program, a watcher thread (woken by the signal through `signal.set_wakeup_fd`) ends the
  process after `grace` seconds with the same one-line report. Staged outputs are removed either way."""

  def __init__(self, grace: float = 1.0):
    self.grace = grace
    self.lock = threading.Lock()
    self.reported = False
    self.folder = None  # the RunFolder of the run, when there is one
    self.prog = "app"
    self.signum = 2  # SIGINT; SIGTERM's handler sets its own

  def install(self, prog: str) -> None:
    import signal
    import socket

    self.prog = prog
    self.reader, writer = socket.socketpair()
    writer.setblocking(False)
    self.writer = writer
    signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)

    def on_term(signum, frame):
      self.signum = signum
      raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    threading.Thread(target=self._watch, daemon=True, name="md-interrupts").start()

  def message(self, signum: int) -> str:
    import signal

    from md_core import progress as _progress

    name = signal.Signals(signum).name if signum else "interrupt"
    where = _progress.where()
    return f"{self.prog}: interrupted ({name}){' ' + where if where else ''}; nothing written"

  def report(self, signum: int) -> bool:
    """Prints the one-line report once and cleans the staged files; False when already done."""
    import sys

    with self.lock:
      if self.reported:
        return False
      self.reported = True
    if self.folder is not None:
      self.folder.discard()
    print(self.message(signum), file=sys.stderr, flush=True)
    return True

  def _watch(self) -> None:
    import time

    data = self.reader.recv(1)
    if not data:
      return
    signum = data[0]
    time.sleep(self.grace)
    if self.report(signum):
      os._exit(128 + signum)


_interrupts = _Interrupts()


def output_folder(workdir: str, *, overwrite: bool = False) -> Any:
  """The run's `RunFolder` (see md_core._runfolder), registered so Ctrl-C removes its staged files."""
  from md_core._runfolder import RunFolder

  folder = RunFolder(workdir, overwrite=overwrite)
  _interrupts.folder = folder
  return folder


def run(main, *, doc: str = "", fixed: tuple[str, ...] = ()) -> None:
  """Runs an md app: `absl.app.run` with md's flag parsing (see `parse_flags`), quiet start-up, one-line
  usage errors (`UsageError`, absl's `UsageError`) with exit code 2, and Ctrl-C / SIGTERM reported in one
  line with exit code 130 / 143.

  Args:
    main: `main(argv)`, which raises `UsageError` for problems with the settings.
    doc: the app's docstring (`__doc__`), shown by `--help`.
    fixed: config keys only the variant sets.
  """
  import sys

  from absl import app, flags, logging

  prog = pathlib.Path(sys.argv[0]).name
  if prog == "__main__.py":
    prog = pathlib.Path(sys.argv[0]).parent.name

  def wrapped(argv):
    verbosity = flags.FLAGS.verbosity if flags.FLAGS["verbosity"].present else -1
    logging.set_verbosity(verbosity)
    quiet(verbosity)
    _interrupts.install(prog)
    try:
      return main(argv)
    except (UsageError, app.UsageError, FileNotFoundError) as e:
      lines = e.lines if isinstance(e, UsageError) else str(e).splitlines()[:1]
      folder = _interrupts.folder
      if folder is not None:
        folder.discard()
      for line in lines:
        print(f"{prog}: {line}", file=sys.stderr)
      sys.exit(2)
    except _file_errors() as e:
      # A model file md cannot use (truncated weights, a broken config, one it may not read): one line
      # naming it (the errors' messages do), exit code 1.
      if _interrupts.folder is not None:
        _interrupts.folder.discard()
      text = str(e).splitlines()[0] if str(e) else type(e).__name__
      if isinstance(e, OSError) and e.filename and str(e.filename) not in text:
        text = f"{e.filename}: {e.strerror or text}"
      print(f"{prog}: {text}", file=sys.stderr)
      sys.exit(1)
    except KeyboardInterrupt:
      signum = _interrupts.signum
      if _interrupts.report(signum):
        # Exit at once: interpreter finalisation with a computation still in flight on XLA's threads
        # can crash (seen as SIGSEGV under load); nothing is left to write or flush but the streams.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(128 + signum)
      import time

      time.sleep(60)  # the watcher is reporting and ends the process

  app.run(wrapped, flags_parser=lambda argv: parse_flags(argv, doc=doc, fixed=fixed))


def _file_errors() -> tuple[type[BaseException], ...]:
  """The errors about a file the run reads, reported by `run` in one line (their messages name it)."""
  from md_core._loading import WeightLoadError
  from md_core._safetensors import SafetensorsError
  from md_core._sources import ConfigError

  return (ConfigError, SafetensorsError, WeightLoadError, PermissionError, IsADirectoryError)


def source_config(source: str, component: str) -> dict:
  """`<component>/config.json` of a checkpoint source, read before any weights (for a hub id only the
  JSON files are fetched). Raises FileNotFoundError naming what is missing."""
  from md_core import _sources

  root = _sources.resolve_source(source, allow_patterns=["*.json"])
  # The component's folder: its subfolder, or where the pipeline shares it from (`_md_components`).
  return _sources.read_json(_sources.resolve_source(root, subfolder=component) / "config.json")


def settings_of(config: Any, **extra: Any) -> dict:
  """The dict an app writes to settings.json: the config's values plus what the run adds."""
  return dict(config.to_dict(), **extra)


def finish_run(
  folder: Any,
  config: Any,
  *,
  wrote: str,
  seconds: float,
  loaded: float,
  lines: Sequence[str] = (),
  **settings: Any,
) -> None:
  """The end of every generate app: settings.json (the config, `settings`, then the load and generate
  seconds) committed with the outputs staged in `folder`, one line saying what was written where and
  how long it took (`wrote`: e.g. "2 image(s)"), then `lines` (empty ones skipped)."""
  folder.commit(
    settings_of(
      config, **settings, load_seconds=round(loaded, 2), generate_seconds=round(seconds, 2)
    )
  )
  print(f"wrote {wrote} and settings.json to {folder.path} ({seconds:.1f}s, load {loaded:.1f}s)")
  for line in lines:
    if line:
      print(line)


def config_file() -> str | None:
  """The config file the `--config` flag named (for `repo_path`)."""
  from absl import flags
  from ml_collections import config_flags

  try:
    return config_flags.get_config_filename(flags.FLAGS["config"])
  except (KeyError, AttributeError):
    return None


def check_local(problems: Problems, key: str, *, image: bool = False) -> list[str]:
  """The comma-separated sources / image files of `--config.<key>`, resolved with `repo_path`; a missing
  local path (or an unreadable image when `image`) becomes a problem."""
  value = problems.config[key] or ""
  items = [item.strip() for item in value.split(",") if item.strip()]
  paths = [repo_path(item, config_file()) for item in items]
  for path in paths:
    if image:
      problems.image(key, path)
      continue
    line = check_source(key, path)
    if line is None and not pathlib.Path(path).exists() and not pathlib.Path(path).suffix:
      from md_core import _sources

      try:  # a hub id: its configs, from the cache (or the hub when online)
        _sources.resolve_source(path, allow_patterns=["*.json"])
      except FileNotFoundError as e:
        line = f"--config.{key}: {e}"
    problems.require(line is None, line or "")
  return paths


def scheduler_steps_problem(
  problems: Problems, model: str, key: str = "num_inference_steps"
) -> None:
  """`--config.<key>` may not exceed the checkpoint scheduler's `num_train_timesteps`."""
  from md_core import _sources

  try:
    root = _sources.resolve_source(model, allow_patterns=["*.json"])
    sched = _sources.read_json(root / "scheduler" / "scheduler_config.json")
  except (FileNotFoundError, ValueError) as e:
    problems.add(f"--config.model: {str(e).splitlines()[0]}")
    return
  most = sched.get("num_train_timesteps")
  steps = problems.config[key]
  if most and steps is not None and steps > most:
    problems.add(f"--config.{key}={steps} must be ≤ the scheduler's num_train_timesteps={most}")
    return
  # The discrete schedulers index their table with `leading` timesteps shifted by `steps_offset`: the
  # first one must stay below num_train_timesteps (md_schedulers refuses it after loading otherwise).
  name = problems.config.get("scheduler") or sched.get("_class_name", "")
  spacing = problems.config.get("timestep_spacing") or sched.get("timestep_spacing", "leading")
  offset = int(sched.get("steps_offset") or 0)
  extra = name == "UniPCMultistepScheduler"  # spaces n + 1 points and drops the last
  if name not in _DISCRETE or spacing != "leading" or not most or not steps or steps < 1:
    return

  def first(n: int) -> int:
    return (n if extra else n - 1) * (most // (n + 1 if extra else n)) + offset

  if first(steps) >= most:
    top = max(n for n in range(1, steps + 1) if first(n) < most)
    problems.add(
      f"--config.{key}={steps} is out of range for {name} (timestep_spacing='leading', "
      f"steps_offset={offset}, num_train_timesteps={most}): use 1 to {top}, or "
      "--config.timestep_spacing=trailing"
    )


# The schedulers whose timesteps index the training table (the sigma-based ones interpolate).
_DISCRETE = ("DDIMScheduler", "DDPMScheduler", "UniPCMultistepScheduler")


def finish_checks(problems: Problems, config: Any, folder: Any) -> jax.sharding.Mesh | None:
  """The checks every app ends with: the output folder and the mesh against the devices; then raises
  every problem collected so far (one line each), or returns the mesh."""
  for line in folder.problems():
    problems.add(line)
  mesh = problems.call(start, config, prefix="--config.mesh: ")
  problems.raise_if_any()
  return mesh


def define_output_flags(default_workdir: str, what: str = "outputs") -> tuple[Any, Any]:
  """`--workdir` and `--overwrite`, the same in every app."""
  from absl import flags

  workdir = flags.DEFINE_string(
    "workdir", default_workdir, f"Folder the {what} and settings.json go to (must be empty)."
  )
  overwrite = flags.DEFINE_bool(
    "overwrite", False, "Write into a non-empty --workdir, replacing the earlier run's outputs."
  )
  return workdir, overwrite


def add_quantization_config(config: Any) -> Any:
  """Adds `config.quantization` (None, or a `md_core.quantize` mode: "int8", "int8-dynamic", "fp8") to
  an app config and returns it; the app passes it to `load_pipeline(..., quantization=)`."""
  from ml_collections import config_dict

  config.quantization = config_dict.placeholder(str)
  return config


def check_quantization(problems: Problems, config: Any) -> None:
  """Reports a `--config.quantization` that is not a quantization mode (before any weight loads)."""
  from md_core.quant import MODES  # noqa: PLC0415

  if config.get("quantization") is not None:
    problems.choice("quantization", MODES, what="a quantization mode")
