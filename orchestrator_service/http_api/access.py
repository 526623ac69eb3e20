"""The HTTP door's access lines (orchestrator_service/access_log.py): one per API request, the outermost
layer of the API, so a request the gate or the key check refuses gets its line too. A Realtime WebSocket is
one line when it closes, with the ids and usage of all its responses.

An images request of n images is n runs of the request path, one line: its request ids, usage summed.
The status is the gRPC code's name the HTTP status stands for (errors.STATUS read backwards), and the HTTP
status itself; a client that went away before its answer ended is CANCELLED, whatever was sent before.
"""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ..access_log import AccessLine, key_name, trace_id
from .errors import STATUS
from .routes import CLIENT_ID_HEADER

API_PREFIX = "/v1/"   # the API's requests; /health (probes) has no line
_CODE_OF_HTTP = {http: code for code, (http, _type, _code) in STATUS.items()}


def status_of_http(http_status: int) -> grpc.StatusCode:
    """The gRPC code an HTTP status stands for: the API's own mapping backwards; otherwise a 2xx/3xx is OK,
    another 4xx the client's (INVALID_ARGUMENT), another 5xx the server's (INTERNAL)."""
    if http_status < 400:
        return grpc.StatusCode.OK
    if http_status in _CODE_OF_HTTP:
        return _CODE_OF_HTTP[http_status]
    return grpc.StatusCode.INVALID_ARGUMENT if http_status < 500 else grpc.StatusCode.INTERNAL


class HttpAccess:
    """ASGI middleware writing each API request's access line once its answer ended."""

    def __init__(self, app: ASGIApp, keys, prefix: str = API_PREFIX):
        self.app, self.keys, self.prefix = app, keys, prefix

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket") or not scope["path"].startswith(self.prefix):
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        client = scope.get("client")
        line = AccessLine("http", client[0] if client else None, key_name(self.keys, headers.get("authorization")),
                          headers.get(CLIENT_ID_HEADER, ""), trace_id(headers.items()))
        answer: dict[str, Any] = {"status": None, "complete": False, "gone": False}

        async def receiving() -> Message:
            message = await receive()
            if message["type"] == "http.disconnect" and not answer["complete"]:
                answer["gone"] = True
            return message

        async def sending(message: Message) -> None:
            if message["type"] in ("http.response.start", "websocket.http.response.start"):
                answer["status"] = message["status"]
            elif message["type"] == "websocket.accept":  # a session: its one line when it ends, its responses'
                answer["status"] = 101                    # ids and usage in it
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                answer["complete"] = True

        token = line.opened()
        try:
            await self.app(scope, receiving, sending)
        except asyncio.CancelledError:   # the server stops (a client gone ends its run, not this task)
            answer["gone"] = True
            raise
        finally:
            line.closed(token)
            http = answer["status"] or 500   # nothing sent: the server (uvicorn) answers 500 for a failure
            line.write(grpc.StatusCode.CANCELLED if answer["gone"] else status_of_http(http), http)
