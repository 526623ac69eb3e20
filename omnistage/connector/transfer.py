"""Whole chunks through a stage's connector.

`ChunkSender` (producer side) keeps the bytes its stage holds under a budget: over it, `put_chunk`
waits (asyncio) instead of growing memory, after freeing chunks that are kept only for a retried
consumer (already fetched: store.py). Held chunks go when their consumer has fetched them (or, kept,
when their request is released), when their request is cancelled (`release_request`), or after a TTL
when the consumer vanished (a background sweeper). `ChunkReceiver` (consumer side) fetches a chunk's
tensors as soon as its descriptor arrives; the consuming engine puts chunks in order per edge
(stage_service/runtime/base.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass, field
from typing import Mapping

import torch

from omnistage.connector.connector import Connector
from omnistage.connector.errors import ChunkTooLarge
from omnistage.connector.keys import TensorKey
from omnistage.connector.metrics import TransferMetrics
from omnistage.contract.tensors import TensorFormatError
from omnistage.v1 import stage_pb2, tensor_pb2


class ChunkSender:
    def __init__(self, connector: Connector, *, budget_bytes: int, ttl_s: float = 120.0,
                 metrics: TransferMetrics | None = None, sweep_interval_s: float | None = None,
                 room_poll_s: float = 0.01):
        if budget_bytes <= 0 or ttl_s <= 0:
            raise ValueError(f"budget_bytes and ttl_s must be > 0, got {budget_bytes} and {ttl_s}")
        self.connector = connector
        self.stage = connector.stage
        self.budget_bytes = budget_bytes
        self.ttl_s = ttl_s
        self.metrics = metrics or TransferMetrics()
        self.sweep_interval_s = sweep_interval_s or max(0.05, ttl_s / 4)
        self.room_poll_s = room_poll_s  # shared-memory readers free bytes in another process: look this often
        self._reserved = 0  # bytes of puts admitted and in progress
        self._turn = asyncio.Lock()  # producers wait for room one at a time, first come first served
        self._room = asyncio.Event()
        self._sweeper: asyncio.Task | None = None
        connector.release_listeners.append(self._released)

    def start(self) -> None:
        """Start the TTL sweeper (call from the event loop that will use this sender)."""
        if self._sweeper is None:
            self._sweeper = asyncio.create_task(self._sweep_forever(), name=f"connector-sweeper-{self.stage}")

    async def close(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper
            self._sweeper = None

    async def put_chunk(self, request_id: str, chunk_id: int, tensors: Mapping[str, torch.Tensor], *,
                        consumer: str = "", consumer_host: str | None = None, transport: str = "auto",
                        readers: int = 1, timeout: float | None = None,
                        consumer_device: str | None = None) -> list[tensor_pb2.Tensor]:
        """Descriptors for one chunk's tensors, waiting first while the stage is over its budget.
        `consumer_device`: where the consumer(s) run ("cpu", "cuda"; None: unknown), for `auto`."""
        conn = self.connector
        held = {name: conn.transport_for(t, transport, consumer_host, consumer_device) != "inline"
                for name, t in tensors.items()}
        need = sum(t.numel() * t.element_size() for name, t in tensors.items() if held[name])
        if need > self.budget_bytes:
            raise ChunkTooLarge(f"stage {self.stage}: chunk {chunk_id} of request {request_id} needs {need} bytes, "
                                f"more than the stage's whole buffer budget ({self.budget_bytes}); raise the budget "
                                "or make chunks smaller")
        edge = f"{self.stage}->{consumer or '*'}"
        t0 = time.perf_counter()
        async with asyncio.timeout(timeout):
            await self._admit(need)
        try:
            msgs = []
            for name, t in tensors.items():
                msg = await conn.put(TensorKey(request_id, self.stage, chunk_id, name), t, transport=transport,
                                     consumer_host=consumer_host, readers=readers, consumer_device=consumer_device)
                self.metrics.bytes.labels(edge, _transport(msg), "out").inc(t.numel() * t.element_size())
                msgs.append(msg)
        except BaseException:
            conn.release_chunk(request_id, chunk_id, "failed")
            raise
        finally:
            self._reserved -= need
        self.metrics.chunks.labels(edge, "out").inc()
        self.metrics.seconds.labels(edge, "out").observe(time.perf_counter() - t0)
        self.metrics.buffered.labels(self.stage).set(conn.held_bytes_known)
        return msgs

    async def _admit(self, need: int) -> None:
        async with self._turn:
            t0 = time.perf_counter()
            waited = False
            while (over := self.connector.held_bytes + self._reserved + need - self.budget_bytes) > 0:
                if self.connector.evict_fetched(over) >= over:
                    continue
                waited = True
                self._room.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._room.wait(), self.room_poll_s)
            self._reserved += need
            if waited:
                self.metrics.budget_wait.labels(self.stage).observe(time.perf_counter() - t0)

    def _released(self, nbytes: int, reason: str) -> None:
        self.metrics.released.labels(self.stage, reason).inc(nbytes)
        self.metrics.buffered.labels(self.stage).set(self.connector.held_bytes_known)
        self._room.set()

    def release_request(self, request_id: str) -> int:
        """The request is cancelled, failed or done: free every chunk of it this stage still holds."""
        return self.connector.release_request(request_id, "cancel")

    def sweep(self, now: float | None = None) -> int:
        """Free what has been held longer than the TTL; returns the bytes freed."""
        return self.connector.expire(self.ttl_s, now)

    async def _sweep_forever(self) -> None:
        while True:
            await asyncio.sleep(self.sweep_interval_s)
            self.sweep()
            self.metrics.buffered.labels(self.stage).set(self.connector.held_bytes)

    @property
    def held_bytes(self) -> int:
        return self.connector.held_bytes


@dataclass
class ReceivedChunk:
    chunk: stage_pb2.Chunk               # the descriptor as it arrived (text, timing, end of stream...)
    tensors: dict[str, torch.Tensor]     # its tensors, fetched
    transfer_ms: float
    paths: dict[str, str] = field(default_factory=dict)  # tensor name -> memory path (paths.py)

    @property
    def path(self) -> str:
        """The chunk's memory path(s), for a trace attribute: one name, or several joined by ","."""
        return ",".join(sorted(set(self.paths.values())))


class ChunkReceiver:
    def __init__(self, connector: Connector, *, metrics: TransferMetrics | None = None):
        self.connector = connector
        self.metrics = metrics or TransferMetrics()

    async def fetch(self, chunk: stage_pb2.Chunk) -> ReceivedChunk:
        """Fetch one chunk's tensors now (the caller orders chunks itself)."""
        names = [t.name for t in chunk.tensors]
        if len(set(names)) != len(names):
            raise TensorFormatError(f'chunk {chunk.chunk_id} from "{chunk.stage}" names a tensor twice: {names}')
        edge = f"{chunk.stage}->{self.connector.stage}"
        t0 = time.perf_counter()
        fetched = await asyncio.gather(*(self.connector.get(t) for t in chunk.tensors))
        seconds = time.perf_counter() - t0
        paths = {}
        for msg, t in zip(chunk.tensors, fetched):
            paths[msg.name] = path = self.connector.path_of(msg)
            self.metrics.bytes.labels(edge, _transport(msg), "in").inc(t.numel() * t.element_size())
            self.metrics.paths.labels(edge, path).inc()
        self.metrics.chunks.labels(edge, "in").inc()
        self.metrics.seconds.labels(edge, "in").observe(seconds)
        return ReceivedChunk(chunk, dict(zip(names, fetched)), seconds * 1e3, paths)


def _transport(msg: tensor_pb2.Tensor) -> str:
    return msg.ref.backend if msg.WhichOneof("payload") == "ref" else "inline"
