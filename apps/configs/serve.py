"""serve: md's HTTP server (md-serve) over an image and a video pipeline, with the web page at /.

uv run apps/serve --config=apps/configs/serve.py:default                 # http://127.0.0.1:8000/
MD_SERVE_TOKEN=s3cret uv run apps/serve --config=apps/configs/serve.py:default --config.port=8080
uv run apps/serve --config=apps/configs/serve.py:default --config.host=0.0.0.0 \
  --config.token_file=/run/secrets/md-token --config.allowed_hosts=md.example.com \
  --config.public_url=https://md.example.com       # behind a TLS terminator at md.example.com
uv run apps/serve --config=apps/configs/serve.py:image --config.image_model=path/to/diffusers-folder
uv run apps/serve --config=apps/configs/serve.py:default --config.image_loras=style=style.safetensors
uv run apps/serve --config=apps/configs/serve.py:default --config.verifier=shapes   # search requests
uv run apps/serve --config=apps/configs/serve.py:default --config.executables=True --config.warmup=True
uv run apps/serve --help --config=apps/configs/serve.py:default   # the variants, keys and values

Variants: default (md's own trained shapes models: models/shapes-sd for images, models/shapes-wan for
videos, 64 x 64, 9 frames), image / video (one of them alone), tiny / tiny-image / tiny-video (the tiny
random pipelines in tests/fixtures, 32 x 32: fast to compile, for tests and benchmarks). Prompts the
shapes models follow: "a red circle in the top left on a white background", "a green triangle moving up
on a black background" (guidance 3 is what their model cards score).
"""

import ml_collections

_IMAGE = "tests/fixtures/sd_pipeline/sd"
_VIDEO = "tests/fixtures/wan_pipeline/t2v"
_SHAPES = dict(
  image_model="models/shapes-sd",
  image_size="64x64",
  video_model="models/shapes-wan",
  video_size="64x64",
  num_frames=9,
  video_max_sequence_length=16,  # the text length shapes-wan was trained with
)
_TINY = dict(image_model=_IMAGE, video_model=_VIDEO)

VARIANTS = {
  "default": _SHAPES,
  "image": dict(_SHAPES, video_model=""),
  "video": dict(_SHAPES, image_model=""),
  "tiny": _TINY,
  "tiny-image": dict(_TINY, video_model=""),
  "tiny-video": dict(_TINY, image_model=""),
}


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  name = arg or "default"
  if name not in VARIANTS:
    raise ValueError(
      f"apps/configs/serve.py: unknown variant {name!r}; choose one of {sorted(VARIANTS)}"
    )
  c = ml_collections.ConfigDict()
  c.variant = name
  # Models: diffusers folders (md-sd and md-wan pipelines; "" leaves that kind out), their names in
  # requests, default sizes and limits.
  c.image_model = ""
  c.image_name = "image"
  c.image_size = "32x32"  # "WxH" when a request gives none
  c.image_loras = ""  # comma-separated name=file.safetensors, hot-swapped per request
  c.video_model = ""
  c.video_name = "video"
  c.video_size = "32x32"
  c.num_frames = 5
  c.video_max_sequence_length = 0  # text tokens of every video call (0: the pipeline's default)
  c.max_pixels = 0  # largest height x width a request may ask for (0: 4 x the default size's)
  c.max_steps = 100  # most denoising steps a request may ask for
  c.video_mag_ratios = ""  # comma-separated name=ratios.json: MagCache ratio sets requests may name
  c.dtype = "float32"
  # The server.
  # Loopback by default; any other address needs a token (and a TLS terminator in front).
  c.host = "127.0.0.1"
  c.port = 8000
  # The bearer token /v1/* requires: from token_file (first line), else $MD_SERVE_TOKEN, else token
  # (visible in `ps`: prefer the other two); all empty: open, which only loopback allows.
  c.token_file = ""
  c.token = ""
  c.allowed_hosts = ""  # comma-separated Host names besides the loopback ones and --config.host
  c.allowed_origins = ""  # comma-separated origins of other sites' pages allowed to call the API
  c.public_url = ""  # base of result URLs, e.g. https://md.example.com ("": relative URLs)
  c.shutdown = "finish"  # on stop: "finish" accepted jobs, or "cancel" them
  c.finish_timeout_s = 300.0  # "finish" runs them this long, then cancels the rest (each recorded)
  # The queue: jobs waiting or running before 429, rows per call, the batch sizes calls are padded to,
  # how long the first job waits for compatible ones, a preview event every k steps (0: none).
  c.max_queue = 32
  c.max_batch = 4
  c.batch_buckets = "1,2,4"
  c.batch_wait_s = 0.05
  c.preview_every = 4
  c.job_timeout_s = 600.0  # a job running longer fails at its next step (0: no deadline)
  c.max_programs = 8  # distinct compiled shapes kept; past that all are freed and compile again
  # Inference-time search ("search": {"budget": 8} in a request): "" (off), "shapes" (md-data's shapes
  # analyser) or "clip=<folder>" (a local CLIP with tokenizer/, text_encoder/, image_encoder/).
  c.verifier = ""
  c.compilation_cache = True
  # Ahead-of-time executables: True (~/.cache/md/executables), a folder, or "" (off). With warmup, every
  # batch bucket of each model runs once before the server opens (its programs compiled, or read back
  # from the executables folder), so no request waits on a compile at the default size.
  c.executables = ""
  c.warmup = False
  c.update(VARIANTS[name])
  c.lock()
  return c
