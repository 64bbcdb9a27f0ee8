"""serve: an HTTP server for md pipelines (md-serve): OpenAI-style image and video generation, a job queue
that batches compatible requests, progress events, cancellation, metrics and a web page at /.

uv run apps/serve --config=apps/configs/serve.py:default
uv run apps/serve --help --config=apps/configs/serve.py:default   # the variants, keys and values
"""

import os
import sys

if not any(a.startswith(("--verbosity", "-v")) for a in sys.argv[1:]):
  os.environ["TF_CPP_MIN_LOG_LEVEL"] = os.environ.get("TF_CPP_MIN_LOG_LEVEL") or "2"

from ml_collections import config_flags  # noqa: E402

from md_core import apps  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file(
  "config", None, "ml-collections config file (apps/configs/serve.py:<variant>)."
)
_FIXED = ("variant",)
_FAMILIES = {"StableDiffusion": "md_sd", "Wan": "md_wan"}


def _size(p, key):
  text = p.config[key]
  try:
    w, h = (int(v) for v in text.lower().split("x"))
  except ValueError:
    p.add(f'--config.{key}={text!r}: expected "WxH"')
    return None
  return h, w


def _family(p, key, folder):
  """The md package that loads the diffusers folder at `folder` (read from model_index.json)."""
  import json
  import pathlib

  index = pathlib.Path(folder) / "model_index.json"
  if not index.is_file():
    p.add(f"--config.{key}={folder}: no model_index.json (give a diffusers pipeline folder)")
    return None
  cls = json.loads(index.read_text()).get("_class_name", "")
  for prefix, module in _FAMILIES.items():
    if cls.startswith(prefix):
      return module
  p.add(
    f"--config.{key}={folder}: pipeline class {cls!r} is not one md-serve runs ({list(_FAMILIES)})"
  )
  return None


def _loras(p, key):
  out = {}
  for item in filter(None, (s.strip() for s in p.config[key].split(","))):
    name, _, file = item.partition("=")
    file = apps.repo_path(file, apps.config_file())
    if not file or not os.path.isfile(file):
      p.add(f"--config.{key}: {item!r} is not name=<existing .safetensors file>")
    out[name] = file
  return out


def _check(config):
  p = apps.Problems(config)
  found = {}
  for kind in ("image", "video"):
    folder = apps.repo_path(config[f"{kind}_model"], apps.config_file())
    if folder:
      found[kind] = dict(folder=folder, family=_family(p, f"{kind}_model", folder))
      found[kind]["size"] = _size(p, f"{kind}_size")
  p.require(bool(found), "no model: set --config.image_model and/or --config.video_model")
  loras = _loras(p, "image_loras")
  p.require(config.shutdown in ("finish", "cancel"), "--config.shutdown must be finish or cancel")
  p.positive("max_queue", "max_batch", "num_frames", "max_steps", "max_programs")
  p.at_least("max_pixels", 0)
  p.at_least("job_timeout_s", 0)
  p.at_least("finish_timeout_s", 0)
  p.require(
    1 <= config.port <= 65535, f"--config.port={config.port} is out of range: expected 1..65535"
  )
  try:
    token = md_serve_token(config)
  except ValueError as e:
    p.add(f"--config.token_file: {e}")
    token = None
  loopback = config.host in ("127.0.0.1", "localhost", "::1")
  p.require(
    loopback or bool(token),
    f"--config.host={config.host} is not loopback: set a token (--config.token_file or "
    "$MD_SERVE_TOKEN) and put a TLS terminator in front",
  )
  ratios = {}
  for item in filter(None, (x.strip() for x in config.video_mag_ratios.split(","))):
    name, _, file = item.partition("=")
    file = apps.repo_path(file, apps.config_file())
    if not name or not file or not os.path.isfile(file):
      p.add(f"--config.video_mag_ratios: {item!r} is not name=<existing ratios .json file>")
    ratios[name] = file
  p.at_least("video_max_sequence_length", 0)
  p.at_least("batch_wait_s", 0)
  p.at_least("preview_every", 0)
  try:
    buckets = [int(b) for b in config.batch_buckets.split(",")]
  except ValueError:
    buckets = []
  p.require(bool(buckets) and min(buckets) > 0, "--config.batch_buckets: comma-separated sizes > 0")
  v = config.verifier
  p.require(
    v in ("", "shapes") or v.startswith("clip="),
    "--config.verifier: '', 'shapes' or 'clip=<folder>'",
  )
  p.dtype("dtype")
  if p.lines:
    raise apps.UsageError(p.lines)
  return found, loras, buckets, token, ratios


def md_serve_token(config):
  """The token: --config.token_file's first line, else $MD_SERVE_TOKEN, else --config.token."""
  import md_serve

  return md_serve.read_token(config.token_file or None) or config.token or None


def _names(text):
  return [x.strip() for x in text.split(",") if x.strip()]


def main(argv):
  import importlib

  import jax.numpy as jnp

  from md_core import progress as md_progress

  config = _CONFIG.value
  with md_progress.phase("checking"):
    found, loras, buckets, token, ratios = _check(config)
  apps.configure_jax(compilation_cache=config.compilation_cache, executables=config.executables)
  import md_serve

  models = {}
  with md_progress.phase("loading", announce=True):
    for kind, spec in found.items():
      family = importlib.import_module(spec["family"])
      pipe = family.load_pipeline(spec["folder"], dtype=jnp.dtype(config.dtype), progress=False)
      name = config[f"{kind}_name"]
      models[name] = md_serve.ServedModel(
        name,
        pipe,
        loras=loras if kind == "image" else None,
        default_size=spec["size"],
        max_pixels=config.max_pixels or None,
        max_steps=config.max_steps,
        num_frames=config.num_frames,
        mag_ratios=ratios if kind == "video" else None,
        call_kwargs=(
          {"max_sequence_length": config.video_max_sequence_length}
          if kind == "video" and config.video_max_sequence_length > 0
          else None
        ),
      )
  verifier = None
  if config.verifier == "shapes":
    verifier = md_serve.ShapesVerifier()
  elif config.verifier.startswith("clip="):
    verifier = md_serve.ClipVerifier(config.verifier[5:])
  print(f"md-serve on http://{config.host}:{config.port}/ with {sorted(models)}", flush=True)
  md_serve.serve(
    models,
    host=config.host,
    port=config.port,
    token=token,
    shutdown=config.shutdown,
    finish_timeout_s=config.finish_timeout_s,
    allowed_hosts=["127.0.0.1", "localhost", "::1", config.host, *_names(config.allowed_hosts)],
    allowed_origins=_names(config.allowed_origins),
    public_url=config.public_url,
    job_timeout_s=config.job_timeout_s or None,
    max_programs=config.max_programs,
    max_queue=config.max_queue,
    max_batch=config.max_batch,
    batch_buckets=buckets,
    batch_wait_s=config.batch_wait_s,
    preview_every=config.preview_every,
    verifier=verifier,
    warmup=config.warmup,
  )


if __name__ == "__main__":
  apps.run(main, doc=__doc__, fixed=_FIXED)
