"""Pieces every omnistage gRPC server shares: health + reflection wiring, connection settings (keepalive,
connection age), an HTTP port for Prometheus metrics, probes and drain, signal handling, and mapping of
domain errors to status codes."""

from __future__ import annotations

import argparse
import asyncio
import hmac
import ipaddress
import logging
import os
import signal
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable, Coroutine, Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from omnistage import tls
from omnistage.api import SpecError
from omnistage.contract.launch import (
    DRAIN_PATH,
    LIVE_PATH,
    METRICS_PATH,
    READY_PATH,
    SERVICE_ACCOUNT_TOKEN,
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


def grpc_server_options(max_receive_bytes: int, max_send_bytes: int,
                        request_timeout_s: float) -> list[tuple[str, int]]:
    """Options of every omnistage gRPC server: message sizes, keepalive and connection age.

    `request_timeout_s` is the pipeline's requestTimeoutSeconds: no request lives longer, so a connection
    past its age gets that long (and a margin) for its streams to finish before it is closed; a shorter
    grace would cut requests in flight. 0 (no default deadline): no grace bound, streams are never cut."""
    options = [("grpc.max_receive_message_length", max_receive_bytes),
               ("grpc.max_send_message_length", max_send_bytes),
               *KEEPALIVE_CHANNEL_OPTIONS,
               # Accept the clients' pings at their interval, with room for jitter (the default policy takes
               # one per 5 minutes without data and closes the connection on the third early one).
               ("grpc.http2.min_ping_interval_without_data_ms", KEEPALIVE_TIME_MS // 2),
               ("grpc.max_connection_age_ms", MAX_CONNECTION_AGE_MS)]
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
                            ) -> tuple[grpc.aio.Server, health_aio.HealthServicer]:
    """A server with every omnistage server's options (`grpc_server_options`), the service `add_servicer`
    puts on it, health (NOT_SERVING for now) and reflection; its ports are the caller's to add."""
    server = grpc.aio.server(interceptors=interceptors,
                             options=grpc_server_options(max_receive_bytes, max_send_bytes, request_timeout_s))
    add_servicer(server)
    health = add_health_and_reflection(server, [service])
    await set_serving(health, [service], False)
    return server, health


def _is_loopback(address: str) -> bool:
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return False
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped  # ::ffff:127.0.0.1 from a dual-stack socket
    return ip.is_loopback


def drain_permitted(peer: str, local: str, authorization: str | None,
                    token_file: str | os.PathLike = SERVICE_ACCOUNT_TOKEN) -> bool:
    """May this caller take the replica down with /drain? Yes from inside the pod: a loopback peer, or
    one whose address is the connection's own local address (the pod calling its own IP, as the preStop
    hook does; no other host can open a connection from that address). Otherwise only with
    `Authorization: Bearer <the pod's service-account token>`, read now so a rotated token counts; no
    token file (stages mount none): inside the pod only."""
    if _is_loopback(peer) or (peer and peer == local):
        return True
    scheme, _, presented = (authorization or "").partition(" ")
    if scheme.lower() != "bearer" or not presented.strip():
        return False
    try:
        with open(token_file, "rb") as f:
            token = f.read().strip()
    except OSError:
        return False
    return bool(token) and hmac.compare_digest(presented.strip().encode(), token)


class HttpStatusServer:
    """The HTTP paths of the process contract (`omnistage.contract.launch`): metrics, readiness (200 once
    serving, 503 while loading or draining), liveness (503 with the reason once `live` names one: the
    kubelet restarts the container), and drain (for a preStop hook: stop taking work, finish what was
    admitted, answer when done; only for callers `drain_permitted` lets in)."""

    def __init__(self, host: str, port: int, registry: CollectorRegistry, ready: Callable[[], bool],
                 drain: Callable[[], None] | None = None, live: Callable[[], str | None] | None = None,
                 token_file: str | os.PathLike = SERVICE_ACCOUNT_TOKEN):
        registry_, ready_, drain_, live_ = registry, ready, drain, live

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                if self.path.startswith(METRICS_PATH):
                    body, code, ctype = generate_latest(registry_), 200, CONTENT_TYPE_LATEST
                elif self.path.startswith(READY_PATH):
                    ok = ready_()
                    body, code, ctype = (b"ready\n" if ok else b"not ready\n"), (200 if ok else 503), "text/plain"
                elif self.path.startswith(DRAIN_PATH) and drain_ is not None:
                    if drain_permitted(self.client_address[0], self.connection.getsockname()[0],
                                       self.headers.get("Authorization"), token_file):
                        drain_()  # blocks until admitted work is finished (bounded by the drain setting)
                        body, code, ctype = b"drained\n", 200, "text/plain"
                    else:
                        body, code, ctype = (b"forbidden: /drain only from inside the pod or with its "
                                             b"service-account token\n"), 403, "text/plain"
                elif self.path.startswith(LIVE_PATH):
                    stalled = live_() if live_ is not None else None
                    body, code, ctype = ((b"ok\n", 200, "text/plain") if stalled is None else
                                         (f"not live: {stalled}\n".encode(), 503, "text/plain"))
                else:
                    body, code, ctype = b"not found\n", 404, "text/plain"
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):  # keep probes out of the logs
                pass

        self.httpd = ThreadingHTTPServer((host, port), Handler)
        self.httpd.daemon_threads = False  # stop() waits for handlers: a /drain caller gets its answer
        self.port = self.httpd.server_address[1]
        self._thread = threading.Thread(target=self.httpd.serve_forever, name="http-status", daemon=True)

    def start(self) -> "HttpStatusServer":
        self._thread.start()
        return self

    def stop(self) -> None:
        self.httpd.shutdown()
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


def configure_logging(level: str = "INFO") -> None:
    logging.basicConfig(level=getattr(logging, level.upper(), logging.INFO),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    quiet_import_warnings()


def run_server(serve: Callable[[argparse.Namespace], Coroutine[Any, Any, int]], args: argparse.Namespace,
               name: str, refusals: Sequence[tuple[type[Exception], str]] = ()) -> int:
    """A server process's main: logging at `args.log_level`, then `serve(args)`, its exit code. What it
    refuses to start on exits 2 with one line saying why, not a traceback (`launch.report_exit`: on stderr
    and in the termination log): an invalid pipeline, TLS material (`name` says whose), and each
    (exception, prefix) of `refusals`, the first that fits, as "prefix: message"."""
    configure_logging(args.log_level)
    try:
        return asyncio.run(serve(args))
    except SpecError as e:
        report_exit(f"{args.pipeline}: invalid pipeline:\n" + "\n".join(f"  {x}" for x in e.errors))
        return 2
    except tls.TlsError as e:
        report_exit(f"{name}: TLS: {e}")
        return 2
    except tuple(kind for kind, _ in refusals) as e:
        report_exit(next(f"{prefix}: {e}" for kind, prefix in refusals if isinstance(e, kind)))
        return 2
