"""One stage replica's end of the data plane: output tensors become descriptors for its consumers,
input descriptors become tensors, and what the stage holds for consumers is freed when the request is
released (the orchestrator releases it once it ended: until then a retried consumer may fetch it again),
when it is cancelled, after the stage's TTL, or first when a new chunk needs the room (already fetched).

Tensors the client reads (tokens, audio, images) stay inline when the stage's output goes to the
client; the rest goes by the edge's transport (`auto`: inline when small, shared memory when the
consumer shares this host, else UCX). Where no consumer is named, everything is inline.
"""

from __future__ import annotations

import asyncio
import importlib.util
import logging
import os
import socket
from typing import Mapping

import torch
from prometheus_client import CollectorRegistry

from omnistage import tensors as tensor_codec
from omnistage.connector import ChunkReceiver, ChunkSender, Connector, TransferMetrics, make_connector
from omnistage.connector.connector import default_host_id
from omnistage.launch import ENV_HOST_ID, ENV_POD_IP, ENV_SAME_HOST, ENV_TRANSPORTS
from omnistage.spec import Pipeline, Stage
from omnistage.v1 import stage_pb2, tensor_pb2

from .convert import input_from_proto
from .engines.base import InputChunk

log = logging.getLogger("omnistage.stage")

# What the orchestrator reads out of an output stage's chunks for the client.
CLIENT_TENSORS = frozenset({"token_ids", "prompt_token_ids", "audio", "image"})


def ucx_available() -> bool:
    return importlib.util.find_spec("ucxx") is not None


def wanted_transports(pipeline: Pipeline, stage: Stage, same_host: bool, env: Mapping[str, str]) -> tuple[str, ...]:
    """The stores a stage enables (inline is always on). Pure: decided from the spec and environment.

    Shared memory where every stage shares this host (`omnistage serve`), or where an edge asks for it.
    UCX where an edge into or out of this stage asks for it, or where peers may be on other hosts (a
    cluster) and `auto` would pick it. Without UCX on a cluster, `auto` sends everything inline.
    """
    if env.get(ENV_TRANSPORTS):
        return tuple(t.strip() for t in env[ENV_TRANSPORTS].split(",") if t.strip())
    edges = [e for s in pipeline.stages for e in s.inputs if s.name == stage.name or e.source == stage.name]
    asked = {e.transport for e in edges}
    stores = []
    if same_host or "shm" in asked:
        stores.append("shm")
    if ("ucx" in asked or (not same_host and "auto" in asked)) and ucx_available():
        stores.append("ucx")
    return tuple(stores)


def out_transport(pipeline: Pipeline, stage: str, consumers: list[str]) -> str:
    """The transport for a chunk read by `consumers`: their edges' setting when they agree, else auto."""
    chosen = {e.transport for s in pipeline.stages if s.name in consumers for e in s.inputs if e.source == stage}
    return chosen.pop() if len(chosen) == 1 else "auto"


class DataPlane:
    def __init__(self, pipeline: Pipeline, stage: Stage, registry: CollectorRegistry | None = None,
                 host: str = "127.0.0.1", env: Mapping[str, str] | None = None):
        env = os.environ if env is None else env
        self.pipeline = pipeline
        self.stage = stage
        self.same_host = env.get(ENV_SAME_HOST) == "1"
        self.host_id = env.get(ENV_HOST_ID) or default_host_id()
        self.transports = wanted_transports(pipeline, stage, self.same_host, env)
        self.ucx_host = _reachable(host, env)
        self.settings = pipeline.deployment.stages[stage.name].transfer
        self.metrics = TransferMetrics(registry)
        # Inline only until start(): a stage is usable (for tests of the engine alone) without stores.
        self.connector = Connector(stage.name, self.host_id, {})
        self.sender: ChunkSender | None = None
        self.receiver = ChunkReceiver(self.connector, metrics=self.metrics)

    async def start(self) -> None:
        self.connector = await make_connector(self.stage.name, self.transports, host_id=self.host_id,
                                              ucx_host=self.ucx_host, retain_fetched=True)
        self.sender = ChunkSender(self.connector, budget_bytes=self.settings.max_buffered_bytes,
                                  ttl_s=self.settings.ttl_seconds, metrics=self.metrics)
        self.sender.start()
        self.receiver = ChunkReceiver(self.connector, metrics=self.metrics)
        log.info("stage %s data plane: %s (host id %s)", self.stage.name,
                 ", ".join(["inline", *self.transports]), self.host_id)

    async def close(self) -> None:
        """Free everything held and stop the stores (a live UCX notifier thread would block exit)."""
        if self.sender is not None:
            await self.sender.close()
            self.sender = None
        await self.connector.close()

    async def outputs(self, header: stage_pb2.StageRequestHeader, chunk_id: int,
                      tensors: Mapping[str, torch.Tensor]) -> list[tensor_pb2.Tensor]:
        """Descriptors of one output chunk's tensors (waits while the stage is over its byte budget)."""
        consumers = list(header.consumers)
        inline = {n for n in tensors if not consumers or self.sender is None
                  or (header.inline_outputs and n in CLIENT_TENSORS)}
        msgs = [tensor_codec.to_proto(n, t) for n, t in tensors.items() if n in inline]
        rest = {n: t for n, t in tensors.items() if n not in inline}
        if rest:
            msgs += await self.sender.put_chunk(
                header.request_id, chunk_id, rest, consumer=",".join(consumers),
                consumer_host=self.host_id if self.same_host else None,
                transport=out_transport(self.pipeline, self.stage.name, consumers), readers=len(consumers))
        return msgs

    async def input_chunk(self, msg: stage_pb2.Chunk) -> InputChunk:
        """An input chunk with its tensors fetched from wherever its producer holds them."""
        got = await self.receiver.fetch(msg)
        return input_from_proto(msg, got.tensors, got.transfer_ms)

    def release(self, request_id: str) -> int:
        """Free every chunk of a request this stage still holds; returns the bytes freed."""
        return self.sender.release_request(request_id) if self.sender is not None else 0

    @property
    def held_bytes(self) -> int:
        return self.connector.held_bytes

    @property
    def unfetched_bytes(self) -> int:
        """Bytes held that a consumer has still to fetch."""
        return self.connector.unfetched_bytes

    async def wait_fetched(self, timeout: float, poll_s: float = 0.05) -> bool:
        """Wait until consumers fetched every chunk held for them (or `timeout`: the TTL frees them anyway);
        True when nothing is left unfetched. A draining stage closes its stores only after this."""
        loop = asyncio.get_running_loop()
        end = loop.time() + max(0.0, min(timeout, self.settings.ttl_seconds))
        while self.connector.unfetched_bytes:
            if loop.time() >= end:
                return False
            await asyncio.sleep(poll_s)
        return True


def _reachable(host: str, env: Mapping[str, str]) -> str:
    """The address consumers reach this stage's UCX listener at: its bind address, unless that is a wildcard."""
    if host in ("", "0.0.0.0", "::"):
        return env.get(ENV_POD_IP) or socket.gethostbyname(socket.gethostname())
    return host
