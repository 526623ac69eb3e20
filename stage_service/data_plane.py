"""One stage replica's end of the data plane: output tensors become descriptors for its consumers,
input descriptors become tensors, and what the stage holds for consumers is freed when the request is
released (the orchestrator releases it once it ended: until then a retried consumer may fetch it again),
when it is cancelled, after the stage's TTL, or first when a new chunk needs the room (already fetched).

Tensors the client reads (tokens, audio, images) stay inline when the stage's output goes to the
client; the rest goes by the edge's transport (`auto`: inline when small, shared memory when the
consumer shares this host, else UCX). Where no consumer is named, everything is inline.

The connector runs on the engine's device (`engine.placement.device`): received tensors land where
the engine runs, and a CUDA stage's tensors leave from device memory over UCX where UCX carries it.
Between two GPU stages of one host, `auto` takes UCX (CUDA IPC) rather than shared memory.

UCX authenticates with the pipeline's data-plane key, read from the file the stage's --data-plane-key
names (omnistage/connector/ucx_auth.py; on a cluster, the pipeline's key Secret, mounted in every stage
pod). Without one UCX may listen on loopback only: beyond it, a stage whose edges ask for UCX by name
refuses to start, and `auto` edges leave UCX out (docs/security.md).
"""

from __future__ import annotations

import asyncio
import importlib.util
import logging
import os
import socket
from collections import OrderedDict
from typing import Mapping

import torch
from prometheus_client import CollectorRegistry

from omnistage.api import Pipeline, Stage
from omnistage.connector import ChunkReceiver, ChunkSender, Connector, TransferMetrics, make_connector
from omnistage.connector.connector import default_host_id
from omnistage.connector.ucx_auth import read_key
from omnistage.contract import tensors as tensor_codec
from omnistage.contract.devices import CPU, CUDA, uses_gpus
from omnistage.contract.launch import ENV_HOST_ID, ENV_POD_IP, ENV_SAME_HOST, ENV_TRANSPORTS, is_loopback
from omnistage.v1 import stage_pb2, tensor_pb2
from stage_service.convert import input_from_proto
from stage_service.runtime.base import InputChunk

log = logging.getLogger("omnistage.stage")

# Requests whose input paths are remembered for the trace, at most (a request that ends without a
# last chunk or a release is forgotten oldest first).
INPUT_PATHS_KEPT = 4096

# What the orchestrator reads out of an output stage's chunks for the client (orchestrator_service/outputs.py:
# text tokens, audio, an image's PNG, a video's frames); it never fetches them by reference.
CLIENT_TENSORS = frozenset({"token_ids", "prompt_token_ids", "audio", "image", "video"})


def ucx_available() -> bool:
    return importlib.util.find_spec("ucxx") is not None


def spec_device(pipeline: Pipeline, stage: str) -> str:
    """Where the spec puts a stage's engine: CUDA when it has GPUs and is not pinned to the CPU (a
    replica that finds no CUDA device then refuses to start: omnistage.contract.devices)."""
    return CUDA if uses_gpus(pipeline.deployment.stages[stage]) else CPU


def wanted_transports(pipeline: Pipeline, stage: Stage, same_host: bool, env: Mapping[str, str]) -> tuple[str, ...]:
    """The stores a stage enables (inline is always on). Pure: decided from the spec and environment.

    Shared memory where every stage shares this host (`omnistage serve`), or where an edge asks for it.
    UCX where an edge into or out of this stage asks for it, where peers may be on other hosts (a
    cluster) and `auto` would pick it, or on one host for an `auto` edge between two GPU stages (CUDA
    IPC). Without UCX on a cluster, `auto` sends everything inline.
    """
    if env.get(ENV_TRANSPORTS):
        return tuple(t.strip() for t in env[ENV_TRANSPORTS].split(",") if t.strip())
    edges = [(s.name, e) for s in pipeline.stages for e in s.inputs if s.name == stage.name or e.source == stage.name]
    asked = {e.transport for _, e in edges}
    gpu_auto = any(e.transport == "auto" and spec_device(pipeline, consumer) == spec_device(pipeline, e.source) == CUDA
                   for consumer, e in edges)
    stores = []
    if same_host or "shm" in asked:
        stores.append("shm")
    if ("ucx" in asked or ("auto" in asked and not same_host) or gpu_auto) and ucx_available():
        stores.append("ucx")
    return tuple(stores)


def unkeyed_transports(pipeline: Pipeline, stage: Stage, transports: tuple[str, ...], keyed: bool, ucx_host: str,
                       env: Mapping[str, str]) -> tuple[str, ...]:
    """The stores a stage runs without a data-plane key: UCX only on loopback, or where an edge (or the
    environment) names it, so that its store refuses to start and says why. Pure."""
    if keyed or "ucx" not in transports or is_loopback(ucx_host):
        return transports
    named = bool(env.get(ENV_TRANSPORTS)) or any(
        e.transport == "ucx" for s in pipeline.stages for e in s.inputs if stage.name in (s.name, e.source))
    return transports if named else tuple(t for t in transports if t != "ucx")


def out_transport(pipeline: Pipeline, stage: str, consumers: list[str]) -> str:
    """The transport for a chunk read by `consumers`: their edges' setting when they agree, else auto."""
    chosen = {e.transport for s in pipeline.stages if s.name in consumers for e in s.inputs if e.source == stage}
    return chosen.pop() if len(chosen) == 1 else "auto"


def consumers_device(pipeline: Pipeline, consumers: list[str]) -> str | None:
    """Where a chunk's consumers run, by the spec: their device when they agree, else None (unknown)."""
    devices = {spec_device(pipeline, c) for c in consumers}
    return devices.pop() if len(devices) == 1 else None


class DataPlane:
    def __init__(self, pipeline: Pipeline, stage: Stage, registry: CollectorRegistry | None = None,
                 host: str = "127.0.0.1", env: Mapping[str, str] | None = None, device: str = CPU,
                 key_file: str | None = None):
        env = os.environ if env is None else env
        self.pipeline = pipeline
        self.stage = stage
        self.same_host = env.get(ENV_SAME_HOST) == "1"
        self.host_id = env.get(ENV_HOST_ID) or default_host_id()
        self.ucx_host = _reachable(host, env)
        self.ucx_key = read_key(key_file)  # the pipeline's UCX data-plane key
        wanted = wanted_transports(pipeline, stage, self.same_host, env)
        self.transports = unkeyed_transports(pipeline, stage, wanted, self.ucx_key is not None, self.ucx_host, env)
        if self.transports != wanted:
            log.warning("stage %s: no UCX data-plane key (--data-plane-key) and UCX would listen beyond loopback "
                        "(%s): UCX is off, auto edges go inline or by shared memory", stage.name, self.ucx_host)
        self.settings = pipeline.deployment.stages[stage.name].transfer
        self.device = device  # the engine's (engine.placement.device): where received tensors land
        self.metrics = TransferMetrics(registry)
        # Inline only until start(): a stage is usable (for tests of the engine alone) without stores.
        self.connector = Connector(stage.name, self.host_id, {})
        self.sender: ChunkSender | None = None
        self.receiver = ChunkReceiver(self.connector, metrics=self.metrics)
        self._input_paths: OrderedDict[str, set[str]] = OrderedDict()  # request -> paths since its last chunk out

    async def start(self) -> None:
        self.connector = await make_connector(self.stage.name, self.transports, host_id=self.host_id,
                                              ucx_host=self.ucx_host, retain_fetched=True, device=self.device,
                                              ucx_key=self.ucx_key)
        self.sender = ChunkSender(self.connector, budget_bytes=self.settings.max_buffered_bytes,
                                  ttl_s=self.settings.ttl_seconds, metrics=self.metrics)
        self.sender.start()
        self.receiver = ChunkReceiver(self.connector, metrics=self.metrics)
        log.info("stage %s data plane: %s (host id %s, tensors on %s%s)", self.stage.name,
                 ", ".join(["inline", *self.transports]), self.host_id, self.device,
                 ", UCX carries device memory" if self.connector.ucx_device_memory else "")

    async def close(self) -> None:
        """Free everything held and stop the stores (UCX: its endpoints, worker and listener)."""
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
                transport=out_transport(self.pipeline, self.stage.name, consumers), readers=len(consumers),
                consumer_device=consumers_device(self.pipeline, consumers))
        return msgs

    async def input_chunk(self, msg: stage_pb2.Chunk, request_id: str = "") -> InputChunk:
        """An input chunk with its tensors fetched from wherever its producer holds them; the memory
        paths they took are remembered for the request's next output chunk (its trace)."""
        got = await self.receiver.fetch(msg)
        if request_id and got.paths:
            self._input_paths.setdefault(request_id, set()).update(got.paths.values())
            self._input_paths.move_to_end(request_id)
            while len(self._input_paths) > INPUT_PATHS_KEPT:
                self._input_paths.popitem(last=False)
        return input_from_proto(msg, got.tensors, got.transfer_ms)

    def input_paths(self, request_id: str, done: bool = False) -> str:
        """The memory paths of the inputs fetched for a request since its last output chunk ("," joined);
        `done`: its last chunk, so forget the request."""
        paths = self._input_paths.pop(request_id, set()) if done else self._input_paths.get(request_id, set())
        if not done and paths:
            self._input_paths[request_id] = set()
        return ",".join(sorted(paths))

    def release(self, request_id: str) -> int:
        """Free every chunk of a request this stage still holds; returns the bytes freed."""
        self._input_paths.pop(request_id, None)
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
