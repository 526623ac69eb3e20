"""Helpers for tests that run real stage and orchestrator servers in-process on port 0."""

from __future__ import annotations

import asyncio
import contextlib
import copy
from pathlib import Path
from typing import AsyncIterator

import grpc
import pytest
import yaml

from omnistage import tls, tls_grpc
from omnistage.api import Pipeline, parse_pipeline
from omnistage.client import build_request
from omnistage.contract import launch, tensors
from omnistage.local.process_group import kill_group, stop_group
from omnistage.v1 import stage_pb2, stage_pb2_grpc
from orchestrator_service.server import OrchestratorServer
from stage_service.server import StageServer

from .conftest import EXAMPLES
from .polling import wait_until, wait_until_sync


def example(name: str, edit=None) -> Pipeline:
    doc = yaml.safe_load((EXAMPLES / f"{name}.yaml").read_text())
    if edit:
        doc = copy.deepcopy(doc)
        edit(doc)
    return parse_pipeline(doc)


async def all_queued(sched, calls, n: int):
    """Run `calls` (an awaitable over n requests to a stage) with the stage's first step held until all n are
    in its scheduler, so that what happens to them together (admission under a budget, preemption) does not
    depend on how fast they arrive; returns what `calls` returns."""
    import threading

    go = threading.Event()
    step = sched.step_fn

    def held(batch):
        go.wait(timeout=120)  # on the step thread: the loop goes on taking requests meanwhile
        return step(batch)
    sched.step_fn = held
    task = asyncio.ensure_future(calls)
    try:
        await wait_until(lambda: sched.unfinished() >= n or task.done(), timeout=120)
    finally:
        go.set()
    return await task


def hollow_store(root: Path, models) -> Path:
    """A model store under `root` holding the hollow layout (`omnistage models hollow`) of each (family, name)."""
    from omnistage.checkpoints.hollow import write_hollow

    for family, name in models:
        write_hollow(family, root / name)
    return root


def in_engine_process(name: str, stage: str) -> Pipeline:
    """An example with one stage's model in a process of its own (`engineArgs.engine_process: true`)."""
    def edit(doc):
        doc["spec"]["deployment"]["stages"][stage].setdefault("engineArgs", {})["engine_process"] = True
    return example(name, edit)


def small_lm(limits: dict, orchestrator: dict | None = None) -> Pipeline:
    """llm-tiny with the tiny LM on the transformers engine (no vLLM needed), `limits` as its
    spec.topology.limits and, when given, `orchestrator` as its spec.deployment.orchestrator."""
    def edit(doc):
        doc["spec"]["topology"]["stages"][0]["engine"] = "transformers"
        doc["spec"]["topology"]["limits"] = dict(limits)
        if orchestrator is not None:
            doc["spec"]["deployment"]["orchestrator"] = dict(orchestrator)
    return example("llm-tiny", edit)


async def start_stage(pipeline: Pipeline, stage: str, model_dir: Path, **kw) -> StageServer:
    srv = StageServer(pipeline, stage, "127.0.0.1", 0, model_root=str(model_dir), **kw)
    await srv.start()
    return srv


@contextlib.asynccontextmanager
async def stage_servers(pipeline: Pipeline, model_dir: Path,
                        names: tuple[str, ...] | None = None) -> AsyncIterator[dict[str, StageServer]]:
    """A server for each named stage (every stage of the pipeline by default), by name; all drained on the
    way out, those already started too when a later one fails to start."""
    servers: dict[str, StageServer] = {}
    try:
        for name in names or [s.name for s in pipeline.stages]:
            servers[name] = await start_stage(pipeline, name, model_dir)
        yield servers
    finally:
        for srv in servers.values():
            await srv.drain()


def stage_servers_fixture(pipeline: Pipeline, names: tuple[str, ...] | None = None):
    """A module-scoped fixture of `stage_servers(pipeline, model_dir, names)`: assign it to the fixture's name
    in the test module (`servers = stage_servers_fixture(PIPELINE)`)."""
    @pytest.fixture(scope="module")
    async def fixture(model_dir):
        async with stage_servers(pipeline, model_dir, names) as servers:
            yield servers
    return fixture


@contextlib.asynccontextmanager
async def served_pipeline(pipeline: Pipeline, model_dir: Path):
    """Every stage of the pipeline and an orchestrator over them: yields (orchestrator, stage servers by name)."""
    async with stage_servers(pipeline, model_dir) as stages:
        orc = OrchestratorServer(pipeline, {n: [f"127.0.0.1:{s.port}"] for n, s in stages.items()})
        await orc.start(wait_for_stages=30)
        try:
            yield orc, stages
        finally:
            await orc.drain()


def header(request_id: str = "r1", deadline_unix_ms: int = 0, **params) -> stage_pb2.StageInput:
    p = build_request(**{"prompt": "Hello there", **params}).params
    return stage_pb2.StageInput(header=stage_pb2.StageRequestHeader(request_id=request_id, params=p,
                                                                    deadline_unix_ms=deadline_unix_ms))


async def call_stage(port: int, first: stage_pb2.StageInput | None, chunks=(), timeout: float = 120,
                     channel: grpc.aio.Channel | None = None) -> list[stage_pb2.Chunk]:
    """One Process call: the header, then the given input chunks; returns every output chunk (not the
    progress reports sent between them)."""
    own = channel is None
    channel = channel or grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    try:
        stub = stage_pb2_grpc.StageServiceStub(channel)

        async def requests():
            if first is not None:
                yield first
            for c in chunks:
                yield stage_pb2.StageInput(chunk=c)

        return [out.chunk async for out in stub.Process(requests(), timeout=timeout) if out.HasField("chunk")]
    finally:
        if own:
            await channel.close()


def tensor_of(chunk: stage_pb2.Chunk, name: str):
    """The tensor `name` of an output chunk, as a torch tensor."""
    return next(tensors.from_proto(t) for t in chunk.tensors if t.name == name)


def token_ids(chunks) -> list[int]:
    """The token ids of a stream of LM output chunks, in order."""
    return [t for c in chunks for t in tensor_of(c, "token_ids").tolist()]


class StageProcess:
    """A stage replica as a real process (`python -m stage_service`), for tests that kill it."""

    def __init__(self, pipeline_file: Path, stage: str, model_dir: Path, tmp: Path, tag: str = ""):
        import os
        import subprocess

        tag = tag or stage
        self.ready_file = tmp / f"{tag}.ready"
        self.log = tmp / f"{tag}.log"
        self.proc = subprocess.Popen(
            launch.stage_command(pipeline_file, stage, port=0, model_dir=model_dir, ready_file=self.ready_file),
            stdout=open(self.log, "w"), stderr=subprocess.STDOUT, env={**os.environ, **launch.service_env()},
            start_new_session=True)
        self.port: int | None = None

    def wait_ready(self, timeout: float = 120) -> "StageProcess":
        def ports() -> launch.ReadyPorts | None:
            ready = launch.read_ready(self.ready_file)
            if ready is None and self.proc.poll() is not None:
                raise AssertionError(f"stage exited with {self.proc.returncode}:\n{self.log.read_text()}")
            return ready

        self.port = wait_until_sync(ports, timeout, 0.05, what="stage ready",
                                    detail=lambda: "\n" + self.log.read_text()).grpc
        return self

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def kill(self) -> None:
        kill_group(self.proc, 10)

    def stop(self) -> None:
        stop_group(self.proc, 30, 10)


def write_pipeline(pipeline: Pipeline, path: Path) -> Path:
    path.write_text(yaml.safe_dump(dict(pipeline.raw), sort_keys=False))
    return path


def pipeline_tls(folder: Path, pipeline: Pipeline, namespace: str = "test",
                 ca: tuple[bytes, bytes] | None = None) -> dict[str | None, tls.TlsFiles]:
    """A TLS folder for the orchestrator (key None) and each stage of `pipeline`, from `ca` (cert, key PEM;
    a new one when not given): pass `files.folder` as tls_dir to StageServer / OrchestratorServer."""
    ca = ca or tls.new_ca()
    return tls.write_pipeline_dirs(folder, *ca, namespace, pipeline.name, [s.name for s in pipeline.stages])


def tls_channel(port: int, ca: bytes, cert: bytes | None, key: bytes | None, server_identity: str) -> grpc.aio.Channel:
    """A channel to 127.0.0.1:`port` that trusts `ca`, presents `cert` (none: no client certificate) and checks
    the server proves `server_identity`: any caller a test plays."""
    creds = grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)
    return grpc.aio.secure_channel(f"127.0.0.1:{port}", creds, options=tls_grpc.target_options(server_identity))
