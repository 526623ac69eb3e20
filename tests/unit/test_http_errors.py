"""The HTTP API's one error mapping (orchestrator_service/http_api/errors.py) and its API-key check: every
status a refusal can carry, the field named as the client sent it, bodies of the wrong shape, and keys
compared with every configured key."""

from __future__ import annotations

import grpc
import pytest
from pydantic import ValidationError

from omnistage.contract.params import InvalidRequest
from orchestrator_service.http_api.errors import (
    ApiError,
    UnknownModel,
    error_response,
    field_path,
    from_exception,
    openai_param,
)
from orchestrator_service.http_api.schemas import ChatCompletionRequest
from orchestrator_service.servicer import Refused

FIELDS = {"params.parts": "messages", "params.parts[1]": "messages[0].content[1]",
          "params.text.max_tokens": "max_tokens", "params.audio.speaker": "audio.voice",
          "outputs[0]": "modalities[0]"}

STATUSES = [
    (grpc.StatusCode.INVALID_ARGUMENT, 400, "invalid_request_error", None),
    (grpc.StatusCode.RESOURCE_EXHAUSTED, 429, "rate_limit_error", "rate_limit_exceeded"),
    (grpc.StatusCode.UNAVAILABLE, 503, "service_unavailable_error", "unavailable"),
    (grpc.StatusCode.DEADLINE_EXCEEDED, 504, "timeout_error", "timeout"),
    (grpc.StatusCode.INTERNAL, 500, "server_error", None),
    (grpc.StatusCode.CANCELLED, 500, "server_error", None),
]


@pytest.mark.parametrize("code,status,kind,error_code", STATUSES, ids=[c.name for c, *_ in STATUSES])
def test_each_refusal_status_has_one_http_answer(code, status, kind, error_code):
    e = from_exception(Refused(code, "why"), FIELDS)
    assert (e.status, e.type, e.code, e.message) == (status, kind, error_code, "why")
    assert e.body() == {"error": {"message": "why", "type": kind, "param": None, "code": error_code}}


@pytest.mark.parametrize("param,message,openai,text", [
    ("params.text.max_tokens", "params.text.max_tokens: must be between 1 and 512, got 600",
     "max_tokens", "max_tokens: must be between 1 and 512, got 600"),
    ("params.parts[1].image", "params.parts[1].image: cannot decode", "messages[0].content[1]",
     "messages[0].content[1]: cannot decode"),
    ("params.parts", "params.parts: decoding took longer than 0.001 s", "messages",
     "messages: decoding took longer than 0.001 s"),
    ("outputs[0]", "outputs[0]: no audio output", "modalities[0]", "modalities[0]: no audio output"),
    ("request_id", "request_id: too long", "request_id", "request_id: too long"),
    # A stage's refusal carries no param of its own: its message begins with the field.
    (None, 'params.audio.speaker: unknown speaker "alloy"', "audio.voice", 'audio.voice: unknown speaker "alloy"'),
    (None, "no field here", None, "no field here"),
])
def test_a_bad_field_is_named_as_the_client_sent_it(param, message, openai, text):
    e = from_exception(Refused(grpc.StatusCode.INVALID_ARGUMENT, message, param=param), FIELDS)
    assert (e.status, e.param, e.message) == (400, openai, text)


def test_overload_carries_retry_after_in_whole_seconds():
    for seconds, header in ((0.1, "1"), (1.0, "1"), (2.01, "3")):
        e = from_exception(Refused(grpc.StatusCode.RESOURCE_EXHAUSTED, "full", retry_after_s=seconds))
        assert e.headers == {"Retry-After": header}


RETRY_HEADERS = [
    # The orchestrator's admission says when; a stage's own queue full and a draining orchestrator do not.
    (Refused(grpc.StatusCode.RESOURCE_EXHAUSTED, "full", retry_after_s=2.5), 429, {"Retry-After": "3"}),
    (Refused(grpc.StatusCode.RESOURCE_EXHAUSTED, "stage talker: queue full", stage="talker"), 429,
     {"Retry-After": "1"}),
    (Refused(grpc.StatusCode.UNAVAILABLE, "orchestrator is draining; retry on another replica"), 503,
     {"Retry-After": "1"}),
    (Refused(grpc.StatusCode.UNAVAILABLE, "stage talker has no replicas", stage="talker"), 503, {}),
    (Refused(grpc.StatusCode.DEADLINE_EXCEEDED, "too late"), 504, {"x-should-retry": "false"}),
    (Refused(grpc.StatusCode.DEADLINE_EXCEEDED, "stage talker: too late", stage="talker"), 504,
     {"x-should-retry": "false"}),
    (Refused(grpc.StatusCode.INVALID_ARGUMENT, "bad"), 400, {}),
]


@pytest.mark.parametrize("refused,status,headers", RETRY_HEADERS, ids=[r.message for r, *_ in RETRY_HEADERS])
def test_retry_headers(refused, status, headers):
    e = from_exception(refused)
    assert (e.status, e.headers) == (status, headers)
    sent = error_response(e).headers
    assert all(sent[name] == value for name, value in headers.items())


def test_a_stage_that_is_down_is_named():
    e = from_exception(Refused(grpc.StatusCode.UNAVAILABLE, "stage talker has no replicas", stage="talker"))
    assert e.status == 503 and e.code == "stage_unavailable" and e.body()["error"]["stage"] == "talker"


def test_translation_errors_model_and_faults():
    assert from_exception(InvalidRequest("stop", "is empty")).param == "stop"
    e = from_exception(UnknownModel("gpt-4o", "omni"))
    assert (e.status, e.param, e.code) == (404, "model", "model_not_found")
    e = from_exception(RuntimeError("secret detail"))
    assert e.status == 500 and "secret" not in e.message
    same = ApiError(413, "too big")
    assert from_exception(same) is same


@pytest.mark.parametrize("body,param", [
    ('{"messages": [{"role": "user", "content": "x"}], "temperature": "hot"}', "temperature"),
    ('{"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}', "messages[0].content[0].text"),
    ('{"messages": [{"role": "user", "content": 5}]}', "messages[0].content"),
    ('{"messages": [{"role": "user", "content": "x"}], "stop": [1]}', "stop[0]"),
    ('{"messages": []}', "messages"),
    ('{"messages": [{"role": "user", "content": "x"}], "stream": "yes"}', "stream"),
    ('{"messages": [{"role": "user", "content": "x"}], "max_tokens": 1.5}', "max_tokens"),
    ("{", None),
])
def test_bodies_of_the_wrong_shape_are_400_naming_the_field(body, param):
    with pytest.raises(ValidationError) as v:
        ChatCompletionRequest.model_validate_json(body, strict=True)
    e = from_exception(v.value)
    assert e.status == 400 and e.param == param
    assert e.message.startswith(f"{param}: " if param else "the body is not valid JSON")


def test_field_paths_and_longest_prefix():
    assert field_path(("messages", 0, "content", "list[ContentPart]", 1, "image_url", "url")) == \
        "messages[0].content[1].image_url.url"
    assert field_path(("stop", "str")) == "stop"
    assert openai_param("params.parts[1].image", FIELDS) == "messages[0].content[1]"
    assert openai_param("params.parts[10]", FIELDS) == "messages"  # not params.parts[1]
    assert openai_param("params.seed", FIELDS) == "params.seed"


