"""The OpenAI-compatible HTTP front door of the orchestrator.

It only translates: an HTTP request becomes the same GenerateRequest a gRPC client sends, and goes down
the one request path (`OrchestratorServicer.generate`: admission, routing, cancellation, trace). Served by
uvicorn on the orchestrator's own event loop, on its own port, its connections bounded by the door
(connections.py) and its requests by the gate (gate.py).
"""

from __future__ import annotations

import asyncio
import logging
import socket
import ssl
from typing import Mapping

import uvicorn

from omnistage import tls as tls_files
from omnistage.api import Pipeline
from omnistage.contract.launch import ENV_ALLOWED_HOSTS

from .access import HttpAccess
from .connections import ConnectionLimits, Door, protocol_for, websocket_protocol_for
from .gate import HostCheck, RequestGate
from .parse_workers import ParseWorkers, address_space_for
from .realtime.limits import MAX_FRAME_BYTES, PING_INTERVAL_S
from .routes import BODIES_AT_ONCE, build_app, chat_body_limit

log = logging.getLogger("omnistage.orchestrator.http_api")

__all__ = ["ENV_ALLOWED_HOSTS", "HttpApi", "allowed_hosts_from", "request_limit"]


# Requests in progress beyond admission's running and waiting ones: model listings, bodies being read or
# refused.
REQUEST_SLACK = 64


def request_limit(pipeline: Pipeline) -> int:
    """Requests in progress at once (from their headers to their answer's end); beyond it the API answers
    429 at once (`/health` aside). Admission holds `maxInflight` running and `maxQueued` waiting: more could
    only hold bodies for requests that admission would refuse anyway. Idle and half-open connections are
    not requests: the door bounds those (connections.py)."""
    orchestrator = pipeline.deployment.orchestrator
    return orchestrator.max_inflight + orchestrator.max_queued + REQUEST_SLACK


def _server_context(tls: tls_files.TlsFiles) -> ssl.SSLContext:
    """The API's TLS context: its certificate and key; clients present none."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(str(tls.cert), str(tls.key))
    return context


def allowed_hosts_from(env: Mapping[str, str]) -> tuple[str, ...]:
    """The names $OMNISTAGE_ALLOWED_HOSTS lists (comma separated; blanks ignored)."""
    return tuple(name.strip() for name in env.get(ENV_ALLOWED_HOSTS, "").split(",") if name.strip())


class HttpApi:
    def __init__(self, servicer, pipeline: Pipeline, host: str, port: int, tls: tls_files.TlsFiles | None = None,
                 allowed_hosts: tuple[str, ...] = ()):
        """`allowed_hosts`: domain names a request's Host may carry when bound to loopback, besides
        `localhost` (a local proxy's); see gate.HostCheck."""
        self.request_limit = request_limit(pipeline)
        # Its keys: the servicer's, one set for both front doors; behind the Host check and the request limit.
        # Large bodies are parsed in processes of their own: one for each body the budget reads at once.
        self.parse_workers = ParseWorkers(pipeline, BODIES_AT_ONCE, address_space_for(chat_body_limit(pipeline.limits)))
        self.gate = RequestGate(build_app(servicer, pipeline, self.parse_workers), self.request_limit,
                                HostCheck.for_bind(host, allowed_hosts))
        self.app = HttpAccess(self.gate, servicer.api_keys)   # outermost: every API request gets its access line
        self.tls = tls  # given: HTTPS with its tls.crt and tls.key
        self._tls_stamp = tls.stamp() if tls else None
        # The door does the TLS handshakes (connections.py: counted and timed from the TCP accept), not uvicorn.
        self.ssl = _server_context(tls) if tls else None
        self.door = Door(ConnectionLimits.for_process(floor=self.request_limit), tls=self.ssl)
        self.host, self.port = host, port
        self._server: uvicorn.Server | None = None
        self._task: asyncio.Task | None = None

    async def start(self) -> int:
        """Bind (port 0: any free) and serve on the running loop; returns the bound port."""
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        # IPPROTO_TCP named, not 0: accepted connections inherit it, and asyncio sets TCP_NODELAY only on
        # sockets that say TCP. Without it, Nagle holds a response's body behind its headers until the
        # client's delayed ACK: 40 ms on every answer.
        sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((self.host, self.port))
        except OSError as e:  # a port already taken: say which, the process reports it in one line
            sock.close()
            raise OSError(e.errno, f"cannot bind the OpenAI API to {self.host}:{self.port}: {e.strerror}") from None
        self.port = sock.getsockname()[1]
        # log_config=None: the process's logging stays as the orchestrator configured it. No limit_concurrency:
        # uvicorn's counts idle and half-open connections too (a slowloris fills it); the door and the gate
        # bound connections and requests instead.
        # WebSockets (the Realtime API) are upgraded from the door's connections and stay counted in it; no
        # per-message compression: base64 audio hardly compresses, and inflating would cost the loop every request
        # shares.
        config = uvicorn.Config(self.app, log_config=None, log_level="warning", lifespan="off", access_log=False,
                                ws=websocket_protocol_for(self.door), ws_max_size=MAX_FRAME_BYTES,
                                ws_ping_interval=PING_INTERVAL_S, ws_ping_timeout=PING_INTERVAL_S,
                                ws_per_message_deflate=False, timeout_graceful_shutdown=5,
                                http=protocol_for(self.door))
        config.load()
        self._server = uvicorn.Server(config)
        # What serve() does, less its signal handlers (SIGTERM belongs to the orchestrator's drain):
        # the lifespan (off), startup on our socket, then the main loop in a task.
        self._server.lifespan = config.lifespan_class(config)
        await self._server.startup(sockets=[sock])
        self._task = asyncio.create_task(self._server.main_loop(), name="http-api")
        self.parse_workers.start()
        log.info("OpenAI-compatible API on %s://%s:%d/v1", "https" if self.tls else "http", self.host, self.port)
        return self.port

    def reload_tls(self) -> None:
        """After tls.crt and tls.key were rotated: new connections get the new certificate (a new context, read
        once and swapped in whole: files rewritten while they are read can never leave the live one keyless),
        those open keep theirs."""
        if self.tls is None or self.ssl is None or self.tls.stamp() == self._tls_stamp:
            return
        stamp = self.tls.stamp()
        try:
            context = _server_context(self.tls)
        except (OSError, ValueError) as e:  # ssl.SSLError is an OSError: mid-rotation, next time whole
            log.warning("HTTP API certificate in %s not reloaded: %s", self.tls.folder, e)
            return
        self.ssl = self.door.tls = context   # the door secures each new connection with the context of its time
        self._tls_stamp = stamp
        log.info("HTTP API certificate in %s reloaded", self.tls.folder)

    async def stop(self) -> None:
        """Stop accepting, close connections; streams still open are cancelled with their requests."""
        if self._server is None:
            return
        self._server.should_exit = True
        if self._task is not None:
            await self._task
        self.door.end_handshakes()
        await self._server.shutdown()
        self.parse_workers.close()
        self._server = self._task = None
