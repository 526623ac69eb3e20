"""Wires one stage replica: engine, StageService, grpc.health.v1, reflection, metrics, drain.

Drain order on SIGTERM: health NOT_SERVING -> refuse new work (UNAVAILABLE) ->
wait for admitted work up to the drain bound -> wait (within that bound and the
TTL) for consumers to fetch the outputs held for them -> server.stop(grace) -> engine
shutdown; then the process exits 0. An engine that cannot recover flips health
at once and the process exits non-zero (EXIT_ENGINE_DEAD). An engine that hangs
(no step progress while it holds work, see StepScheduler.stalled) fails /livez,
and the kubelet restarts the container.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
import time
from pathlib import Path

import grpc

from omnistage import serving, tls, tls_expiry, tls_grpc
from omnistage.api import MAX_MESSAGE_BYTES, Pipeline, load_pipeline
from omnistage.checkpoints.check import StageCheckError, check_stage
from omnistage.checkpoints.defaults import with_model_limits
from omnistage.checkpoints.shards import CheckpointError
from omnistage.contract import launch
from omnistage.v1 import stage_pb2, stage_pb2_grpc
from stage_service import tracing
from stage_service.data_plane import DataPlane
from stage_service.engines.registry import create_engine
from stage_service.metrics import StageMetrics
from stage_service.runtime import faults
from stage_service.runtime.base import SteppedEngine
from stage_service.runtime.errors import EngineConfigError
from stage_service.servicer import StageServicer

log = logging.getLogger("omnistage.stage")
SERVICE = stage_pb2.DESCRIPTOR.services_by_name["StageService"].full_name
EXIT_ENGINE_DEAD = 3
STOP_GRACE_S = 1.0  # after the drain bound: what is still running gets this long before it is cancelled


class StageServer:
    """One stage replica. `start()` loads the model and binds; `drain()` stops it gracefully."""

    def __init__(self, pipeline: Pipeline, stage_name: str, host: str = "127.0.0.1", port: int = 0,
                 http_port: int | None = None, model_root: str | None = None, drain_seconds: float | None = None,
                 tls_dir: str | None = None, data_plane_key: str | None = None):
        self.pipeline = pipeline
        self.stage = pipeline.stage(stage_name)
        self.host, self.port, self.http_port = host, port, http_port
        self.tls = tls.TlsFiles(Path(tls_dir)) if tls_dir else None  # given: mutual TLS, callers checked
        self.interceptors = self._authorization()  # before anything loads: unusable TLS files fail here
        self.engine = create_engine(pipeline, self.stage, model_root)
        self.metrics = StageMetrics(self.stage.name)
        if self.tls is not None:
            tls_expiry.CertificateMetrics(self.metrics.registry).follow("pipeline", self.tls)
        self.engine.bind_metrics(self.metrics)
        self.data_plane = DataPlane(pipeline, self.stage, self.metrics.registry, host,
                                    device=self.engine.placement.device,  # received tensors land where it runs
                                    key_file=data_plane_key)  # the pipeline's UCX data-plane key
        self.servicer = StageServicer(pipeline, self.stage, self.engine, self.metrics, self.data_plane)
        self.drain_seconds = (drain_seconds if drain_seconds is not None
                              else pipeline.deployment.stages[self.stage.name].drain_seconds)
        self.server: grpc.aio.Server | None = None
        self.http: serving.HttpStatusServer | None = None
        self.ready = False
        self.stopped = asyncio.Event()
        self._drain_called = False
        self.exit_code = 0
        self._watcher: asyncio.Task | None = None
        self._setup = asyncio.Lock()

    async def start(self) -> int:
        t0 = time.monotonic()
        async with self._setup:  # a drain that comes meanwhile waits for the gRPC server to be up
            await self.data_plane.start()
            self.server, self.health = await serving.start_grpc_server(
                SERVICE, lambda server: stage_pb2_grpc.add_StageServiceServicer_to_server(self.servicer, server),
                MAX_MESSAGE_BYTES, MAX_MESSAGE_BYTES, self.pipeline.limits.request_timeout_seconds, self.interceptors)
            self.port = self._add_port()
            await self.server.start()
            if self.http_port is not None:
                self.http = serving.HttpStatusServer(
                    self.host, self.http_port, self.metrics.registry, lambda: self.ready,
                    serving.blocking_drain(asyncio.get_running_loop(), self.drain), live=self.stalled).start()
        try:
            await self.engine.start()  # health stays NOT_SERVING until the model is loaded
        except BaseException:
            await self.server.stop(0)  # the model did not load: nothing stays bound or held
            await self.data_plane.close()
            raise
        if self.servicer.draining:  # stopped while loading: never SERVING; free what loading built
            await self.engine.shutdown()
            return self.port
        self._watcher = asyncio.create_task(self._watch_engine())
        self.ready = True
        await serving.set_serving(self.health, [SERVICE], True)
        log.info("stage %s serving on %s:%d (model loaded in %.1fs)", self.stage.name, self.host, self.port,
                 time.monotonic() - t0)
        return self.port

    def _authorization(self) -> list[grpc.aio.ServerInterceptor]:
        """With TLS: Process, Release and GetLoad only for the pipeline's own orchestrator and stages."""
        if self.tls is None:
            return []
        methods = stage_pb2.DESCRIPTOR.services_by_name["StageService"].methods_by_name
        return [tls_grpc.StageAuthorization.for_stage(self.tls, SERVICE, methods)]

    def _add_port(self) -> int:
        address = f"{self.host}:{self.port}"
        if self.tls is None:
            return self.server.add_insecure_port(address)
        return self.server.add_secure_port(address, tls_grpc.server_credentials(self.tls))

    async def drain(self, exit_code: int = 0) -> None:
        if self._drain_called:  # once; a second SIGTERM or /drain waits for the first to finish
            await self.stopped.wait()
            return
        self._drain_called = True
        self.exit_code = exit_code
        self.servicer.draining = True
        self.ready = False
        async with self._setup:
            pass
        if self.server is None:  # never started
            await self.data_plane.close()
            self.stopped.set()
            return
        await serving.set_serving(self.health, [SERVICE], False)
        log.info("stage %s draining: %d in flight, bound %.0fs", self.stage.name, self.servicer.inflight,
                 self.drain_seconds)
        loop = asyncio.get_running_loop()
        end = loop.time() + self.drain_seconds
        try:
            await asyncio.wait_for(self.servicer.idle.wait(), self.drain_seconds)
        except asyncio.TimeoutError:
            log.warning("stage %s: drain bound passed with %d in flight", self.stage.name, self.servicer.inflight)
        # Outputs held for consumers that have not fetched them yet would be lost with the store: wait for
        # them within what is left of the drain bound (and the TTL, which would free them anyway).
        if not await self.data_plane.wait_fetched(end - loop.time()):
            log.warning("stage %s: closing with %d bytes its consumers never fetched", self.stage.name,
                        self.data_plane.unfetched_bytes)
        try:
            await self.server.stop(grace=STOP_GRACE_S)
        finally:
            if self._watcher is not None and self._watcher is not asyncio.current_task():
                self._watcher.cancel()
            await self.engine.shutdown()
            await self.data_plane.close()
            self.stopped.set()  # the HTTP port stays up until close(): a /drain caller gets its answer

    def close(self) -> None:
        """After `stopped`: close the HTTP port, once a pending /drain has been answered."""
        if self.http:
            self.http.stop()
            self.http = None

    def stalled(self) -> str | None:
        """Why the engine makes no progress (for /livez; called on the HTTP thread), or None. Engines on the
        step scheduler are watched; vLLM's engine core runs outside it and is not (None)."""
        scheduler = self.engine.scheduler if isinstance(self.engine, SteppedEngine) else None
        return None if scheduler is None else scheduler.stalled(scheduler.clock())

    async def _watch_engine(self) -> None:
        """An engine that cannot recover: NOT_SERVING at once, then stop and exit non-zero."""
        await self.engine.dead.wait()
        log.error("stage %s: engine failed for good: %r", self.stage.name, self.engine.failed)
        await self.drain(exit_code=EXIT_ENGINE_DEAD)


async def serve(args: argparse.Namespace) -> int:
    # The limits the file leaves to the model, read as the orchestrator reads them: one default either side.
    pipeline, _ = with_model_limits(load_pipeline(args.pipeline), args.model_dir)
    if args.stage not in {s.name for s in pipeline.stages}:
        print(f'{args.pipeline}: no stage named "{args.stage}" (stages: '
              f'{", ".join(s.name for s in pipeline.stages)})', file=sys.stderr)
        return 2
    check_stage(pipeline, pipeline.stage(args.stage), args.model_dir)  # before any weights are read
    tracing.configure_from_env(args.stage)
    srv = StageServer(pipeline, args.stage, args.host, args.port, args.http_port, args.model_dir,
                      args.drain_seconds, tls_dir=args.tls_dir, data_plane_key=args.data_plane_key)
    faults.fail_steps_from_env(srv.engine)  # a test's switch: nothing unless the environment asks
    serving.on_signals(lambda: asyncio.ensure_future(srv.drain()))
    await srv.start()
    if srv.ready:
        if args.ready_file:
            launch.write_ready(args.ready_file, launch.ReadyPorts(srv.port, srv.http.port if srv.http else None))
        log.info("stage %s ready on %s:%d", args.stage, args.host, srv.port)  # a log line: JSON under --log-format json
    await srv.stopped.wait()
    await asyncio.to_thread(srv.close)  # off the loop: a pending /drain answer still needs it
    return srv.exit_code


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return launch.stage_parser().parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    stage = f"{args.pipeline}: stage {args.stage}"
    return serving.run_server(serve, args, f"stage {args.stage}",
                              [(StageCheckError, args.pipeline), (EngineConfigError, stage), (CheckpointError, stage)])
