"""What every request passes before its route: the Host it names (on loopback, only loopback names: a web
page that rebinds its own DNS name to 127.0.0.1 must not drive the local API), a WebSocket's Origin (a web
page of another site must not open one: browsers apply no CORS to WebSockets), and a place among the
requests in progress (beyond the requests admission runs and queues, more could only hold bodies for
answers admission refuses). `/health` needs no place: it answers while the door is full."""

from __future__ import annotations

import ipaddress
from typing import Iterable
from urllib.parse import urlsplit

from starlette.types import ASGIApp, Receive, Scope, Send

from omnistage.contract.launch import is_loopback

from .errors import DEFAULT_RETRY_AFTER_S, ApiError, error_response, retry_after_header

HEALTH_PATH = "/health"  # the health route (routes.build_app): answered however many requests are in progress
MAX_HOST_SHOWN = 200  # characters of a refused Host header quoted back


def host_name(header: str) -> str:
    """The name in a Host header, lower case, without port or trailing dot: `[::1]:8000` -> `::1`."""
    host = header.strip().lower()
    if host.startswith("["):
        host = host[1:host.find("]")] if "]" in host else host[1:]
    elif host.count(":") == 1:
        host = host.rsplit(":", 1)[0]
    return host.rstrip(".")


def could_rebind(host: str) -> bool:
    """Whether a Host can come from DNS rebinding: a domain name (dotted, not an address) that is not a
    loopback name. A browser sends the name it resolved; an address literal was never resolved, and a
    name without a dot (the machine's own, a compose service) is no domain a web page can own."""
    if "." not in host or is_loopback(host):
        return False
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return True
    return False


class HostCheck:
    """The Host a request to an API bound to loopback may carry: any but a domain name (`could_rebind`),
    unless that is the bound host or one of `extra` (names a local proxy or tool uses)."""

    def __init__(self, bound_host: str, extra: Iterable[str] = ()):
        self.names = {host_name(bound_host), *(host_name(n) for n in extra)}

    @classmethod
    def for_bind(cls, bound_host: str, extra: Iterable[str] = ()) -> HostCheck | None:
        """The check for an API bound to `bound_host`; None (any Host) unless that is loopback: reachable
        from the network, its clients name it however their DNS or proxy does."""
        return cls(bound_host, extra) if is_loopback(host_name(bound_host)) else None

    def refusal(self, header: str | None) -> ApiError | None:
        if header is None:  # no Host (HTTP/1.0): not a browser
            return None
        name = host_name(header)
        if not could_rebind(name) or name in self.names:
            return None
        shown = header[:MAX_HOST_SHOWN]
        return ApiError(421, f'the Host header "{shown}" names a domain this API does not serve: bound to loopback, '
                             f'it answers to localhost, addresses and names without a dot', code="host_not_allowed")


def cross_origin(scope: Scope) -> ApiError | None:
    """A WebSocket handshake sent by a web page of another origin than the API's own (its `Origin` names another
    host than its `Host`): refused. A browser lets any page open a WebSocket to any address and read what comes
    back, so without this a page on any site could talk to an API on the visitor's loopback. SDK clients send
    no Origin."""
    headers = {k: v.decode("latin-1") for k, v in scope["headers"] if k in (b"origin", b"host")}
    origin = headers.get(b"origin")
    if origin is None:
        return None
    try:
        origin_host = urlsplit(origin.strip()).netloc.lower()
    except ValueError:
        origin_host = ""
    if origin_host and origin_host == headers.get(b"host", "").strip().lower():
        return None
    return ApiError(403, f'a WebSocket opened by a web page of the origin "{origin[:MAX_HOST_SHOWN]}" is refused: '
                         "only clients that are not web pages of another site (they send no Origin) or pages this "
                         "host serves may open one", code="origin_not_allowed")


class RequestGate:
    """ASGI middleware: the Host check, then a place among `limit` requests in progress (429 beyond)."""

    def __init__(self, app: ASGIApp, limit: int, hosts: HostCheck | None):
        self.app, self.limit, self.hosts = app, limit, hosts
        self.in_progress = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):  # a WebSocket holds its place for as long as it is open
            await self.app(scope, receive, send)
            return
        if self.hosts is not None:
            header = next((v.decode("latin-1") for k, v in scope["headers"] if k == b"host"), None)
            if (refusal := self.hosts.refusal(header)) is not None:
                await error_response(refusal)(scope, receive, send)
                return
        if scope["type"] == "websocket" and (refusal := cross_origin(scope)) is not None:
            await error_response(refusal)(scope, receive, send)
            return
        if scope["path"] == HEALTH_PATH:
            await self.app(scope, receive, send)
            return
        if self.in_progress >= self.limit:
            refusal = ApiError(429, f"this API is serving as many requests as it takes at once ({self.limit}); "
                                    f"retry", "rate_limit_error", code="rate_limit_exceeded",
                               headers={"Retry-After": retry_after_header(DEFAULT_RETRY_AFTER_S)})
            await error_response(refusal)(scope, receive, send)
            return
        self.in_progress += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.in_progress -= 1
