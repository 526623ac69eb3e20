"""Pieces every omnistage gRPC server shares: health + reflection wiring, connection settings (keepalive,
connection age), an HTTP port for Prometheus metrics, probes and drain, signal handling, and mapping of
domain errors to status codes."""

from __future__ import annotations

import argparse
import asyncio
import hmac
import logging
import os
import secrets
import signal
import socket
import stat
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable, Coroutine, Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from omnistage import logs, tls
from omnistage.api import SpecError
from omnistage.contract.launch import (
    DRAIN_PATH,
    LIVE_PATH,
    METRICS_PATH,
    READY_PATH,
    drain_token_path,
    report_exit,
)

log = logging.getLogger("omnistage")

# Keepalive: a peer that vanished without closing its connections (node lost, network cut, a process frozen)
# is noticed within KEEPALIVE_TIME_MS + KEEPALIVE_TIMEOUT_MS instead of the kernel's hours of TCP
# retries: its calls fail (UNAVAILABLE, retried elsewhere) and the other side's work is cancelled.
KEEPALIVE_TIME_MS = 10_000
KEEPALIVE_TIMEOUT_MS = 10_000
# For every channel a service opens to another (the orchestrator's to each stage replica).
KEEPALIVE_CHANNEL_OPTIONS = (
    ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
    ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
    ("grpc.keepalive_permit_without_calls", 1),   # an idle pooled channel is checked too
    ("grpc.http2.max_pings_without_data", 0),     # a long step sends no data: keep pinging through it
)
# Connections are closed after this age (gRPC adds +-10% jitter) so clients reconnect, re-resolve and spread
# over replicas added since; long, as reconnecting costs a handshake (TLS included) on the request path.
MAX_CONNECTION_AGE_MS = 30 * 60_000
MAX_CONNECTION_AGE_GRACE_MARGIN_MS = 60_000


def grpc_server_options(max_receive_bytes: int, max_send_bytes: int, request_timeout_s: float,
                        max_concurrent_streams: int | None = None,
                        stream_window_bytes: int | None = None) -> list[tuple[str, int]]:
    """Options of every omnistage gRPC server: message sizes, keepalive and connection age.

    `request_timeout_s` is the pipeline's requestTimeoutSeconds: no request lives longer, so a connection
    past its age gets that long (and a margin) for its streams to finish before it is closed; a shorter
    grace would cut requests in flight. 0 (no default deadline): no grace bound, streams are never cut.
    `max_concurrent_streams`: the most calls one connection may have open at once (None: gRPC's default, none).
    `stream_window_bytes`: a fixed HTTP/2 receive window per call (None: gRPC's default, which grows with the
    bandwidth-delay product it measures, to several MiB a call: what a caller can make the server buffer before
    anything reads its message)."""
    options = [("grpc.max_receive_message_length", max_receive_bytes),
               ("grpc.max_send_message_length", max_send_bytes),
               *KEEPALIVE_CHANNEL_OPTIONS,
               # Accept the clients' pings at their interval, with room for jitter (the default policy takes
               # one per 5 minutes without data and closes the connection on the third early one).
               ("grpc.http2.min_ping_interval_without_data_ms", KEEPALIVE_TIME_MS // 2),
               ("grpc.max_connection_age_ms", MAX_CONNECTION_AGE_MS)]
    if max_concurrent_streams is not None:
        options.append(("grpc.max_concurrent_streams", max_concurrent_streams))
    if stream_window_bytes is not None:
        options += [("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", stream_window_bytes)]
    if request_timeout_s > 0:
        options.append(("grpc.max_connection_age_grace_ms",
                        int(request_timeout_s * 1e3) + MAX_CONNECTION_AGE_GRACE_MARGIN_MS))
    return options


def add_health_and_reflection(server: grpc.aio.Server, service_names: list[str]) -> health_aio.HealthServicer:
    health = health_aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    reflection.enable_server_reflection([*service_names, reflection.SERVICE_NAME, "grpc.health.v1.Health"], server)
    return health


async def set_serving(health: health_aio.HealthServicer, services: list[str], serving: bool) -> None:
    status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
    for name in ["", *services]:
        await health.set(name, status)


async def start_grpc_server(service: str, add_servicer: Callable[[grpc.aio.Server], None], max_receive_bytes: int,
                            max_send_bytes: int, request_timeout_s: float,
                            interceptors: Sequence[grpc.aio.ServerInterceptor] | None = None,
                            max_concurrent_rpcs: int | None = None, max_concurrent_streams: int | None = None,
                            stream_window_bytes: int | None = None, also_reflected: Sequence[str] = (),
                            ) -> tuple[grpc.aio.Server, health_aio.HealthServicer]:
    """A server with every omnistage server's options (`grpc_server_options`), the service `add_servicer`
    puts on it, health (NOT_SERVING for now) and reflection; its ports are the caller's to add.
    `max_concurrent_rpcs`: calls open at once beyond it are answered RESOURCE_EXHAUSTED (None: no bound).
    `also_reflected`: more services `add_servicer` puts on it, listed by reflection (health follows `service`)."""
    server = grpc.aio.server(interceptors=interceptors, maximum_concurrent_rpcs=max_concurrent_rpcs,
                             options=grpc_server_options(max_receive_bytes, max_send_bytes, request_timeout_s,
                                                         max_concurrent_streams, stream_window_bytes))
    add_servicer(server)
    health = add_health_and_reflection(server, [service, *also_reflected])
    await set_serving(health, [service], False)
    return server, health


# The status port (`HttpStatusServer`) against slow and silent clients: a connection gets this long for each
# read or write (a kubelet probe times out after 2-5 s, a Prometheus scrape after 10 s); at most
# STATUS_MAX_CONNECTIONS at once (a thread each), and past that the oldest one that has not sent its request
# yet is shed for the newcomer, so a probe always gets in: it sends its request at once.
STATUS_CONNECTION_TIMEOUT_S = 10.0
STATUS_MAX_CONNECTIONS = 64
# stop() waits this long for a /drain caller to get its answer (the drain itself is over by then).
DRAIN_ANSWER_WAIT_S = 5.0


def drain_permitted(authorization: str | None, token: str | None) -> bool:
    """May this caller take the process down with /drain? Only with `Authorization: Bearer <its drain
    token>`; no token (none could be written safely): nobody. The caller's address proves nothing: behind a
    sidecar proxy every client comes from loopback, and on a shared host any user reaches loopback."""
    scheme, _, presented = (authorization or "").partition(" ")
    if not token or scheme.lower() != "bearer" or not presented.strip():
        return False
    return hmac.compare_digest(presented.strip().encode(), token.encode())


def write_drain_token(port: int, temp_dir: str | os.PathLike | None = None) -> str | None:
    """A new drain token for the process serving /drain on `port`, written where the preStop hook reads it
    (`launch.drain_token_path`): 0600 in a 0700 folder of this user. A folder there that is not that (a link,
    another user's, readable by others) is not trusted: None, and /drain refuses everyone (SIGTERM drains)."""
    path = drain_token_path(port, temp_dir)
    try:
        try:
            path.parent.mkdir(mode=0o700)
        except FileExistsError:
            pass
        st = os.lstat(path.parent)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
            log.warning("/drain disabled: %s is not a private folder of this user", path.parent)
            return None
        token = secrets.token_urlsafe(32)
        path.unlink(missing_ok=True)   # a dead process's, of the same port
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(token + "\n")
        return token
    except OSError as e:
        log.warning("/drain disabled: cannot write its token to %s (%s)", path, e.strerror or e)
        return None


class _BoundedHTTPServer(ThreadingHTTPServer):
    """A thread per connection, at most STATUS_MAX_CONNECTIONS; past that the oldest connection still
    waiting for its request is shed for the new one (a slowloris loses its sockets, a probe gets in)."""

    daemon_threads = True   # exit never waits on a silent client; stop() waits for /drain answers only
    request_queue_size = 128   # the listen backlog: a burst of connections waits to be accepted (and shed)

    def __init__(self, *args, **kw):
        self._lock = threading.Lock()
        self._waiting: dict[Any, None] = {}   # connections not past their request line, oldest first
        self._busy: set[Any] = set()
        super().__init__(*args, **kw)

    def process_request(self, request, client_address):
        with self._lock:
            if len(self._waiting) + len(self._busy) >= STATUS_MAX_CONNECTIONS:
                if not self._waiting:   # every slot is answering a request: the newcomer waits its turn
                    self.shutdown_request(request)
                    return
                oldest = next(iter(self._waiting))
                del self._waiting[oldest]
                try:
                    oldest.shutdown(socket.SHUT_RDWR)   # its thread's read returns; the thread ends
                except OSError:
                    pass
            self._waiting[request] = None
        super().process_request(request, client_address)

    def request_started(self, request) -> bool:
        """The connection's request has been read; False when it was shed meanwhile."""
        with self._lock:
            if request not in self._waiting:
                return False
            del self._waiting[request]
            self._busy.add(request)
            return True

    def handle_error(self, request, client_address):
        if not isinstance(sys.exc_info()[1], OSError):   # a client that went away is not an error of ours
            super().handle_error(request, client_address)

    def shutdown_request(self, request):
        with self._lock:
            self._waiting.pop(request, None)
            self._busy.discard(request)
        super().shutdown_request(request)


class HttpStatusServer:
    """The HTTP paths of the process contract (`omnistage.contract.launch`): metrics, readiness (200 once
    serving, 503 while loading or draining), liveness (503 with the reason once `live` names one: the
    kubelet restarts the container), and drain (`POST`, for a preStop hook: stop taking work, finish what was
    admitted, answer when done; only with the drain token this server wrote, `write_drain_token`). Slow or
    silent clients hold at most STATUS_MAX_CONNECTIONS threads, each for STATUS_CONNECTION_TIMEOUT_S per read."""

    def __init__(self, host: str, port: int, registry: CollectorRegistry, ready: Callable[[], bool],
                 drain: Callable[[], None] | None = None, live: Callable[[], str | None] | None = None,
                 temp_dir: str | os.PathLike | None = None):
        registry_, ready_, drain_, live_ = registry, ready, drain, live
        answering = threading.Semaphore(0)   # released once per /drain answer sent
        self._drains = 0
        server = self

        class Handler(BaseHTTPRequestHandler):
            timeout = STATUS_CONNECTION_TIMEOUT_S

            def parse_request(self):
                ok = super().parse_request()   # the request line and headers, read
                if not self.server.request_started(self.request):   # type: ignore[attr-defined]
                    self.close_connection = True   # shed while it was still sending: not answered
                    return False
                return ok

            def answer(self, code: int, body: bytes, ctype: str = "text/plain", **headers: str) -> None:
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                for name, value in headers.items():
                    self.send_header(name, value)
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self):
                if self.path.startswith(METRICS_PATH):
                    self.answer(200, generate_latest(registry_), CONTENT_TYPE_LATEST)
                elif self.path.startswith(READY_PATH):
                    ok = ready_()
                    self.answer(200 if ok else 503, b"ready\n" if ok else b"not ready\n")
                elif self.path.startswith(LIVE_PATH):
                    stalled = live_() if live_ is not None else None
                    self.answer(*((200, b"ok\n") if stalled is None else (503, f"not live: {stalled}\n".encode())))
                elif self.path.startswith(DRAIN_PATH) and drain_ is not None:
                    self.answer(405, b"method not allowed: POST /drain\n", Allow="POST")
                else:
                    self.answer(404, b"not found\n")

            def do_POST(self):
                if not (self.path.startswith(DRAIN_PATH) and drain_ is not None):
                    self.answer(404, b"not found\n")
                elif not drain_permitted(self.headers.get("Authorization"), server._token):
                    self.answer(403, b"forbidden: /drain takes the process's drain token (see the preStop hook)\n")
                else:
                    server._drains += 1
                    try:
                        drain_()  # blocks until admitted work is finished (bounded by the drain setting)
                        self.answer(200, b"drained\n")
                    finally:
                        answering.release()

            def log_message(self, *args):  # keep probes out of the logs
                pass

        self.httpd = _BoundedHTTPServer((host, port), Handler)
        self.port = self.httpd.server_address[1]
        self._answering = answering
        self._token = write_drain_token(self.port, temp_dir) if drain is not None else None
        self._token_path = drain_token_path(self.port, temp_dir) if self._token else None
        self._thread = threading.Thread(target=self.httpd.serve_forever, name="http-status", daemon=True)

    def start(self) -> "HttpStatusServer":
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop serving; a /drain caller being answered gets its answer (bounded), silent clients are not
        waited for. Removes the drain token."""
        if self._token_path is not None:
            self._token_path.unlink(missing_ok=True)
            self._token_path = None
        if self._thread.is_alive():
            self.httpd.shutdown()
        for _ in range(self._drains):
            self._answering.acquire(timeout=DRAIN_ANSWER_WAIT_S)
        self._drains = 0
        self.httpd.server_close()


def blocking_drain(loop: asyncio.AbstractEventLoop, drain: Callable[[], "asyncio.Future"]) -> Callable[[], None]:
    """A drain coroutine made callable from the HTTP thread, returning once it finished."""
    def run() -> None:
        asyncio.run_coroutine_threadsafe(drain(), loop).result()
    return run


def on_signals(callback: Callable[[], None], signals=(signal.SIGTERM, signal.SIGINT)) -> None:
    loop = asyncio.get_running_loop()
    for sig in signals:
        loop.add_signal_handler(sig, callback)


# Libraries that warn at import about things no omnistage path uses: torchao (imported by transformers and
# diffusers whenever it is installed) that its CUDA-only kernel libraries do not load on a CPU host, and torch
# that torchao registers enums the old way. Their errors still show.
QUIET_AT_IMPORT = ("torchao", "torch.utils._pytree")


def quiet_import_warnings() -> None:
    for name in QUIET_AT_IMPORT:
        logging.getLogger(name).setLevel(logging.ERROR)


def configure_logging(level: str = "INFO", fmt: str = logs.DEFAULT_LOG_FORMAT, access_log: str = "on") -> None:
    """The process's log lines (omnistage/logs.py), and the import warnings quieted."""
    logs.configure(level, fmt, access_log)
    quiet_import_warnings()


def run_loop(main: Coroutine[Any, Any, Any]) -> Any:
    """`main` run to completion on uvloop where it is installed (it comes with vLLM; vLLM's own server runs
    on it): its per-callback cost is a fraction of the standard loop's, and the request path pays it per
    event in every process (gRPC streams, uvicorn, the queues between them); else on asyncio's own loop."""
    try:
        import uvloop
    except ImportError:  # the standard loop: same behaviour, more CPU per event
        return asyncio.run(main)
    return uvloop.run(main)


def run_server(serve: Callable[[argparse.Namespace], Coroutine[Any, Any, int]], args: argparse.Namespace,
               name: str, refusals: Sequence[tuple[type[Exception], str]] = ()) -> int:
    """A server process's main: logging at `args.log_level`, then `serve(args)`, its exit code. What it
    refuses to start on exits 2 with one line saying why, not a traceback (`launch.report_exit`: on stderr
    and in the termination log): an invalid pipeline, TLS material (`name` says whose), and each
    (exception, prefix) of `refusals`, the first that fits, as "prefix: message"."""
    configure_logging(args.log_level, args.log_format, args.access_log)
    try:
        return run_loop(serve(args))
    except SpecError as e:
        report_exit(f"{args.pipeline}: invalid pipeline:\n" + "\n".join(f"  {x}" for x in e.errors))
        return 2
    except tls.TlsError as e:
        report_exit(f"{name}: TLS: {e}")
        return 2
    except tuple(kind for kind, _ in refusals) as e:
        report_exit(next(f"{prefix}: {e}" for kind, prefix in refusals if isinstance(e, kind)))
        return 2
