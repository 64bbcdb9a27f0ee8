"""serve: md's HTTP server (md-serve) over an image and a video pipeline, with the web page at /.

uv run apps/serve --config=apps/configs/serve.py:default                 # http://127.0.0.1:8000/
uv run apps/serve --config=apps/configs/serve.py:default --config.port=8080 --config.token=s3cret
uv run apps/serve --config=apps/configs/serve.py:image --config.image_model=path/to/diffusers-folder
uv run apps/serve --config=apps/configs/serve.py:default --config.image_loras=style=style.safetensors
uv run apps/serve --config=apps/configs/serve.py:default --config.verifier=shapes   # search requests
uv run apps/serve --config=apps/configs/serve.py:default --config.executables=True --config.warmup=True
uv run apps/serve --help --config=apps/configs/serve.py:default   # the variants, keys and values

Variants: default (an image and a video model), image (image only), video (video only). The model folders
are options: today they point at the tiny random pipelines in tests/fixtures (sd_pipeline/sd,
wan_pipeline/t2v); md's own trained default models plug in with --config.image_model= /
--config.video_model= (a diffusers folder under models/) once they exist.
"""

import ml_collections

_IMAGE = "tests/fixtures/sd_pipeline/sd"
_VIDEO = "tests/fixtures/wan_pipeline/t2v"

VARIANTS = {
  "default": dict(image_model=_IMAGE, video_model=_VIDEO),
  "image": dict(image_model=_IMAGE, video_model=""),
  "video": dict(image_model="", video_model=_VIDEO),
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
  c.max_pixels = 1024 * 1024
  c.dtype = "float32"
  # The server.
  c.host = "127.0.0.1"
  c.port = 8000
  c.token = ""  # a bearer token /v1/* requires ("" : open)
  c.shutdown = "finish"  # on stop: "finish" accepted jobs, or "cancel" them
  # The queue: jobs waiting or running before 429, rows per call, the batch sizes calls are padded to,
  # how long the first job waits for compatible ones, a preview event every k steps (0: none).
  c.max_queue = 32
  c.max_batch = 4
  c.batch_buckets = "1,2,4"
  c.batch_wait_s = 0.05
  c.preview_every = 4
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
