"""The API's connections, below HTTP requests: how many it holds (in all and per client address), how long
a request's headers may take, how slowly a body may come, and how long an answer may sit unread.

uvicorn alone bounds none of these: it times out idle keep-alive connections only, so a socket that starts
its headers and goes silent is held for ever, and an answer the client never reads stays in the process.
`DoorProtocol` is uvicorn's httptools protocol with a timer per connection for each phase; `Door` is the
table of open connections they share. Connections waiting for a request (headers not yet complete: new,
half-open, or idle between requests) hold no work, so they are the ones given up when the door is full:
the oldest of the same address first, so that one address crowding the door evicts its own sockets; one still
taking an answer from its buffer, or draining the body of a request answered early, only when no other is.

Over HTTPS the door does the TLS handshake itself (asyncio's `start_tls`) rather than leaving it to the server
below uvicorn, so that a connection is counted (in all and per address) from its TCP accept, and its handshake
has a deadline of ours: one that has not completed its handshake within HANDSHAKE_TIMEOUT_S is closed, and one
over the caps is closed at once, before its handshake (there is no TLS session yet to carry an answer).

A WebSocket (the Realtime API) is upgraded from a door connection and stays counted in the door, as working,
until it ends (`DoorWebSocketProtocol`); the send floor applies to it as to an HTTP answer (`SendFloor`).

Each request's headers are counted and timed from the first byte of its request line to their end, whatever
the previous request on the connection is doing: a request answered before its body was read (401, 413, 421,
429) has the rest of its body drained, bounded, so that a client still sending it reads the answer.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import resource
import ssl
from collections import OrderedDict

from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol
from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol

from .errors import ApiError
from .responses import SEND_STALL_S

log = logging.getLogger("omnistage.orchestrator.http_api")

# A TLS handshake must complete within this from the TCP accept: a client's handshake takes a few round trips;
# a socket that opens and sends nothing (or dribbles its ClientHello) is holding a slot. As the header deadline,
# counted apart from it (the headers' clock starts once the connection is secured).
HANDSHAKE_TIMEOUT_S = 10.0
# A request's headers (from the connection opening, or the previous answer ending) must be complete within
# this: a client sends them in one piece; a socket still sending them after this long is holding a slot.
HEADER_TIMEOUT_S = 20.0
# The most bytes of one request's headers: ours are a few hundred; OpenAI SDK and proxies add a few KiB.
MAX_HEADER_BYTES = 64 << 10
# Headers as the parser hands them over: each line's ": " and CRLF, and the request line's method and version.
HEADER_LINE_BYTES = 4
REQUEST_LINE_BYTES = 24
# After an answer sent before its request's body was read (a refusal): the rest of the body is read and dropped,
# up to this much for this long, then the connection closes. A client sends its whole body before it reads
# (the OpenAI SDKs do); closing on unread bytes resets the connection, and the reset loses the answer. 64 MiB
# covers an ordinary upload over a slow link; a larger one is cut, it only costs the reading.
LINGER_BYTES = 64 << 20
LINGER_S = 60.0
# A body must come at this rate at least, judged over each window while the server waits for it: 1 KiB/s,
# slower than any working uplink, fast enough that a drip-fed body cannot hold its share of the body budget
# for hours. A window in which the API was not reading (its buffer full) is not judged.
RECEIVE_WINDOW_S = 10.0
MIN_RECEIVE_BYTES = 10 << 10
# An answer must leave at this rate at least once the connection's buffers are full (a client that stopped
# reading): over a streamed answer's grace (its sends have their own pace on top), at 1 KiB/s.
SEND_WINDOW_S = SEND_STALL_S
MIN_SEND_BYTES = 60 << 10
# Open connections take at most 1/FD_SHARE of the process's file descriptors: the rest are for the stage
# channels, shared-memory segments, logs and model files, which must not fail with EMFILE under a flood.
FD_SHARE = 2
# ... and at most this many, whatever the descriptor limit: each costs about 10 KiB of protocol, parser and
# transport state in the process.
MAX_CONNECTIONS = 16384
# One client address holds at most 1/ADDRESS_SHARE of them, so others always find room. Behind a proxy every
# client shares its address: raise the process's descriptor limit (ulimit -n) to raise both.
ADDRESS_SHARE = 2


@dataclasses.dataclass(frozen=True)
class ConnectionLimits:
    """The door's bounds (the constants above); the door reads them at each use."""

    header_timeout_s: float = HEADER_TIMEOUT_S
    handshake_timeout_s: float = HANDSHAKE_TIMEOUT_S
    max_header_bytes: int = MAX_HEADER_BYTES
    receive_window_s: float = RECEIVE_WINDOW_S
    min_receive_bytes: int = MIN_RECEIVE_BYTES
    send_window_s: float = SEND_WINDOW_S
    min_send_bytes: int = MIN_SEND_BYTES
    max_connections: int = MAX_CONNECTIONS
    max_per_address: int = MAX_CONNECTIONS // ADDRESS_SHARE
    linger_bytes: int = LINGER_BYTES
    linger_s: float = LINGER_S

    @classmethod
    def for_process(cls, floor: int) -> ConnectionLimits:
        """The caps this process's descriptor limit allows; at least `floor` connections (the requests the
        API serves at once), so the door is never smaller than the work it admits."""
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        total = MAX_CONNECTIONS if soft == resource.RLIM_INFINITY else min(MAX_CONNECTIONS, soft // FD_SHARE)
        total = max(total, floor)
        # One address (a proxy's) may still fill every request the API serves at once.
        return cls(max_connections=total, max_per_address=max(floor, total // ADDRESS_SHARE))


def raw_answer(error: ApiError) -> bytes:
    """An error as a whole HTTP answer that closes the connection, for where no request (or no ASGI app)
    is there to answer it."""
    body = json.dumps(error.body()).encode()
    headers = {"content-type": "application/json", "content-length": str(len(body)), "connection": "close",
               **error.headers}
    return STATUS_LINE[error.status] + b"".join(f"{k}: {v}\r\n".encode("latin-1") for k, v in headers.items()) + \
        b"\r\n" + body


def _too_many(message: str) -> ApiError:
    return ApiError(429, message, "rate_limit_error", code="too_many_connections", headers={"Retry-After": "1"})


class Door:
    """The API's open connections: counted per client address, capped in all and per address. Those waiting
    for a request are kept oldest first, per address, to be given up when the door is full."""

    def __init__(self, limits: ConnectionLimits, tls: ssl.SSLContext | None = None):
        """`tls`: HTTPS, each connection's handshake done by its DoorProtocol with this context."""
        self.limits, self.tls = limits, tls
        self.open: dict[str, int] = {}  # client address -> open connections
        self.total = 0
        self.waiting: dict[str, OrderedDict[DoorProtocol, None]] = {}  # client address -> waiting, oldest first
        self.handshakes: set[asyncio.Task] = set()  # TLS handshakes in progress

    def end_handshakes(self) -> None:
        """Close the connections still in their TLS handshake (the API stops: none is to start a request)."""
        for handshake in list(self.handshakes):
            handshake.cancel()

    def open_from(self, address: str) -> int:
        return self.open.get(address, 0)

    def admit(self, conn: DoorProtocol) -> ApiError | None:
        """Count a new connection in, making room by closing a waiting one where the door is full; the
        refusal to answer when there is no room."""
        address = conn.address
        if self.open_from(address) >= self.limits.max_per_address:
            if not self._evict(address):
                return _too_many(f"{address} holds {self.open_from(address)} connections to this API, as many "
                                 f"as one address may; reuse them (keep-alive) or retry")
        elif self.total >= self.limits.max_connections:
            # The address holding the most connections gives one up: a flood evicts its own sockets.
            crowded = max(self.waiting, key=self.open_from, default=None)
            if crowded is None or not self._evict(crowded):
                return ApiError(503, f"this API holds as many connections as it may ({self.total}); retry",
                                "service_unavailable_error", code="too_many_connections",
                                headers={"Retry-After": "1"})
        self.open[address] = self.open_from(address) + 1
        self.total += 1
        conn.counted = True
        return None

    def waits(self, conn: DoorProtocol) -> None:
        """`conn` waits for a request: it holds no work."""
        if conn.counted:
            self.waiting.setdefault(conn.address, OrderedDict())[conn] = None

    def works(self, conn: DoorProtocol) -> None:
        """`conn` has a request in progress: it is not given up."""
        waiting = self.waiting.get(conn.address)
        if waiting is not None:
            waiting.pop(conn, None)
            if not waiting:
                del self.waiting[conn.address]

    def release(self, conn: DoorProtocol) -> None:
        if not conn.counted:
            return
        conn.counted = False
        self.works(conn)
        self.total -= 1
        left = self.open.get(conn.address, 0) - 1
        if left > 0:
            self.open[conn.address] = left
        else:
            self.open.pop(conn.address, None)

    def _evict(self, address: str) -> bool:
        waiting = self.waiting.get(address)
        if not waiting:
            return False
        # The oldest holding nothing; one still taking its answer (or draining a refused body) only as last choice.
        oldest = next((c for c in waiting if not c.lingering and not c.transport.get_write_buffer_size()),
                      next(iter(waiting)))
        self.release(oldest)  # counted out now: the close completes on the next turn of the loop
        oldest.refused = True
        if oldest.transport.get_write_buffer_size():
            oldest.transport.abort()  # an answer it is not taking: close() would wait for it
        else:
            oldest.transport.close()
        return True


class SendFloor:
    """The floor on the rate a client takes a held answer, for the door's protocols (HTTP and WebSocket):
    once the connection's buffers are full, the client must take `min_send_bytes` each `send_window_s`, or
    the connection is cut (a close would wait for the buffer to drain: never)."""

    door: Door
    transport: asyncio.Transport
    loop: asyncio.AbstractEventLoop
    address: str
    _send_timer: asyncio.TimerHandle | None = None
    _unsent = 0  # bytes buffered at the start of the current send window

    def pause_writing(self) -> None:
        """The connection's buffers are full: from now the client must take `min_send_bytes` a window."""
        super().pause_writing()  # type: ignore[misc]
        if self._send_timer is None:
            self._unsent = self.transport.get_write_buffer_size()
            self._send_timer = self.loop.call_later(self.door.limits.send_window_s, self._judge_send)

    def resume_writing(self) -> None:
        super().resume_writing()  # type: ignore[misc]
        self._stop_judging_send()

    def _stop_judging_send(self) -> None:
        if self._send_timer is not None:
            self._send_timer.cancel()
            self._send_timer = None

    def _judge_send(self) -> None:
        # While writing is paused nothing more is written (the sends wait), so what left the buffer is what the
        # client took.
        self._send_timer = None
        limits = self.door.limits
        unsent = self.transport.get_write_buffer_size()
        if self._unsent - unsent < limits.min_send_bytes:
            log.warning("HTTP API: a client at %s took %d bytes of its answer in %g s; connection cut",
                        self.address, max(0, self._unsent - unsent), limits.send_window_s)
            self.transport.abort()
            return
        self._unsent = unsent
        self._send_timer = self.loop.call_later(limits.send_window_s, self._judge_send)


class DoorProtocol(SendFloor, HttpToolsProtocol):
    """uvicorn's HTTP/1.1 protocol with the door's bounds: counted in `door` (a subclass per API sets it),
    a deadline on each request's headers, a floor on the rate of its body, and a floor on the rate at which
    the client takes a held answer."""

    door: Door

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.address = ""
        self.counted = False
        self.secured = False  # HTTPS: the TLS handshake is done (connection_made is the secured transport's)
        self._early: list[bytes] = []  # HTTPS: bytes decrypted as the handshake completed, before connection_made
        self.refused = False  # answered and closing: nothing it sends starts a request
        self.lingering = False  # draining the body of a request answered before it was read
        self._in_headers = False  # a request's headers have begun and are not complete
        self._messages = 0  # requests begun on this connection
        self._header_bytes = 0  # of the request whose headers are in progress, as the parser handed them over
        self._header_chunks = 0  # of the same: the pieces received wholly inside them
        self._drained = 0  # bytes received while lingering
        self._received = 0  # bytes received in the current receive window
        self._header_timer: asyncio.TimerHandle | None = None
        self._receive_timer: asyncio.TimerHandle | None = None

    # ------------------------------------------------------------------ the connection
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        if self.door.tls is not None and not self.secured:  # the TCP connection of an HTTPS one
            self._handshake(transport, self.door.tls)
            return
        super().connection_made(transport)
        if not self.counted:  # counted here; a secured one was counted at its TCP accept, and keeps the address
            # it was counted under (read again now, a peer that reset after its handshake would have none)
            self.address = self.client[0] if self.client else ""
            refusal = self.door.admit(self)
            if refusal is not None:
                log.debug("HTTP API: connection from %s refused: %s", self.address, refusal.message)
                self._refuse(refusal)
                return
        self._await_request()

    # ------------------------------------------------------------------ TLS
    def _handshake(self, tcp: asyncio.Transport, context: ssl.SSLContext) -> None:
        """Count the TCP connection in, then secure it (within `handshake_timeout_s`); over the caps it is
        closed at once."""
        tcp.pause_reading()  # its bytes are the handshake's, not HTTP's
        # Until secured, the door sees the TCP transport: what it closes to give the connection up.
        self.transport = tcp
        peer = tcp.get_extra_info("peername")
        self.address = str(peer[0]) if isinstance(peer, (tuple, list)) and peer else ""
        refusal = self.door.admit(self)
        if refusal is not None:
            log.debug("HTTP API: connection from %s closed before its TLS handshake: %s", self.address,
                      refusal.message)
            self.refused = True
            tcp.abort()
            return
        self.door.waits(self)  # holds no work yet: among the first given up when the door is full
        handshake = self.loop.create_task(self._secure(tcp, context))
        self.door.handshakes.add(handshake)
        handshake.add_done_callback(self.door.handshakes.discard)

    async def _secure(self, tcp: asyncio.Transport, context: ssl.SSLContext) -> None:
        try:
            secured = await self.loop.start_tls(tcp, self, context, server_side=True,
                                                ssl_handshake_timeout=self.limits.handshake_timeout_s)
        except BaseException as e:  # broad: any failed handshake (late, refused, reset, the API stopping) ends it
            self._insecure(tcp)
            if isinstance(e, asyncio.CancelledError):
                raise
            log.debug("HTTP API: TLS handshake from %s failed: %r", self.address, e)
            return
        if secured is None or self.refused:  # closed meanwhile, or given up by the door as it completed
            self._insecure(tcp)
            if secured is not None:
                secured.abort()
            return
        self.secured = True
        self.connection_made(secured)
        early, self._early = self._early, []
        for data in early:
            self.data_received(data)

    def _insecure(self, tcp: asyncio.Transport) -> None:
        """The handshake failed: counted out, the TCP connection closed (start_tls closed it; a close still
        waiting to flush is not waited for)."""
        self.refused = True
        self.door.release(self)
        tcp.abort()

    def handle_websocket_upgrade(self) -> None:
        """A WebSocket upgrade: the connection stays counted in the door (as working: never given up for
        room) until the WebSocket protocol that takes the transport over loses it; this protocol's timers
        end here (the WebSocket has its own keepalive, and the endpoint its own bounds)."""
        if self._too_long():  # refused by data_received once the parser returns
            return
        for timer in (self._header_timer, self._receive_timer, self._send_timer):
            if timer is not None:
                timer.cancel()
        self._header_timer = self._receive_timer = self._send_timer = None
        self.door.works(self)
        super().handle_websocket_upgrade()
        upgraded = self.transport.get_protocol()
        if isinstance(upgraded, DoorWebSocketProtocol):
            upgraded.counted_as = self
        else:  # not ours to count: counted out now
            self.door.release(self)

    def connection_lost(self, exc: Exception | None) -> None:
        try:
            self.door.release(self)
            self.refused = True
            for timer in (self._header_timer, self._receive_timer, self._send_timer):
                if timer is not None:
                    timer.cancel()
        finally:  # uvicorn forgets the connection whatever the door's count said
            super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self.refused:  # refused or given up: closing (TLS may still hand over what it decrypted)
            return
        if self.door.tls is not None and not self.secured:  # secured, and not yet told: held until it is
            self._early.append(data)
            return
        self._received += len(data)
        within = self._in_headers  # a request's headers in progress, since before this piece
        begun = self._messages
        super().data_received(data)
        if within and self._in_headers and begun == self._messages:
            self._header_chunks += len(data)  # the whole piece is that request's headers
        if self.lingering:
            self._drained += len(data)
            if self._drained > self.limits.linger_bytes:
                self._stop_lingering()
                self.transport.close()
                return
        if self._too_long() and not self.transport.is_closing():
            self._refuse(ApiError(431, f"the request's headers are longer than {self.limits.max_header_bytes} bytes",
                                  code="headers_too_large"))

    def _too_long(self) -> bool:
        """Whether the headers in progress, or those just completed, are past the cap. Counted both from the
        parser's pieces (a header not yet complete is held by the parser) and from the pieces received wholly
        inside the headers: never more than the headers' bytes, and at most one piece fewer."""
        return max(self._header_bytes, self._header_chunks) > self.limits.max_header_bytes

    @property
    def limits(self) -> ConnectionLimits:
        return self.door.limits

    def _refuse(self, error: ApiError) -> None:
        """Answer `error` and close, where no answer has started; otherwise just cut the connection."""
        self.refused = True
        self._stop_lingering()
        if self.pipeline:  # the next request's headers are in while an answer is in progress: no room for ours
            self.transport.abort()
            return
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete:
            if cycle.response_started:
                self.transport.abort()
                return
            cycle.disconnected = True  # the app's answer, if it comes, goes nowhere
            cycle.message_event.set()
        self.transport.write(raw_answer(error))
        self.transport.close()

    # ------------------------------------------------------------------ headers
    def _await_request(self) -> None:
        """No request in progress: the connection waits for one, closed if none begins in time."""
        self.door.waits(self)
        if self._header_timer is None:  # a request begun already has its own deadline
            self._header_timer = self.loop.call_later(self.limits.header_timeout_s, self._headers_late)

    def _headers_late(self) -> None:
        self._header_timer = None
        if self.transport.is_closing():
            return
        if not self._in_headers:  # nothing of a request came: an idle connection, closed without a word
            self.transport.close()
            return
        self._refuse(ApiError(408, f"the request's headers did not arrive within {self.limits.header_timeout_s:g} s",
                              code="request_timeout"))

    def on_message_begin(self) -> None:
        """A request's first byte: its headers are counted and timed from here, pipelined or not."""
        super().on_message_begin()
        self._messages += 1
        self._in_headers = True
        self._header_bytes = REQUEST_LINE_BYTES
        self._header_chunks = 0
        if self._header_timer is not None:
            self._header_timer.cancel()
        self._header_timer = self.loop.call_later(self.limits.header_timeout_s, self._headers_late)

    def on_url(self, url: bytes) -> None:
        self._header_bytes += len(url)
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._header_bytes += len(name) + len(value) + HEADER_LINE_BYTES
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._in_headers = False
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None
        if self._too_long():  # refused by data_received once the parser returns
            super().on_headers_complete()
            return
        self._header_bytes = self._header_chunks = 0
        self.door.works(self)
        super().on_headers_complete()
        self._received = 0
        if self._receive_timer is None:
            self._receive_timer = self.loop.call_later(self.limits.receive_window_s, self._judge_receive)

    def on_message_complete(self) -> None:
        if self.lingering:  # the rest of a refused body is in: the connection serves its next request
            self._stop_lingering()
            self._await_request()
        super().on_message_complete()

    def on_response_complete(self) -> None:
        pipelined = bool(self.pipeline)  # the next request's headers are in already
        cycle = self.cycle
        super().on_response_complete()
        if pipelined or self.transport.is_closing():
            return
        if cycle is not None and cycle.more_body:  # answered before its body was read: drain the rest
            self.door.waits(self)
            self.lingering = True
            self._drained = 0
            self._header_timer = self.loop.call_later(self.limits.linger_s, self._linger_over)
        else:
            self._await_request()

    # ------------------------------------------------------------------ an answer before the body
    def _stop_lingering(self) -> None:
        if self.lingering:
            self.lingering = False
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

    def _linger_over(self) -> None:
        self._header_timer = None
        self.lingering = False
        if not self.transport.is_closing():
            self.transport.close()

    # ------------------------------------------------------------------ the body
    def _judge_receive(self) -> None:
        """At the end of a window: a body still coming must have brought `min_receive_bytes` in it."""
        self._receive_timer = None
        cycle = self.cycle
        if self.transport.is_closing() or cycle is None or not cycle.more_body or cycle.response_complete:
            return  # no body awaited (the next request's headers have their own deadline)
        # Bytes not yet taken by the API, or a client waiting for `100 Continue`: the API is the slow one.
        server_behind = cycle.body or self.flow.read_paused or cycle.waiting_for_100_continue
        if not server_behind and self._received < self.limits.min_receive_bytes:
            rate = self.limits.min_receive_bytes / self.limits.receive_window_s
            self._refuse(ApiError(408, f"the request's body came at {self._received} bytes in "
                                       f"{self.limits.receive_window_s:g} s, slower than {rate:.0f} bytes/s",
                                  code="request_timeout"))
            return
        self._received = 0
        self._receive_timer = self.loop.call_later(self.limits.receive_window_s, self._judge_receive)


class DoorWebSocketProtocol(SendFloor, WebSocketsSansIOProtocol):
    """uvicorn's WebSocket protocol for a connection upgraded from a DoorProtocol: it counts the connection
    out of the door when it ends (the HTTP protocol it took the transport from is never told), and a client
    that stops reading is cut by the door's send floor (its sends would wait for ever otherwise)."""

    door: Door
    counted_as: DoorProtocol | None = None  # the HTTP protocol the connection is counted under

    @property
    def address(self) -> str:  # type: ignore[override]
        return self.counted_as.address if self.counted_as is not None else ""

    def connection_lost(self, exc: Exception | None) -> None:
        try:
            self._stop_judging_send()
            if self.counted_as is not None:
                self.door.release(self.counted_as)
                self.counted_as = None
        finally:
            super().connection_lost(exc)


def protocol_for(door: Door) -> type[DoorProtocol]:
    """The protocol class uvicorn makes each connection with, bound to `door`."""
    return type("ApiDoorProtocol", (DoorProtocol,), {"door": door})


def websocket_protocol_for(door: Door) -> type[DoorWebSocketProtocol]:
    """The protocol class uvicorn upgrades a connection to for a WebSocket, bound to `door`."""
    return type("ApiDoorWebSocketProtocol", (DoorWebSocketProtocol,), {"door": door})
