"""Pieces every omnistage gRPC server shares: health + reflection wiring, an HTTP port for
Prometheus metrics and probes, signal handling, and mapping of domain errors to status codes."""

from __future__ import annotations

import asyncio
import logging
import signal
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from omnistage.launch import DRAIN_PATH, LIVE_PATH, METRICS_PATH, READY_PATH

log = logging.getLogger("omnistage")


def add_health_and_reflection(server: grpc.aio.Server, service_names: list[str]) -> health_aio.HealthServicer:
    health = health_aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    reflection.enable_server_reflection([*service_names, reflection.SERVICE_NAME, "grpc.health.v1.Health"], server)
    return health


async def set_serving(health: health_aio.HealthServicer, services: list[str], serving: bool) -> None:
    status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
    for name in ["", *services]:
        await health.set(name, status)


class HttpStatusServer:
    """The HTTP paths of the process contract (`omnistage.launch`): metrics, readiness (200 once
    serving, 503 while loading or draining), liveness, and drain (for a preStop hook: stop taking
    work, finish what was admitted, answer when done)."""

    def __init__(self, host: str, port: int, registry: CollectorRegistry, ready: Callable[[], bool],
                 drain: Callable[[], None] | None = None):
        registry_, ready_, drain_ = registry, ready, drain

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 - http.server's naming
                if self.path.startswith(METRICS_PATH):
                    body, code, ctype = generate_latest(registry_), 200, CONTENT_TYPE_LATEST
                elif self.path.startswith(READY_PATH):
                    ok = ready_()
                    body, code, ctype = (b"ready\n" if ok else b"not ready\n"), (200 if ok else 503), "text/plain"
                elif self.path.startswith(DRAIN_PATH) and drain_ is not None:
                    drain_()  # blocks until admitted work is finished (bounded by the drain setting)
                    body, code, ctype = b"drained\n", 200, "text/plain"
                elif self.path.startswith(LIVE_PATH):
                    body, code, ctype = b"ok\n", 200, "text/plain"
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


def configure_logging(level: str = "INFO") -> None:
    logging.basicConfig(level=getattr(logging, level.upper(), logging.INFO),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
