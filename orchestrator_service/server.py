"""Wires one orchestrator replica: Orchestrator service, grpc.health.v1, reflection, metrics, the
OpenAI-compatible HTTP API (optional, on its own port), drain.

Drain order on SIGTERM or /drain: NOT_SERVING -> refuse new work -> admitted work (gRPC calls and HTTP
requests alike) finishes within the drain bound -> the HTTP API stops (what is still open is cancelled)
-> the router closes its stage channels. Jobs (the job API's runner) claim no more at the drain's start; those
running here have the drain bound to finish, then stop and are released (queued again: another replica takes them).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

from omnistage import serving, tls, tls_expiry, tls_grpc
from omnistage.api import MAX_MESSAGE_BYTES, Pipeline, load_pipeline
from omnistage.checkpoints.defaults import with_model_limits
from omnistage.contract import launch
from omnistage.v1 import jobs_pb2, jobs_pb2_grpc, orchestrator_pb2, orchestrator_pb2_grpc

from . import otel
from .access_log import GrpcAccess
from .api_keys import ApiKeyError, ApiKeys
from .byte_budget import ByteBudget
from .discovery import FileDiscovery, KubernetesDiscovery, read_endpoints_file
from .grpc_door import ClientDoor
from .jobs.api import JobSettings
from .jobs.replica import JobsFlagError, ReplicaJobs
from .jobs.service import JobsServicer
from .media_check import MediaCheck
from .metrics import OrchestratorMetrics
from .routing import Router
from .servicer import OrchestratorServicer
from .voices import VoiceError, Voices

if TYPE_CHECKING:
    from .http_api import HttpApi

log = logging.getLogger("omnistage.orchestrator")
SERVICE = orchestrator_pb2.DESCRIPTOR.services_by_name["Orchestrator"].full_name
JOBS_SERVICE = jobs_pb2.DESCRIPTOR.services_by_name["Jobs"].full_name
MIN_RECEIVE_BYTES = 64 << 20
GENERATE = f"/{SERVICE}/Generate"
SUBMIT_JOB = f"/{JOBS_SERVICE}/Submit"
# Calls open at once beyond the admitted and waiting requests: health checks, DescribePipeline, reflection and
# the admission's own refusals being answered (those carry a retry hint, so room for a burst of them). Past
# maxInflight + maxQueued + this, gRPC itself answers RESOURCE_EXHAUSTED before reading the message.
RPC_SLACK = 64
# Calls one client connection may have open at once: HTTP/2's recommended floor (RFC 9113 6.5.2), far above
# what one well-behaved client multiplexes, and no longer every call the server takes on one connection.
MAX_STREAMS_PER_CONNECTION = 100
# The client port's fixed receive window per call: what a caller can make this process buffer before its key
# is checked and its call refused. gRPC's default window grows with the measured bandwidth-delay product, to
# about 10 MiB a call (16 keyless 120 MiB calls grew the peak RSS by up to 154 MiB); 1 MiB still uploads at
# about 20 MB/s over a 50 ms round trip and at the link's speed within a cluster.
CLIENT_STREAM_WINDOW_BYTES = 1 << 20
# Requests of the largest size the receive limit lets in that admitted and waiting gRPC requests may hold
# between them; more bytes than that are refused RESOURCE_EXHAUSTED until some end (many small ones fit).
FULL_SIZE_REQUESTS_HELD = 4
DRAIN_POLL_S = 0.05  # how often a drain looks whether the admitted HTTP requests have finished


def parse_endpoints(specs: list[str], pipeline: Pipeline) -> dict[str, list[str]]:
    """`NAME=HOST:PORT[,HOST:PORT...]` flags -> stage -> addresses; every stage must have one."""
    out: dict[str, list[str]] = {}
    known = {s.name for s in pipeline.stages}
    for spec in specs:
        name, sep, addrs = spec.partition("=")
        if not sep or not addrs:
            raise ValueError(f'--stage-endpoint "{spec}": expected NAME=HOST:PORT[,HOST:PORT...]')
        if name not in known:
            raise ValueError(f'--stage-endpoint "{spec}": pipeline has no stage "{name}"')
        out.setdefault(name, []).extend(a for a in addrs.split(",") if a)
    missing = sorted(known - set(out))
    if missing:
        raise ValueError(f"no endpoint given for stage(s): {', '.join(missing)}")
    return out


class OrchestratorServer:
    def __init__(self, pipeline: Pipeline, endpoints: dict[str, list[str]], host: str = "127.0.0.1",
                 port: int = 0, http_port: int | None = None, drain_seconds: float | None = None,
                 namespace: str | None = None, api_port: int | None = None, api_keys: Sequence[str] = (),
                 tls_dir: str | None = None, client_tls_dir: str | None = None,
                 tls_reload_s: float = tls_grpc.RELOAD_INTERVAL_S, endpoints_file: str | None = None,
                 jobs_store: str | None = None, jobs_content: str | None = None,
                 jobs_settings: JobSettings = JobSettings()):
        self.pipeline = pipeline
        # Its voices, from the model store's checkpoint as the limits are (serve): configs only. First: a
        # VoiceError (a defaultVoice the checkpoint lacks) stops the start before anything is opened.
        voices = Voices.read(pipeline, launch.model_root())
        self.router = Router(pipeline)
        # Stage channels over mutual TLS as this orchestrator's identity; the client-facing ports over TLS.
        # Both read here: unusable files fail before anything binds.
        self.router.tls = tls_grpc.ChannelTls(tls.TlsFiles(Path(tls_dir))) if tls_dir else None
        self.client_tls = tls.TlsFiles(Path(client_tls_dir)) if client_tls_dir else None
        if self.client_tls is not None:
            self.client_tls.read_leaf()
        self.tls_reload_s = tls_reload_s
        self._tls_watch: asyncio.Task | None = None
        for stage, addrs in endpoints.items():
            self.router.set_endpoints(stage, addrs)
        self.metrics = OrchestratorMetrics()
        certificates = tls_expiry.CertificateMetrics(self.metrics.registry)
        for name, files in (("pipeline", self.router.tls and self.router.tls.files), ("client", self.client_tls)):
            if files is not None:
                certificates.follow(name, files)
        self.media = MediaCheck(pipeline)
        keys = ApiKeys(api_keys, pipeline.deployment.orchestrator.max_priority)
        self.servicer = OrchestratorServicer(pipeline, self.router, self.metrics, self.media, keys, voices)
        # The job API's store, content and runner (JobsFlagError: a jobs flag that cannot work, before anything opens).
        self.jobs = ReplicaJobs(self.servicer, self.metrics, jobs_store, jobs_content, jobs_settings)
        # Room for every request the limits admit (validation keeps that within MAX_MESSAGE_BYTES; a larger
        # message gets gRPC's RESOURCE_EXHAUSTED).
        self.receive_bytes = min(max(MIN_RECEIVE_BYTES, pipeline.limits.max_request_bytes), MAX_MESSAGE_BYTES)
        # A job's Submit carries a whole request, as Generate does: both take their bytes from one budget.
        self.door = ClientDoor([SERVICE, JOBS_SERVICE], keys, ByteBudget(FULL_SIZE_REQUESTS_HELD * self.receive_bytes),
                               [GENERATE, SUBMIT_JOB], on_refused=self._count_refusal)
        self.host, self.port, self.http_port = host, port, http_port
        self.api_port = api_port
        self.api: HttpApi | None = None  # once started
        self.drain_seconds = (drain_seconds if drain_seconds is not None
                              else pipeline.deployment.orchestrator.drain_seconds)
        self.ready = False
        self.stopped = asyncio.Event()
        self._drain_called = False
        self.http: serving.HttpStatusServer | None = None
        # In a cluster: stage replicas come from the Endpoints of their Services.
        # Locally: from the endpoints file `omnistage serve` rewrites as it scales.
        self.discovery = (KubernetesDiscovery(pipeline, namespace, self.router.set_endpoints)
                          if namespace is not None else
                          FileDiscovery(pipeline, endpoints_file, self.router.set_endpoints)
                          if endpoints_file is not None else None)

    async def start(self, wait_for_stages: float | None = None) -> int:
        # Keys are checked and request bytes budgeted by the door before a handler runs.
        orc = self.pipeline.deployment.orchestrator
        self.server, self.health = await serving.start_grpc_server(
            SERVICE, self._add_servicers,
            self.receive_bytes, MAX_MESSAGE_BYTES, self.pipeline.limits.request_timeout_seconds,
            interceptors=[GrpcAccess(GENERATE, self.servicer.api_keys), self.door],  # access lines: outermost
            max_concurrent_rpcs=orc.max_inflight + orc.max_queued + RPC_SLACK,
            max_concurrent_streams=MAX_STREAMS_PER_CONNECTION, stream_window_bytes=CLIENT_STREAM_WINDOW_BYTES,
            also_reflected=[JOBS_SERVICE])
        self.port = self._add_port()
        await self.server.start()
        self.router.start()
        if self.router.tls is not None or self.client_tls is not None:
            self._tls_watch = asyncio.create_task(tls_grpc.watch(self.reload_tls, self.tls_reload_s))
        if self.discovery is not None:
            self.discovery.start()
            await asyncio.wait_for(self.discovery.synced.wait(), 60)
        if self.http_port is not None:
            self.http = serving.HttpStatusServer(self.host, self.http_port, self.metrics.registry,
                                                 lambda: self.ready,
                                                 serving.blocking_drain(asyncio.get_running_loop(), self.drain)).start()
        if wait_for_stages:
            await self.router.wait_ready(wait_for_stages)
        if self.api_port is not None:  # before ready: /readyz answering 200 means the API answers too
            # Imported here: the HTTP stack (FastAPI, uvicorn) loads only where the API is served.
            from .http_api import HttpApi, allowed_hosts_from

            api = HttpApi(self.servicer, self.pipeline, self.host, self.api_port, tls=self.client_tls,
                          allowed_hosts=allowed_hosts_from(os.environ))
            self.api_port = await api.start()
            self.api = api  # only once bound: a drain after a failed start has no API to stop
        await self.jobs.start()  # once the stages are there: a claimed job goes straight down the request path
        self.ready = True
        await serving.set_serving(self.health, [SERVICE, JOBS_SERVICE], True)
        log.info("orchestrator for %s serving on %s:%d", self.pipeline.name, self.host, self.port)
        return self.port

    def _add_servicers(self, server) -> None:
        orchestrator_pb2_grpc.add_OrchestratorServicer_to_server(self.servicer, server)
        jobs_pb2_grpc.add_JobsServicer_to_server(JobsServicer(self.servicer.jobs, self.servicer.api_keys), server)

    def _count_refusal(self, method: str, outcome: str) -> None:
        if method == GENERATE:  # as the handler counts its refusals
            self.metrics.requests.labels(outcome).inc()

    def _add_port(self) -> int:
        address = f"{self.host}:{self.port}"
        if self.client_tls is None:
            return self.server.add_insecure_port(address)
        return self.server.add_secure_port(address, tls_grpc.server_credentials(self.client_tls,
                                                                                require_client_cert=False))

    def reload_tls(self) -> None:
        """Rotated certificate files: new stage channels with the new leaf; the HTTP API's new connections get
        the new client-facing certificate (the gRPC ports reload theirs at each handshake by themselves)."""
        if self.router.tls is not None and self.router.tls.refresh():
            self.router.renew_channels()
        if self.api is not None:
            self.api.reload_tls()

    async def drain(self) -> None:
        if self._drain_called:  # once; a second SIGTERM or /drain waits for the first to finish
            await self.stopped.wait()
            return
        self._drain_called = True
        self.servicer.draining = True
        self.ready = False
        await serving.set_serving(self.health, [SERVICE, JOBS_SERVICE], False)
        try:
            # One bound for both front doors: server.stop waits for gRPC calls only.
            await asyncio.gather(self.server.stop(grace=self.drain_seconds),
                                 self._admitted_work_finished(self.drain_seconds),
                                 self.jobs.drain(self.drain_seconds))
        finally:
            if self._tls_watch is not None:
                self._tls_watch.cancel()
            if self.api is not None:
                await self.api.stop()
            await self.jobs.close()  # once neither door can call it
            if self.discovery is not None:
                self.discovery.stop()
            await self.router.close()
            self.media.close()
            self.stopped.set()  # the HTTP port stays up until close(): a /drain caller gets its answer

    async def _admitted_work_finished(self, bound: float) -> None:
        """Until no request is admitted or waiting (HTTP ones included), at most `bound` seconds."""
        if self.api is None:
            return  # gRPC calls only: server.stop(grace) waits for them
        admission = self.servicer.admission
        loop = asyncio.get_running_loop()
        end = loop.time() + bound
        while (admission.inflight or admission.queued) and loop.time() < end:
            await asyncio.sleep(DRAIN_POLL_S)
        if admission.inflight or admission.queued:
            log.warning("orchestrator: drain bound passed with %d requests in flight, %d waiting",
                        admission.inflight, admission.queued)

    def close(self) -> None:
        """After `stopped`: close the HTTP port, once a pending /drain has been answered."""
        if self.http:
            self.http.stop()
            self.http = None


async def serve(args: argparse.Namespace) -> int:
    pipeline, notes = with_model_limits(load_pipeline(args.pipeline), launch.model_root())
    for note in notes:  # the limits the file leaves to the model, as read from its checkpoints
        log.info("orchestrator: %s", note)
    otel.configure_from_env()
    namespace = None
    if args.discovery == "kubernetes":
        if args.stage_endpoint:
            print("orchestrator: --stage-endpoint and --discovery kubernetes exclude each other", file=sys.stderr)
            return 2
        endpoints = {}
        namespace = args.namespace
    elif args.discovery == "file":
        if args.stage_endpoint or not args.endpoints_file:
            print("orchestrator: --discovery file takes --endpoints-file and no --stage-endpoint", file=sys.stderr)
            return 2
        try:  # read once here: a bad file at start is an error, later ones are logged and skipped
            read_endpoints_file(args.endpoints_file, pipeline)
        except ValueError as e:
            print(f"orchestrator: {e}", file=sys.stderr)
            return 2
        endpoints = {}
    else:
        try:
            endpoints = parse_endpoints(args.stage_endpoint, pipeline)
        except ValueError as e:
            print(f"orchestrator: {e}", file=sys.stderr)
            return 2
    srv = OrchestratorServer(pipeline, endpoints, args.host, args.port, args.http_port, args.drain_seconds,
                             namespace=namespace, api_port=args.api_port, api_keys=args.api_key,
                             tls_dir=args.tls_dir, client_tls_dir=args.client_tls_dir,
                             endpoints_file=args.endpoints_file if args.discovery == "file" else None,
                             jobs_store=args.jobs_store, jobs_content=args.jobs_content,
                             jobs_settings=JobSettings(args.jobs_ttl_s, args.jobs_concurrency,
                                                       args.jobs_max_queued_per_key, args.jobs_lease_s,
                                                       args.jobs_max_attempts))
    serving.on_signals(lambda: asyncio.ensure_future(srv.drain()))
    try:
        await srv.start(wait_for_stages=args.wait_for_stages)
    except OSError as e:  # a port already taken: one line saying which, not a traceback
        launch.report_exit(f"orchestrator: {e.strerror or e}")
        await srv.drain()
        srv.close()
        return 2
    if args.ready_file:
        launch.write_ready(args.ready_file, launch.ReadyPorts(srv.port, srv.http.port if srv.http else None,
                                                              srv.api_port))
    log.info("orchestrator ready on %s:%d", args.host, srv.port)  # log lines: JSON under --log-format json
    if srv.api is not None:
        url = launch.http_url(args.host, srv.api_port, launch.API_PATH)
        log.info("OpenAI API on %s", tls.https(url) if srv.client_tls else url)
    await srv.stopped.wait()
    await asyncio.to_thread(srv.close)  # off the loop: a pending /drain answer still needs it
    return 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return launch.orchestrator_parser().parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    return serving.run_server(serve, parse_args(argv), "orchestrator",  # an ApiKeyError names the entry, never the key
                              [(ApiKeyError, "orchestrator"), (VoiceError, "orchestrator"),
                               (JobsFlagError, "orchestrator")])
