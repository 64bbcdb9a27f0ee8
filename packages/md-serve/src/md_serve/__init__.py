"""md-serve: an HTTP server for md pipelines (job queue with shape-bucket batching, progress events,
cancellation, metrics, a web page) and inference-time search over noises with verifiers."""

from md_serve._jobs import Job, JobQueue, QueueFull, ShuttingDown, compile_count
from md_serve._models import NoiseSpec, ServedModel, noise_spec
from md_serve._requests import GenRequest, RequestError, parse_request, parse_size
from md_serve._search import METHODS, ClipVerifier, SearchResult, ShapesVerifier, Verifier, search
from md_serve._server import encode_result, make_app, serve

__all__ = [
  "METHODS",
  "ClipVerifier",
  "GenRequest",
  "Job",
  "JobQueue",
  "NoiseSpec",
  "QueueFull",
  "RequestError",
  "SearchResult",
  "ServedModel",
  "ShapesVerifier",
  "ShuttingDown",
  "Verifier",
  "compile_count",
  "encode_result",
  "make_app",
  "noise_spec",
  "parse_request",
  "parse_size",
  "search",
  "serve",
]
