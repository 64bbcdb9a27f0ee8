"""The HTTP API as pydantic models and the OpenAPI document built from them (`GET /openapi.json`).

The models state each field's type and the bounds that hold on every server (a model's own limits: size
multiple, pixels, steps, frames, are on `/v1/models`); `parse_request` applies both and names the field.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr

from md_serve._requests import CACHES, MAX_RATIOS

Number = StrictInt | StrictFloat


class LoraChoice(BaseModel):
  """An adapter from the model's registry and its scale."""

  model_config = ConfigDict(extra="forbid")
  name: StrictStr
  scale: Annotated[Number, Field(ge=-100, le=100)] = 1.0


class SearchOptions(BaseModel):
  """Inference-time search: `budget` samples, kept by the server's verifier."""

  model_config = ConfigDict(extra="forbid")
  budget: Annotated[StrictInt, Field(ge=1, le=64)] = 8
  method: Literal["random", "zero_order", "path"] = "random"


class GenerationRequest(BaseModel):
  """The body of `POST /v1/images/generations` and `POST /v1/videos/generations`."""

  model_config = ConfigDict(extra="forbid")
  prompt: Annotated[StrictStr, Field(min_length=1, pattern=r"\S")]
  model: StrictStr | None = None
  n: Annotated[StrictInt, Field(ge=1)] = 1
  size: Annotated[StrictStr, Field(pattern=r"^\s*\d+\s*[xX]\s*\d+\s*$")] | None = None
  response_format: Literal["b64_json", "url"] = "b64_json"
  negative_prompt: StrictStr | None = None
  steps: Annotated[StrictInt, Field(ge=1)] | None = None
  guidance: Annotated[Number, Field(ge=0, le=100, allow_inf_nan=False)] = 5.0
  seed: Annotated[StrictInt, Field(ge=0, le=2**31 - 1)] = 0
  scheduler: StrictStr | None = None
  cache: Literal[tuple(CACHES)] | None = None  # type: ignore[valid-type]
  cache_options: dict[
    StrictStr,
    StrictBool
    | Number
    | StrictStr
    | Annotated[list[Number], Field(min_length=1, max_length=MAX_RATIOS)],
  ] = {}
  loras: list[LoraChoice | StrictStr] = []
  num_frames: Annotated[StrictInt, Field(ge=1)] | None = None
  video_format: Literal["mp4", "gif"] = "mp4"
  search: SearchOptions | None = None
  wait: StrictBool = True
  user: StrictStr | None = None


class ErrorDetail(BaseModel):
  message: str
  type: str
  param: str | None


class Error(BaseModel):
  """Every refusal: `param` names the field (or body, host, origin, content-type...)."""

  error: ErrorDetail


class ResultItem(BaseModel):
  b64_json: str | None = None
  mime_type: str | None = None
  url: str | None = None
  score: float | None = None


class GenerationResult(BaseModel):
  created: int
  id: str
  data: list[ResultItem]


class JobInfo(BaseModel):
  model_config = ConfigDict(extra="allow")
  id: str
  object: Literal["job"]
  status: Literal["queued", "running", "succeeded", "failed", "cancelled"]
  kind: str
  model: str
  step: int
  total: int


class ModelList(BaseModel):
  model_config = ConfigDict(extra="allow")
  object: Literal["list"]
  data: list[dict[str, Any]]
  limits: dict[str, Any]


_REFUSALS = {
  "400": "a bad field (named in error.param)",
  "401": "missing or wrong bearer token",
  "403": "an Origin this server does not serve",
  "404": "no such model, job or file",
  "408": "the body did not arrive in time",
  "409": "the job was cancelled",
  "413": "the body is too large",
  "415": "the body is not JSON",
  "421": "a Host this server does not answer",
  "422": "the pipeline refused the request (e.g. a size its model cannot take)",
  "429": "the queue is full (Retry-After)",
  "503": "the server is shutting down",
  "504": "the job ran past its deadline",
}


def _json(ref: str) -> dict:
  return {"content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{ref}"}}}}


def _responses(ok: dict[str, tuple[str, str]], codes: tuple[str, ...]) -> dict:
  out = {code: {"description": what, **_json(ref)} for code, (what, ref) in ok.items()}
  for code in codes:
    out[code] = {"description": _REFUSALS[code], **_json("Error")}
  return out


def openapi(title: str = "md") -> dict:
  """The OpenAPI 3.1 document of the routes (request and response schemas from the models above)."""
  components = {}
  for model in (GenerationRequest, Error, GenerationResult, JobInfo, ModelList):
    schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
    components.update(schema.pop("$defs", {}))
    components[model.__name__] = schema
  auth = ("401", "403", "421")
  generation = {
    "requestBody": {"required": True, **_json("GenerationRequest")},
    "responses": _responses(
      {"200": ("the results", "GenerationResult"), "202": ("the job (wait=false)", "JobInfo")},
      ("400", *auth, "404", "408", "409", "413", "415", "422", "429", "503", "504"),
    ),
  }
  job_id = {"name": "job_id", "in": "path", "required": True, "schema": {"type": "string"}}
  index = {"name": "index", "in": "path", "required": True, "schema": {"type": "string"}}
  file_ok = {
    "description": "result i: PNG, MP4 or GIF",
    "content": {m: {"schema": {"type": "string", "format": "binary"}} for m in (
      "image/png", "video/mp4", "image/gif")},
  }  # fmt: skip
  return {
    "openapi": "3.1.0",
    "info": {"title": f"{title} (md-serve)", "version": "1"},
    "paths": {
      "/v1/images/generations": {"post": {"operationId": "images", **generation}},
      "/v1/videos/generations": {"post": {"operationId": "videos", **generation}},
      "/v1/models": {
        "get": {
          "operationId": "models",
          "responses": _responses({"200": ("models and limits", "ModelList")}, auth),
        }
      },
      "/v1/jobs/{job_id}": {
        "get": {
          "operationId": "job",
          "parameters": [job_id],
          "responses": _responses({"200": ("the job", "JobInfo")}, (*auth, "404")),
        },
        "delete": {
          "operationId": "cancel",
          "parameters": [job_id],
          "responses": _responses({"200": ("the job, cancelled", "JobInfo")}, (*auth, "404")),
        },
      },
      "/v1/files/{job_id}/{index}": {
        "get": {
          "operationId": "file",
          "parameters": [job_id, index],
          "responses": {"200": file_ok, **_responses({}, (*auth, "404"))},
        }
      },
    },
    "components": {"schemas": components},
  }
