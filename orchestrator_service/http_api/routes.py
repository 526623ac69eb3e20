"""The API's routes. Each handler is a short narrative: read the body -> translate -> call the request
path -> shape the answer; failures become the OpenAI error shape in one place (`_answers_errors`)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import time
from typing import AsyncIterator, Awaitable, Callable, Iterator, TypeVar

from pydantic import BaseModel
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp

from omnistage.api import Limits, Pipeline
from omnistage.contract.params import InvalidRequest

from ..servicer import MAX_REQUEST_ID
from . import audio_formats, chat, images, speech, translate
from .auth import ApiKeyAuth
from .call import Call, ClientGone, deadline_from
from .errors import ApiError, error_response, from_exception
from .responses import SSE_HEADERS, SSE_MEDIA_TYPE, CallStreamResponse, model_card
from .schemas import ChatCompletionRequest, ImageRequest, SpeechRequest

BASE64_SLACK = 1 << 20  # JSON around a chat body's base64 media
TEXT_SLACK = 64 << 10  # JSON around a text-only body's text
JSON_BYTES_PER_CHAR = 6  # a character at its longest in JSON: escaped, \uXXXX
TEXT_FIELDS = 2  # text fields of a text-only body that may each hold a whole prompt (prompt, negative_prompt)
BODIES_AT_ONCE = 2  # the body budget: this many chat bodies at their largest, read at once
BODY_IDLE_S = 30.0  # a body of which no piece comes for this long is 408
PARSE_IN_THREAD_BYTES = 1 << 20  # bodies larger than this are parsed and translated off the event loop
TRACE_HEADER = "X-Omnistage-Trace"  # 1: the answer carries the request's trace (as gRPC's return_trace)
# The client's own label for a request (as OpenAI's API takes it): kept as the request's client_request_id;
# the server's id comes back as X-Request-Id.
CLIENT_ID_HEADER = "X-Client-Request-Id"
Plan = TypeVar("Plan")


def chat_body_limit(limits: Limits) -> int:
    """The largest chat body the pipeline's limits admit: every part at its largest, in base64."""
    return limits.max_request_bytes * 4 // 3 + BASE64_SLACK


def text_body_limit(limits: Limits) -> int:
    """The largest speech or images body: they carry text only, each text field a whole prompt at most."""
    return TEXT_FIELDS * limits.max_prompt_chars * JSON_BYTES_PER_CHAR + TEXT_SLACK


class BodyBudget:
    """Bytes of request bodies held at once, across requests: a body takes its bytes as they come, and
    gives them all back once it is translated (or refused), so bodies arriving together cannot hold more
    than `capacity` between them."""

    def __init__(self, capacity: int):
        self.capacity, self.held = capacity, 0

    @contextlib.contextmanager
    def holding(self) -> Iterator[Callable[[int], None]]:
        """`with budget.holding() as take: take(n)`; a take past the capacity is 429."""
        taken = 0

        def take(n: int) -> None:
            nonlocal taken
            if self.held + n > self.capacity:
                raise ApiError(429, f"the server is reading as many request bodies as it holds at once "
                                    f"({self.capacity} bytes); retry", "rate_limit_error", code="rate_limit_exceeded",
                               headers={"Retry-After": "1"})
            self.held += n
            taken += n

        try:
            yield take
        finally:
            self.held -= taken


def _answers_errors(handler: Callable[..., Awaitable[Response]]):
    @functools.wraps(handler)
    async def wrapped(self, request: Request) -> Response:
        try:
            return await handler(self, request)
        except (ClientGone, ClientDisconnect):
            return Response(status_code=499)  # nobody is listening: never sent
        except Exception as e:  # noqa: BLE001 - any failure is the client's answer; from_exception logs faults
            return error_response(from_exception(e))
    return wrapped


class Endpoints:
    def __init__(self, servicer, pipeline: Pipeline):
        self.servicer, self.pipeline = servicer, pipeline
        self.card = model_card(pipeline, int(time.time()))
        self.chat_limit = chat_body_limit(pipeline.limits)
        self.text_limit = text_body_limit(pipeline.limits)
        self.budget = BodyBudget(BODIES_AT_ONCE * self.chat_limit)

    @_answers_errors
    async def chat_completions(self, request: Request) -> Response:
        plan = await self._translated(request, ChatCompletionRequest, translate.chat, self.chat_limit)
        call = self._call(request, plan)
        if plan.stream:
            return await _events(call, chat.stream(call, plan, self.pipeline.name))
        async with call:
            return JSONResponse(await chat.complete(call, plan, self.pipeline.name),
                                headers={"X-Request-Id": call.request_id})

    @_answers_errors
    async def audio_speech(self, request: Request) -> Response:
        plan = await self._translated(request, SpeechRequest, translate.speech, self.text_limit)
        call = self._call(request, plan)
        if plan.stream:
            return await _events(call, speech.sse_stream(call))
        media_type = audio_formats.content_type(plan.audio_format)
        if plan.audio_format == "pcm":
            rate = speech.first_rate(await call.open())
            return CallStreamResponse(call, speech.pcm_stream(call), media_type,
                                      {speech.SAMPLE_RATE_HEADER: str(rate)} if rate else {})
        async with call:
            audio, rate = await speech.whole(call, plan.audio_format)
        return Response(audio, media_type=media_type, headers={"X-Request-Id": call.request_id})

    @_answers_errors
    async def images_generations(self, request: Request) -> Response:
        plans = await self._translated(request, ImageRequest, translate.images, self.text_limit)
        calls = [self._call(request, p) for p in plans]
        return JSONResponse(await images.generate(calls),
                            headers={"X-Request-Id": ",".join(c.request_id for c in calls)})

    @_answers_errors
    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [self.card]})

    @_answers_errors
    async def model(self, request: Request) -> Response:
        translate.check_model(request.path_params["model"], self.pipeline)
        return JSONResponse(self.card)

    async def health(self, request: Request) -> Response:
        if self.servicer.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        return JSONResponse({"status": "ok"})

    # ------------------------------------------------------------------ helpers
    async def _translated(self, request: Request, model: type[BaseModel],
                          translation: Callable[[BaseModel, Pipeline], Plan], limit: int) -> Plan:
        """The JSON body, strictly typed as `model`, translated; bounded in size (`limit`), in the bytes
        of all bodies read at once (the budget) and in the time between its pieces."""
        trace = trace_from(request)
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise _too_large(limit)
        with self.budget.holding() as take:
            raw = bytearray()
            more = True
            while more:
                try:
                    async with asyncio.timeout(BODY_IDLE_S):
                        message = await request.receive()
                except TimeoutError:
                    raise ApiError(408, f"no part of the body came for {BODY_IDLE_S:.0f} s", code="request_timeout",
                                   headers={"Connection": "close"}) from None
                if message["type"] == "http.disconnect":
                    raise ClientGone
                piece, more = message.get("body", b""), message.get("more_body", False)
                if len(raw) + len(piece) > limit:
                    raise _too_large(limit)
                take(len(piece))
                raw += piece
            parse = functools.partial(_parse, raw, model, translation, self.pipeline)
            # Parsing and decoding a large body takes a while (about 0.7 s for 64 MiB): not on the event loop.
            plan = await asyncio.to_thread(parse) if len(raw) > PARSE_IN_THREAD_BYTES else parse()
        plans = plan if isinstance(plan, list) else [plan]
        label = request.headers.get(CLIENT_ID_HEADER, "")
        if label:  # a refusal of the label names the header it came in
            plans = [dataclasses.replace(p, fields={**p.fields, "request_id": CLIENT_ID_HEADER}) for p in plans]
            room = MAX_REQUEST_ID - len(f".{len(plans) - 1}") if len(plans) > 1 else MAX_REQUEST_ID
            if len(label) > room:
                raise InvalidRequest(CLIENT_ID_HEADER, f"is longer than {room} characters" + (
                    f" (with n={len(plans)} each image's request is labelled LABEL.i)" if len(plans) > 1 else ""))
        for i, p in enumerate(plans):
            p.request.return_trace |= trace  # the header, or the body's return_trace
            # n images are n requests: each label must be unique in flight
            p.request.request_id = label if len(plans) == 1 or not label else f"{label}.{i}"
        return plans if isinstance(plan, list) else plans[0]

    def _call(self, request: Request, plan: translate.Translated) -> Call:
        return Call(self.servicer, plan.request, plan.fields, deadline=deadline_from(request.headers),
                    receive=request.receive)


async def _events(call: Call, events: AsyncIterator[bytes]) -> Response:
    """Server-sent events from `call`, once its first event came (a refusal before it is raised)."""
    await call.open()
    return CallStreamResponse(call, events, SSE_MEDIA_TYPE, SSE_HEADERS)


def _parse(raw: bytearray, model: type[BaseModel], translation: Callable[[BaseModel, Pipeline], Plan],
           pipeline: Pipeline) -> Plan:
    return translation(model.model_validate_json(raw, strict=True), pipeline)


def trace_from(request: Request) -> bool:
    """Whether `X-Omnistage-Trace` asks for the request's trace."""
    value = request.headers.get(TRACE_HEADER, "0").strip().lower()
    if value not in ("0", "1", "true", "false"):
        raise InvalidRequest(TRACE_HEADER, f"must be 1 or 0, got {value!r}")
    return value in ("1", "true")


def _too_large(limit: int) -> ApiError:
    return ApiError(413, f"the body is larger than {limit} bytes (this pipeline's limits)", code="request_too_large")


async def _http_error(request: Request, exc: HTTPException) -> Response:
    """Starlette's own 404 / 405 in the OpenAI shape."""
    return error_response(ApiError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}"))


def build_app(servicer, pipeline: Pipeline) -> ASGIApp:
    """The API as an ASGI app: the routes behind the API-key check (the servicer's keys, shared with gRPC)."""
    api = Endpoints(servicer, pipeline)
    routes = [
        Route("/v1/chat/completions", api.chat_completions, methods=["POST"]),
        Route("/v1/audio/speech", api.audio_speech, methods=["POST"]),
        Route("/v1/images/generations", api.images_generations, methods=["POST"]),
        Route("/v1/models", api.models, methods=["GET"]),
        Route("/v1/models/{model:path}", api.model, methods=["GET"]),
        Route("/health", api.health, methods=["GET"]),
    ]
    return ApiKeyAuth(Starlette(routes=routes, exception_handlers={HTTPException: _http_error}), servicer.api_keys)
