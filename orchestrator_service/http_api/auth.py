"""API keys on the HTTP front door: with keys configured, every path but the open ones (`/health`) needs
`Authorization: Bearer KEY`. The keys and their constant-time check are the client API's one set
(orchestrator_service/api_keys.py), shared with the gRPC front door."""

from __future__ import annotations

from typing import Iterable

import grpc
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

from ..api_keys import ApiKeys
from .errors import error_response, of_status

OPEN_PATHS = ("/health",)


class ApiKeyAuth:
    """ASGI middleware: a request without a valid key gets 401 in the OpenAI error shape (a WebSocket's
    handshake too: the 401 is its answer, before any upgrade)."""

    def __init__(self, app: ASGIApp, keys: ApiKeys, open_paths: Iterable[str] = OPEN_PATHS):
        self.app = app
        self.keys = keys
        self.open_paths = frozenset(open_paths)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket") or not self.keys.required or scope["path"] in self.open_paths:
            await self.app(scope, receive, send)
            return
        header = Headers(scope=scope).get("authorization")
        if self.keys.match(header) is not None:
            await self.app(scope, receive, send)
            return
        message = ("Incorrect API key provided" if header else
                   "Missing API key: send it as the header Authorization: Bearer KEY")
        await error_response(of_status(grpc.StatusCode.UNAUTHENTICATED, message))(scope, receive, send)
