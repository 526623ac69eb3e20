"""Connector test support: a `ChunkReceiver` that also puts chunks in order per request and edge, so
connector tests can check delivery order without a stage engine (a stage orders its inputs in its
engine, stage_service/runtime/base.py); a producer and a consumer connector on one host."""

from __future__ import annotations

import contextlib
from typing import AsyncIterator

from omnistage.connector import ChunkReceiver, Connector, ReceivedChunk, TransferMetrics, make_connector
from omnistage.contract.chunks import EdgeReorderBuffer
from omnistage.v1 import stage_pb2


class OrderingReceiver(ChunkReceiver):
    def __init__(self, connector: Connector, *, metrics: TransferMetrics | None = None, max_pending: int = 1024):
        super().__init__(connector, metrics=metrics)
        self.max_pending = max_pending
        self._edges: dict[tuple[str, str], EdgeReorderBuffer[ReceivedChunk]] = {}

    async def receive(self, request_id: str, chunk: stage_pb2.Chunk) -> list[ReceivedChunk]:
        """Fetch one chunk's tensors now; return the chunks of its edge that are now deliverable, in order."""
        received = await self.fetch(chunk)
        order = self._edges.get((request_id, chunk.stage))
        if order is None:
            edge = f"{chunk.stage}->{self.connector.stage}"
            order = self._edges[(request_id, chunk.stage)] = EdgeReorderBuffer(edge, self.max_pending)
        ready = order.push(chunk.chunk_id, received, chunk.end_of_stream)
        if order.finished:
            del self._edges[(request_id, chunk.stage)]
        return ready

    def forget(self, request_id: str) -> None:
        """Drop the ordering state of a request that ended (chunks still waiting for earlier ones go too)."""
        for key in [k for k in self._edges if k[0] == request_id]:
            del self._edges[key]


@contextlib.asynccontextmanager
async def connector_pair(host_id: str) -> AsyncIterator[tuple[Connector, Connector]]:
    """A producer (thinker) and a consumer (talker) connector on host `host_id`, with shared memory and UCX;
    the consumer is closed first."""
    producer = await make_connector("thinker", ("shm", "ucx"), host_id=host_id)
    consumer = await make_connector("talker", ("shm", "ucx"), host_id=host_id)
    try:
        yield producer, consumer
    finally:
        await consumer.close()
        await producer.close()
