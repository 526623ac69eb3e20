"""What goes back on the wire beyond one endpoint: server-sent events, a streamed response that owns its
call scope (and gives up on a client that stops reading), the request trace, and the pipeline as an
OpenAI model object."""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import time
from typing import AsyncIterator, Mapping

from google.protobuf.json_format import MessageToDict
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from omnistage.api import Pipeline, accepted_inputs
from omnistage.v1 import orchestrator_pb2

from .. import consumer_pace
from .call import Call

log = logging.getLogger("omnistage.orchestrator.http_api")

SSE_MEDIA_TYPE = "text/event-stream"
SSE_DONE = b"data: [DONE]\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}  # no proxy holds events back
# A client connected but not reading: once the connection's buffers are full a send waits; past this (and
# what the bytes it took earned, consumer_pace.py) the request is cancelled (its admission slot and stage
# buffers freed) and the connection closed.
SEND_STALL_S = consumer_pace.GRACE_S
TRACE_FIELD = "omnistage_trace"  # the answer's extra top-level field with the request's trace


def sse_event(obj: Mapping) -> bytes:
    """One server-sent event: `data: {json}` and a blank line."""
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


def b64encode_str(data: bytes) -> str:
    """Bytes as base64 text, for a JSON answer."""
    return base64.b64encode(data).decode("ascii")


def trace_dict(final: orchestrator_pb2.Final | None) -> dict | None:
    """A final event's trace (there when the request asked for one) as JSON, with gRPC's field names; None
    without one."""
    if final is None or not final.HasField("trace"):
        return None
    return MessageToDict(final.trace, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)


def with_trace(obj: dict, final: orchestrator_pb2.Final | None) -> dict:
    """`obj` with the request's trace as TRACE_FIELD, when it asked for one (and ran to its final event)."""
    if (trace := trace_dict(final)) is not None:
        obj[TRACE_FIELD] = trace
    return obj


class SendStalled(Exception):
    """The client read slower than the door serves (consumer_pace.py); the message says how slowly."""


class CallStreamResponse(StreamingResponse):
    """A body streamed from a call, which the response owns: however the stream ends (answer complete, a
    stop string, an error event, the client gone), the body is closed and then the call, so the
    request is cancelled in every stage before the response is done. The client going away is noticed by
    the call's own watcher (uvicorn would drop what is sent after it without a word); a client that stays
    but stops reading or reads a trickle, by its sends' waiting against the bytes it took (consumer_pace.py,
    with SEND_STALL_S as the grace)."""

    def __init__(self, call: Call, content: AsyncIterator[bytes], media_type: str,
                 headers: Mapping[str, str] | None = None):
        super().__init__(content, media_type=media_type, headers={"X-Request-Id": call.request_id, **(headers or {})})
        self.call = call

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        pace = consumer_pace.ConsumerPace(SEND_STALL_S, consumer_pace.MIN_READ_BPS)

        async def paced_send(message) -> None:
            nbytes = len(message.get("body", b""))
            allowed, t0 = pace.allowed_wait(nbytes), time.monotonic()
            try:
                async with asyncio.timeout(allowed):
                    await send(message)
            except TimeoutError:
                raise SendStalled(pace.too_slow(nbytes, allowed)) from None
            pace.sent(nbytes, time.monotonic() - t0)

        try:
            await self.stream_response(paced_send)
        except SendStalled as e:
            # Returning with the body unfinished makes uvicorn close the connection (it logs that too).
            log.warning("HTTP API: request %s: %s", self.call.request_id, e)
        finally:
            try:
                await self.body_iterator.aclose()
            finally:
                await self.call.close()


def model_card(pipeline: Pipeline, created: int) -> dict:
    """The pipeline as the one model this server serves, with what it takes and makes."""
    return {"id": pipeline.name, "object": "model", "created": created, "owned_by": "omnistage",
            "input_modalities": sorted(accepted_inputs(pipeline)),
            "output_modalities": [o.modality for o in pipeline.outputs],
            "stages": [s.name for s in pipeline.stages]}
