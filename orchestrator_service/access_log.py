"""The orchestrator's access log: one `omnistage.access` line per client request, on both front doors.

A door opens an `AccessLine` when a request arrives (who sent it: address, API key name, the client's label,
trace id) and writes it once the answer ended, with its status; in between, the request path's events pass
through `observed`, which notes the server's request id, the time to the first output, and the final usage
(tokens in and out, audio seconds, images). The gRPC door is an interceptor (`GrpcAccess`), outside the key
check, so a refused key is a line too; the HTTP door is an ASGI wrapper (http_api/access.py). The line
reaches the request path through a context variable: both doors run the request path in the context the
line was opened in (gRPC: the same task; HTTP: tasks the handler creates, which copy it).

The API key is named by its place in the configured list (`key-0`, `key-1`, ...): never the key, nor anything
computed from it (a short key's hash is guessed). The status is the gRPC status code's name on both doors
(the HTTP door also gives its HTTP status), so one query counts both. Levels: `logs.level_for`.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import inspect
import logging
import socket
import time
from dataclasses import dataclass, field
from typing import Any, AsyncGenerator, AsyncIterator, Awaitable, Callable, Iterable

import grpc

from omnistage import tracing
from omnistage.logs import ACCESS_LOGGER, level_for
from omnistage.v1 import orchestrator_pb2

from . import client_cap

log = logging.getLogger(ACCESS_LOGGER)
# Who answers: in a pod its name (the host name Kubernetes gives it), locally the machine's.
SERVER = socket.gethostname()

_current: contextvars.ContextVar[AccessLine | None] = contextvars.ContextVar("omnistage_access_line", default=None)


def key_name(keys, header: str | None) -> str | None:
    """The name of the configured API key `header` carries (`key-N`, N its place in the list); None without
    keys configured or without a match."""
    index = client_cap.key_index(keys, header)
    return None if index is None else f"key-{index}"


def trace_id(pairs: Iterable[tuple[str, Any]]) -> str | None:
    """The trace id of the W3C `traceparent` among a request's headers or metadata (as tracing reads it: a
    malformed one is none); None without one."""
    parent = tracing.trace_context(pairs).get(tracing.TRACEPARENT)
    return parent[3:35] if parent else None   # version "-" trace id "-" parent id "-" flags


@dataclass
class AccessLine:
    """One client request's access line, filled as the request goes and written once (`write`)."""

    door: str                        # grpc | http
    peer: str | None                 # the client's address
    api_key: str | None              # the key's name (key_name), never the key
    client_request_id: str = ""      # the client's own label for the request
    trace_id: str | None = None
    request_ids: list[str] = field(default_factory=list)   # the server's ids (an n-images request has n)
    started: float = field(default_factory=time.perf_counter)
    first_output: float | None = None
    tokens_in: int = 0
    tokens_out: int = 0
    audio_s: float = 0.0
    images: int = 0
    ended_as: grpc.StatusCode | None = None   # how the request path ended, when not with its answer
    written: bool = False

    def opened(self) -> contextvars.Token:
        """This line is the current request's from now on (in this context and the tasks it starts)."""
        return _current.set(self)

    @staticmethod
    def closed(token: contextvars.Token) -> None:
        """No line is current any more (where `opened` made this one so)."""
        with contextlib.suppress(ValueError):   # closed from another context: nothing of ours left there
            _current.reset(token)

    def saw(self, ev: orchestrator_pb2.GenerateResponse) -> None:
        if self.first_output is None and not ev.HasField("final") and not ev.HasField("progress"):
            self.first_output = time.perf_counter()
        if ev.HasField("final"):
            usage = ev.final.usage
            self.tokens_in += usage.prompt_tokens
            self.tokens_out += usage.completion_tokens
            self.audio_s += usage.audio_seconds
            self.images += usage.images

    def fields(self, status: grpc.StatusCode, http_status: int | None = None) -> dict[str, Any]:
        now = time.perf_counter()
        out: dict[str, Any] = {
            "server": SERVER, "door": self.door, "status": status.name, "peer": self.peer, "api_key": self.api_key,
            "request_id": " ".join(self.request_ids), "client_request_id": self.client_request_id,
            "ttfp_s": None if self.first_output is None else round(self.first_output - self.started, 6),
            "total_s": round(now - self.started, 6), "tokens_in": self.tokens_in, "tokens_out": self.tokens_out,
            "audio_s": round(self.audio_s, 6), "images": self.images,
        }
        if http_status is not None:
            out["http_status"] = http_status
        if self.trace_id:
            out["trace_id"] = self.trace_id
        return out

    def write(self, status: grpc.StatusCode, http_status: int | None = None) -> None:
        """The line, once: at INFO for answers and the client's own errors, WARNING for load and deadlines,
        ERROR for server faults. How the request path ended (`ended_as`) wins over an HTTP status sent
        before it (a stream cut short after its 200)."""
        if self.written:
            return
        self.written = True
        if self.ended_as is not None:
            status = self.ended_as
        level = level_for(status)
        if not log.isEnabledFor(level):   # --access-log off: nothing built
            return
        fields = self.fields(status, http_status)
        log.log(level, " ".join(f"{k}={v}" for k, v in fields.items() if v not in (None, "")), extra=fields)


async def observed(events: AsyncGenerator[orchestrator_pb2.GenerateResponse, None],
                   request_id: str) -> AsyncIterator[orchestrator_pb2.GenerateResponse]:
    """The request path's events as they go, noted on the current request's access line (if any). Closing
    this closes `events` (so a door that stops early cancels the request now, not at garbage collection)."""
    line = _current.get()
    if line is not None:
        line.request_ids.append(request_id)
    try:
        async for ev in events:
            if line is not None:
                line.saw(ev)
            yield ev
    except Exception as e:   # a failure; a cancel or close is the door's to judge (a stop string, a slow client)
        if line is not None:
            line.ended_as = _status_of(e)
        raise
    finally:
        await events.aclose()


def _status_of(e: BaseException) -> grpc.StatusCode:
    code = getattr(e, "code", None)   # the request path's Refused carries its status code
    if isinstance(code, grpc.StatusCode):
        return code
    if isinstance(e, (GeneratorExit, asyncio.CancelledError)):
        return grpc.StatusCode.CANCELLED
    return grpc.StatusCode.UNKNOWN


class GrpcAccess(grpc.aio.ServerInterceptor):
    """The gRPC door's access lines, for `method` (the Generate method's full path). Put it first among the
    server's interceptors: outside the key check, a refused key gets its line too."""

    def __init__(self, method: str, keys):
        self.method, self.keys = method, keys

    async def intercept_service(self, continuation: Callable[[grpc.HandlerCallDetails],
                                                             Awaitable[grpc.RpcMethodHandler]],
                                details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if details.method != self.method or handler is None:
            return handler
        header = dict(details.invocation_metadata or ()).get("authorization")
        api_key = key_name(self.keys, header if isinstance(header, str) else None)
        trace = trace_id(details.invocation_metadata or ())
        if handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(
                _logged(handler.unary_stream, api_key, trace), request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer)
        if handler.stream_stream is not None:   # the key check's refusal (grpc_door._refusing)
            return grpc.stream_stream_rpc_method_handler(
                _logged(handler.stream_stream, api_key, trace), request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer)
        return handler


def _logged(inner: Callable, api_key: str | None, trace: str | None) -> Callable:
    """`inner` (a handler: an async generator, or a coroutine that writes with context.write()) with its
    access line: opened before it runs, written with the call's status once it ended."""
    async def logged(request: Any, context: grpc.aio.ServicerContext):
        label = request.request_id if isinstance(request, orchestrator_pb2.GenerateRequest) else ""
        line = AccessLine("grpc", client_cap.peer_host(context.peer()), api_key, label, trace)
        token = line.opened()
        status: grpc.StatusCode | None = None
        try:
            if inspect.isasyncgenfunction(inner):
                async for ev in inner(request, context):
                    yield ev
            else:
                await inner(request, context)
        except grpc.aio.AbortError:
            raise   # the status it set is context.code()
        except BaseException as e:
            status = _status_of(e)
            raise
        finally:
            line.closed(token)
            code = context.code()
            line.write(status or (code if isinstance(code, grpc.StatusCode) else grpc.StatusCode.OK))
    return logged
