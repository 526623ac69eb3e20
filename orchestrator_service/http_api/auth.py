"""API keys: with keys configured, every path but the open ones (`/health`) needs
`Authorization: Bearer KEY`. The key given is compared with every configured key in constant time,
with no early exit, so how long the check takes says nothing about which key (if any) matched."""

from __future__ import annotations

import hmac
from typing import Iterable, Sequence

import grpc

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

from .errors import error_response, of_status

OPEN_PATHS = ("/health",)


def authorized(header: str | None, keys: Sequence[bytes]) -> bool:
    scheme, _, token = (header or "").partition(" ")
    given = token.strip().encode() if scheme.lower() == "bearer" else b""
    ok = False
    for key in keys:
        ok |= hmac.compare_digest(given, key)
    return ok


class ApiKeyAuth:
    """ASGI middleware: a request without a valid key gets 401 in the OpenAI error shape."""

    def __init__(self, app: ASGIApp, keys: Iterable[str], open_paths: Iterable[str] = OPEN_PATHS):
        self.app = app
        self.keys = tuple(k.encode() for k in keys)
        if any(not k for k in self.keys):
            raise ValueError("an API key must not be empty")
        self.open_paths = frozenset(open_paths)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self.keys or scope["path"] in self.open_paths:
            await self.app(scope, receive, send)
            return
        header = Headers(scope=scope).get("authorization")
        if authorized(header, self.keys):
            await self.app(scope, receive, send)
            return
        message = ("Incorrect API key provided" if header else
                   "Missing API key: send it as the header Authorization: Bearer KEY")
        await error_response(of_status(grpc.StatusCode.UNAUTHENTICATED, message))(scope, receive, send)
