"""The API's routes. Each handler is a short narrative: read the body -> translate -> call the request
path -> shape the answer; failures become the OpenAI error shape in one place (`_answers_errors`)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import io
import time
from typing import AsyncIterator, Awaitable, Callable, TypeVar

from pydantic import BaseModel
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route, WebSocketRoute
from starlette.types import ASGIApp
from starlette.websockets import WebSocket

from omnistage.api import Pipeline
from omnistage.contract.params import InvalidRequest

from .. import client_cap, otel
from ..byte_budget import BudgetFull, ByteBudget
from ..servicer import MAX_REQUEST_ID
from . import (
    audio_formats,
    body_models,
    chat,
    completions,
    image_edits,
    images,
    multipart_form,
    speech,
    transcriptions,
    translate,
    videos,
    voices,
)
from .audio_ids import AnswerTranscripts
from .auth import ApiKeyAuth
from .body_limits import BodyBounds, BodyScan, chat_bounds, text_bounds
from .body_limits import chat_body_limit as chat_body_limit  # each endpoint's size, as the API's own
from .body_limits import text_body_limit as text_body_limit
from .call import Call, ClientGone, deadline_from
from .errors import ApiError, error_response, from_exception, retry_after_header
from .parse_workers import ParseWorkers
from .realtime import RealtimeEndpoint
from .responses import SSE_HEADERS, SSE_MEDIA_TYPE, CallStreamResponse, model_card
from .schemas import ChatCompletionRequest, ImageEditRequest, ImageRequest, SpeechRequest

BODIES_AT_ONCE = 2  # the body budget: this many chat bodies at their largest, read at once
CLIENT_BODIES = 1  # of which one client address may hold this many: the rest stays open to the others
BODY_IDLE_S = 30.0  # a body of which no piece comes for this long is 408
# A body's whole time: BODY_BASE_S plus its size (declared, or read so far) at BODY_MIN_RATE; slower is 408, so
# that a body drip-fed a byte at a time (each piece within BODY_IDLE_S) cannot hold its budget for hours.
# 32 KiB/s is a 256 kbit/s uplink: a 16 MiB part from a 1 Mbit/s one has time to spare. A lower floor holds no
# more memory: what one slow client holds is bounded by its share of the body budget (CLIENT_BODIES).
BODY_BASE_S = 30.0
BODY_MIN_RATE = 32 << 10
# Bodies larger than this are parsed and translated off the event loop: in a parser process (parse_workers.py)
# where the API has them, else on a thread. Smaller ones take a few milliseconds: a process's round trip is not
# worth it.
PARSE_APART_BYTES = 1 << 20
TRACE_HEADER = "X-Omnistage-Trace"  # 1: the answer carries the request's trace (as gRPC's return_trace)
# The client's own label for a request (as OpenAI's API takes it): kept as the request's client_request_id;
# the server's id comes back as X-Request-Id.
CLIENT_ID_HEADER = "X-Client-Request-Id"
Plan = TypeVar("Plan")


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
    def __init__(self, servicer, pipeline: Pipeline, parse_workers: ParseWorkers | None = None):
        self.servicer, self.pipeline, self.parse_workers = servicer, pipeline, parse_workers
        self.card = model_card(pipeline, int(time.time())) | voices.card_fields(servicer.voices)
        limits = pipeline.limits
        self.chat_limit, self.text_limit = chat_bounds(limits), text_bounds(limits)
        self.upload_limit = transcriptions.upload_body_limit(limits)
        self.budget = ByteBudget(BODIES_AT_ONCE * self.chat_limit.size, CLIENT_BODIES * self.chat_limit.size)
        self.schemas = body_models.bounded(limits)  # each request model under this pipeline's limits
        self.transcripts = AnswerTranscripts()  # what each audio answer said, for a later turn's audio.id
        # The job API the servicer shares with gRPC; a request path without one (a stand-in) has no job store.
        self.videos = videos.VideoEndpoints(self, getattr(servicer, "jobs", None), pipeline, servicer.api_keys)

    @_answers_errors
    async def chat_completions(self, request: Request) -> Response:
        plan = await self._translated(request, ChatCompletionRequest, translate.chat, self.chat_limit)
        self._fill_transcripts(plan)
        call = self._call(request, plan)
        if plan.stream:
            return await _events(call, chat.stream(call, plan, self.pipeline.name, self.transcripts))
        async with call:
            return JSONResponse(await chat.complete(call, plan, self.pipeline.name, self.transcripts),
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
        return await self._images(request, await self._translated(request, ImageRequest, translate.images,
                                                                  self.text_limit))

    @_answers_errors
    async def images_edits(self, request: Request) -> Response:
        """The image to edit uploaded (multipart, as the SDKs send it) or inline in JSON (bounded as chat's parts)."""
        if multipart_form.is_form(request.headers.get("content-type", "")):
            plans = await self._uploaded(request, image_edits.from_upload)
        else:
            plans = await self._translated(request, ImageEditRequest, image_edits.from_json, self.chat_limit)
        return await self._images(request, plans)

    async def _images(self, request: Request, plans: list[translate.Translated]) -> Response:
        calls = [self._call(request, p) for p in plans]
        return JSONResponse(await images.generate(calls),
                            headers={"X-Request-Id": ",".join(c.request_id for c in calls)})

    @_answers_errors
    async def audio_transcriptions(self, request: Request) -> Response:
        return await self._transcribed(request, await self._uploaded(request, transcriptions.transcription))

    @_answers_errors
    async def audio_translations(self, request: Request) -> Response:
        return await self._transcribed(request, await self._uploaded(request, transcriptions.translation))

    async def _transcribed(self, request: Request, plan: transcriptions.Transcription) -> Response:
        call = self._call(request, plan)
        if plan.stream:
            return await _events(call, transcriptions.stream(call))
        async with call:
            return await transcriptions.whole(call, plan)

    @_answers_errors
    async def text_completions(self, request: Request) -> Response:
        plans = await self._translated(request, completions.CompletionRequest, completions.translate,
                                       completions.body_bounds(self.pipeline.limits))
        calls = [self._call(request, p) for p in plans]
        if plans[0].stream:  # one choice: several are refused
            return await _events(calls[0], completions.stream(calls[0], plans[0], self.pipeline.name))
        return JSONResponse(await completions.complete(calls, plans, self.pipeline.name),
                            headers={"X-Request-Id": ",".join(c.request_id for c in calls)})

    @_answers_errors
    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [self.card]})

    @_answers_errors
    async def model(self, request: Request) -> Response:
        translate.check_model(request.path_params["model"], self.pipeline)
        return JSONResponse(self.card)

    @_answers_errors
    async def audio_voices(self, request: Request) -> Response:
        translate.check_model(request.query_params.get("model"), self.pipeline)
        return JSONResponse(voices.listing(self.pipeline.name, self.servicer.voices))

    async def health(self, request: Request) -> Response:
        if self.servicer.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        return JSONResponse({"status": "ok"})

    # ------------------------------------------------------------------ helpers
    def _fill_transcripts(self, plan: translate.Translated) -> None:
        """Each earlier spoken answer the conversation refers to by its audio id, as what it said; bounded by
        the prompt's characters as they are filled (the same id sent a thousand times is not copied past it)."""
        room = self.pipeline.limits.max_prompt_chars
        for ref in plan.audio_refs:
            text = self.transcripts.transcript(ref.id, ref.field) or " "
            room -= len(text)
            if room < 0:
                raise InvalidRequest("messages", "the transcripts of the earlier audio answers it refers to are "
                                                 f"more than {self.pipeline.limits.max_prompt_chars} characters")
            plan.request.params.parts[ref.part].text = text

    async def _translated(self, request: Request, model: type[BaseModel],
                          translation: Callable[[BaseModel, Pipeline], Plan], bounds: BodyBounds) -> Plan:
        """The JSON body, strictly typed as `model`, translated; bounded as `_body` reads it, and in its JSON
        values and escapes (`bounds`)."""
        trace = trace_from(request)
        async with self._body(request, bounds.size, BodyScan(bounds).add) as (body, received):
            # Parsing and decoding a large body takes a while (about 1.2 s for 170 MiB of media parts, of which
            # the parser holds Python's lock about 0.25 s at a time, stalling every stream): not in this process.
            if received > PARSE_APART_BYTES and self.parse_workers is not None:
                plan = await self.parse_workers.parse(body, model, translation)
            else:
                parse = functools.partial(_parse, body, self.schemas[model], translation, self.pipeline)
                plan = await asyncio.to_thread(parse) if received > PARSE_APART_BYTES else parse()
        return self._labelled(request, plan, trace)

    async def _uploaded(self, request: Request, translation: Callable[[bytes, str, Pipeline], Plan]) -> Plan:
        """The multipart body (an upload), bounded as `_body` reads it (in size: `transcriptions`' limit),
        translated."""
        trace = trace_from(request)
        async with self._body(request, self.upload_limit) as (body, received):
            parse = functools.partial(translation, body.getvalue(), request.headers.get("content-type", ""),
                                      self.pipeline)
            body.close()  # its bytes live on in `parse` only
            plan = await asyncio.to_thread(parse) if received > PARSE_APART_BYTES else parse()
        return self._labelled(request, plan, trace)

    @contextlib.asynccontextmanager
    async def _body(self, request: Request, limit: int,
                    scan: Callable[[bytes], None] | None = None) -> AsyncIterator[tuple[io.BytesIO, int]]:
        """The body's bytes and their count, held (in the body budget) for the scope: bounded in size
        (`limit`), in the bytes of all bodies read at once and of this client's (the budget), in the time
        between its pieces and in its whole time (at least BODY_MIN_RATE); each piece passed to `scan` as it
        comes (which may refuse it)."""
        declared = request.headers.get("content-length", "")
        expected = int(declared) if declared.isdigit() else 0
        if expected > limit:
            raise _too_large(limit)
        started = time.monotonic()
        with self.budget.holding(request.client.host if request.client else "") as take:

            body = io.BytesIO()  # grown in place, and its value is the bytes themselves (_parse)
            received = 0
            more = True
            while more:
                allowed = BODY_BASE_S + max(expected, received) / BODY_MIN_RATE
                left = started + allowed - time.monotonic()
                try:
                    async with asyncio.timeout(max(0.0, min(BODY_IDLE_S, left))):
                        message = await request.receive()
                except TimeoutError:
                    raise _too_slow(received, time.monotonic() - started, left < BODY_IDLE_S) from None
                if message["type"] == "http.disconnect":
                    raise ClientGone
                piece, more = message.get("body", b""), message.get("more_body", False)
                if received + len(piece) > limit:
                    raise _too_large(limit)
                if scan is not None:
                    scan(piece)
                try:
                    take(len(piece))
                except BudgetFull as e:
                    raise ApiError(429, f"{e}; retry", "rate_limit_error", code="rate_limit_exceeded",
                                   headers={"Retry-After": retry_after_header(1)}) from None
                body.write(piece)
                received += len(piece)
            yield body, received

    def _labelled(self, request: Request, plan: Plan, trace: bool) -> Plan:
        """The translated request(s) with the client's label (CLIENT_ID_HEADER) and the trace header."""
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

    def realtime_call(self, websocket: WebSocket, request, fields) -> Call:
        """A Realtime response's run: as an HTTP request's, its connection's headers standing for the request's."""
        key = client_cap.key_index(self.servicer.api_keys, websocket.headers.get("authorization"))
        client = client_cap.client_of(key, websocket.client.host if websocket.client else None,
                                      self.servicer.client_cap.trusted)
        return Call(self.servicer, request, fields, client=client,
                    incoming=otel.Incoming.of("http", websocket.headers.items()))

    def _call(self, request: Request, plan: translate.Translated) -> Call:
        key = client_cap.key_index(self.servicer.api_keys, request.headers.get("authorization"))
        client = client_cap.client_of(key, request.client.host if request.client else None,
                                      self.servicer.client_cap.trusted)
        return Call(self.servicer, plan.request, plan.fields, deadline=deadline_from(request.headers),
                    receive=request.receive, client=client,
                    incoming=otel.Incoming.of("http", request.headers.items()))


def answering(handler: Callable[[Request], Awaitable[Response]]) -> Callable[[Request], Awaitable[Response]]:
    """`handler(request)` (another module's endpoint) answering its failures as every route does."""
    wrapped = _answers_errors(lambda _self, request: handler(request))

    async def endpoint(request: Request) -> Response:
        return await wrapped(None, request)
    return endpoint


async def _events(call: Call, events: AsyncIterator[bytes]) -> Response:
    """Server-sent events from `call`, once its first event came (a refusal before it is raised)."""
    await call.open()
    return CallStreamResponse(call, events, SSE_MEDIA_TYPE, SSE_HEADERS)


def _parse(body: io.BytesIO, model: type[BaseModel], translation: Callable[[BaseModel, Pipeline], Plan],
           pipeline: Pipeline) -> Plan:
    """The body (taken: closed) parsed as `model` and translated. Its bytes are the only copy of the body while
    it is parsed (BytesIO hands over its buffer as they are; the parser would copy a bytearray), and none is
    held while the translation decodes and copies the parts."""
    raw = body.getvalue()
    body.close()
    request = model.model_validate_json(raw, strict=True)
    del raw
    return translation(request, pipeline)


def trace_from(request: Request) -> bool:
    """Whether `X-Omnistage-Trace` asks for the request's trace."""
    value = request.headers.get(TRACE_HEADER, "0").strip().lower()
    if value not in ("0", "1", "true", "false"):
        raise InvalidRequest(TRACE_HEADER, f"must be 1 or 0, got {value!r}")
    return value in ("1", "true")


def _too_slow(received: int, elapsed: float, whole: bool) -> ApiError:
    """408 for a body that stopped coming (`whole`: that came slower than the minimum rate)."""
    why = (f"the body came slower than {BODY_MIN_RATE} bytes/s: {received} bytes in {elapsed:.1f} s (a body has "
           f"{BODY_BASE_S:.0f} s plus its size at that rate)") if whole else \
        f"no part of the body came for {BODY_IDLE_S:.0f} s"
    return ApiError(408, why, code="request_timeout", headers={"Connection": "close"})


def _too_large(limit: int) -> ApiError:
    return ApiError(413, f"the body is larger than {limit} bytes (this pipeline's limits)", code="request_too_large")


async def _http_error(request: Request, exc: HTTPException) -> Response:
    """Starlette's own 404 / 405 in the OpenAI shape."""
    return error_response(ApiError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}"))


def build_app(servicer, pipeline: Pipeline, parse_workers: ParseWorkers | None = None) -> ASGIApp:
    """The API as an ASGI app: the routes behind the API-key check (the servicer's keys, shared with gRPC);
    large bodies parsed by `parse_workers` (none: on a thread)."""
    api = Endpoints(servicer, pipeline, parse_workers)
    routes = [
        Route("/v1/chat/completions", api.chat_completions, methods=["POST"]),
        Route("/v1/completions", api.text_completions, methods=["POST"]),
        Route("/v1/audio/speech", api.audio_speech, methods=["POST"]),
        Route("/v1/audio/voices", api.audio_voices, methods=["GET"]),
        Route("/v1/images/generations", api.images_generations, methods=["POST"]),
        Route("/v1/images/edits", api.images_edits, methods=["POST"]),
        Route("/v1/audio/transcriptions", api.audio_transcriptions, methods=["POST"]),
        Route("/v1/audio/translations", api.audio_translations, methods=["POST"]),
        Route("/v1/models", api.models, methods=["GET"]),
        Route("/v1/models/{model:path}", api.model, methods=["GET"]),
        *videos.routes(api.videos, answering),
        Route("/health", api.health, methods=["GET"]),
        WebSocketRoute("/v1/realtime", RealtimeEndpoint(pipeline, api.realtime_call, servicer.voices).serve),
    ]
    return ApiKeyAuth(Starlette(routes=routes, exception_handlers={HTTPException: _http_error}), servicer.api_keys)
