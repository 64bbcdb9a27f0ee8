"""md-serve: an HTTP server for md pipelines (job queue with shape-bucket batching, progress events,
cancellation, metrics, a web page) and inference-time search over noises with verifiers."""

from md_serve._jobs import Job, JobQueue, QueueFull, ShuttingDown, compile_count
from md_serve._models import NoiseSpec, ServedModel, noise_spec
from md_serve._requests import CACHES, GenRequest, RequestError, parse_request, parse_size
from md_serve._schema import GenerationRequest, openapi
from md_serve._search import METHODS, ClipVerifier, SearchResult, ShapesVerifier, Verifier, search
from md_serve._server import (
  LOOPBACK,
  TOKEN_ENV,
  encode_result,
  header_timeout_protocol,
  make_app,
  read_token,
  serve,
)

__all__ = [
  "CACHES",
  "LOOPBACK",
  "METHODS",
  "ClipVerifier",
  "GenRequest",
  "GenerationRequest",
  "Job",
  "JobQueue",
  "NoiseSpec",
  "QueueFull",
  "RequestError",
  "SearchResult",
  "ServedModel",
  "ShapesVerifier",
  "ShuttingDown",
  "TOKEN_ENV",
  "Verifier",
  "compile_count",
  "encode_result",
  "header_timeout_protocol",
  "make_app",
  "noise_spec",
  "openapi",
  "parse_request",
  "parse_size",
  "read_token",
  "search",
  "serve",
]
