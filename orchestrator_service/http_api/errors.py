"""The one mapping of what goes wrong to the OpenAI error shape `{"error": {message, type, param, code}}`.

Sources: the request path's `Refused` (its gRPC status code says what kind), a field this API cannot
translate (`InvalidRequest`, naming the OpenAI field), a body of the wrong shape (pydantic), an unknown
model. `param` names the OpenAI field: a request-path field (`params.text.max_tokens`) is mapped back
through the field map the translation made (`max_tokens`).
"""

from __future__ import annotations

import logging
import math
import re
from dataclasses import dataclass, field
from typing import Mapping

import grpc
from pydantic import ValidationError
from starlette.responses import JSONResponse

from omnistage.contract.params import InvalidRequest

from ..servicer import Refused

log = logging.getLogger("omnistage.orchestrator.http_api")

# gRPC status -> (HTTP status, OpenAI error type, code). Anything else is a server error.
STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error", None),
    grpc.StatusCode.UNAUTHENTICATED: (401, "invalid_request_error", "invalid_api_key"),
    grpc.StatusCode.NOT_FOUND: (404, "invalid_request_error", "model_not_found"),
    grpc.StatusCode.ALREADY_EXISTS: (409, "invalid_request_error", "duplicate_request_id"),
    grpc.StatusCode.PERMISSION_DENIED: (403, "permission_error", None),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error", "rate_limit_exceeded"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable_error", "unavailable"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout_error", "timeout"),
}
SERVER_ERROR = (500, "server_error", None)
# Headers every answer of a status carries: a deadline that passed passes again on a retry, and the openai
# SDKs read `x-should-retry` before their own retry rule (which retries any 5xx).
STATUS_HEADERS = {grpc.StatusCode.DEADLINE_EXCEEDED: {"x-should-retry": "false"}}
# Retry-After when the refusal gives none: overload in a stage (its own queue full) and a draining
# orchestrator (another replica, or this one restarted, takes the retry) are over in about a second.
DEFAULT_RETRY_AFTER_S = 1
# A stage's INVALID_ARGUMENT reaches the orchestrator as "<field>: <message>" (InvalidRequest's text).
_FIELD_PREFIX = re.compile(r"^((?:params\.|outputs\[)[\w.\[\]]*|request_id): ")
# Validation errors a refusal weighs (the deepest named). The schema's fail-fast lists keep a body's errors to
# a few per field (a few dozen at most); more than this are counted, never built.
MAX_REPORTED_ERRORS = 64
# Pydantic's union branch labels in an error's location ("str", "list[ContentPart]"): not fields.
_UNION_LABEL = re.compile(r"^(str|int|float|bool|list|dict|none)(\[.*\])?$|[\[\]-]")


@dataclass(eq=False)  # an exception: compared (and hashed) by identity
class ApiError(Exception):
    """An answer in the OpenAI error shape, with its HTTP status."""

    status: int
    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None
    headers: dict[str, str] = field(default_factory=dict)
    extra: dict[str, str] = field(default_factory=dict)  # more keys of the error object (`stage`)

    def __post_init__(self):
        super().__init__(self.message)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code,
                          **self.extra}}


class UnknownModel(Exception):
    """The request names a model this orchestrator does not serve."""

    def __init__(self, model: str, served: str):
        self.model, self.served = model, served
        super().__init__(f'The model "{model}" does not exist (this server serves "{served}")')


def of_status(code: grpc.StatusCode, message: str, param: str | None = None) -> ApiError:
    """An error of the kind a gRPC status code names."""
    status, kind, error_code = STATUS.get(code, SERVER_ERROR)
    return ApiError(status, message, kind, param, error_code, dict(STATUS_HEADERS.get(code, {})))


def bad_request(param: str | None, message: str) -> ApiError:
    return of_status(grpc.StatusCode.INVALID_ARGUMENT, message, param)


def from_exception(e: BaseException, fields: Mapping[str, str] = {}) -> ApiError:
    """Any failure of a request as the client sees it; `fields` maps request-path fields to OpenAI ones."""
    if isinstance(e, ApiError):
        return e
    if isinstance(e, Refused):
        return from_refused(e, fields)
    if isinstance(e, InvalidRequest):
        return bad_request(e.field, str(e))
    if isinstance(e, ValidationError):
        return from_validation(e)
    if isinstance(e, UnknownModel):
        return of_status(grpc.StatusCode.NOT_FOUND, str(e), "model")
    # A fault in this process, not the client's: its text stays in the log.
    log.error("HTTP API: request failed", exc_info=e)
    return of_status(grpc.StatusCode.INTERNAL, "internal error (see the orchestrator's log)")


def from_refused(e: Refused, fields: Mapping[str, str]) -> ApiError:
    status, kind, code = STATUS.get(e.code, SERVER_ERROR)
    message, param, headers, extra = e.message, None, dict(STATUS_HEADERS.get(e.code, {})), {}
    if e.code == grpc.StatusCode.INVALID_ARGUMENT:
        field_ = e.param
        if field_ is None and (m := _FIELD_PREFIX.match(message)):
            field_ = m.group(1)
        if field_ is not None:
            param = openai_param(field_, fields)
            if message.startswith(f"{field_}: "):
                message = f"{param}: {message[len(field_) + 2:]}"
    retry_after = e.retry_after_s
    if retry_after is None and (e.code == grpc.StatusCode.RESOURCE_EXHAUSTED or
                                (e.code == grpc.StatusCode.UNAVAILABLE and not e.stage)):  # no stage: draining
        retry_after = DEFAULT_RETRY_AFTER_S
    if retry_after is not None:
        headers["Retry-After"] = retry_after_header(retry_after)
    if e.stage:
        extra["stage"] = e.stage
        if e.code == grpc.StatusCode.UNAVAILABLE:
            code = "stage_unavailable"
    return ApiError(status, message, kind, param, code, headers, extra)


def retry_after_header(seconds: float) -> str:
    """`Retry-After` in whole seconds, at least 1."""
    return str(max(1, math.ceil(seconds)))


def openai_param(request_field: str, fields: Mapping[str, str]) -> str:
    """The OpenAI field a request-path field came from: the longest mapped prefix (`params.parts[2].image`
    -> `messages[0].content[1]`); the field itself when nothing maps it."""
    best = ""
    for prefix in fields:
        if (request_field == prefix or request_field.startswith((prefix + ".", prefix + "["))) and \
                len(prefix) > len(best):
            best = prefix
    return fields[best] if best else request_field


def from_validation(e: ValidationError) -> ApiError:
    """A body of the wrong shape: the most specific field at fault (the deepest: the union branch the
    client meant), as an OpenAI field path, with what each branch expected there; of the first few errors."""
    count = e.error_count()
    if count > MAX_REPORTED_ERRORS:  # errors() builds a dict per error, with its input: never for many
        return bad_request(None, f"the body does not match the request's schema ({count} errors)")
    errors = e.errors(include_url=False, include_input=False)
    if errors[0]["type"] == "json_invalid":
        return bad_request(None, f"the body is not valid JSON: {errors[0]['msg']}")
    paths = [field_path(err["loc"]) for err in errors]
    param = max(paths, key=lambda p: (p.count(".") + p.count("["), len(p)))
    why = " or ".join(dict.fromkeys(err["msg"] for err, p in zip(errors, paths) if p == param))
    return bad_request(param or None, f"{param}: {why}" if param else why)


def field_path(loc) -> str:
    """('messages', 0, 'content', 'list[ContentPart]', 1, 'text') -> 'messages[0].content[1].text'."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif not _UNION_LABEL.search(part):
            out += f".{part}" if out else part
    return out


def error_response(e: ApiError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)
