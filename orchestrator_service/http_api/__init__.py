"""The OpenAI-compatible HTTP front door of the orchestrator.

It only translates: an HTTP request becomes the same GenerateRequest a gRPC client sends, and goes down
the one request path (`OrchestratorServicer.generate`: admission, routing, cancellation, trace). Served by
uvicorn on the orchestrator's own event loop, on its own port.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from typing import Sequence

import uvicorn

from omnistage.spec import Pipeline

from .routes import build_app

log = logging.getLogger("omnistage.orchestrator.http_api")

__all__ = ["HttpApi", "connection_limit"]

# Connections beyond admission's running and waiting requests: health probes, model listings, bodies being
# refused, keep-alive connections between requests.
CONNECTION_SLACK = 64


def connection_limit(pipeline: Pipeline) -> int:
    """Connections (and requests) served at once; beyond it uvicorn answers 503 at once. Admission holds
    `maxInflight` running and `maxQueued` waiting: more connections could only hold bodies and sockets for
    requests that admission would refuse anyway."""
    orchestrator = pipeline.deployment.orchestrator
    return orchestrator.max_inflight + orchestrator.max_queued + CONNECTION_SLACK


class HttpApi:
    def __init__(self, servicer, pipeline: Pipeline, host: str, port: int, api_keys: Sequence[str] = ()):
        self.app = build_app(servicer, pipeline, api_keys)
        self.limit_concurrency = connection_limit(pipeline)
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
        # log_config=None: the process's logging stays as the orchestrator configured it.
        config = uvicorn.Config(self.app, log_config=None, log_level="warning", lifespan="off", access_log=False,
                                ws="none", timeout_graceful_shutdown=5, limit_concurrency=self.limit_concurrency)
        config.load()
        self._server = uvicorn.Server(config)
        # What serve() does, less its signal handlers (SIGTERM belongs to the orchestrator's drain):
        # the lifespan (off), startup on our socket, then the main loop in a task.
        self._server.lifespan = config.lifespan_class(config)
        await self._server.startup(sockets=[sock])
        self._task = asyncio.create_task(self._server.main_loop(), name="http-api")
        log.info("OpenAI-compatible API on http://%s:%d/v1", self.host, self.port)
        return self.port

    async def stop(self) -> None:
        """Stop accepting, close connections; streams still open are cancelled with their requests."""
        if self._server is None:
            return
        self._server.should_exit = True
        if self._task is not None:
            await self._task
        await self._server.shutdown()
        self._server = self._task = None
