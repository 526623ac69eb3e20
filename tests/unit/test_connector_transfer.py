"""Chunks through the connector: the producer waits over its byte budget (asserted on event
order), cancel and TTL free everything, chunks reach the consumer in order, metrics per edge."""

from __future__ import annotations

import asyncio

import pytest
import torch
from prometheus_client import CollectorRegistry

from omnistage.connector import ChunkSender, ChunkTooLarge, TensorNotFound, TransferMetrics, make_connector
from omnistage.v1 import stage_pb2

from ..connector_support import OrderingReceiver
from ..polling import wait_until

CHUNK = 256 << 10  # bytes per test chunk: above the inline threshold


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
async def stage_pair():
    clock = Clock()
    producer = await make_connector("thinker", ("shm",), host_id="h", clock=clock)
    consumer = await make_connector("talker", ("shm",), host_id="h")
    registry = CollectorRegistry()
    metrics = TransferMetrics(registry)  # one per process, as a stage has one registry
    sender = ChunkSender(producer, budget_bytes=2 * CHUNK, ttl_s=30, metrics=metrics)
    receiver = OrderingReceiver(consumer, metrics=metrics)
    yield sender, receiver, clock, registry
    await sender.close()
    await consumer.close()
    await producer.close()
    assert producer.stores["shm"].segments() == []


def chunk_tensors(i: int) -> dict[str, torch.Tensor]:
    return {"hidden": torch.full((CHUNK // 4,), float(i))}


def as_chunk(i: int, msgs, end: bool = False) -> stage_pb2.Chunk:
    return stage_pb2.Chunk(stage="thinker", chunk_id=i, tensors=msgs, end_of_stream=end)


async def test_producer_waits_over_its_budget_until_the_consumer_has_a_chunk(stage_pair):
    sender, receiver, _, _ = stage_pair
    events: list[str] = []

    async def produce(i):
        msgs = await sender.put_chunk("r1", i, chunk_tensors(i), consumer="talker")
        events.append(f"put{i}")
        return msgs

    m0, m1 = await produce(0), await produce(1)
    third = asyncio.create_task(produce(2))
    for _ in range(20):  # give it every chance to run: it must stay parked on the budget
        await asyncio.sleep(0)
    assert not third.done() and sender.held_bytes == 2 * CHUNK
    events.append("get0")
    [got] = await receiver.receive("r1", as_chunk(0, m0))
    assert got.tensors["hidden"][0] == 0.0
    m2 = await asyncio.wait_for(third, 5)
    assert events == ["put0", "put1", "get0", "put2"]
    for i, m in ((1, m1), (2, m2)):
        await receiver.receive("r1", as_chunk(i, m))
    await wait_until(lambda: sender.held_bytes == 0, what="nothing held")


async def test_ack_wakes_a_waiting_producer_and_inline_tensors_do_not_count(stage_pair):
    sender, _, _, _ = stage_pair
    events = []
    for i in range(2):
        await sender.put_chunk("r1", i, chunk_tensors(i))
    small = {"token_ids": torch.arange(8)}  # inline: carried in the message, not held
    await sender.put_chunk("r1", 9, small)

    async def third():
        await sender.put_chunk("r1", 2, chunk_tensors(2))
        events.append("put2")

    task = asyncio.create_task(third())
    await asyncio.sleep(0)
    events.append("ack0")
    assert sender.connector.release_chunk("r1", 0, "ack") == CHUNK
    await asyncio.wait_for(task, 5)
    assert events == ["ack0", "put2"]


async def test_chunk_bigger_than_the_whole_budget_is_refused(stage_pair):
    sender, _, _, _ = stage_pair
    with pytest.raises(ChunkTooLarge,
                       match=r"needs 786432 bytes, more than the stage's whole buffer budget \(524288\)"):
        await sender.put_chunk("r1", 0, {"x": torch.zeros(3 * CHUNK // 4)})
    assert sender.held_bytes == 0


async def test_put_that_times_out_waiting_for_room_leaves_nothing_behind(stage_pair):
    sender, _, _, _ = stage_pair
    for i in range(2):
        await sender.put_chunk("r1", i, chunk_tensors(i))
    with pytest.raises(TimeoutError):
        await sender.put_chunk("r1", 2, chunk_tensors(2), timeout=0.05)
    assert sender.held_bytes == 2 * CHUNK and sender._reserved == 0


async def test_cancel_mid_stream_frees_every_buffer(stage_pair):
    sender, receiver, _, _ = stage_pair
    msgs = [await sender.put_chunk("r1", 0, chunk_tensors(0))]
    other = await sender.put_chunk("r2", 0, chunk_tensors(5))
    await receiver.receive("r1", as_chunk(0, msgs[0]))
    msgs.append(await sender.put_chunk("r1", 1, chunk_tensors(1)))
    assert sender.release_request("r1") == CHUNK
    assert sender.held_bytes == CHUNK  # r2 untouched
    with pytest.raises(TensorNotFound):
        await receiver.receive("r1", as_chunk(1, msgs[1]))
    receiver.forget("r1")
    await receiver.receive("r2", as_chunk(0, other))
    assert sender.held_bytes == 0


async def test_ttl_frees_what_a_vanished_consumer_left(stage_pair):
    sender, _, clock, _ = stage_pair
    await sender.put_chunk("r1", 0, chunk_tensors(0))
    clock.now += 20
    await sender.put_chunk("r1", 1, chunk_tensors(1))
    assert sender.sweep() == 0
    clock.now += 11  # chunk 0 is 31 s old, chunk 1 is 11 s old
    assert sender.sweep() == CHUNK and sender.held_bytes == CHUNK
    clock.now += 20
    assert sender.sweep() == CHUNK and sender.held_bytes == 0


async def test_the_sweeper_runs_on_its_own():
    producer = await make_connector("thinker", ("shm",), host_id="h")
    sender = ChunkSender(producer, budget_bytes=4 * CHUNK, ttl_s=0.2)
    sender.start()
    try:
        await sender.put_chunk("r1", 0, chunk_tensors(0))
        await wait_until(lambda: sender.held_bytes == 0, what="nothing held")
        assert producer.stores["shm"].segments() == []
    finally:
        await sender.close()
        await producer.close()


@pytest.mark.parametrize("order", [(0, 1, 2, 3), (3, 2, 1, 0), (1, 3, 0, 2), (2, 0, 3, 1)])
async def test_chunks_arriving_out_of_order_are_delivered_in_order(stage_pair, order):
    sender, receiver, _, _ = stage_pair
    sender.budget_bytes = 8 * CHUNK
    msgs = {i: await sender.put_chunk("r1", i, chunk_tensors(i)) for i in range(4)}
    delivered = []
    for i in order:
        for got in await receiver.receive("r1", as_chunk(i, msgs[i], end=(i == 3))):
            delivered.append((got.chunk.chunk_id, got.tensors["hidden"][0].item(), got.chunk.end_of_stream))
    assert delivered == [(0, 0.0, False), (1, 1.0, False), (2, 2.0, False), (3, 3.0, True)]
    assert receiver._edges == {}  # the edge's state goes with its end of stream
    assert sender.held_bytes == 0


async def test_metrics_per_edge(stage_pair):
    sender, receiver, _, registry = stage_pair
    m = await sender.put_chunk("r1", 0, {**chunk_tensors(0), "ids": torch.arange(4)}, consumer="talker")
    value = registry.get_sample_value
    assert value("omnistage_transfer_buffered_bytes", {"stage": "thinker"}) == CHUNK
    await receiver.receive("r1", as_chunk(0, m))
    out = {"edge": "thinker->talker", "direction": "out"}
    inn = {"edge": "thinker->talker", "direction": "in"}
    assert value("omnistage_transfer_bytes_total", {**out, "transport": "shm"}) == CHUNK
    assert value("omnistage_transfer_bytes_total", {**out, "transport": "inline"}) == 32
    assert value("omnistage_transfer_bytes_total", {**inn, "transport": "shm"}) == CHUNK
    assert value("omnistage_transfer_chunks_total", out) == 1 and value("omnistage_transfer_chunks_total", inn) == 1
    assert value("omnistage_transfer_seconds_count", inn) == 1
    await wait_until(lambda: sender.held_bytes == 0, what="nothing held")
    assert value("omnistage_transfer_released_bytes_total", {"stage": "thinker", "reason": "consumed"}) == CHUNK
    assert value("omnistage_transfer_buffered_bytes", {"stage": "thinker"}) == 0


async def test_duplicate_tensor_names_are_refused(stage_pair):
    _, receiver, _, _ = stage_pair
    from omnistage.contract.tensors import TensorFormatError, to_proto
    t = to_proto("x", torch.zeros(2))
    with pytest.raises(TensorFormatError, match="names a tensor twice"):
        await receiver.receive("r1", as_chunk(0, [t, t]))


def test_budget_and_ttl_must_be_positive():
    conn = type("C", (), {"stage": "s", "release_listeners": []})()
    for kwargs in ({"budget_bytes": 0}, {"budget_bytes": 1, "ttl_s": 0}):
        with pytest.raises(ValueError, match="must be > 0"):
            ChunkSender(conn, **kwargs)


