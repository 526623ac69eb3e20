"""Helpers for tests that run real stage and orchestrator servers in-process on port 0."""

from __future__ import annotations

import copy
from pathlib import Path

import grpc
import yaml

from omnistage.client import build_request
from omnistage.spec import Pipeline, parse_pipeline
from omnistage.v1 import stage_pb2, stage_pb2_grpc
from stage_service.server import StageServer

from .conftest import EXAMPLES


def example(name: str, edit=None) -> Pipeline:
    doc = yaml.safe_load((EXAMPLES / f"{name}.yaml").read_text())
    if edit:
        doc = copy.deepcopy(doc)
        edit(doc)
    return parse_pipeline(doc)


async def start_stage(pipeline: Pipeline, stage: str, model_dir: Path, **kw) -> StageServer:
    srv = StageServer(pipeline, stage, "127.0.0.1", 0, model_root=str(model_dir), **kw)
    await srv.start()
    return srv


def header(request_id: str = "r1", deadline_unix_ms: int = 0, **params) -> stage_pb2.StageInput:
    p = build_request(**{"prompt": "Hello there", **params}).params
    return stage_pb2.StageInput(header=stage_pb2.StageRequestHeader(request_id=request_id, params=p,
                                                                    deadline_unix_ms=deadline_unix_ms))


async def call_stage(port: int, first: stage_pb2.StageInput | None, chunks=(), timeout: float = 120,
                     channel: grpc.aio.Channel | None = None) -> list[stage_pb2.Chunk]:
    """One Process call: the header, then the given input chunks; returns every output chunk."""
    own = channel is None
    channel = channel or grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    try:
        stub = stage_pb2_grpc.StageServiceStub(channel)

        async def requests():
            if first is not None:
                yield first
            for c in chunks:
                yield stage_pb2.StageInput(chunk=c)

        return [out.chunk async for out in stub.Process(requests(), timeout=timeout)]
    finally:
        if own:
            await channel.close()
